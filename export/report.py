"""What the fold and the exporters report, and the comparison they share.

Errors are kept per output name and judged per output channel (the last axis), each against
its own scale: max |output| of the Keras model in that channel over the probe. A small head
next to a large one, or a sigmoid column concatenated to a price column, is judged on its own
scale, not hidden under the larger one. A channel whose own scale is 0 (constant zero, such
as a dead ReLU unit) is judged against its output's scale: any error there counts at the size
of the output's other values. Any non-finite error, output or scale makes the relative error
NaN, which never passes: `worst` is np.max, which propagates NaN, not Python's max, which drops
one that is not first.

A probe whose outputs are the same for every sample is refused (`check_varies`): a file that
ignores its input would match it.

A quantization-aware (QAT) model's file is judged in units of each output's quantization step
instead (`lsb_errors`, `LsbTolerance`), and its int8 weights are read back (`WeightCheck`): it
computes the model's own integer arithmetic, so its error is a few steps of the output's grid,
whatever the output's scale.
"""

import collections
import dataclasses
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from keras_bn.export import defaults

#: int8 readiness: the channel spread (max / min over channels of max abs(w)) above which the
#: smallest channel of a folded kernel keeps under 13 int8 levels (127 / spread) where the kernel
#: is quantized per tensor (one scale, max abs(w) / 127). Information, not a verdict: a tiny
#: channel may carry next to nothing (a network-slimming model's γ ≈ 0 channels: spreads of
#: 1e3 to 1e6, harmless), so the risk flags are measured (`INT8_READINESS_TOLERANCE`).
INT8_SPREAD_THRESHOLD = 10.0
#: int8 readiness: a folded host is an int8 risk when rounding its kernel alone to int8 moves
#: the folded model's outputs by more than this fraction of an output channel's scale on the
#: probe: the tolerance an int8 file is verified at (export/readiness.py measures it).
INT8_READINESS_TOLERANCE = defaults.SCALE_TOLERANCES["int8"]


def max_abs_error(actual: npt.ArrayLike | None, expected: npt.ArrayLike) -> float:
    """max |actual − expected| in float64; inf when `actual` is missing (None) or the shapes
    differ (a wrong file)."""
    if actual is None:
        return float("inf")
    got = np.asarray(actual, np.float64)
    wanted = np.asarray(expected, np.float64)
    if got.shape != wanted.shape:
        return float("inf")
    return float(np.max(np.abs(got - wanted), initial=0.0))


def scale(expected: npt.ArrayLike) -> float:
    """max |expected|: what an output's error is measured against (NaN if it has a NaN)."""
    return float(np.max(np.abs(np.asarray(expected, np.float64)), initial=0.0))


def worst(values: Iterable[float]) -> float:
    """The largest of `values`, NaN if any is NaN; 0 for none."""
    array = np.asarray(list(values), np.float64)
    return float(np.max(array, initial=0.0)) if array.size else 0.0


def relative(error: float, output_scale: float) -> float:
    """`error` / `output_scale`; NaN when the scale is not finite (0 counts as 1e-30)."""
    return error / max(output_scale, 1e-30) if np.isfinite(output_scale) else float("nan")


@dataclasses.dataclass(frozen=True)
class WorstChannel:
    """The channel of an output furthest from the Keras model, relative to its scale.

    A channel is an index on the output's last axis (an output of shape (batch,) is one
    channel). It is judged against its own scale, the largest absolute Keras output in that
    channel over the probe, but never against less than 1e-4 / scale_tolerance of its output's scale
    (`channel_scale_floor`; at most the output's scale). So a channel passes when it is within
    the tolerance of its own scale or within 1e-4, float32's tolerance, of its output's scale:
    float32 rounding follows the output's values, not a near-zero channel's. A channel whose
    own scale is 0 (constant zero, such as a dead ReLU unit) is judged against that floor.

    Attributes:
        channel: the channel's index on the last axis.
        relative_error: its max abs error (the worst over runtime settings) / `scale`; NaN
            when an error, output or scale is not finite.
        max_abs_error: its max abs error.
        scale: the scale it is judged against: its own, or the floor.
    """

    channel: int
    relative_error: float
    max_abs_error: float
    scale: float


def channel_scale_floor(scale_tolerance: float) -> float:
    """The least a channel is judged against, as a fraction of its output's scale:
    FLOAT32_SCALE_TOLERANCE / scale_tolerance, at most 1 (a float32 file: the output's scale).

    Args:
        scale_tolerance: the tolerance the channels are judged at.

    Returns:
        float in (0, 1].
    """
    return min(1.0, defaults.FLOAT32_SCALE_TOLERANCE / scale_tolerance)


def _by_channel(array: np.ndarray) -> np.ndarray:
    """(samples × positions, channels): the last axis is the channel axis."""
    return array.reshape(-1, 1) if array.ndim < 2 else array.reshape(-1, array.shape[-1])


def worst_channel(
    expected: npt.ArrayLike, actuals: Iterable[npt.ArrayLike | None], scale_tolerance: float
) -> WorstChannel:
    """The WorstChannel of one output.

    Args:
        expected: the Keras output, first axis the samples.
        actuals: the runtime's output for each setting (None or a wrong shape: off by inf).
        scale_tolerance: the tolerance it is judged at (it sets `channel_scale_floor`).

    Returns:
        WorstChannel: the first channel with a NaN relative error, else the largest.
    """
    expected = np.asarray(expected, np.float64)
    by_channel = _by_channel(expected)
    floor = scale(expected) * channel_scale_floor(scale_tolerance)  # NaN if a value is
    scales = np.maximum(np.max(np.abs(by_channel), axis=0, initial=0.0), floor)  # keeps NaN
    errors = np.zeros(by_channel.shape[1])
    for actual in actuals:
        actual = None if actual is None else np.asarray(actual, np.float64)
        if actual is None or actual.shape != expected.shape:
            channel_errors = np.full(by_channel.shape[1], np.inf)
        else:
            channel_errors = np.max(np.abs(_by_channel(actual) - by_channel), axis=0, initial=0.0)
        errors = np.maximum(errors, channel_errors)  # propagates NaN
    if not errors.size:
        return WorstChannel(0, 0.0, 0.0, float(floor))
    with np.errstate(invalid="ignore"):
        ratios = np.where(np.isfinite(scales), errors / np.maximum(scales, 1e-30), np.nan)
    nan = np.flatnonzero(np.isnan(ratios))
    channel = int(nan[0]) if nan.size else int(np.argmax(ratios))
    return WorstChannel(
        channel, float(ratios[channel]), float(errors[channel]), float(scales[channel])
    )


def compare(
    expected: Mapping[str, npt.ArrayLike],
    actual: Mapping[str, Mapping[str, npt.ArrayLike]],
    scale_tolerance: float,
) -> tuple[dict[str, dict[str, float]], dict[str, float], dict[str, WorstChannel]]:
    """Every output of every runtime setting against the Keras model.

    Args:
        expected: {output name: Keras output}.
        actual: {runtime setting: {output name: array}}; an output a setting lacks is off by
            inf.
        scale_tolerance: the tolerance the outputs are judged at (for `channel_scale_floor`).

    Returns:
        (errors, output_scales, worst_channels): output name → {setting: max abs error};
        output name → the largest absolute Keras output; output name → WorstChannel.
    """
    errors: dict[str, dict[str, float]] = {}
    scales: dict[str, float] = {}
    channels: dict[str, WorstChannel] = {}
    for name, value in expected.items():
        got = [outputs.get(name) for outputs in actual.values()]
        errors[name] = {
            setting: max_abs_error(outputs.get(name), value) for setting, outputs in actual.items()
        }
        scales[name] = scale(value)
        channels[name] = worst_channel(value, got, scale_tolerance)
    return errors, scales, channels


def check_varies(
    expected: Mapping[str, npt.ArrayLike],
    what: str,
    inputs: Mapping[str, npt.ArrayLike] | None = None,
    allow_unverified: bool = False,
) -> str | None:
    """Refuse a probe on which an output is the same for every sample.

    Such a probe verifies nothing: a file that ignores its input (a wrong kernel layout, a
    dropped layer) matches it, and an all-zero output has scale 0. Where the probe's samples
    differ (`inputs`) the model itself ignores them (an untrained or dead network): no probe
    can verify its file, which `allow_unverified` writes anyway, reported unverified.

    Args:
        expected: {output name: Keras output on the probe}.
        what: the probe's name, for the message.
        inputs: {input name: the probe's array}, to tell a constant probe from a constant
            model: where every input is constant (or this is None: not known) the probe is
            blamed, with no way through; where some input varies, allow_unverified may write
            the file, and the message names the inputs that do not vary.
        allow_unverified: accept a model whose own outputs are constant on a varied probe.

    Returns:
        None, or with `allow_unverified`, why the file is unverified (the constant outputs).

    Raises:
        ValueError: naming the first such output and the probe; for a constant model, saying
            so, and naming `probe=` and `allow_unverified=True`.
    """
    constant: list[str] = []
    for name, value in expected.items():
        value = np.asarray(value)
        if len(value) < 2:
            raise ValueError(
                f"{what} has {len(value)} sample: on one sample, output '{name}' cannot vary "
                f"with the input, and a file that ignores its input would match it. Give "
                f"several different samples (real inputs)."
            )
        if not np.all(value == value[:1]):  # NaN != NaN: a NaN output fails later, as NaN
            continue
        same = _constant_inputs(inputs)
        if same is None or (inputs is not None and len(same) == len(inputs)):
            raise ValueError(
                f"Output '{name}' is the same for all {len(value)} samples of {what} (max "
                f"|output| {scale(value):.3g}): a file that ignores its input would match it. "
                f"Give samples on which the model's outputs differ (real inputs)."
            )
        if not allow_unverified:
            # Some input varies: the model itself may be constant (untrained, dead), or read
            # only the inputs that do not vary.
            cause = (
                f"input(s) {same} are the same for every sample, and the output may read only "
                f"them; give them samples that differ (probe=, CLI: --representative-data). If "
                f"the model itself gives the same output for every sample anyway"
                if same
                else "the model itself gives the same output for every probe sample (an "
                "untrained or dead network, every unit before the output off, say), so no "
                "probe can tell its file from one that ignores its input. Train the model, "
                "or give probe= samples (CLI: --representative-data) on which its outputs "
                "differ; for a smoke test only"
            )
            differ = "some inputs differ between samples" if same else "the samples differ"
            raise ValueError(
                f"Output '{name}' is the same for all {len(value)} samples of {what} (max "
                f"|output| {scale(value):.3g}), though {differ}: {cause}, "
                f"allow_unverified=True (CLI: --allow-unverified) writes the file anyway, "
                f"marked unverified in its report."
            )
        constant.append(name)
    if not constant:
        return None
    same = _constant_inputs(inputs)
    given = f" (input(s) {same} the same for every sample)" if same else ""
    return (
        f"output(s) {constant} of the model are the same for every sample of {what}{given}: "
        f"the file could not be verified (allow_unverified=True)"
    )


def _constant_inputs(inputs: Mapping[str, npt.ArrayLike] | None) -> list[str] | None:
    """The names of the inputs whose samples are all the same; None where not known."""
    if inputs is None:
        return None
    return [
        key for key, array in inputs.items() if np.all(np.asarray(array) == np.asarray(array)[:1])
    ]


@dataclasses.dataclass(frozen=True)
class LsbError:
    """One output's error in units of its quantization step (LSB), for a QAT model's file.

    Attributes:
        step: the output's step: the scale of the int8 grid it is read from.
        max_lsb: max abs(file − Keras) / step over every value of the output (inf for a wrong
            shape or a missing output, NaN for a non-finite value).
        percentile_lsb: the `percentile`-th percentile of abs(file − Keras) / step over every
            value of the output (samples × positions × channels).
        percentile: which percentile (`defaults.QAT_PERCENTILE`, 99).
        off_share: the share of values off by more than half a step: on another level of
            the grid than the Keras model's.
    """

    step: float
    max_lsb: float
    percentile_lsb: float
    percentile: float
    off_share: float


_GRID_SLACK_LSB = 1e-3


@dataclasses.dataclass(frozen=True)
class LsbTolerance:
    """What a QAT model's file may differ from the Keras model by, in output steps.

    An integer runtime requantizes each layer with fixed-point arithmetic where TensorFlow
    rounds in float, so a value can land one level off at any layer, and such differences add
    up along the layers; a wrong file (a wrong scale, kernel layout or range, a lost channel)
    is off by many steps on most values. So most values must be within `percentile_lsb`, and
    every value within `max_lsb`.

    Attributes:
        max_lsb: the largest error allowed on any value.
        percentile: the percentile judged against `percentile_lsb`.
        percentile_lsb: the largest error allowed at that percentile.
    """

    max_lsb: float
    percentile: float
    percentile_lsb: float

    def admits(self, error: LsbError) -> bool:
        """Whether `error` is within both bounds (NaN never is).

        Args:
            error: an LsbError.

        Returns:
            bool.
        """
        # Both outputs lie on the grid, so an error is a whole number of steps up to float32
        # rounding (2.0000006 is 2 steps): compare with a slack far below one step.
        slack = _GRID_SLACK_LSB
        return bool(
            error.max_lsb <= self.max_lsb + slack
            and error.percentile_lsb <= self.percentile_lsb + slack
        )

    def __str__(self) -> str:
        return (
            f"max {self.max_lsb:g} LSB, {self.percentile:g}th percentile {self.percentile_lsb:g} "
            f"LSB of each output's step"
        )


def lsb_error(
    actual: npt.ArrayLike | None, expected: npt.ArrayLike, step: float, percentile: float
) -> LsbError:
    """The LsbError of one output of one runtime setting.

    Args:
        actual: the file's output (None for a missing one).
        expected: the Keras model's.
        step: the output's step.
        percentile: the percentile to report.

    Returns:
        LsbError: inf errors for a missing output or a wrong shape; NaN ones for a
        non-finite value.
    """
    expected = np.asarray(expected, np.float64)
    if actual is None or np.shape(actual) != expected.shape:
        return LsbError(step, float("inf"), float("inf"), percentile, 1.0)
    errors = np.abs(np.asarray(actual, np.float64) - expected).reshape(-1) / step
    if errors.size == 0:
        return LsbError(step, 0.0, 0.0, percentile, 0.0)
    if not np.all(np.isfinite(errors)):
        return LsbError(step, float("nan"), float("nan"), percentile, float("nan"))
    return LsbError(
        step,
        float(errors.max()),
        float(np.percentile(errors, percentile)),
        percentile,
        float(np.mean(errors > 0.5)),
    )


def lsb_errors(
    expected: Mapping[str, npt.ArrayLike],
    actual: Mapping[str, Mapping[str, npt.ArrayLike]],
    steps: Mapping[str, float],
    percentile: float,
) -> dict[str, dict[str, LsbError]]:
    """Every output of every runtime setting against the Keras model, in output steps.

    Args:
        expected: {output name: Keras output}.
        actual: {runtime setting: {output name: array}}.
        steps: {output name: its step}.
        percentile: the percentile to report.

    Returns:
        output name → {setting: LsbError}.
    """
    return {
        name: {
            setting: lsb_error(outputs.get(name), value, steps[name], percentile)
            for setting, outputs in actual.items()
        }
        for name, value in expected.items()
    }


@dataclasses.dataclass(frozen=True)
class WeightCheck:
    """A QAT host's kernel as the written file holds it, against the grid the model rounds to.

    Attributes:
        host: the QAT layer's path.
        kernel: "kernel", or "depthwise_kernel" (a separable host's).
        bits: the weights' bits: the file's integers must lie in ±(2^(bits−1) − 1).
        tensor: the name of the file's tensor (TFLite) or initializer (ONNX) that holds it;
            None when the file has none.
        dtype: its dtype in the file ("int8" when right), or None.
        max_abs_q: the largest |integer| in it, or None.
        matches: whether its integers equal `fake_quant.weight_grid` of the host's folded
            weights exactly, in the file's layout, with the same scales (to float32
            rounding).
        saturated_bias: the output channels whose int32 bias the file holds at ±(2³¹ − 1)
            (TFLite): a channel's weight step so small that bias / (input step · weight step)
            overflows int32, which the converter meets by clamping the bias and changing the
            channel's weights and scale.
    """

    host: str
    kernel: str
    bits: int
    tensor: str | None
    dtype: str | None
    max_abs_q: int | None
    matches: bool
    saturated_bias: tuple[int, ...] = ()


def histogram(op_names: Iterable[str]) -> dict[str, int]:
    """op name → count, most frequent first."""
    return dict(collections.Counter(op_names).most_common())


def over_tolerance(error: float | None, tolerance: float = INT8_READINESS_TOLERANCE) -> bool | None:
    """Whether a measured rounding error is over `tolerance`: None when not measured, True for
    NaN (NaN never reads as fine).

    Args:
        error: a relative error, or None.
        tolerance: the largest error that is fine.

    Returns:
        bool or None.
    """
    return None if error is None else not error <= tolerance


@dataclasses.dataclass(frozen=True)
class ChannelSpread:
    """A folded host's int8 readiness: how far apart its channels' weight ranges are, and how
    far rounding its weights to int8 moves the model's outputs.

    A backward fold multiplies each output channel of the host's kernel by its BN's γ/σ, a
    forward fold each input channel. Where one int8 scale covers channels of very different
    ranges, the small ones round to a few levels, or to zero; whether that matters depends on
    what those channels carry, so it is measured (`fold_batch_norms(..., int8_readiness=True)`,
    export/readiness.py): the folded model is run on the probe with this host's folded kernel
    alone rounded to the symmetric narrow-range int8 grid, and each output channel is compared
    with the unrounded folded model's against its own scale, as an int8 file is verified.

    Attributes:
        host: the host's name ("inner/conv" inside a nested model "inner").
        layer: the host's class name.
        output_spread: max / min over output channels of max abs(w) per channel, on the folded
            kernel (`fold.channel_spread`: all-zero channels left out, NaN if a weight is
            NaN). For a SeparableConv, its pointwise kernel: the one the fold scales, whose
            last axis is the output channels (the depthwise kernel is left as trained).
        input_spread: the same over input channels, for a host that took a forward fold;
            None otherwise.
        per_tensor_error: the worst output channel's error, relative to its scale, of the
            folded model with this host's kernel rounded to int8 with one scale for the whole
            tensor; NaN for a non-finite weight or output; None when not measured.
        per_channel_error: the same with one scale per output channel (TFLite's int8).
    """

    host: str
    layer: str
    output_spread: float
    input_spread: float | None = None
    per_tensor_error: float | None = None
    per_channel_error: float | None = None

    @property
    def int8_risk(self) -> bool | None:
        """True when `per_tensor_error` is over INT8_READINESS_TOLERANCE (or NaN): precision
        that matters is lost where the weights are quantized per tensor (one scale for the
        whole kernel). None when not measured."""
        return over_tolerance(self.per_tensor_error)

    @property
    def per_channel_int8_risk(self) -> bool | None:
        """True when `per_channel_error` is over INT8_READINESS_TOLERANCE (or NaN): precision is
        lost even where each output channel has its own scale (TFLite's int8). None when not
        measured."""
        return over_tolerance(self.per_channel_error)

    def to_dict(self) -> dict[str, Any]:
        """The fields and both risk flags, as a JSON-ready dict.

        Returns:
            dict with `host`, `layer`, `output_spread`, `input_spread`, `per_tensor_error`,
            `per_channel_error`, `int8_risk` and `per_channel_int8_risk`.
        """
        return {
            **dataclasses.asdict(self),
            "int8_risk": self.int8_risk,
            "per_channel_int8_risk": self.per_channel_int8_risk,
        }


class _OutputErrors:
    """The error summaries FoldReport and ExportReport share, from `errors` and
    `output_scales`; a subclass whose `errors` hold more than one number per output says how
    to reduce them in `_error_by_output`."""

    # Fields of the dataclasses that use this base (a plain class: dataclass ignores these).
    errors: dict
    output_scales: dict
    worst_channels: dict

    def _error_by_output(self) -> dict[str, float]:
        return self.errors

    @property
    def relative_errors(self) -> dict[str, float]:
        """output name → the relative error of its worst channel (`worst_channels`), the one
        judged; for an output without one (a report built by hand), its error (the worst over
        runtime settings, in an ExportReport) / its scale."""
        return {
            name: self.worst_channels[name].relative_error
            if name in self.worst_channels
            else relative(error, self.output_scales[name])
            for name, error in self._error_by_output().items()
        }

    @property
    def max_abs_error(self) -> float:
        """The largest absolute error over the outputs (and runtime settings); NaN if any is
        NaN, 0 for none."""
        return worst(self._error_by_output().values())

    @property
    def relative_error(self) -> float:
        """The worst relative error over the outputs (and runtime settings); NaN if any output
        or error is not finite."""
        return worst(self.relative_errors.values())


@dataclasses.dataclass
class FoldReport(_OutputErrors):
    """What `fold_batch_norms` did, and how far the folded model is from the original.

    Attributes:
        folded: FoldedBN per folded batch norm.
        kept: KeptBN per batch norm kept as an InferenceAffine layer, with the reason.
        errors: output name → max abs(folded − original) on the probe.
        output_scales: output name → max abs(original output) on the probe.
        channel_spreads: ChannelSpread per folded host, its int8 readiness (its rounding
            errors measured only with `fold_batch_norms(..., int8_readiness=True)`);
            `int8_risks` lists those whose error is over INT8_READINESS_TOLERANCE.
        worst_channels: output name → WorstChannel: the channel (last axis) furthest from
            the original relative to its own scale; `relative_errors` are theirs.
    """

    folded: list
    kept: list
    errors: dict
    output_scales: dict
    channel_spreads: list = dataclasses.field(default_factory=list)
    worst_channels: dict = dataclasses.field(default_factory=dict)

    @property
    def int8_readiness_measured(self) -> bool:
        """Whether every host's rounding errors were measured (int8_readiness=True); True for
        a model with no folded host, where there is nothing to measure."""
        return all(spread.per_tensor_error is not None for spread in self.channel_spreads)

    @property
    def int8_risks(self) -> list[ChannelSpread] | None:
        """The ChannelSpread of each host whose measured rounding error is over
        INT8_READINESS_TOLERANCE (or NaN), per tensor (`int8_risk`) or per channel
        (`per_channel_int8_risk`, TFLite's int8); None when not measured
        (`int8_readiness_measured` is False), which is not the same as no risk."""
        if not self.int8_readiness_measured:
            return None
        return [
            spread
            for spread in self.channel_spreads
            if spread.int8_risk or spread.per_channel_int8_risk
        ]

    def to_dict(self) -> dict[str, Any]:
        """The report as a JSON-ready dict: the fields (FoldedBN, KeptBN, ChannelSpread and
        WorstChannel as dicts), `relative_errors`, `relative_error`, `int8_spread_threshold`,
        `int8_readiness_tolerance`, `int8_readiness_measured` and `int8_risks` (the names of
        the hosts at risk; None when not measured).

        Returns:
            dict, as the CLI's `--report` file holds it under "fold".
        """
        risks = self.int8_risks
        return {
            **dataclasses.asdict(self),
            "relative_errors": self.relative_errors,
            "relative_error": self.relative_error,
            "channel_spreads": [spread.to_dict() for spread in self.channel_spreads],
            "int8_spread_threshold": INT8_SPREAD_THRESHOLD,
            "int8_readiness_tolerance": INT8_READINESS_TOLERANCE,
            "int8_readiness_measured": self.int8_readiness_measured,
            "int8_risks": None if risks is None else [spread.host for spread in risks],
        }


@dataclasses.dataclass
class ExportReport(_OutputErrors):
    """A written file, checked in its runtime against the Keras model.

    The file is judged on the probe: for int8, samples it was not calibrated with (held out
    from `representative_data`); each output channel (last axis) against its own scale.

    Attributes:
        format: "tflite" or "onnx".
        path: the file's absolute path.
        size_bytes: its size.
        errors: output name → {runtime setting → max abs(runtime − Keras)} on the probe
            ("litert"; "ort_disabled" and "ort_enabled" for onnxruntime's optimiser).
        output_scales: output name → max abs(Keras output) on the probe.
        scale_tolerance: the tolerance: the largest error allowed, as a fraction of each
            output channel's scale; None for a QAT model's file, which is judged in output
            steps (`lsb_tolerance`).
        op_histogram: op name → count in the file.
        quantization: the TFLite quantization, None for float32; "int8" for a
            quantization-aware model's files (TFLite full integer, ONNX QDQ).
        fold: the FoldReport, or None when fold=False.
        worst_channels: output name → WorstChannel on the probe: the channel furthest from
            the Keras model relative to its own scale; `relative_errors` are theirs, and
            `passed` judges them.
        in_sample_errors: for int8, output name → {setting → max abs error} on calibration
            samples (up to `defaults.PROBE_SAMPLES` of them), for comparison: a file much
            better there than on `errors`' held-out samples fits its calibration set only.
            None for other files.
        in_sample_worst_channels: for int8, the WorstChannel of each output on those
            calibration samples; None for other files.
        probe_samples: the number of samples the file was verified on.
        calibration_samples: for int8, the number of samples it was calibrated with.
        probe_held_out: for int8, whether the samples it was verified on were held out from
            its calibration (no `probe` given); False when the caller's `probe` was used,
            which may hold calibration samples.
        lsb_errors: for a QAT model's file, output name → {setting → LsbError}: the error in
            units of the output's step, which `passed` judges; None for other files.
        lsb_tolerance: for a QAT model's file, the LsbTolerance it is judged at; None for
            other files.
        weights: for a QAT model's file, a WeightCheck per fake-quantized kernel, which must
            all match; None for other files.
        float_ops: for a QAT model's file, op name → count of the ops that compute in
            float, in the format's op names: in TFLite, the ops with a float input or output
            tensor (the float input's QUANTIZE and the float output's DEQUANTIZE are not
            counted); in ONNX, the ops outside a DequantizeLinear → op → QuantizeLinear unit
            (`keras_bn.export.qdq.float_ops`). Empty for a file an integer runtime computes
            whole, which `passed` requires; None for other files.
        unverified: why the file is unverified, when the model's own outputs were the same
            for every probe sample and the export was given allow_unverified=True (its errors
            then say only that the file gives that output too); None for a verified file.
        log: the lines the converter and the runtime wrote to stderr while the file was made
            and checked (TensorFlow's C++ logging, such as the TFLite converter's
            "fully_quantize: 0, inference_type: 6, ..."), and the deprecation warnings about
            TensorFlow they raised, kept here rather than on the terminal
            (keras_bn/_quiet.py); a conversion that fails prints them instead.
    """

    format: str
    path: str
    size_bytes: int
    errors: dict
    output_scales: dict
    scale_tolerance: float | None
    op_histogram: dict
    quantization: str | None = None
    fold: FoldReport | None = None
    worst_channels: dict = dataclasses.field(default_factory=dict)
    in_sample_errors: dict | None = None
    in_sample_worst_channels: dict | None = None
    probe_samples: int | None = None
    calibration_samples: int | None = None
    probe_held_out: bool = False
    lsb_errors: dict | None = None
    lsb_tolerance: LsbTolerance | None = None
    weights: list | None = None
    float_ops: dict | None = None
    unverified: str | None = None
    log: list = dataclasses.field(default_factory=list)

    def _error_by_output(self) -> dict[str, float]:
        return {name: worst(by_setting.values()) for name, by_setting in self.errors.items()}

    @property
    def passed(self) -> bool:
        """For a float model's file: the worst channel of every output, in every runtime
        setting, within `scale_tolerance` of its scale on the probe (NaN fails); the
        in-sample errors are reported, not judged. For a QAT model's file: every output of
        every setting within `lsb_tolerance`, every WeightCheck matching and no float op."""
        if self.lsb_tolerance is None:  # a float model's file (no tolerance: nothing passes)
            return self.scale_tolerance is not None and bool(
                self.relative_error <= self.scale_tolerance
            )
        return (
            all(
                self.lsb_tolerance.admits(error)
                for by_setting in (self.lsb_errors or {}).values()
                for error in by_setting.values()
            )
            and all(check.matches for check in self.weights or ())
            and not self.float_ops
        )

    @property
    def max_lsb_error(self) -> float | None:
        """For a QAT model's file, the largest `LsbError.max_lsb` over the outputs and
        settings (NaN if any is NaN); None for other files."""
        if self.lsb_errors is None:
            return None
        return worst(e.max_lsb for s in self.lsb_errors.values() for e in s.values())

    @property
    def percentile_lsb_error(self) -> float | None:
        """For a QAT model's file, the largest `LsbError.percentile_lsb` over the outputs and
        settings (NaN if any is NaN); None for other files."""
        if self.lsb_errors is None:
            return None
        return worst(e.percentile_lsb for s in self.lsb_errors.values() for e in s.values())

    @property
    def in_sample_relative_errors(self) -> dict[str, float] | None:
        """For int8, output name → its worst channel's relative error on calibration
        samples; None for other files."""
        if self.in_sample_worst_channels is None:
            return None
        return {name: c.relative_error for name, c in self.in_sample_worst_channels.items()}

    @property
    def in_sample_relative_error(self) -> float | None:
        """For int8, the worst of `in_sample_relative_errors`; None for other files."""
        by_output = self.in_sample_relative_errors
        return None if by_output is None else worst(by_output.values())

    @property
    def atol(self) -> float | None:
        """The deprecated name of `scale_tolerance` (read-only; a DeprecationWarning)."""
        warnings.warn(
            "ExportReport.atol is deprecated: read ExportReport.scale_tolerance (the same "
            "value, a fraction of each output's scale).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.scale_tolerance

    def to_dict(self) -> dict[str, Any]:
        """The report as a JSON-ready dict: the fields (`fold` as `FoldReport.to_dict`,
        WorstChannel, LsbError, LsbTolerance and WeightCheck as dicts), plus `max_abs_error`,
        `relative_errors`, `relative_error`, `in_sample_relative_errors`,
        `in_sample_relative_error`, `max_lsb_error`, `percentile_lsb_error` and `passed`.

        Returns:
            dict, as the CLI's `--report` file lists it under "exports".
        """
        data = dataclasses.asdict(self)
        data["fold"] = None if self.fold is None else self.fold.to_dict()
        data.update(
            max_abs_error=self.max_abs_error,
            relative_errors=self.relative_errors,
            relative_error=self.relative_error,
            in_sample_relative_errors=self.in_sample_relative_errors,
            in_sample_relative_error=self.in_sample_relative_error,
            max_lsb_error=self.max_lsb_error,
            percentile_lsb_error=self.percentile_lsb_error,
            passed=self.passed,
        )
        return data


class VerificationError(Exception):
    """A written file differs from the Keras model by more than the tolerance.

    Raised by `export_tflite` and `export_onnx` with strict=True. The file was not put at its
    path (any existing file there is unchanged); the message names the worst output and its
    error, its worst channel and the samples it was measured on (for a quantization-aware
    model: each output over its tolerance in output steps, each kernel not on its grid, and
    the ops left in float).

    Args:
        report: the ExportReport of the rejected file.

    Attributes:
        report: the ExportReport of the rejected file, whose `path` is where it would have
            gone and whose `errors` say by how much each output missed.
    """

    def __init__(self, report: ExportReport) -> None:
        self.report = report
        if report.lsb_tolerance is not None:
            super().__init__(_quantized_failure(report, report.lsb_tolerance))
            return
        relative_errors = report.relative_errors
        worst_name = max(
            relative_errors, key=lambda n: np.nan_to_num(relative_errors[n], nan=np.inf)
        )
        where = ""
        if worst_name in report.worst_channels:
            where = f" (channel {report.worst_channels[worst_name].channel})"
        samples = ""
        if report.in_sample_relative_error is not None:
            kind = "held-out samples" if report.probe_held_out else "samples of `probe`"
            samples = (
                f" on {report.probe_samples} {kind} (on calibration samples: "
                f"{report.in_sample_relative_error:.3g})"
            )
        super().__init__(
            f"The {report.format} file for {report.path} differs from the Keras model: output "
            f"'{worst_name}' is off by {relative_errors[worst_name]:.3g} of its scale{where}"
            f"{samples}, over scale_tolerance={report.scale_tolerance:g}; the file was not "
            f"written (any existing file is unchanged). Pass strict=False to write it anyway."
        )


def _quantized_failure(report: ExportReport, tolerance: LsbTolerance) -> str:
    """VerificationError's message for a QAT model's file (judged at `tolerance`, its
    `lsb_tolerance`): what it failed on."""
    problems = []
    for name, by_setting in (report.lsb_errors or {}).items():
        for setting, error in by_setting.items():
            if not tolerance.admits(error):
                problems.append(
                    f"output '{name}' ({setting}) is off by {error.max_lsb:.3g} LSB at most and "
                    f"{error.percentile_lsb:.3g} LSB at the {error.percentile:g}th percentile "
                    f"(step {error.step:.3g})"
                )
    for check in report.weights or ():
        if check.tensor is None:
            problems.append(f"the {check.kernel} of '{check.host}' is not an int8 weight of it")
        elif not check.matches:
            problems.append(
                f"the {check.kernel} of '{check.host}' ({check.tensor}, {check.dtype}) is not "
                f"its {check.bits}-bit grid"
                + (
                    f": its int32 bias overflows in channels {list(check.saturated_bias)}, "
                    f"whose weight steps are too small for their bias (the converter clamped "
                    f"the bias and rescaled those channels' weights); such a channel's weights "
                    f"are almost 0 (a BN γ near 0 folded into them): set them to exactly 0, "
                    f"or give the channel larger weights"
                    if check.saturated_bias
                    else ""
                )
            )
    if report.float_ops:
        ops = ", ".join(f"{name}×{count}" for name, count in report.float_ops.items())
        problems.append(f"it computes in float: {ops}")
    return (
        f"The {report.format} file for {report.path} does not compute the quantization-aware "
        f"model: {'; '.join(problems)} (tolerance: {report.lsb_tolerance}); the file was not "
        f"written (any existing file is unchanged). Pass strict=False to write it anyway."
    )

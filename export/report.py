"""What the fold and the exporters report, and the comparison they share.

Errors are kept per output name and measured against each output's own scale (max |output|
of the Keras model on the probe), so a small head next to a large one is judged on its own
scale. Any non-finite error, output or scale makes the relative error NaN, which never passes:
`worst` is np.max, which propagates NaN, not Python's max, which drops one that is not first.
"""

import collections
import dataclasses
import warnings

import numpy as np

#: int8 readiness: the channel spread (max / min over channels of max abs(w)) above which a
#: folded host is an int8 risk. A weight tensor quantized per tensor has one int8 scale,
#: max abs(w) / 127, so a channel whose largest weight is `spread` times smaller than the tensor's
#: keeps only 127 / spread levels: above 10, under 13 (< 4 bits). On the digits MLP the
#: per-tensor int8 file leaves the int8 tolerance (5e-2) between spreads 6.4 and 12.9; healthy
#: trained hosts have spreads of 2 to 3 (benchmarks/bench_int8_spread.py).
INT8_SPREAD_THRESHOLD = 10.0


def max_abs_error(actual, expected):
    """max |actual − expected| in float64; inf when the shapes differ (a wrong file)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        return float("inf")
    return float(np.max(np.abs(actual - expected), initial=0.0))


def scale(expected):
    """max |expected|: what an output's error is measured against (NaN if it has a NaN)."""
    return float(np.max(np.abs(np.asarray(expected, np.float64)), initial=0.0))


def worst(values):
    """The largest of `values`, NaN if any is NaN; 0 for none."""
    values = np.asarray(list(values), np.float64)
    return float(np.max(values, initial=0.0)) if values.size else 0.0


def relative(error, output_scale):
    return error / max(output_scale, 1e-30) if np.isfinite(output_scale) else float("nan")


def histogram(op_names):
    """op name → count, most frequent first."""
    return dict(collections.Counter(op_names).most_common())


def over_threshold(spread, threshold=INT8_SPREAD_THRESHOLD):
    """True when `spread` is above `threshold` or NaN (NaN never reads as fine)."""
    return spread is not None and not spread <= threshold


@dataclasses.dataclass(frozen=True)
class ChannelSpread:
    """How far apart a folded host's per-channel weight ranges are: its int8 readiness.

    A backward fold multiplies each output channel of the host's kernel by its BN's γ/σ, a
    forward fold each input channel. Where one int8 scale covers channels of very different
    ranges, the small ones round to a few levels, or to zero.

    Attributes:
        host: the host's name ("inner/conv" inside a nested model "inner").
        layer: the host's class name.
        output_spread: max / min over output channels of max abs(w) per channel, on the folded
            kernel (`fold.channel_spread`: all-zero channels left out, NaN if a weight is
            NaN). For a SeparableConv, its pointwise kernel: the one the fold scales, whose
            last axis is the output channels (the depthwise kernel is left as trained).
        input_spread: the same over input channels, for a host that took a forward fold;
            None otherwise.
    """

    host: str
    layer: str
    output_spread: float
    input_spread: float | None = None

    @property
    def int8_risk(self):
        """True when a spread is over INT8_SPREAD_THRESHOLD (or NaN), so that precision is
        lost where the weights are quantized per tensor (one scale for the whole kernel)."""
        return over_threshold(self.output_spread) or over_threshold(self.input_spread)

    @property
    def per_channel_int8_risk(self):
        """True when the input spread is over the threshold (or NaN), so that precision is lost
        even where each output channel has its own scale (TFLite's int8), since that scale
        spans every input channel."""
        return over_threshold(self.input_spread)

    def to_dict(self):
        """The fields and both risk flags, as a JSON-ready dict.

        Returns:
            dict with `host`, `layer`, `output_spread`, `input_spread`, `int8_risk` and
            `per_channel_int8_risk`.
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

    def _error_by_output(self):
        return self.errors

    @property
    def relative_errors(self):
        """output name → its error (the worst over runtime settings, in an ExportReport) /
        that output's scale."""
        return {
            name: relative(error, self.output_scales[name])
            for name, error in self._error_by_output().items()
        }

    @property
    def max_abs_error(self):
        """The largest absolute error over the outputs (and runtime settings); NaN if any is
        NaN, 0 for none."""
        return worst(self._error_by_output().values())

    @property
    def relative_error(self):
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
        channel_spreads: ChannelSpread per folded host, its int8 readiness; `int8_risks`
            lists those over INT8_SPREAD_THRESHOLD.
    """

    folded: list
    kept: list
    errors: dict
    output_scales: dict
    channel_spreads: list = dataclasses.field(default_factory=list)

    @property
    def int8_risks(self):
        """The ChannelSpread of each host whose spread is over INT8_SPREAD_THRESHOLD (or
        NaN): an int8 risk where weights are quantized per tensor (`per_channel_int8_risk`
        says whether per-channel quantization, TFLite's, is affected too)."""
        return [spread for spread in self.channel_spreads if spread.int8_risk]

    def to_dict(self):
        """The report as a JSON-ready dict: the fields (FoldedBN, KeptBN and ChannelSpread as
        dicts), `relative_errors`, `relative_error`, `int8_spread_threshold` and `int8_risks`
        (the names of the hosts at risk).

        Returns:
            dict, as the CLI's `--report` file holds it under "fold".
        """
        return {
            **dataclasses.asdict(self),
            "relative_errors": self.relative_errors,
            "relative_error": self.relative_error,
            "channel_spreads": [spread.to_dict() for spread in self.channel_spreads],
            "int8_spread_threshold": INT8_SPREAD_THRESHOLD,
            "int8_risks": [spread.host for spread in self.int8_risks],
        }


@dataclasses.dataclass
class ExportReport(_OutputErrors):
    """A written file, checked in its runtime against the Keras model.

    Attributes:
        format: "tflite" or "onnx".
        path: the file's absolute path.
        size_bytes: its size.
        errors: output name → {runtime setting → max abs(runtime − Keras)} on the probe
            ("litert"; "ort_disabled" and "ort_enabled" for onnxruntime's optimiser).
        output_scales: output name → max abs(Keras output) on the probe.
        scale_tolerance: the tolerance: the largest error allowed, as a fraction of each
            output's scale.
        op_histogram: op name → count in the file.
        quantization: the TFLite quantization, None for float32.
        fold: the FoldReport, or None when fold=False.
    """

    format: str
    path: str
    size_bytes: int
    errors: dict
    output_scales: dict
    scale_tolerance: float
    op_histogram: dict
    quantization: str | None = None
    fold: FoldReport | None = None

    def _error_by_output(self):
        return {name: worst(by_setting.values()) for name, by_setting in self.errors.items()}

    @property
    def passed(self):
        """Every output of every runtime setting within `scale_tolerance` of its scale (NaN
        fails)."""
        return bool(self.relative_error <= self.scale_tolerance)

    @property
    def atol(self):
        """The deprecated name of `scale_tolerance` (read-only; a DeprecationWarning)."""
        warnings.warn(
            "ExportReport.atol is deprecated: read ExportReport.scale_tolerance (the same "
            "value, a fraction of each output's scale).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.scale_tolerance

    def to_dict(self):
        """The report as a JSON-ready dict: the fields (`fold` as `FoldReport.to_dict`), plus
        `max_abs_error`, `relative_errors`, `relative_error` and `passed`.

        Returns:
            dict, as the CLI's `--report` file lists it under "exports".
        """
        data = dataclasses.asdict(self)
        data["fold"] = None if self.fold is None else self.fold.to_dict()
        data.update(
            max_abs_error=self.max_abs_error,
            relative_errors=self.relative_errors,
            relative_error=self.relative_error,
            passed=self.passed,
        )
        return data


class VerificationError(Exception):
    """A written file differs from the Keras model by more than the tolerance.

    Raised by `export_tflite` and `export_onnx` with strict=True. The file was not put at its
    path (any existing file there is unchanged); the message names the worst output and its
    error.

    Args:
        report: the ExportReport of the rejected file.

    Attributes:
        report: the ExportReport of the rejected file, whose `path` is where it would have
            gone and whose `errors` say by how much each output missed.
    """

    def __init__(self, report):
        self.report = report
        worst_name = max(
            report.relative_errors,
            key=lambda n: np.nan_to_num(report.relative_errors[n], nan=np.inf),
        )
        super().__init__(
            f"The {report.format} file for {report.path} differs from the Keras model: output "
            f"'{worst_name}' is off by {report.relative_errors[worst_name]:.3g} of its scale, "
            f"over scale_tolerance={report.scale_tolerance:g}; the file was not written (any "
            f"existing file is unchanged). Pass strict=False to write it anyway."
        )

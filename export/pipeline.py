"""The one export pipeline: fold → trace → convert → write a temporary file → run it →
compare → rename it over the target.

A `Format` (tflite.py, onnx.py) supplies only what differs between file formats: the names
its files can hold, refusing layers its converter cannot take, the samples it calibrates on,
converting the traced model to bytes, validating the written file, running it in its runtime
and listing its ops. The verification is shared: the file is judged before it replaces
anything, on a probe whose outputs vary (`report.check_varies`), each output channel against
its own scale (`report.compare`); for a format that calibrates (int8), on samples held out from
calibration, with the error on calibration samples reported beside it. A file over the
tolerance raises `VerificationError` and the target path keeps what it had (strict=False
writes it anyway).

A quantization-aware (QAT) model (`Format.quantized`) takes the same steps, but is not folded
(its layers hold their batch norms folded already), is converted from its export form
(export/qat.py), and is judged in units of each output's quantization step, with its int8
weights read back from the file (`Format.check_weights`, `Format.float_ops`).
"""

import os
import typing
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from keras_bn import _quiet
from keras_bn._errors import UnsupportedModelError
from keras_bn._graph import models
from keras_bn.export import atomic, defaults, qat, report, trace
from keras_bn.export.graph import fold_batch_norms
from keras_bn.quantize import hosts


class Samples(typing.NamedTuple):
    """What a file is verified on.

    Attributes:
        probe: the Feed the file is judged on.
        calibration: the Feed it was calibrated with (int8), or None; the report gives the
            error on up to `defaults.PROBE_SAMPLES` of them beside the probe's.
        held_out: whether `probe` was held out from `calibration`.
    """

    probe: trace.Feed
    calibration: trace.Feed | None = None
    held_out: bool = False


class Format:
    """The format-specific steps of an export. Subclasses set `name` and implement the rest."""

    name = ""
    quantization: str | None = None
    names = trace.ANY_NAMES  # the names its files can hold
    quantized = False  # a QAT model: converted from its export form, judged in output steps

    def default_scale_tolerance(self) -> float:
        """The tolerance when the caller gives none, as a fraction of each output's scale."""
        return defaults.FLOAT32_SCALE_TOLERANCE

    def samples(self, sig: trace.Signature, probe: trace.ModelInput | None) -> Samples:
        """The Samples to verify on: `probe` (a structure `model.predict` takes) when given,
        else seeded random input (`defaults.PROBE_SAMPLES` samples for a QAT model, whose
        output percentiles need many values); nothing calibrated."""
        if probe is not None:
            return Samples(trace.feed(sig, probe))
        if self.quantized:
            return Samples(trace.random_feed(sig, batch=defaults.PROBE_SAMPLES))
        return Samples(trace.random_feed(sig))

    def check_model(self, model: keras.Model) -> None:
        """Raise a one-line UnsupportedModelError for a model the converter is known to get
        wrong."""

    def convert(self, model: keras.Model, sig: trace.Signature) -> bytes:
        """The file's bytes for `model`, traced with the inputs and outputs of `sig`."""
        raise NotImplementedError

    def check_file(self, written: str, target: str | os.PathLike[str]) -> None:
        """Raise if the `written` file is not a valid file of its format; the error names
        `target`, the path the caller gave (the written file is a temporary)."""

    def run(self, path: str, inputs: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
        """{runtime setting: {output name: array}} for a {input name: array} feed."""
        raise NotImplementedError

    def op_names(self, path: str) -> list[str]:
        """The name of every op in the file (repeated as often as it occurs)."""
        raise NotImplementedError

    def check_weights(self, path: str) -> list[report.WeightCheck]:
        """For a QAT model: a report.WeightCheck per kernel `convert` wrote, read from the
        file."""
        raise NotImplementedError

    def float_ops(self, path: str) -> dict[str, int]:
        """For a QAT model: op name → count of the file's ops that compute in float (in the
        format's own op names), read from the file; empty for a file an integer runtime
        computes whole."""
        raise NotImplementedError


class QuantizedFormat(Format):
    """What a QAT model's format adds to its float format's (list it first among the bases):
    the model's kernels, taken when it converts (`take_weights`), which `check_weights` reads
    back; and the refusal of the QAT hosts the format cannot hold (`host_refusal`)."""

    quantized = True
    # Whether per-channel Dense kernels go in the file as 1×1 convolutions (`qat.host_weights`).
    dense_as_conv = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._weights: list[qat.HostWeight] = []

    def host_refusal(self, layer: keras.layers.Layer) -> str | None:
        """Why the format cannot hold the QAT host `layer` (a message), or None."""
        return None

    def check_model(self, model: keras.Model) -> None:
        """The float format's refusals, then for each QAT host the refusal every format
        shares (`hosts.int8_file_refusal`) and its own `host_refusal`."""
        super().check_model(model)
        for layer in models.layers_within(model, qat.QAT_HOSTS):
            shared = hosts.int8_file_refusal(layer.host, _input_rank(layer))
            if shared:
                raise UnsupportedModelError(
                    f"{self.names.format} export of a quantization-aware model cannot take QAT "
                    f"layer "
                    f"'{layer.name}': its host {shared}, then train it again."
                )
            refusal = self.host_refusal(layer)
            if refusal:
                raise UnsupportedModelError(refusal)

    def take_weights(self, model: keras.Model, sig: trace.Signature) -> list[qat.HostWeight]:
        """The model's kernels (`qat.host_weights`), their tags clear of the file's input and
        output names, kept for `check_weights`."""
        self._weights = qat.host_weights(
            model, (*sig.input_names, *sig.output_names), self.dense_as_conv
        )
        return self._weights


def _input_rank(layer: keras.layers.Layer) -> int | None:
    """The rank of the input `layer` is called on in its model's graph; None where unknown."""
    try:
        return len(layer.input.shape)
    except (AttributeError, ValueError):
        return None


def export(
    model: keras.Model,
    path: str | os.PathLike[str],
    fmt: Format,
    scale_tolerance: float | None = None,
    strict: bool = True,
    fold: bool = True,
    probe: trace.ModelInput | None = None,
    on_stage: Callable[[str], None] | None = None,
    allow_unverified: bool = False,
) -> report.ExportReport:
    """Fold `model`, convert it with `fmt`, write it to `path` only if it verifies.

    See export_tflite / export_onnx for the arguments; returns the ExportReport.
    """
    if fmt.quantized:
        if scale_tolerance is not None:
            raise ValueError(
                f"A quantization-aware model's file is judged in units of each output's "
                f"quantization step ({_LSB_TOLERANCE}), not at a fraction of its scale; "
                f"received scale_tolerance={scale_tolerance!r}."
            )
    elif scale_tolerance is None:
        scale_tolerance = default_scale_tolerance(model, fmt)
    else:
        scale_tolerance = defaults.check_scale_tolerance(scale_tolerance)
    for flag, value in (("strict", strict), ("allow_unverified", allow_unverified)):
        if not isinstance(value, bool):
            raise ValueError(f"{flag} must be True or False; received {flag}={value!r}.")
    atomic.target(path)  # a folder or a device fails here, not after the conversion
    sig = trace.signature(model, fmt.names)
    fmt.check_model(model)
    steps: dict[str, float] = {}  # each output's step, for a QAT model
    if fmt.quantized:
        qat.check_exportable(model, fmt.names.format)
        steps = dict(zip(sig.output_names, qat.output_steps(model)))
    samples = fmt.samples(sig, probe)
    expected = trace.outputs(model, sig, samples.probe)
    unverified = report.check_varies(expected, samples.probe.what, samples.probe, allow_unverified)
    in_sample = None
    if samples.calibration is not None:
        in_sample = trace.spread_samples(samples.calibration, defaults.PROBE_SAMPLES)
        expected_in_sample = trace.outputs(model, sig, in_sample)
    stage = on_stage or (lambda name: None)
    fold = fold and not fmt.quantized  # a QAT model's layers hold their batch norms folded
    if fold:
        stage("fold")
    source, fold_report = (
        fold_batch_norms(
            model,
            sig.pack(samples.probe),
            int8_readiness=fmt.quantization == "int8",
            allow_unverified=unverified is not None,
        )
        if fold
        else (model, None)
    )
    stage("convert")
    log: list[str] = []  # what the converter and the runtime print: into the report
    with _quiet.captured(log):
        content = fmt.convert(source, sig)
    # A QAT file (no scale_tolerance) has its per-channel errors reported, at int8's channel
    # floor, not judged.
    channel_tolerance = (
        defaults.SCALE_TOLERANCES["int8"] if scale_tolerance is None else scale_tolerance
    )

    def verify(written: str) -> report.ExportReport:
        with _quiet.captured(log):
            fmt.check_file(written, path)
            actual = fmt.run(written, samples.probe)
            in_sample_actual = None if in_sample is None else fmt.run(written, in_sample)
            ops = fmt.op_names(written)
            quantized: dict[str, Any] = {}
            if fmt.quantized:
                quantized = dict(
                    lsb_errors=report.lsb_errors(expected, actual, steps, defaults.QAT_PERCENTILE),
                    lsb_tolerance=_LSB_TOLERANCE,
                    weights=fmt.check_weights(written),
                    float_ops=fmt.float_ops(written),
                )
        errors, scales, channels = report.compare(expected, actual, channel_tolerance)
        in_sample_errors = in_sample_channels = None
        if in_sample_actual is not None:
            in_sample_errors, _, in_sample_channels = report.compare(
                expected_in_sample, in_sample_actual, channel_tolerance
            )
        result = report.ExportReport(
            format=fmt.name,
            path=os.path.abspath(path),
            size_bytes=len(content),
            errors=errors,
            output_scales=scales,
            scale_tolerance=scale_tolerance,
            op_histogram=report.histogram(ops),
            quantization=fmt.quantization,
            fold=fold_report,
            worst_channels=channels,
            in_sample_errors=in_sample_errors,
            in_sample_worst_channels=in_sample_channels,
            probe_samples=samples.probe.samples,
            calibration_samples=(
                None if samples.calibration is None else samples.calibration.samples
            ),
            probe_held_out=samples.held_out,
            unverified=unverified,
            log=log,
            **quantized,
        )
        if strict and not result.passed:
            raise report.VerificationError(result)
        return result

    stage("verify")
    return atomic.write_bytes(path, content, check=verify)


_LSB_TOLERANCE = report.LsbTolerance(
    defaults.QAT_MAX_LSB, defaults.QAT_PERCENTILE, defaults.QAT_PERCENTILE_LSB
)


def default_scale_tolerance(model: keras.Model, fmt: Format | None = None) -> float:
    """The format's default tolerance (the float32 one for the folded Keras model itself, when
    `fmt` is None), or the half-precision floor if larger and any layer of the model computes in
    a 16-bit float."""
    tolerance = defaults.FLOAT32_SCALE_TOLERANCE if fmt is None else fmt.default_scale_tolerance()
    if any(
        layer.compute_dtype in defaults.HALF_PRECISION_DTYPES for layer in model._flatten_layers()
    ):
        return max(tolerance, defaults.HALF_PRECISION_SCALE_TOLERANCE)
    return tolerance


def scale_tolerance_argument(scale_tolerance: float | None, atol: float | None) -> float | None:
    """The tolerance an exporter was given, under its name or its deprecated one, `atol`.

    Called by the exporters themselves: the DeprecationWarning points at their caller.

    Raises:
        ValueError: both were given.
    """
    if atol is None:
        return scale_tolerance
    if scale_tolerance is not None:
        raise ValueError(
            f"Pass scale_tolerance only: atol is its deprecated name; received "
            f"scale_tolerance={scale_tolerance!r} and atol={atol!r}."
        )
    warnings.warn(
        "atol is deprecated: pass scale_tolerance instead (the same value, a fraction of each "
        "output's scale, not an absolute tolerance).",
        DeprecationWarning,
        stacklevel=3,
    )
    return atol

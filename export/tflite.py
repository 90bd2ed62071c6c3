"""export_tflite: the TFLite steps of the export pipeline (builtin ops only, run in LiteRT).

The traced model goes through a SavedModel (keras.export.ExportArchive) to the converter, so
the file's signature keeps the model's input and output names; LiteRT's signature runner then
feeds and reads them by name, at any batch size.

A quantization-aware (QAT) model is written full-integer from its own ranges: its export form
(export/qat.py) holds each kernel as its grid's values under an 8-bit narrow-range FakeQuant
whose step is the grid's, so that the converter stores the k-bit integers as int8 as they are
(a k-bit FakeQuant makes it re-round 3- and 5..7-bit weights onto its own storage grid), and
every activation as 8-bit FakeQuant ops. The converter then needs no representative data. The
kernels are found again in the file by the name of their FakeQuant op.
"""

import contextlib
import io
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from keras_bn.backend import guard

# The writer converts TensorFlow functions: a file from another backend is loaded under
# TensorFlow. Checked before the runtime's import, so that its absence is named.
guard.require_writers("keras_bn.export.export_tflite")

from ai_edge_litert.interpreter import Interpreter, OpResolverType  # noqa: E402

from keras_bn._errors import UnsupportedModelError  # noqa: E402
from keras_bn.export import defaults, pipeline, qat, report, trace  # noqa: E402
from keras_bn.quantize import hosts  # noqa: E402

QUANTIZATIONS = tuple(defaults.SCALE_TOLERANCES)  # None (float32), "float16", "dynamic", "int8"
SIGNATURE = "serve"
# A SavedModel signature's argument names: TensorFlow's rule, without the '/' it allows, which
# the export archive replaces by '_' (a name collision with another input). Its output keys
# and LiteRT take any string.
NAMES = trace.NameRules(
    format="TFLite",
    input_pattern=r"[A-Za-z0-9.][A-Za-z0-9_.-]*",
    input_characters="a letter, a digit or '.', followed by letters, digits, '_', '.' and '-' only",
)
L = keras.layers
# channels_first layers the TFLite converter cannot take (TF 2.21): it fails with a long MLIR
# error, or (a bias-free Conv1D) writes a file whose output has the wrong shape.
CHANNELS_FIRST_UNCONVERTIBLE = (
    L.Conv1D,
    L.Conv3D,
    L.DepthwiseConv1D,
    L.SeparableConv1D,
    L.Conv1DTranspose,
    L.Conv2DTranspose,
    L.Conv3DTranspose,
)
# The QAT hosts a file can hold, and each kernel's TFLite layout from its grid's channels-last
# view: CONV_2D (O, kh, kw, I) from (kh, kw, I, O); DEPTHWISE_CONV_2D (1, kh, kw, C·M) from
# (kh, kw, 1, C·M); FULLY_CONNECTED (out, in) from (in, out). (op, layout, quantized axis).
QAT_HOSTS = (L.Dense, L.Conv2D, L.DepthwiseConv2D, L.SeparableConv2D)
QAT_LAYOUTS = {
    hosts.CONV: ("CONV_2D", (3, 0, 1, 2), 0),
    hosts.DEPTHWISE: ("DEPTHWISE_CONV_2D", (2, 0, 1, 3), 3),
    hosts.DENSE: ("FULLY_CONNECTED", (1, 0), 0),
}


def export_tflite(
    model: keras.Model,
    path: str | os.PathLike[str],
    quantization: str | None = None,
    representative_data: trace.ModelInput | None = None,
    fold: bool = True,
    probe: trace.ModelInput | None = None,
    scale_tolerance: float | None = None,
    strict: bool = True,
    on_stage: Callable[[str], None] | None = None,
    *,
    atol: float | None = None,
    allow_unverified: bool = False,
) -> report.ExportReport:
    """Write `model` as a .tflite file at `path`, once it matches the Keras model in LiteRT.

    A quantization-aware model (one holding keras_bn.quantize layers, from `quantize_model`)
    is written full-integer (int8) from its own weights and activation ranges, with no
    calibration: its file computes the model's own integer arithmetic. It is judged in units
    of each output's quantization step (the report's `lsb_errors`: at most
    `defaults.QAT_MAX_LSB` steps on every value and `defaults.QAT_PERCENTILE_LSB` on 99% of
    them), its int8 weights are read back and must equal the grid its layers round to
    (`weights`), and no op may compute in float (`float_ops`).

    Args:
        model: a built Sequential or Functional Keras model; any number of inputs and outputs
            (lists, dicts), of any dtypes.
        path: the .tflite file to write. It is written to a temporary file in the same
            folder, run and compared, and only then renamed to `path`.
        quantization: None (float32), "float16", "dynamic" (int8 weights) or "int8" (full
            integer ops, float input and output), which needs `representative_data`. For a
            quantization-aware model, None or "int8" (the model's own int8, the default);
            any other is refused.
        representative_data: inputs (first axis: samples) in any structure `model.predict`
            takes (a dict keyed by input name for a model that takes a dict). For int8, a
            quarter of them, at most 64 (`defaults.PROBE_SAMPLES`), are held out and are the
            default probe, so the file is verified on samples it was not calibrated with; up
            to 200 (`defaults.CALIBRATION_SAMPLES`) of the rest calibrate; both are spread
            evenly over the samples, and int8 needs at least 16
            (`defaults.INT8_MIN_SAMPLES`). For the other quantizations, and for a
            quantization-aware model (whose ranges are its own: nothing is calibrated), 64
            of them spread evenly are the default probe.
        fold: fold the batch norms first (`fold_batch_norms`); a quantization-aware model's
            layers hold theirs folded already, and it is not folded again.
        probe: inputs on which the file is compared with `model`, in any structure
            `model.predict` takes, whose outputs differ between samples; default: from
            `representative_data` (above), else seeded random input (64 samples for a
            quantization-aware model). An int8 file's report also gives its error on up to 64
            calibration samples (`in_sample_errors`).
        scale_tolerance: the largest error allowed, as a fraction of each output channel's
            scale (max abs(output) in that channel on the probe); default
            `defaults.SCALE_TOLERANCES[quantization]`: 1e-4 for float32, 1e-3 for float16,
            2e-2 for dynamic, 1e-1 for int8 (at least 1e-2 for a model that computes in
            float16 or bfloat16). Not for a quantization-aware model, judged in output
            steps.
        strict: raise VerificationError (and write nothing) when the file is over
            `scale_tolerance`; False writes it anyway and returns the report (`report.passed`
            is False).
        on_stage: optional callback, called with "fold", "convert" and "verify" as each
            stage starts (the CLI's progress display).
        atol: the deprecated name of `scale_tolerance` (a DeprecationWarning).
        allow_unverified: for a smoke test of a model whose own outputs are the same for
            every probe sample (untrained, or dead: every unit before the output off), which
            no probe can verify: write its file anyway, with `report.unverified` saying why.
            Off by default: such a model is refused (ValueError). A probe whose samples are
            all alike is refused either way.

    Returns:
        ExportReport: the LiteRT error of each output (and its worst channel) against
        `model`, the op histogram and the file size; for a quantization-aware model also the
        errors in output steps, the weights read back and the float ops.

    Raises:
        VerificationError: the file is over `scale_tolerance` (or not finite) and strict is
            True; any file at `path` is unchanged.
        UnsupportedModelError: a model structure the export cannot take (a subclassed or
            unbuilt model, a layer whose config does not round-trip), an input dict key a
            TFLite signature cannot name, or a layer the converter cannot write
            (channels_first 1D/3D and transposed convolutions, a grouped Conv3D, 16-bit
            compute dtypes); for a quantization-aware model, a layer kept in float, a QAT
            layer with float weights or output, a host other than Dense (per tensor),
            Conv2D, DepthwiseConv2D or SeparableConv2D (channels_last), or an output no
            quantizer rounds; named; a TypeError and a ValueError.
        ValueError: a bad argument (both `scale_tolerance` and `atol`, say), a probe or
            representative data that does not fit the model, a probe on which an output is
            the same for every sample (for a model whose own outputs are, unless
            allow_unverified), or fewer than 16 samples for int8; for a
            quantization-aware model, a quantization other than None and "int8", a
            scale_tolerance, or an activation quantizer that never saw a training batch.
        ConverterError: the converter failed (e.g. an op that is not a TFLite builtin).
        OSError: `path` cannot be written, or is a folder, FIFO or device (refused before
            converting).
    """
    scale_tolerance = pipeline.scale_tolerance_argument(scale_tolerance, atol)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}; received {quantization!r}.")
    if qat.is_quantized(model):
        if quantization not in (None, "int8"):
            raise ValueError(
                f"'{model.name}' is a quantization-aware model: its file is the int8 its layers "
                f'compute (quantization=None or "int8"), from its own ranges; received '
                f"quantization={quantization!r}. Export the float model for a {quantization} "
                f"file."
            )
        return pipeline.export(
            model,
            path,
            _QuantizedTFLite(representative_data),
            scale_tolerance=scale_tolerance,
            strict=strict,
            fold=fold,
            probe=probe,
            on_stage=on_stage,
            allow_unverified=allow_unverified,
        )
    if quantization == "int8" and representative_data is None:
        raise ValueError(
            'quantization="int8" (full integer) needs representative_data to calibrate '
            "the activation ranges."
        )
    return pipeline.export(
        model,
        path,
        _TFLite(quantization, representative_data),
        scale_tolerance=scale_tolerance,
        strict=strict,
        fold=fold,
        probe=probe,
        on_stage=on_stage,
        allow_unverified=allow_unverified,
    )


class _TFLite(pipeline.Format):
    name = "tflite"
    names = NAMES

    def __init__(
        self, quantization: str | None, representative_data: trace.ModelInput | None
    ) -> None:
        self.quantization = quantization
        self._representative_data = representative_data

    def default_scale_tolerance(self) -> float:
        return defaults.SCALE_TOLERANCES[self.quantization]

    def _representative(self, sig: trace.Signature) -> trace.Feed:
        return trace.feed(sig, self._representative_data, "representative_data")

    def samples(self, sig: trace.Signature, probe: trace.ModelInput | None) -> pipeline.Samples:
        if self.quantization == "int8":  # held-out samples: not the ones it calibrates on
            calibration, held_out = trace.held_out_split(self._representative(sig))
            if probe is None:
                return pipeline.Samples(held_out, calibration, held_out=True)
            return pipeline.Samples(trace.feed(sig, probe), calibration)
        if probe is None and self._representative_data is not None:
            return pipeline.Samples(
                trace.spread_samples(self._representative(sig), defaults.PROBE_SAMPLES)
            )
        return super().samples(sig, probe)

    def check_model(self, model: keras.Model) -> None:
        for layer in model._flatten_layers(include_self=False):
            if layer.compute_dtype in defaults.HALF_PRECISION_DTYPES and not isinstance(
                layer, L.InputLayer
            ):
                raise UnsupportedModelError(
                    f"TFLite cannot convert layer '{layer.name}', which computes in "
                    f"{layer.compute_dtype} (a mixed-precision policy): its TensorFlow ops have "
                    f"no TFLite builtin. Rebuild the model under the float32 policy (and use "
                    f'quantization="float16" for a half-size file), or export it to ONNX.'
                )
            if type(layer) is L.Conv3D and layer.groups > 1:
                raise UnsupportedModelError(
                    f"TFLite cannot convert layer '{layer.name}' (Conv3D with "
                    f"groups={layer.groups}): LiteRT's CONV_3D has no groups. Build it as "
                    f"{layer.groups} Conv3D layers on slices of the channels, concatenated."
                )
            if (
                type(layer) in CHANNELS_FIRST_UNCONVERTIBLE
                and layer.data_format == "channels_first"
            ):
                raise UnsupportedModelError(
                    f"TFLite cannot convert layer '{layer.name}' ({type(layer).__name__} with "
                    f"data_format='channels_first'): the converter fails on it. Build the "
                    f"model channels_last (TFLite's own layout), or export it to ONNX."
                )

    def convert(self, model: keras.Model, sig: trace.Signature) -> bytes:
        import tensorflow as tf  # the writer's own (keras_bn.backend.guard.require_writers)

        function = trace.inference_function(model, sig)
        archive = keras.export.ExportArchive()
        archive.track(model)
        archive.add_endpoint(SIGNATURE, function.python_function, trace.tensor_specs(sig))
        with (
            tempfile.TemporaryDirectory() as folder,
            contextlib.redirect_stdout(io.StringIO()),
            warnings.catch_warnings(),
        ):
            # TF warns that int8 calibration got float input statistics, which is what we ask
            # for (float input and output).
            warnings.filterwarnings("ignore", message="Statistics for quantized inputs")
            archive.write_out(folder, verbose=False)
            converter = tf.lite.TFLiteConverter.from_saved_model(folder, [SIGNATURE])
            self._configure(converter, sig)
            return converter.convert()

    def _configure(self, converter: Any, sig: trace.Signature) -> None:
        import tensorflow as tf  # the writer's own (keras_bn.backend.guard.require_writers)

        # Builtins only: a folded model needs no Flex (Keras's own export turns SELECT_TF_OPS on).
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        if self.quantization is not None:
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
        if self.quantization == "float16":
            converter.target_spec.supported_types = [tf.float16]
        if self.quantization == "int8":
            samples, _ = trace.held_out_split(self._representative(sig))

            def calibration() -> Iterator[dict[str, np.ndarray]]:
                for i in range(samples.samples):
                    yield {name: array[i : i + 1] for name, array in samples.items()}

            converter.representative_dataset = calibration
            converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]

    def run(self, path: str, inputs: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
        return {"litert": run(path, inputs)}

    def op_names(self, path: str) -> list[str]:
        return [op["op_name"] for op in _plain_interpreter(path)._get_ops_details()]


class _QuantizedTFLite(pipeline.QuantizedFormat, _TFLite):
    """A QAT model's file: full integer from its export form, no calibration; its
    `representative_data` only gives the default probe."""

    # The converter fails on a FULLY_CONNECTED with per-channel weight scales ("mismatched
    # quantized axes"); a 1×1 CONV_2D holds them.
    dense_as_conv = True

    def __init__(self, representative_data: trace.ModelInput | None) -> None:
        super().__init__("int8", representative_data)

    def samples(self, sig: trace.Signature, probe: trace.ModelInput | None) -> pipeline.Samples:
        if probe is None and self._representative_data is not None:
            return pipeline.Samples(
                trace.spread_samples(self._representative(sig), defaults.PROBE_SAMPLES)
            )
        return pipeline.Format.samples(self, sig, probe)

    def host_refusal(self, layer: keras.layers.Layer) -> str | None:
        host = layer.host
        if type(host) not in QAT_HOSTS or getattr(host, "data_format", "") == "channels_first":
            # ONNX takes an ungrouped channels_first host, but no 1-D or 3-D one either
            known = type(host) in QAT_HOSTS
            to_onnx = known and getattr(host, "groups", 1) == 1
            return (
                f"TFLite export of a quantization-aware model takes Dense, Conv2D, "
                f"DepthwiseConv2D and SeparableConv2D hosts, channels_last; '{layer.name}' "
                f"hosts a {type(host).__name__}{' (channels_first)' if known else ''}."
                f"{' Export it to ONNX.' if to_onnx else ''}"
            )
        return None

    def convert(self, model: keras.Model, sig: trace.Signature) -> bytes:
        weights = self.take_weights(model, sig)
        return super().convert(qat.export_model(model, weights, _on_int8_grid), sig)

    def _configure(self, converter: Any, sig: trace.Signature) -> None:
        import tensorflow as tf  # the writer's own (keras_bn.backend.guard.require_writers)

        # The ranges are in the graph (FakeQuant ops): quantize, calibrate nothing. Builtins
        # only; an op the converter left in float shows in `float_ops`.
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        converter.optimizations = [tf.lite.Optimize.DEFAULT]

    def check_weights(self, path: str) -> list[report.WeightCheck]:
        plain = _plain_interpreter(path)
        details = {d["index"]: d for d in plain.get_tensor_details()}
        kernels = [
            (op["op_name"], details[op["inputs"][1]], _bias(op, details))
            for op in plain._get_ops_details()
            if op["op_name"] in {layout[0] for layout in QAT_LAYOUTS.values()}
        ]
        return [_weight_check(plain, weight, kernels) for weight in self._weights]

    def float_ops(self, path: str) -> dict[str, int]:
        plain = _plain_interpreter(path)
        details = {d["index"]: d for d in plain.get_tensor_details()}
        inputs = {d["index"] for d in plain.get_input_details()}
        outputs = {d["index"] for d in plain.get_output_details()}
        found: list[str] = []
        for op in plain._get_ops_details():
            tensors = [i for i in (*op["inputs"], *op["outputs"]) if i >= 0]
            if op["op_name"] == "QUANTIZE" and set(op["inputs"]) <= inputs:
                continue  # the float input, quantized
            if op["op_name"] == "DEQUANTIZE" and set(op["outputs"]) <= outputs:
                continue  # the float output
            if any(np.issubdtype(details[i]["dtype"], np.floating) for i in tensors):
                found.append(op["op_name"])
        return report.histogram(found)


def _on_int8_grid(weight: qat.HostWeight) -> Any:
    """A kernel for the converter: its grid's values under an 8-bit narrow-range FakeQuant
    whose range is ±127 steps, so that the file holds the k-bit integers themselves as int8;
    named by the kernel's tag, to be found in the file."""
    import tensorflow as tf  # the writer's own (keras_bn.backend.guard.require_writers)

    grid = weight.grid
    wide = np.asarray(grid.scale * np.float32(127), np.float32)
    if grid.per_channel:
        return tf.quantization.fake_quant_with_min_max_vars_per_channel(
            grid.values, -wide, wide, num_bits=8, narrow_range=True, name=weight.tag
        )
    return tf.quantization.fake_quant_with_min_max_vars(
        grid.values, -float(wide), float(wide), num_bits=8, narrow_range=True, name=weight.tag
    )


def _bias(op: dict[str, Any], details: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The bias tensor's details of a CONV_2D, DEPTHWISE_CONV_2D or FULLY_CONNECTED op, or
    None where it has none."""
    inputs = op["inputs"]
    return details[inputs[2]] if len(inputs) > 2 and inputs[2] >= 0 else None


def _weight_check(
    plain: Interpreter,
    weight: qat.HostWeight,
    kernels: list[tuple[str, dict[str, Any], dict[str, Any] | None]],
) -> report.WeightCheck:
    """The report.WeightCheck of one kernel: the weight tensor of a CONV_2D,
    DEPTHWISE_CONV_2D or FULLY_CONNECTED op named after the kernel's FakeQuant op (its tag,
    which TensorFlow may suffix when a shared layer traces it twice), and the channels where
    that op's int32 bias is saturated."""
    op_name, layout, axis = QAT_LAYOUTS[weight.layout_kind]
    ours = [
        (detail, bias)
        for name, detail, bias in kernels
        if name == op_name and _tagged(detail["name"], weight.tag)
    ]
    found = [detail for detail, _ in ours]
    saturated: set[int] = set()
    for _, bias in ours:
        if bias is not None:
            values = plain.get_tensor(bias["index"]).reshape(-1).astype(np.int64)
            saturated |= {int(c) for c in np.flatnonzero(np.abs(values) >= 2**31 - 1)}
    if not found:
        return report.WeightCheck(
            weight.host, weight.kernel, weight.grid.bits, None, None, None, False
        )
    expected = weight.grid.q.transpose(layout)
    matches = True
    for detail in found:
        q = plain.get_tensor(detail["index"])
        parameters = detail["quantization_parameters"]
        scales = np.broadcast_to(weight.grid.scale, (expected.shape[axis],))
        matches &= bool(
            q.dtype == np.int8
            and q.shape == expected.shape
            and np.array_equal(q, expected)
            and np.all(parameters["zero_points"] == 0)
            and (not weight.grid.per_channel or parameters["quantized_dimension"] == axis)
            and np.allclose(
                np.broadcast_to(parameters["scales"], scales.shape), scales, rtol=1e-6, atol=0
            )
        )
    q = plain.get_tensor(found[0]["index"])
    return report.WeightCheck(
        weight.host,
        weight.kernel,
        weight.grid.bits,
        found[0]["name"],
        q.dtype.name,
        int(np.abs(q.astype(np.int64)).max(initial=0)),
        matches,
        tuple(sorted(saturated)),
    )


def _tagged(tensor_name: str, tag: str) -> bool:
    """Whether a TFLite tensor name (op names joined by ';') names the op `tag` (or `tag_N`)."""
    parts = {part for name in tensor_name.split(";") for part in name.split("/")}
    return tag in parts or any(
        part.startswith(f"{tag}_") and part[len(tag) + 1 :].isdigit() for part in parts
    )


def _plain_interpreter(path: str | os.PathLike[str]) -> Interpreter:
    """An interpreter without the default delegate: its ops and tensors as the file holds them
    (a delegate shows partitions as DELEGATE ops)."""
    return Interpreter(
        model_path=str(path),
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
    )


def run(
    path: str | os.PathLike[str], inputs: np.ndarray | dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Run a .tflite file written by export_tflite in LiteRT.

    Args:
        path: the file.
        inputs: {input name: array}, or one array for a single-input file; any batch size.

    Returns:
        {output name: array}.

    Raises:
        ValueError: one array for a file with several inputs.
    """
    runner = Interpreter(model_path=str(path)).get_signature_runner(SIGNATURE)
    details = runner.get_input_details()
    inputs = trace.by_input_name(inputs, list(details), path)
    return runner(**{name: np.asarray(inputs[name], details[name]["dtype"]) for name in details})

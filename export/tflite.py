"""export_tflite: the TFLite steps of the export pipeline (builtin ops only, run in LiteRT).

The traced model goes through a SavedModel (keras.export.ExportArchive) to the converter, so
the file's signature keeps the model's input and output names; LiteRT's signature runner then
feeds and reads them by name, at any batch size.
"""

import contextlib
import io
import tempfile
import warnings

import keras
import numpy as np
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter, OpResolverType

from keras_bn._errors import UnsupportedModelError
from keras_bn.export import defaults, pipeline, trace

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


def export_tflite(
    model,
    path,
    quantization=None,
    representative_data=None,
    fold=True,
    probe=None,
    scale_tolerance=None,
    strict=True,
    on_stage=None,
    *,
    atol=None,
):
    """Write `model` as a .tflite file at `path`, once it matches the Keras model in LiteRT.

    Args:
        model: a built Sequential or Functional Keras model; any number of inputs and outputs
            (lists, dicts), of any dtypes.
        path: the .tflite file to write. It is written to a temporary file in the same
            folder, run and compared, and only then renamed to `path`.
        quantization: None (float32), "float16", "dynamic" (int8 weights) or "int8" (full
            integer ops, float input and output), which needs `representative_data`.
        representative_data: inputs (first axis: samples) in any structure `model.predict`
            takes (a dict keyed by input name for a model that takes a dict). For int8, a
            quarter of them, at most 64 (`defaults.PROBE_SAMPLES`), are held out and are the
            default probe, so the file is verified on samples it was not calibrated with; up
            to 200 (`defaults.CALIBRATION_SAMPLES`) of the rest calibrate; both are spread
            evenly over the samples, and int8 needs at least 16
            (`defaults.INT8_MIN_SAMPLES`). For the other quantizations, 64 of them spread
            evenly are the default probe.
        fold: fold the batch norms first (`fold_batch_norms`).
        probe: inputs on which the file is compared with `model`, in any structure
            `model.predict` takes, whose outputs differ between samples; default: from
            `representative_data` (above), else seeded random input. An int8 file's report
            also gives its error on up to 64 calibration samples (`in_sample_errors`).
        scale_tolerance: the largest error allowed, as a fraction of each output channel's
            scale (max abs(output) in that channel on the probe); default
            `defaults.SCALE_TOLERANCES[quantization]`: 1e-4 for float32, 1e-3 for float16,
            2e-2 for dynamic, 1e-1 for int8 (at least 1e-2 for a model that computes in
            float16 or bfloat16).
        strict: raise VerificationError (and write nothing) when the file is over
            `scale_tolerance`; False writes it anyway and returns the report (`report.passed`
            is False).
        on_stage: optional callback, called with "fold", "convert" and "verify" as each
            stage starts (the CLI's progress display).
        atol: the deprecated name of `scale_tolerance` (a DeprecationWarning).

    Returns:
        ExportReport: the LiteRT error of each output (and its worst channel) against
        `model`, the op histogram and the file size.

    Raises:
        VerificationError: the file is over `scale_tolerance` (or not finite) and strict is
            True; any file at `path` is unchanged.
        UnsupportedModelError: a model structure the export cannot take (a subclassed or
            unbuilt model, a layer whose config does not round-trip), an input dict key a
            TFLite signature cannot name, or a layer the converter cannot write
            (channels_first 1D/3D and transposed convolutions, a grouped Conv3D, 16-bit
            compute dtypes), named; a TypeError and a ValueError.
        ValueError: a bad argument (both `scale_tolerance` and `atol`, say), a probe or
            representative data that does not fit the model, a probe on which an output is
            the same for every sample, or fewer than 16 samples for int8.
        ConverterError: the converter failed (e.g. an op that is not a TFLite builtin).
        OSError: `path` cannot be written, or is a folder, FIFO or device (refused before
            converting).
    """
    scale_tolerance = pipeline.scale_tolerance_argument(scale_tolerance, atol)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}; received {quantization!r}.")
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
    )


class _TFLite(pipeline.Format):
    name = "tflite"
    names = NAMES

    def __init__(self, quantization, representative_data):
        self.quantization = quantization
        self._representative_data = representative_data

    def default_scale_tolerance(self):
        return defaults.SCALE_TOLERANCES[self.quantization]

    def _representative(self, sig):
        return trace.feed(sig, self._representative_data, "representative_data")

    def samples(self, sig, probe):
        if self.quantization == "int8":  # held-out samples: not the ones it calibrates on
            calibration, held_out = trace.held_out_split(self._representative(sig))
            given = None if probe is None else trace.feed(sig, probe)
            return pipeline.Samples(held_out if given is None else given, calibration)
        if probe is None and self._representative_data is not None:
            return pipeline.Samples(
                trace.spread_samples(self._representative(sig), defaults.PROBE_SAMPLES)
            )
        return super().samples(sig, probe)

    def check_model(self, model):
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

    def convert(self, model, sig):
        function = trace.inference_function(model, sig)
        archive = keras.export.ExportArchive()
        archive.track(model)
        archive.add_endpoint(SIGNATURE, function.python_function, list(sig.input_specs))
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

    def _configure(self, converter, sig):
        # Builtins only: a folded model needs no Flex (Keras's own export turns SELECT_TF_OPS on).
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        if self.quantization is not None:
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
        if self.quantization == "float16":
            converter.target_spec.supported_types = [tf.float16]
        if self.quantization == "int8":
            samples, _ = trace.held_out_split(self._representative(sig))

            def calibration():
                for i in range(samples.samples):
                    yield {name: array[i : i + 1] for name, array in samples.items()}

            converter.representative_dataset = calibration
            converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]

    def run(self, path, inputs):
        return {"litert": run(path, inputs)}

    def op_names(self, path):
        # Without the default delegate: partitions would show up as DELEGATE.
        plain = Interpreter(
            model_path=path,
            experimental_op_resolver_type=(OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES),
        )
        return [op["op_name"] for op in plain._get_ops_details()]


def run(path, inputs):
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

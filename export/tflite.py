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

from keras_bn.export import pipeline, trace

QUANTIZATIONS = (None, "float16", "dynamic", "int8")
# Defaults for `atol`, as a fraction of each output's scale. float32 is exact up to rounding.
# The quantized ones are 3x or more the worst error measured on correct exports of the trained
# digits demo CNN, the digits CNN with random BN statistics and MobileNetV2 (alpha 0.35, 96 px,
# random weights and BN statistics): float16 2.8e-4, dynamic 6.7e-3, int8 1.5e-2
# (docs/guide/export.md, "Tolerances"); a wrong file (a misplaced bias, a wrong layout) is off by
# 0.1 to 1.
DEFAULT_ATOL = {None: pipeline.FLOAT32_ATOL, "float16": 1e-3, "dynamic": 2e-2, "int8": 5e-2}
CALIBRATION_SAMPLES = 200
PROBE_SAMPLES = 64
SIGNATURE = "serve"
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
    atol=None,
    strict=True,
    on_stage=None,
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
            takes; up to 200 calibrate int8, and the first 64 are the default probe.
        fold: fold the batch norms first (`fold_batch_norms`).
        probe: inputs on which the file is compared with `model`, in any structure
            `model.predict` takes; default: the first 64 representative samples, else seeded
            random input.
        atol: the largest error allowed, as a fraction of each output's scale (max abs(output)
            on the probe); default `DEFAULT_ATOL[quantization]`: 1e-4 for float32, 1e-3 for
            float16, 2e-2 for dynamic, 5e-2 for int8.
        strict: raise VerificationError (and write nothing) when the file is over `atol`;
            False writes it anyway and returns the report (`report.passed` is False).
        on_stage: optional callback, called with "fold", "convert" and "verify" as each
            stage starts (the CLI's progress display).

    Returns:
        ExportReport: the LiteRT error of each output against `model`, the op histogram and
        the file size.

    Raises:
        VerificationError: the file is over `atol` (or not finite) and strict is True; any
            file at `path` is unchanged.
        ValueError: a bad argument, a probe that does not fit the model, or a layer the
            converter cannot take (channels_first 1D/3D and transposed convolutions, 16-bit
            compute dtypes), named.
        ConverterError: the converter failed (e.g. an op that is not a TFLite builtin).
        OSError: `path` cannot be written, or is a folder, FIFO or device (refused before
            converting).
    """
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
        atol=atol,
        strict=strict,
        fold=fold,
        probe=probe,
        on_stage=on_stage,
    )


class _TFLite(pipeline.Format):
    name = "tflite"

    def __init__(self, quantization, representative_data):
        self.quantization = quantization
        self._representative_data = representative_data

    def default_atol(self):
        return DEFAULT_ATOL[self.quantization]

    def _samples(self, sig):
        if self._representative_data is None:
            return None
        return trace.feed(sig, self._representative_data, "representative_data")

    def default_probe(self, sig):
        samples = self._samples(sig)
        return None if samples is None else trace.first_samples(samples, PROBE_SAMPLES)

    def check_model(self, model):
        for layer in model._flatten_layers(include_self=False):
            if layer.compute_dtype in pipeline.HALF_PRECISION and not isinstance(
                layer, L.InputLayer
            ):
                raise ValueError(
                    f"TFLite cannot convert layer '{layer.name}', which computes in "
                    f"{layer.compute_dtype} (a mixed-precision policy): its TensorFlow ops have "
                    f"no TFLite builtin. Rebuild the model under the float32 policy (and use "
                    f'quantization="float16" for a half-size file), or export it to ONNX.'
                )
            if (
                type(layer) in CHANNELS_FIRST_UNCONVERTIBLE
                and layer.data_format == "channels_first"
            ):
                raise ValueError(
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
            samples = trace.first_samples(self._samples(sig), CALIBRATION_SAMPLES)
            count = len(next(iter(samples.values())))

            def calibration():
                for i in range(count):
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
    """
    runner = Interpreter(model_path=str(path)).get_signature_runner(SIGNATURE)
    names = list(runner.get_input_details())
    if not isinstance(inputs, dict):
        if len(names) != 1:
            raise ValueError(f"{path} has the inputs {names}: give a dict keyed by them.")
        inputs = {names[0]: inputs}
    details = runner.get_input_details()
    return runner(**{name: np.asarray(inputs[name], details[name]["dtype"]) for name in names})

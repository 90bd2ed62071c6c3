"""export_tflite: fold, convert with TFLite builtin ops only, run in LiteRT, compare with Keras."""

import contextlib
import io
import os
import warnings

import numpy as np
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter, OpResolverType

from keras_bn.export import atomic, report, trace
from keras_bn.export.graph import fold_batch_norms, random_input

QUANTIZATIONS = (None, "float16", "dynamic", "int8")
CALIBRATION_SAMPLES = 200


def export_tflite(model, path, quantization=None, representative_data=None, fold=True,
                  probe=None, on_stage=None):
    """Write `model` as a .tflite file at `path` and check it against the Keras model.

    Args:
        model: a Keras model with one input and one output.
        path: the .tflite file to write (atomically: no partial file on failure).
        quantization: None (float32), "float16", "dynamic" (int8 weights) or "int8" (full
            integer ops, float input and output), which needs `representative_data`.
        representative_data: array of inputs (first axis: samples), used to calibrate int8
            and as the default probe.
        fold: fold the batch norms first (`fold_batch_norms`).
        probe: inputs on which the file is compared with `model`; default: up to 64
            representative samples, else seeded random input.
        on_stage: optional callback, called with "fold", "convert" and "verify" as each
            stage starts (the CLI's progress display).

    Returns:
        ExportReport with the error of the LiteRT run against `model`, the op histogram and
        the file size.
    """
    trace.check_single_io(model)
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATIONS}; received {quantization!r}."
        )
    if quantization == "int8" and representative_data is None:
        raise ValueError(
            'quantization="int8" (full integer) needs representative_data to calibrate '
            "the activation ranges."
        )
    if probe is None:
        probe = random_input(model) if representative_data is None else representative_data[:64]
    probe = np.asarray(probe)
    stage = on_stage or (lambda name: None)
    if fold:
        stage("fold")
    source, fold_report = fold_batch_norms(model, probe) if fold else (model, None)
    stage("convert")
    content = _convert(source, quantization, representative_data)
    expected = np.asarray(model(probe, training=False), np.float64)

    stage("verify")
    actual, ops = atomic.write_bytes(path, content, check=lambda written: (
        run(Interpreter(model_path=written), probe), _op_names(written)))
    return report.ExportReport(
        format="tflite",
        path=os.path.abspath(path),
        size_bytes=len(content),
        errors={"litert": report.max_abs_error(actual, expected)},
        output_scale=float(np.abs(expected).max()),
        op_histogram=report.histogram(ops),
        quantization=quantization,
        fold=fold_report,
    )


def run(interpreter, x):
    """Run a single-input, single-output LiteRT interpreter on a batch."""
    (input_detail,) = interpreter.get_input_details()
    interpreter.resize_tensor_input(input_detail["index"], x.shape, strict=False)
    interpreter.allocate_tensors()
    interpreter.set_tensor(input_detail["index"], x.astype(input_detail["dtype"]))
    interpreter.invoke()
    (output_detail,) = interpreter.get_output_details()
    return interpreter.get_tensor(output_detail["index"])


def _op_names(path):
    """The file's own ops (with the default delegate, partitions would show up as DELEGATE)."""
    plain = Interpreter(model_path=path, experimental_op_resolver_type=(
        OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES))
    return [op["op_name"] for op in plain._get_ops_details()]


def _convert(model, quantization, representative_data):
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    # Builtins only: a folded model needs no Flex (Keras's own export turns SELECT_TF_OPS on).
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    if quantization is not None:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if quantization == "float16":
        converter.target_spec.supported_types = [tf.float16]
    if quantization == "int8":
        samples = np.asarray(representative_data)[:CALIBRATION_SAMPLES]
        dtype = model.inputs[0].dtype

        def calibration():
            for sample in samples:
                yield [sample[None].astype(dtype)]

        converter.representative_dataset = calibration
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        # Keras's export prints its signature; TF warns that int8 calibration got float input
        # statistics, which is what we ask for (float input and output).
        warnings.filterwarnings("ignore", message="Statistics for quantized inputs")
        return converter.convert()

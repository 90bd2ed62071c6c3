"""export_onnx: fold, convert with tf2onnx.from_function, run in onnxruntime, compare with Keras."""

import os

import numpy as np
import onnxruntime as ort
import tf2onnx

from keras_bn.export import atomic, report, trace
from keras_bn.export.graph import fold_batch_norms, random_input

# Both ends of onnxruntime's optimiser: what the file says, and what ORT makes of it.
SESSION_SETTINGS = {
    "ort_disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "ort_enabled": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def export_onnx(model, path, opset=17, fold=True, probe=None, on_stage=None):
    """Write `model` as an .onnx file at `path` and check it against the Keras model.

    Args:
        model: a Keras model with one input and one output.
        path: the .onnx file to write (atomically: no partial file on failure).
        opset: the ONNX opset.
        fold: fold the batch norms first (`fold_batch_norms`).
        probe: inputs on which the file is compared with `model`; seeded random by default.
        on_stage: optional callback, called with "fold", "convert" and "verify" as each
            stage starts (the CLI's progress display).

    Returns:
        ExportReport with the error of onnxruntime with graph optimisation disabled and
        enabled, the file's op histogram and its size.
    """
    trace.check_single_io(model)
    probe = np.asarray(random_input(model) if probe is None else probe)
    stage = on_stage or (lambda name: None)
    if fold:
        stage("fold")
    source, fold_report = fold_batch_norms(model, probe) if fold else (model, None)
    stage("convert")
    function = trace.inference_function(source)
    proto, _ = tf2onnx.convert.from_function(
        function, input_signature=function.input_signature, opset=opset
    )
    content = proto.SerializeToString()
    expected = np.asarray(model(probe, training=False), np.float64)

    stage("verify")
    errors = atomic.write_bytes(path, content, check=lambda written: {
        setting: report.max_abs_error(run(written, probe, level), expected)
        for setting, level in SESSION_SETTINGS.items()
    })
    return report.ExportReport(
        format="onnx",
        path=os.path.abspath(path),
        size_bytes=len(content),
        errors=errors,
        output_scale=float(np.abs(expected).max()),
        op_histogram=report.histogram(node.op_type for node in proto.graph.node),
        fold=fold_report,
    )


def run(path, x, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    """Run a single-input, single-output ONNX file in onnxruntime (CPU) on a batch."""
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    (input_,) = session.get_inputs()
    return session.run(None, {input_.name: x.astype(np.float32)})[0]

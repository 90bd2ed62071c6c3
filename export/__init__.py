"""keras_bn.export: fold batch norms into neighbouring layers and write verified TFLite/ONNX files.

In short::

    folded, report = fold_batch_norms(model)            # no BN left; report.folded / .kept
    _, report = fold_batch_norms(model, x, int8_readiness=True)
    report.int8_risks     # hosts whose weights, rounded to int8, move the outputs over 1e-1
    export_tflite(model, "model.tflite", quantization="int8", representative_data=x)
    export_onnx(model, "model.onnx")

Each exporter folds first, converts, writes a temporary file next to the target, runs it in
the real runtime (LiteRT, onnxruntime) against the Keras model, and renames it over the target
only when every output channel is within tolerance of its own scale (else VerificationError,
and the target keeps what it had); int8 files are judged on samples held out from calibration.
Models may have several inputs and outputs; the reports have one error per output.
A quantization-aware model (keras_bn.quantize) is written as its own int8, from its own ranges,
and judged in units of each output's quantization step, its int8 weights read back from the file
(`report.LsbError`, `report.WeightCheck`).
A model structure the fold or an exporter cannot take raises `UnsupportedModelError`.

The names are imported on first use (so the `keras-bn-export` command starts without loading
TensorFlow). `fold_batch_norms` and what it returns also run under the JAX Keras backend; the
TFLite and ONNX writers need TensorFlow (load a `.keras` file saved under JAX there).
"""

import typing

from keras_bn import _lazy
from keras_bn._errors import UnsupportedModelError

if typing.TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from keras_bn._graph.affine import ChannelBias, InferenceAffine
    from keras_bn._graph.fold_plan import FoldedBN, KeptBN
    from keras_bn.export.graph import fold_batch_norms
    from keras_bn.export.onnx import export_onnx
    from keras_bn.export.report import (
        INT8_READINESS_TOLERANCE,
        INT8_SPREAD_THRESHOLD,
        ChannelSpread,
        ExportReport,
        FoldReport,
        VerificationError,
        WorstChannel,
    )
    from keras_bn.export.tflite import export_tflite

__all__ = [
    "INT8_READINESS_TOLERANCE",
    "INT8_SPREAD_THRESHOLD",
    "ChannelBias",
    "ChannelSpread",
    "ExportReport",
    "FoldReport",
    "FoldedBN",
    "InferenceAffine",
    "KeptBN",
    "UnsupportedModelError",
    "VerificationError",
    "WorstChannel",
    "export_onnx",
    "export_tflite",
    "fold_batch_norms",
]

__getattr__, __dir__ = _lazy.attach(
    globals(),
    {
        "ChannelBias": ("keras_bn._graph.affine", "ChannelBias"),
        "InferenceAffine": ("keras_bn._graph.affine", "InferenceAffine"),
        "FoldedBN": ("keras_bn._graph.fold_plan", "FoldedBN"),
        "KeptBN": ("keras_bn._graph.fold_plan", "KeptBN"),
        "fold_batch_norms": ("keras_bn.export.graph", "fold_batch_norms"),
        "export_onnx": ("keras_bn.export.onnx", "export_onnx"),
        "INT8_READINESS_TOLERANCE": ("keras_bn.export.report", "INT8_READINESS_TOLERANCE"),
        "INT8_SPREAD_THRESHOLD": ("keras_bn.export.report", "INT8_SPREAD_THRESHOLD"),
        "ChannelSpread": ("keras_bn.export.report", "ChannelSpread"),
        "ExportReport": ("keras_bn.export.report", "ExportReport"),
        "FoldReport": ("keras_bn.export.report", "FoldReport"),
        "VerificationError": ("keras_bn.export.report", "VerificationError"),
        "WorstChannel": ("keras_bn.export.report", "WorstChannel"),
        "export_tflite": ("keras_bn.export.tflite", "export_tflite"),
    },
)

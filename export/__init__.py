"""keras_bn.export: fold batch norms into neighbouring layers and write verified TFLite/ONNX files.

    folded, report = fold_batch_norms(model)            # no BN left; report.folded / .kept
    export_tflite(model, "model.tflite", quantization="int8", representative_data=x)
    export_onnx(model, "model.onnx")

Each exporter folds first, writes its file atomically, runs it in the real runtime (LiteRT,
onnxruntime) against the Keras model and returns an ExportReport.
"""

from keras_bn.export.affine import InferenceAffine
from keras_bn.export.graph import FoldedBN, FoldReport, KeptBN, fold_batch_norms
from keras_bn.export.onnx import export_onnx
from keras_bn.export.report import ExportReport
from keras_bn.export.tflite import export_tflite

__all__ = [
    "ExportReport",
    "FoldReport",
    "FoldedBN",
    "InferenceAffine",
    "KeptBN",
    "export_onnx",
    "export_tflite",
    "fold_batch_norms",
]

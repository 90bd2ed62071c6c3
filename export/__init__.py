"""keras_bn.export: fold batch norms into neighbouring layers and write verified TFLite/ONNX files."""

from keras_bn.export.affine import InferenceAffine
from keras_bn.export.graph import FoldedBN, FoldReport, KeptBN, fold_batch_norms

__all__ = ["FoldReport", "FoldedBN", "InferenceAffine", "KeptBN", "fold_batch_norms"]

"""keras-bn: batch normalization for Keras 3 (TensorFlow backend).

- `BatchNormalization`: a drop-in for keras.layers.BatchNormalization with a hand-written
  gradient, unbiased population statistics, synchronized replicas, renorm and ghost batches.
- `recalibrate`: exact population statistics for every BN layer of a model (Algorithm 2),
  reported as a `RecalibrationReport` of `LayerChange` entries.
- `callbacks.Recalibrate`: the same at the end of `fit` and around each validation run.
- `diagnostics`: `check_batchnorm` for the BN mistakes that raise no error, and measures of
  gradient explosion, smoothness and internal covariate shift.
- `convert`: swap Keras's and keras_bn's BN layers in a model, weights kept.
- `keras_bn.export`: fold BN into Dense/Conv layers and write verified TFLite and ONNX files.

Importing it needs the TensorFlow Keras backend: any other raises ImportError.
"""

import keras as _keras

if _keras.backend.backend() != "tensorflow":
    raise ImportError(
        "keras_bn needs the TensorFlow Keras backend, but Keras is using "
        f"{_keras.backend.backend()!r}. Set KERAS_BACKEND=tensorflow before importing keras."
    )

from keras_bn import callbacks, convert, diagnostics
from keras_bn.layers import BatchNormalization
from keras_bn.population import (
    LayerChange,
    RecalibrationReport,
    recalibrate,
)

__all__ = [
    "BatchNormalization",
    "LayerChange",
    "RecalibrationReport",
    "callbacks",
    "convert",
    "diagnostics",
    "recalibrate",
]
__version__ = "0.1.0"

"""keras-bn: batch normalization for Keras 3 (TensorFlow backend)."""

import keras as _keras

if _keras.backend.backend() != "tensorflow":
    raise ImportError(
        "keras_bn needs the TensorFlow Keras backend, but Keras is using "
        f"{_keras.backend.backend()!r}. Set KERAS_BACKEND=tensorflow before importing keras."
    )

from keras_bn import callbacks, convert, diagnostics  # noqa: E402
from keras_bn.layers import BatchNormalization  # noqa: E402
from keras_bn.population import (  # noqa: E402
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

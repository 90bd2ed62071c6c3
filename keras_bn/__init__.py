"""keras-bn: batch normalization for Keras 3 (TensorFlow, JAX and PyTorch backends).

- `BatchNormalization`: a drop-in for keras.layers.BatchNormalization with a hand-written
  gradient, unbiased population statistics, synchronized replicas, renorm and ghost batches.
- `recalibrate`: exact population statistics for every BN layer of a model (Algorithm 2),
  reported as a `RecalibrationReport` of `LayerChange` entries.
- `callbacks.Recalibrate`: the same at the end of `fit` and around each validation run.
- `diagnostics`: `check_batchnorm` for the BN mistakes that raise no error, and measures of
  gradient explosion, smoothness and internal covariate shift.
- `convert`: swap Keras's and keras_bn's BN layers in a model, weights kept.
- `quantize`: quantization-aware training with BN folded during training (`quantize_model`).
- `keras_bn.export`: fold BN into Dense/Conv layers and write verified TFLite and ONNX files.
- `UnsupportedModelError`: a model structure the fold, the exporters or `convert` cannot take.
- `KerasBNWarning`: what keras_bn warns with (something ran, but probably not as intended).

`import keras_bn` is light: each name is imported on first use, and nothing imports TensorFlow,
JAX or PyTorch but the backend Keras runs on (keras_bn/backend/). Everything runs under the
TensorFlow, JAX and PyTorch Keras backends, TensorFlow optional under the other two, except the
TFLite and ONNX writers and the diagnostics' gradient probes, which need TensorFlow
(docs/guide/backends.md). Once Keras is imported, keras_bn's layers are registered with it, so
`keras.saving.load_model` reads `.keras` files that hold them.
"""

import typing

from keras_bn import _lazy, _registration
from keras_bn._errors import KerasBNWarning, UnsupportedModelError
from keras_bn._version import __version__ as __version__

if typing.TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from keras_bn import callbacks, convert, diagnostics, quantize
    from keras_bn.layers import BatchNormalization
    from keras_bn.population import LayerChange, RecalibrationReport, recalibrate

__all__ = [
    "BatchNormalization",
    "KerasBNWarning",
    "LayerChange",
    "RecalibrationReport",
    "UnsupportedModelError",
    "callbacks",
    "convert",
    "diagnostics",
    "quantize",
    "recalibrate",
]

__getattr__, __dir__ = _lazy.attach(
    globals(),
    {
        "BatchNormalization": ("keras_bn.layers", "BatchNormalization"),
        "LayerChange": ("keras_bn.population", "LayerChange"),
        "RecalibrationReport": ("keras_bn.population", "RecalibrationReport"),
        "recalibrate": ("keras_bn.population", "recalibrate"),
        "callbacks": ("keras_bn.callbacks", None),
        "convert": ("keras_bn.convert", None),
        "diagnostics": ("keras_bn.diagnostics", None),
        "quantize": ("keras_bn.quantize", None),
    },
)
_registration.register_when_keras_is_ready()

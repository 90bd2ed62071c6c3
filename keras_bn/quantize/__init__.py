"""Quantization-aware training (QAT) with batch norm folded during training.

A host layer (Dense or a convolution) followed by batch norm and optionally ReLU/ReLU6 becomes
one `QuantizedHostBatchNorm`, whose weights are fake-quantized after the fold, so training sees
the integer weights an int8 file holds (Krishnamoorthi, "Quantizing deep convolutional networks
for efficient inference: A whitepaper", 2018, section 3.2; Jacob et al., "Quantization and
Training of Neural Networks for Efficient Integer-Arithmetic-Only Inference", 2018). It
trains like batch-statistics BN until `freeze_batch_norm` (or the `FreezeBatchNorm` callback)
switches it to the folded BN for good.

- `quantize_model`: a copy of a whole model for QAT, weights copied, with a
  `QuantizationReport` of what became which QAT layer and what stayed float (`KeptLayer`).
- `fake_quant`: the k-bit grids (TensorFlow FakeQuant ops, and the same grid in numpy).
- `QuantizedHostBatchNorm`, `QuantizedHost` (no BN), `ActivationQuantizer` (model inputs,
  Add/Concatenate/global pooling outputs), `QuantizedAveragePooling` (an average pool rounding
  its output onto its input's grid, as the int8 one does): the layers, registered with Keras,
  so a `.keras` file holding them loads after `import keras_bn` with no `custom_objects`.
- `from_layers`: a QAT layer from existing host, BN and activation layers, weights copied.
- `FreezeBatchNorm`, `freeze_batch_norm`, `freeze_ranges`.

`keras_bn.export.export_tflite` and `export_onnx` write a trained QAT model as its own integer
arithmetic (full-integer TFLite, ONNX QDQ), traced from each layer's `export_function`.

Example::

    qat = keras_bn.quantize.quantize_model(float_model)
    qat.compile(keras.optimizers.Adam(1e-4), "sparse_categorical_crossentropy")
    qat.fit(x, y, epochs=3, callbacks=[keras_bn.quantize.FreezeBatchNorm(after_steps=500)])
"""

# Keras (and its backend) first: the moment it has loaded, keras_bn registers its layers
# (keras_bn/_registration.py), which imports this package's layer modules; that must not happen
# while one of them is half-imported (it raised AttributeError on `import keras_bn.quantize`).
import keras  # noqa: F401

from keras_bn.quantize import fake_quant
from keras_bn.quantize.activation import ActivationQuantizer
from keras_bn.quantize.factory import from_layers
from keras_bn.quantize.freeze import FreezeBatchNorm, freeze_batch_norm, freeze_ranges
from keras_bn.quantize.layers import QuantizedHost, QuantizedHostBatchNorm
from keras_bn.quantize.pooling import QuantizedAveragePooling
from keras_bn.quantize.report import KeptLayer, QuantizationReport
from keras_bn.quantize.rewrite import quantize_model

__all__ = [
    "ActivationQuantizer",
    "FreezeBatchNorm",
    "KeptLayer",
    "QuantizationReport",
    "QuantizedAveragePooling",
    "QuantizedHost",
    "QuantizedHostBatchNorm",
    "fake_quant",
    "freeze_batch_norm",
    "freeze_ranges",
    "from_layers",
    "quantize_model",
]

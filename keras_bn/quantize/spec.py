"""Where the TFLite int8 spec puts an activation tensor's scale, per Keras operation: what
`quantize_model` reads to place the activation quantizers.

TensorFlow Lite's 8-bit quantization specification ("int8 quantized operator specifications")
gives every activation tensor one per-tensor scale and zero point, and restricts them for some
operators. Each operation of a Keras model falls in one of five roles:

- OWN: the operator's output has a scale of its own (ADD, SUB, MUL, MEAN, and the convolutions
  and FULLY_CONNECTED, whose output quantizer the QAT layers hold themselves): an
  ActivationQuantizer learns it.
- PRESERVES: "Input and outputs must all have same scale/zero_point" with one input
  (MAX_POOL_2D, RESHAPE, PAD, SLICE, TRANSPOSE, SQUEEZE, SPACE_TO_DEPTH, RESIZE_BILINEAR,
  ...), and the layers that are the identity at inference (Dropout and the like): the output
  lies on its input's grid, so no quantizer of its own.
- AVERAGES: the same restriction (AVERAGE_POOL_2D, and RESIZE_BILINEAR: a bilinear
  UpSampling2D), but an average of grid values (a weighted one, for the upsampling) mostly
  lies between two of them, and the int8 kernel rounds it back onto the grid. The layer becomes a
  `QuantizedAveragePooling`, which quantizes its input and rounds its output onto that same
  grid (one range, shared); a producer whose only consumer it is leaves its own quantizer
  out, as for SHARES.
- SHARES: the same restriction with several inputs (CONCATENATION, MAXIMUM, MINIMUM): one
  quantizer on the output sets the scale, and a producer whose only consumer it is leaves its
  own quantizer out, so that it writes directly on the shared grid.
- FIXED: the spec fixes the output's scale (SOFTMAX and LOGISTIC 1/256 with zero point −128,
  TANH 1/128 with 0, LOG_SOFTMAX 16/256 with 127): the converter applies it, and the output
  gets no quantizer. Fake-quantizing a softmax would round the small probabilities a
  cross-entropy loss learns from to 0.

A ReLU/ReLU6 is fused into the operator before it where TFLite can fuse it (its
fused_activation_function): into the QAT layers, and after ADD, SUB and MUL, whose own quantizer
then moves after the ReLU.
"""

import keras

L = keras.layers
OWN, PRESERVES, AVERAGES, SHARES, FIXED = "own", "preserves", "averages", "shares", "fixed"

# Exact classes: a subclass may compute something else, and gets the safe role, OWN.
_PRESERVING = (
    L.MaxPooling1D,
    L.MaxPooling2D,
    L.MaxPooling3D,
    L.GlobalMaxPooling1D,
    L.GlobalMaxPooling2D,
    L.GlobalMaxPooling3D,
    L.Flatten,
    L.Reshape,
    L.Permute,
    L.RepeatVector,
    L.ZeroPadding1D,
    L.ZeroPadding2D,
    L.ZeroPadding3D,
    L.Cropping1D,
    L.Cropping2D,
    L.Cropping3D,
    L.UpSampling1D,
    L.UpSampling2D,
    L.UpSampling3D,
    L.Identity,
    # The identity at inference.
    L.Dropout,
    L.SpatialDropout1D,
    L.SpatialDropout2D,
    L.SpatialDropout3D,
    L.GaussianNoise,
    L.GaussianDropout,
    L.AlphaDropout,
    L.ActivityRegularization,
)
#: The average pools (AVERAGES), which `QuantizedAveragePooling` computes, as it computes a
#: bilinear UpSampling2D.
AVERAGING = (L.AveragePooling1D, L.AveragePooling2D, L.AveragePooling3D)
_SHARING = (L.Concatenate, L.Maximum, L.Minimum)
#: The operations that TFLite's converter writes as a chain of two-input operators when they
#: have more inputs: each partial result gets a scale of its own.
CHAINED = (L.Add, L.Multiply)
#: The operations whose ReLU/ReLU6 TFLite fuses (ADD, SUB, MUL): a ReLU that is their only
#: consumer takes over their output quantizer.
RELU_FUSING = (L.Add, L.Subtract, L.Multiply)
# The step the spec fixes for each activation whose output scale it fixes.
FIXED_STEPS = {"softmax": 1 / 256, "sigmoid": 1 / 256, "tanh": 1 / 128, "log_softmax": 16 / 256}
_FIXED_ACTIVATIONS = tuple(FIXED_STEPS)


def fixed_step(operation: keras.Operation) -> float | None:
    """The output step the spec fixes for a FIXED operation (1/256 for a softmax).

    Args:
        operation: a Keras layer whose `role` is FIXED.

    Returns:
        float, or None for an operation of another role.
    """
    if role(operation) != FIXED:
        return None
    if type(operation) is L.Softmax:
        return FIXED_STEPS["softmax"]
    return FIXED_STEPS[keras.activations.serialize(operation.activation)]


def is_bilinear_upsampling(operation: keras.Operation) -> bool:
    """Whether `operation` is exactly a bilinear UpSampling2D: each output a weighted average of
    its input's values (the nearest-neighbour one copies them, and keeps their grid).

    Args:
        operation: a Keras layer or operation.

    Returns:
        bool.
    """
    return type(operation) is L.UpSampling2D and operation.interpolation == "bilinear"


def role(operation: keras.Operation) -> str:
    """The operation's role: OWN, PRESERVES, AVERAGES, SHARES or FIXED (see the module
    docstring).

    Args:
        operation: a Keras layer or operation of the model.

    Returns:
        One of the five role strings.
    """
    kind = type(operation)
    if kind in AVERAGING or is_bilinear_upsampling(operation):
        return AVERAGES
    if kind in _PRESERVING:
        return PRESERVES
    if kind in _SHARING:
        return SHARES
    if kind is L.Softmax:
        return FIXED
    if kind is L.Activation:
        name = keras.activations.serialize(operation.activation)
        if name == "linear":
            return PRESERVES
        if name in _FIXED_ACTIVATIONS:
            return FIXED
    return OWN

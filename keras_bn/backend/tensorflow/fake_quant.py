"""The FakeQuant kernels of keras_bn.quantize.fake_quant in TensorFlow: the ops the TFLite
converter and tf2onnx turn into quantized tensors (keras_bn/quantize/fake_quant.py's docstring
has the grids; keras_bn/backend/jax/fake_quant.py computes the same values bit for bit)."""

import numpy as np
import tensorflow as tf

from keras_bn.backend import INTERFACE
from keras_bn.backend.constants import MIN_RANGE, ZERO_WEIGHT_RANGE


def weight_max_abs(kernel, per_channel):
    """The TensorFlow kernel of keras_bn.quantize.fake_quant.weight_max_abs."""
    magnitude = tf.abs(tf.cast(kernel, tf.float32))
    if per_channel:
        magnitude = tf.reshape(magnitude, [-1, tf.shape(magnitude)[-1]])
        largest = tf.reduce_max(magnitude, axis=0)
    else:
        largest = tf.reduce_max(magnitude)
    ranged = tf.where(
        largest > 0, tf.maximum(largest, MIN_RANGE), tf.fill(tf.shape(largest), ZERO_WEIGHT_RANGE)
    )
    return tf.stop_gradient(ranged)


def fake_quant_weights(kernel, max_abs, bits):
    """The TensorFlow kernel of keras_bn.quantize.fake_quant.fake_quant_weights: the op's
    values, with gradient 1 to every weight (the op would stop it at the weight that sets the
    range, which float32 puts just past the op's nudged maximum)."""
    max_abs = tf.convert_to_tensor(max_abs)  # a variable closed over needs grad_fn(variables)

    @tf.custom_gradient
    def on_grid(kernel):
        return _rounded_weights(kernel, max_abs, bits), lambda gradient: gradient

    return on_grid(kernel)


def _rounded_weights(kernel, max_abs, bits):
    if max_abs.shape.rank == 1:
        # On a 2-D (-1, channels) view: the op is elementwise, but its gradient takes rank ≤ 4
        # only (a Conv3D kernel has rank 5).
        shape = tf.shape(kernel)
        fake = tf.quantization.fake_quant_with_min_max_vars_per_channel(
            tf.reshape(kernel, [-1, shape[-1]]), -max_abs, max_abs, num_bits=bits, narrow_range=True
        )
        return tf.reshape(fake, shape)
    return tf.quantization.fake_quant_with_min_max_vars(
        kernel, -max_abs, max_abs, num_bits=bits, narrow_range=True
    )


def fake_quant_activations(x, minimum, maximum, bits):
    """The TensorFlow kernel of keras_bn.quantize.fake_quant.fake_quant_activations."""
    maximum = tf.maximum(maximum, minimum + MIN_RANGE)
    return tf.quantization.fake_quant_with_min_max_vars(
        x, minimum, maximum, num_bits=bits, narrow_range=False
    )


def weight_step(max_abs, bits):
    """The TensorFlow kernel of keras_bn.quantize.fake_quant.weight_step."""
    max_abs = tf.convert_to_tensor(max_abs, tf.float32)
    return (max_abs - (-max_abs)) / float(2**bits - 2)


def activation_step(minimum, maximum, bits):
    """The TensorFlow kernel of keras_bn.quantize.fake_quant.activation_step."""
    maximum = tf.maximum(maximum, minimum + MIN_RANGE)
    return (maximum - minimum) / (2.0**bits - 1.0)


def round_bias(bias, step):
    """The TensorFlow kernel of keras_bn.quantize.fake_quant.round_bias."""
    rounded = tf.round(bias / step) * step
    return bias + tf.stop_gradient(rounded - bias)


def halves_away_from_int8_zero(average, minimum, maximum, bits, window):
    """The TensorFlow kernel of keras_bn.quantize.fake_quant.halves_away_from_int8_zero."""
    scale = activation_step(minimum, maximum, bits)
    zero_point = tf.floor(-minimum / scale + 0.5)  # the range holds 0: no clamp needed
    int8_zero = (128.0 - zero_point) * scale
    return average + tf.sign(average - int8_zero) * scale / (4.0 * window)


def export_activations(x, grid):
    """`fake_quant_activations` on `grid`, written with 8-bit FakeQuant ops only.

    At 8 bits it is that op itself. Below, the k-bit grid is the 8-bit grid with the same step
    and lowest value, clamped to the k-bit grid's highest value: x is rounded onto the wide
    grid, clamped (the bound lies on it, so the clamp and the rounding commute), and rounded
    again, so that both the clamp's input and its output carry the grid (what the TFLite
    converter needs to keep the clamp in int8, and onnxruntime to keep its integer kernels
    around it). The low end needs no clamp: it is the wide grid's own.

    Args:
        x: float32 tensor.
        grid: `keras_bn.quantize.fake_quant.activation_grid` of the layer's range.

    Returns:
        The fake-quantized tensor: the same values as `fake_quant_activations` (to float32
        rounding of the step).
    """
    if grid.bits == 8:
        return tf.quantization.fake_quant_with_min_max_vars(
            x, grid.minimum, grid.maximum, num_bits=8, narrow_range=False
        )
    wide_max = float(np.float32(grid.nudged_min) + np.float32(255) * np.float32(grid.scale))

    def on_wide_grid(tensor):
        return tf.quantization.fake_quant_with_min_max_vars(
            tensor, grid.nudged_min, wide_max, num_bits=8, narrow_range=False
        )

    return on_wide_grid(tf.minimum(on_wide_grid(x), grid.nudged_max))


# The interface's functions (keras_bn/backend/__init__.py) defined here, which the backend
# package imports with `*`.
__all__ = [name for name in INTERFACE if name in globals()]

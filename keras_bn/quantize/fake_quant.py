"""Fake quantization: the k-bit grids quantization-aware training rounds to, as pure functions.

Two grids (Jacob et al., "Quantization and Training of Neural Networks for Efficient
Integer-Arithmetic-Only Inference", 2018; Krishnamoorthi, "Quantizing deep convolutional
networks for efficient inference: A whitepaper", 2018):

- weights: symmetric, narrow range. With m = max|w| (per output channel or per tensor) and
  q_max = 2^(k−1) − 1, w ↦ q·m/q_max for the integer q = round(w·q_max/m), |q| ≤ q_max;
- activations: asymmetric, per tensor, over a range [min, max] that holds 0.

The TensorFlow side uses `tf.quantization.fake_quant_with_min_max_vars` and its per-channel
sibling, the ops the TFLite converter turns into quantized tensors (the per-channel op
quantizes along the LAST axis). They "nudge" [min, max] so that 0 lies exactly on the grid:
scale = (max − min)/(q_hi − q_lo), zero point z = round(q_lo − min/scale) clamped to
[q_lo, q_hi], and x ↦ (⌊(clamp(x) − min')/scale + ½⌋)·scale + min' with min' = (q_lo − z)·scale
(q_lo = 1 with a narrow range, else 0; q_hi = 2^k − 1). For the symmetric weight range
[−m, m] the nudge changes nothing: z = 2^(k−1), scale = m/q_max.

`nudged_grid` and `weight_grid` are the same arithmetic in float32 numpy, which the exporters
use to read the integers and scales a file must hold; they give TensorFlow's CPU kernel's
integers exactly (XLA multiplies by 1/scale instead of dividing, which can move a value that
lies on a rounding boundary to the other integer).
"""

import typing

import numpy as np
import tensorflow as tf

MIN_BITS = 2
MAX_BITS = 8
# The FakeQuant ops divide by max − min: a range narrower than this (an all-zero kernel channel,
# an activation that was 0 on every batch seen) is widened to it, and 0 stays on the grid.
MIN_RANGE = 1e-8


@typing.overload
def validate_bits(bits: object, name: str, allow_none: typing.Literal[False] = False) -> int: ...


@typing.overload
def validate_bits(bits: object, name: str, allow_none: bool) -> int | None: ...


def validate_bits(bits: object, name: str, allow_none: bool = False) -> int | None:
    """`bits` as an int in [MIN_BITS, MAX_BITS] (or None where `allow_none`).

    Args:
        bits: the value to check.
        name: the argument's name, for the message.
        allow_none: whether None (no fake quantization) is accepted.

    Returns:
        `bits` (an int, or None).

    Raises:
        ValueError: `bits` is not an int in range (bools and floats included).
    """
    if bits is None and allow_none:
        return None
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise ValueError(
            f"{name} must be an int from {MIN_BITS} to {MAX_BITS}"
            f"{' or None' if allow_none else ''}; received {name}={bits!r}."
        )
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"{name} must be from {MIN_BITS} to {MAX_BITS}; received {name}={bits!r}.")
    return int(bits)


def q_max(bits: int) -> int:
    """The largest |q| of the symmetric narrow-range k-bit weight grid.

    Args:
        bits: 2..8.

    Returns:
        2^(bits−1) − 1.
    """
    return 2 ** (bits - 1) - 1


def weight_max_abs(kernel: tf.Tensor, per_channel: bool) -> tf.Tensor:
    """m for the symmetric weight grid: max|w| per output channel (the last axis) or per tensor.

    The range carries no gradient: the fake quantization's gradient is straight-through for the
    weights only (the scale is a constant of each step, as with an observer's range).

    Args:
        kernel: float tensor whose last axis is the output channel.
        per_channel: one range per output channel (a vector) rather than one (a scalar).

    Returns:
        A float32 vector of the last axis's size, or a scalar, at least MIN_RANGE.
    """
    magnitude = tf.abs(tf.cast(kernel, tf.float32))
    if per_channel:
        magnitude = tf.reshape(magnitude, [-1, tf.shape(magnitude)[-1]])
        largest = tf.reduce_max(magnitude, axis=0)
    else:
        largest = tf.reduce_max(magnitude)
    return tf.stop_gradient(tf.maximum(largest, MIN_RANGE))


def fake_quant_weights(kernel: tf.Tensor, max_abs: tf.Tensor, bits: int) -> tf.Tensor:
    """FQ_w: round `kernel` to the symmetric narrow-range `bits`-bit grid of ±`max_abs`.

    Args:
        kernel: float32 tensor whose last axis is the output channel.
        max_abs: `weight_max_abs(kernel, per_channel)`: a vector (per channel) or a scalar.
        bits: 2..8.

    Returns:
        The fake-quantized kernel, same shape; its gradient is straight-through inside the
        range (every weight is, since the range is the largest magnitude).
    """
    if max_abs.shape.rank == 1:
        return tf.quantization.fake_quant_with_min_max_vars_per_channel(
            kernel, -max_abs, max_abs, num_bits=bits, narrow_range=True
        )
    return tf.quantization.fake_quant_with_min_max_vars(
        kernel, -max_abs, max_abs, num_bits=bits, narrow_range=True
    )


def fake_quant_activations(
    x: tf.Tensor, minimum: tf.Tensor, maximum: tf.Tensor, bits: int
) -> tf.Tensor:
    """Round `x` to the asymmetric `bits`-bit grid of [minimum, maximum] (nudged to hold 0).

    Args:
        x: float32 tensor.
        minimum: float32 scalar ≤ 0, the range's low end.
        maximum: float32 scalar ≥ 0, the range's high end (widened here to at least
            MIN_RANGE above `minimum`).
        bits: 2..8.

    Returns:
        The fake-quantized tensor; the gradient passes where x is inside the nudged range and
        is 0 outside it (clipped values).
    """
    maximum = tf.maximum(maximum, minimum + MIN_RANGE)
    return tf.quantization.fake_quant_with_min_max_vars(
        x, minimum, maximum, num_bits=bits, narrow_range=False
    )


def nudged_grid(
    minimum: np.ndarray, maximum: np.ndarray, bits: int, narrow_range: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The grid TensorFlow's FakeQuant ops use for [minimum, maximum], in float32 numpy.

    Args:
        minimum: array (or scalar) ≤ 0, the ranges' low ends.
        maximum: array of minimum's shape, > minimum and ≥ 0, the high ends.
        bits: 2..8.
        narrow_range: whether the lowest integer is left out (the weights' symmetric grid).

    Returns:
        (scale, zero_point, nudged_min, nudged_max): float32 arrays of the ranges' shape; a
        value x maps to the integer q_lo + ⌊(clamp(x) − nudged_min)/scale + ½⌋ of
        [q_lo, 2^bits − 1] (q_lo = 1 with a narrow range, else 0), and that integer minus
        `zero_point` is the signed one.
    """
    minimum = np.asarray(minimum, np.float32)
    maximum = np.asarray(maximum, np.float32)
    q_lo = np.float32(1 if narrow_range else 0)
    q_hi = np.float32(2**bits - 1)
    scale = (maximum - minimum) / (q_hi - q_lo)
    zero_point_from_min = q_lo - minimum / scale
    # std::round (halves away from zero) of a value that is ≥ q_lo ≥ 0 here.
    zero_point = np.clip(np.floor(zero_point_from_min + np.float32(0.5)), q_lo, q_hi)
    zero_point = np.where(zero_point_from_min < q_lo, q_lo, zero_point)
    zero_point = np.where(zero_point_from_min > q_hi, q_hi, zero_point).astype(np.float32)
    nudged_min = (q_lo - zero_point) * scale
    nudged_max = (q_hi - zero_point) * scale
    return scale, zero_point, nudged_min, nudged_max


def quantize(
    x: np.ndarray, minimum: np.ndarray, maximum: np.ndarray, bits: int, narrow_range: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The signed integers TensorFlow's FakeQuant ops round `x` to (as float32 numpy).

    Args:
        x: array whose last axis lines up with the ranges when they are vectors.
        minimum: the ranges' low ends, a scalar or a vector of x's last axis (per channel).
        maximum: the high ends, of minimum's shape.
        bits: 2..8.
        narrow_range: as in `nudged_grid`.

    Returns:
        (q, scale, zero_point): q the signed integers as float32 (the grid's integer minus
        the zero point), and the grid's scale and zero point; x's fake-quantized value is
        q·scale, up to float32 rounding.
    """
    x = np.asarray(x, np.float32)
    scale, zero_point, nudged_min, nudged_max = nudged_grid(minimum, maximum, bits, narrow_range)
    clamped = np.minimum(np.maximum(x, nudged_min), nudged_max)
    steps = np.floor((clamped - nudged_min) / scale + np.float32(0.5))
    q_lo = np.float32(1 if narrow_range else 0)
    return steps + q_lo - zero_point, scale, zero_point


def weight_grid(kernel: np.ndarray, bits: int, per_channel: bool) -> tuple[np.ndarray, np.ndarray]:
    """The int8 weights and scales of `fake_quant_weights` for a float32 kernel, in numpy.

    Args:
        kernel: array whose last axis is the output channel (the layout `fake_quant_weights`
            quantizes).
        bits: 2..8.
        per_channel: one scale per output channel rather than one.

    Returns:
        (q, scale): q int8 of the kernel's shape with |q| ≤ 2^(bits−1) − 1, and the float32
        scale (a vector of the last axis's size, or a scalar), so that q·scale is the
        fake-quantized kernel.
    """
    kernel = np.asarray(kernel, np.float32)
    magnitude = np.abs(kernel)
    if per_channel:
        largest = magnitude.reshape(-1, kernel.shape[-1]).max(axis=0)
    else:
        largest = magnitude.max()
    largest = np.maximum(largest, np.float32(MIN_RANGE))
    q, scale, _ = quantize(kernel, -largest, largest, bits, narrow_range=True)
    return q.astype(np.int8), scale

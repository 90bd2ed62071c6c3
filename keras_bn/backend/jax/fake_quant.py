"""TensorFlow's FakeQuant ops and keras_bn.quantize.fake_quant's grid functions in jax.numpy,
for QAT under the JAX Keras backend.

`fake_quant_with_min_max_vars` and `fake_quant_with_min_max_vars_per_channel` compute what
TensorFlow's CPU kernels compute, bit for bit (tests/test_quantize_backends.py compares them on
grids of values that include every rounding boundary). The range is nudged so that 0 lies on
the grid: with q_lo = 1 for a narrow range (else 0) and q_hi = 2^bits − 1,

    scale = (max − min)/(q_hi − q_lo),   z = std::round(q_lo − min/scale) clamped to [q_lo, q_hi]
    min' = (q_lo − z)·scale,   max' = (q_hi − z)·scale,   c = min(max(x, min'), max') − min'
    per tensor:   y = ⌊c/scale − (z − q_lo) + ½⌋·scale
    per channel:  y = ⌊c·((q_hi − q_lo)/(max − min)) − (z − q_lo) + ½⌋·scale   (the last axis)

in float32, each operation rounded as written (TensorFlow's per-tensor kernel divides by the
scale, its per-channel one multiplies by the inverse range, so the two round some halves
differently). Their gradients are TensorFlow's: straight-through for x inside [min', max'] and
0 outside; the range gets the sum of the gradients below min' (to min) and above max' (to max).
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from keras_bn.backend import INTERFACE
from keras_bn.backend.constants import MIN_RANGE, ZERO_WEIGHT_RANGE


def _exact(t: Any) -> Any:
    """`t` as computed, opaque to XLA's rewrites: its algebraic simplifier turns a division by
    a broadcast scalar into a multiplication by its reciprocal, and the CPU compiler contracts
    a multiplication followed by an addition into one fused multiply-add; either rounds
    differently from TensorFlow's kernels, which round every operation. A select on `t`'s own
    NaN test returns `t` (a NaN stays NaN), but neither rewrite looks through it
    (jax.lax.optimization_barrier does not hold: XLA drops it before fusing)."""
    return jnp.where(jnp.isnan(t), jnp.float32(jnp.nan), t)


def _std_round(x: Any) -> Any:
    """C's std::round: halves away from zero, exact (x − trunc(x) is exact in float)."""
    whole = jnp.trunc(x)
    return whole + jnp.where(jnp.abs(x - whole) >= 0.5, jnp.sign(x), 0.0)


def nudge(minimum: Any, maximum: Any, bits: int, narrow_range: bool) -> Any:
    """TensorFlow's nudged grid of [minimum, maximum] (float32, elementwise over the ranges).

    Args:
        minimum: float32 array ≤ 0.
        maximum: float32 array of minimum's shape, > minimum.
        bits: 2..16.
        narrow_range: whether the lowest integer is left out.

    Returns:
        (scale, zero_offset, nudged_min, nudged_max): zero_offset is z − q_lo, the integer
        (as float32) the grid's 0 lies above its lowest value.
    """
    q_lo = jnp.float32(1 if narrow_range else 0)
    q_hi = jnp.float32(2**bits - 1)
    width = maximum - minimum
    # A divisor XLA cannot fold to a constant, whose division it would turn into a product.
    scale = width / jnp.where(jnp.isnan(width), width, q_hi - q_lo)
    zero_from_min = q_lo - _exact(minimum / _exact(scale))
    zero = jnp.where(
        zero_from_min < q_lo,
        q_lo,
        jnp.where(zero_from_min > q_hi, q_hi, _std_round(zero_from_min)),
    )
    return scale, zero - q_lo, _exact((q_lo - zero) * scale), _exact((q_hi - zero) * scale)


def _ranges(minimum: Any, maximum: Any) -> Any:
    return jnp.asarray(minimum, jnp.float32), jnp.asarray(maximum, jnp.float32)


def _forward(
    x: Any, minimum: Any, maximum: Any, bits: int, narrow_range: bool, per_channel: bool
) -> Any:
    scale, offset, nudged_min, nudged_max = nudge(minimum, maximum, bits, narrow_range)
    shifted = jnp.maximum(jnp.minimum(x, nudged_max), nudged_min) - nudged_min
    if per_channel:
        levels = jnp.float32(2**bits - 1 - (1 if narrow_range else 0))
        steps = shifted * (levels / (maximum - minimum))
    else:
        # The divisor per element (NaN where x is, which leaves x's NaN a NaN), so that XLA
        # cannot see it is one scalar and multiply by its reciprocal instead.
        steps = shifted / jnp.where(jnp.isnan(shifted), shifted, scale)
    return jnp.floor(_exact(steps) - offset + 0.5) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fake_quant(
    x: Any, minimum: Any, maximum: Any, bits: int, narrow_range: bool, per_channel: bool
) -> Any:
    return _forward(x, minimum, maximum, bits, narrow_range, per_channel)


def _fake_quant_forward(
    x: Any, minimum: Any, maximum: Any, bits: int, narrow_range: bool, per_channel: bool
) -> Any:
    outputs = _forward(x, minimum, maximum, bits, narrow_range, per_channel)
    return outputs, (x, minimum, maximum)


def _fake_quant_backward(
    bits: int, narrow_range: bool, per_channel: bool, saved: Any, gradients: Any
) -> Any:
    x, minimum, maximum = saved
    _, _, nudged_min, nudged_max = nudge(minimum, maximum, bits, narrow_range)
    axes = tuple(range(x.ndim - 1)) if per_channel else None
    zero = jnp.zeros_like(gradients)
    inside = (x >= nudged_min) & (x <= nudged_max)
    to_min = jnp.sum(jnp.where(x < nudged_min, gradients, zero), axis=axes)
    to_max = jnp.sum(jnp.where(x > nudged_max, gradients, zero), axis=axes)
    return jnp.where(inside, gradients, zero), to_min, to_max


_fake_quant.defvjp(_fake_quant_forward, _fake_quant_backward)


def fake_quant_with_min_max_vars(
    x: Any, minimum: Any, maximum: Any, num_bits: int = 8, narrow_range: bool = False
) -> Any:
    """`tf.quantization.fake_quant_with_min_max_vars` in jnp (per tensor).

    Args:
        x: float32 array.
        minimum: float32 scalar ≤ 0.
        maximum: float32 scalar > minimum, ≥ 0.
        num_bits: 2..16.
        narrow_range: whether the lowest integer is left out.

    Returns:
        The fake-quantized array, with TensorFlow's gradients (module docstring).
    """
    minimum, maximum = _ranges(minimum, maximum)
    return _fake_quant(jnp.asarray(x, jnp.float32), minimum, maximum, num_bits, narrow_range, False)


def fake_quant_with_min_max_vars_per_channel(
    x: Any, minimum: Any, maximum: Any, num_bits: int = 8, narrow_range: bool = False
) -> Any:
    """`tf.quantization.fake_quant_with_min_max_vars_per_channel`: as
    `fake_quant_with_min_max_vars`, with one range per entry of x's last axis (`minimum` and
    `maximum` vectors of that length)."""
    minimum, maximum = _ranges(minimum, maximum)
    return _fake_quant(jnp.asarray(x, jnp.float32), minimum, maximum, num_bits, narrow_range, True)


def weight_max_abs(kernel: Any, per_channel: bool) -> Any:
    """`fake_quant.weight_max_abs` in jnp: max|w| per output channel (the last axis) or per
    tensor, at least MIN_RANGE, ZERO_WEIGHT_RANGE where every weight is 0; no gradient."""
    magnitude = jnp.abs(jnp.asarray(kernel, jnp.float32))
    if per_channel:
        largest = jnp.max(jnp.reshape(magnitude, (-1, magnitude.shape[-1])), axis=0)
    else:
        largest = jnp.max(magnitude)
    ranged = jnp.where(largest > 0, jnp.maximum(largest, MIN_RANGE), ZERO_WEIGHT_RANGE)
    return jax.lax.stop_gradient(ranged.astype(jnp.float32))


def fake_quant_weights(kernel: Any, max_abs: Any, bits: int) -> Any:
    """`fake_quant.fake_quant_weights` in jnp: the symmetric narrow-range grid of ±max_abs, with
    gradient 1 to every weight (TensorFlow's op would stop it at the weight that sets the
    range, which float32 puts just past the op's nudged maximum)."""
    return _weights_on_grid(jnp.asarray(kernel, jnp.float32), max_abs, bits)


def _rounded_weights(kernel: Any, max_abs: Any, bits: int) -> Any:
    if jnp.ndim(max_abs) == 1:
        return fake_quant_with_min_max_vars_per_channel(
            kernel, -max_abs, max_abs, num_bits=bits, narrow_range=True
        )
    return fake_quant_with_min_max_vars(kernel, -max_abs, max_abs, num_bits=bits, narrow_range=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _weights_on_grid(kernel: Any, max_abs: Any, bits: int) -> Any:
    return _rounded_weights(kernel, max_abs, bits)


def _weights_on_grid_forward(kernel: Any, max_abs: Any, bits: int) -> Any:
    return _rounded_weights(kernel, max_abs, bits), max_abs


def _weights_on_grid_backward(bits: int, max_abs: Any, gradients: Any) -> Any:
    del bits
    return gradients, jnp.zeros_like(max_abs)  # the range is a constant of the step


_weights_on_grid.defvjp(_weights_on_grid_forward, _weights_on_grid_backward)


def fake_quant_activations(x: Any, minimum: Any, maximum: Any, bits: int) -> Any:
    """`fake_quant.fake_quant_activations` in jnp: the asymmetric grid of [minimum, maximum],
    maximum widened to at least MIN_RANGE above minimum."""
    minimum, maximum = _ranges(minimum, maximum)
    maximum = jnp.maximum(maximum, minimum + MIN_RANGE)
    return fake_quant_with_min_max_vars(x, minimum, maximum, num_bits=bits, narrow_range=False)


def weight_step(max_abs: Any, bits: int) -> Any:
    """`fake_quant.weight_step` in jnp: (max − min)/(2^bits − 2) for the range ±max_abs."""
    max_abs = jnp.asarray(max_abs, jnp.float32)
    return (max_abs - (-max_abs)) / float(2**bits - 2)


def activation_step(minimum: Any, maximum: Any, bits: int) -> Any:
    """`fake_quant.activation_step` in jnp."""
    minimum, maximum = _ranges(minimum, maximum)
    maximum = jnp.maximum(maximum, minimum + MIN_RANGE)
    return (maximum - minimum) / (2.0**bits - 1.0)


def round_bias(bias: Any, step: Any) -> Any:
    """`fake_quant.round_bias` in jnp: round(bias/step)·step (halves to even), the gradient
    straight through to `bias` and none to `step`."""
    rounded = jnp.round(bias / step) * step
    return bias + jax.lax.stop_gradient(rounded - bias)


def halves_away_from_int8_zero(
    average: Any, minimum: Any, maximum: Any, bits: int, window: int
) -> Any:
    """`fake_quant.halves_away_from_int8_zero` in jnp."""
    scale = activation_step(minimum, maximum, bits)
    zero_point = jnp.floor(-jnp.asarray(minimum, jnp.float32) / scale + 0.5)
    int8_zero = (128.0 - zero_point) * scale
    return average + jnp.sign(average - int8_zero) * scale / (4.0 * window)


# The interface's functions (keras_bn/backend/__init__.py) defined here, which the backend
# package imports with `*`.
__all__ = [name for name in INTERFACE if name in globals()]

"""TensorFlow's FakeQuant ops and keras_bn.quantize.fake_quant's grid functions in torch, for
QAT under the PyTorch Keras backend.

`fake_quant_with_min_max_vars` and `fake_quant_with_min_max_vars_per_channel` compute what
TensorFlow's CPU kernels compute, bit for bit (tests/test_quantize_backends.py compares them
with TensorFlow on grids of values that include every rounding boundary). The range is nudged
so that 0 lies on the grid: with q_lo = 1 for a narrow range (else 0) and q_hi = 2^bits − 1,

    scale = (max − min)/(q_hi − q_lo),   z = std::round(q_lo − min/scale) clamped to [q_lo, q_hi]
    min' = (q_lo − z)·scale,   max' = (q_hi − z)·scale,   c = min(max(x, min'), max') − min'
    per tensor:   y = ⌊c/scale − (z − q_lo) + ½⌋·scale
    per channel:  y = ⌊c·((q_hi − q_lo)/(max − min)) − (z − q_lo) + ½⌋·scale   (the last axis)

in float32, each operation rounded as written (keras_bn/backend/jax/fake_quant.py has the same
sequence). Eager torch rounds every operation by itself; what it must not do is turn a
division into a product by the reciprocal, which it does for `number / tensor`
(Tensor.__rtruediv__ is `reciprocal() * number`) and, on CUDA, for a tensor divided by a CPU
scalar: every divisor here is a tensor on the dividend's device (`_divide`). The gradients are
TensorFlow's: straight-through for x inside [min', max'] and 0 outside; the range gets the sum
of the gradients below min' (to min) and above max' (to max).
"""

import torch

from keras_bn.backend import INTERFACE
from keras_bn.backend.constants import MIN_RANGE, ZERO_WEIGHT_RANGE


def _divide(numerator, denominator):
    """numerator / denominator as an IEEE float32 division, either side a Python number or a
    tensor (a number becomes a tensor on the other's device)."""
    like = numerator if isinstance(numerator, torch.Tensor) else denominator
    as_tensor = lambda v: torch.as_tensor(v, dtype=like.dtype, device=like.device)  # noqa: E731
    return torch.div(as_tensor(numerator), as_tensor(denominator))


def _std_round(x):
    """C's std::round: halves away from zero, exact (x − trunc(x) is exact in float)."""
    whole = torch.trunc(x)
    return whole + torch.where(torch.abs(x - whole) >= 0.5, torch.sign(x), 0.0)


def nudge(minimum, maximum, bits, narrow_range):
    """TensorFlow's nudged grid of [minimum, maximum] (float32, elementwise over the ranges).

    Args:
        minimum: float32 tensor ≤ 0.
        maximum: float32 tensor of minimum's shape, > minimum.
        bits: 2..16.
        narrow_range: whether the lowest integer is left out.

    Returns:
        (scale, zero_offset, nudged_min, nudged_max): zero_offset is z − q_lo, the integer
        (as float32) the grid's 0 lies above its lowest value.
    """
    q_lo = 1.0 if narrow_range else 0.0
    q_hi = float(2**bits - 1)
    scale = _divide(maximum - minimum, q_hi - q_lo)
    zero_from_min = q_lo - _divide(minimum, scale)
    zero = torch.where(
        zero_from_min < q_lo,
        q_lo,
        torch.where(zero_from_min > q_hi, q_hi, _std_round(zero_from_min)),
    )
    return scale, zero - q_lo, (q_lo - zero) * scale, (q_hi - zero) * scale


def _ranges(minimum, maximum, like=None):
    """The range as float32 tensors, on `like`'s device (else on that of whichever bound is a
    tensor)."""
    if like is None:
        like = minimum if isinstance(minimum, torch.Tensor) else maximum
    device = like.device if isinstance(like, torch.Tensor) else None
    return tuple(torch.as_tensor(v, device=device).to(torch.float32) for v in (minimum, maximum))


class _FakeQuant(torch.autograd.Function):
    """TensorFlow's FakeQuantWithMinMaxVars(PerChannel): values and gradients."""

    @staticmethod
    def forward(ctx, x, minimum, maximum, bits, narrow_range, per_channel):
        scale, offset, nudged_min, nudged_max = nudge(minimum, maximum, bits, narrow_range)
        shifted = torch.maximum(torch.minimum(x, nudged_max), nudged_min) - nudged_min
        if per_channel:
            levels = float(2**bits - 1 - (1 if narrow_range else 0))
            steps = shifted * _divide(levels, maximum - minimum)
        else:
            steps = _divide(shifted, scale)
        ctx.save_for_backward(x, nudged_min, nudged_max)
        ctx.per_channel = per_channel
        return torch.floor(steps - offset + 0.5) * scale

    @staticmethod
    def backward(ctx, gradients):
        x, nudged_min, nudged_max = ctx.saved_tensors
        axes = tuple(range(x.ndim - 1)) if ctx.per_channel else tuple(range(x.ndim))
        zero = torch.zeros_like(gradients)
        inside = (x >= nudged_min) & (x <= nudged_max)
        to_min = torch.sum(torch.where(x < nudged_min, gradients, zero), axes)
        to_max = torch.sum(torch.where(x > nudged_max, gradients, zero), axes)
        return torch.where(inside, gradients, zero), to_min, to_max, None, None, None


def fake_quant_with_min_max_vars(x, minimum, maximum, num_bits=8, narrow_range=False):
    """`tf.quantization.fake_quant_with_min_max_vars` in torch (per tensor).

    Args:
        x: float32 tensor.
        minimum: float32 scalar ≤ 0.
        maximum: float32 scalar > minimum, ≥ 0.
        num_bits: 2..16.
        narrow_range: whether the lowest integer is left out.

    Returns:
        The fake-quantized tensor, with TensorFlow's gradients (module docstring).
    """
    x = torch.as_tensor(x).to(torch.float32)
    minimum, maximum = _ranges(minimum, maximum, x)
    return _FakeQuant.apply(x, minimum, maximum, num_bits, narrow_range, False)


def fake_quant_with_min_max_vars_per_channel(x, minimum, maximum, num_bits=8, narrow_range=False):
    """`tf.quantization.fake_quant_with_min_max_vars_per_channel`: as
    `fake_quant_with_min_max_vars`, with one range per entry of x's last axis (`minimum` and
    `maximum` vectors of that length)."""
    x = torch.as_tensor(x).to(torch.float32)
    minimum, maximum = _ranges(minimum, maximum, x)
    return _FakeQuant.apply(x, minimum, maximum, num_bits, narrow_range, True)


def weight_max_abs(kernel, per_channel):
    """`fake_quant.weight_max_abs` in torch: max|w| per output channel (the last axis) or per
    tensor, at least MIN_RANGE, ZERO_WEIGHT_RANGE where every weight is 0; no gradient."""
    magnitude = torch.abs(kernel.detach().to(torch.float32))
    if per_channel:
        largest = torch.amax(torch.reshape(magnitude, (-1, magnitude.shape[-1])), dim=0)
    else:
        largest = torch.amax(magnitude)
    return torch.where(largest > 0, torch.clamp(largest, min=MIN_RANGE), ZERO_WEIGHT_RANGE)


class _StraightThrough(torch.autograd.Function):
    """The kernel rounded onto its grid, with gradient 1 to every weight and none to the
    range (a constant of the step)."""

    @staticmethod
    def forward(ctx, kernel, max_abs, bits):
        if max_abs.ndim == 1:
            return fake_quant_with_min_max_vars_per_channel(
                kernel, -max_abs, max_abs, num_bits=bits, narrow_range=True
            )
        return fake_quant_with_min_max_vars(
            kernel, -max_abs, max_abs, num_bits=bits, narrow_range=True
        )

    @staticmethod
    def backward(ctx, gradients):
        return gradients, None, None


def fake_quant_weights(kernel, max_abs, bits):
    """`fake_quant.fake_quant_weights` in torch: the symmetric narrow-range grid of ±max_abs,
    with gradient 1 to every weight (TensorFlow's op would stop it at the weight that sets the
    range, which float32 puts just past the op's nudged maximum; torch.ao's rule gives 1)."""
    return _StraightThrough.apply(kernel.to(torch.float32), max_abs, bits)


def fake_quant_activations(x, minimum, maximum, bits):
    """`fake_quant.fake_quant_activations` in torch: the asymmetric grid of [minimum, maximum],
    maximum widened to at least MIN_RANGE above minimum."""
    x = torch.as_tensor(x).to(torch.float32)
    minimum, maximum = _ranges(minimum, maximum, x)
    maximum = torch.maximum(maximum, minimum + MIN_RANGE)
    return fake_quant_with_min_max_vars(x, minimum, maximum, num_bits=bits, narrow_range=False)


def weight_step(max_abs, bits):
    """`fake_quant.weight_step` in torch: (max − min)/(2^bits − 2) for the range ±max_abs."""
    max_abs = torch.as_tensor(max_abs).to(torch.float32)
    return _divide(max_abs - (-max_abs), float(2**bits - 2))


def activation_step(minimum, maximum, bits):
    """`fake_quant.activation_step` in torch."""
    minimum, maximum = _ranges(minimum, maximum)
    maximum = torch.maximum(maximum, minimum + MIN_RANGE)
    return _divide(maximum - minimum, 2.0**bits - 1.0)


def round_bias(bias, step):
    """`fake_quant.round_bias` in torch: round(bias/step)·step (halves to even), the gradient
    straight through to `bias` and none to `step`."""
    rounded = torch.round(_divide(bias, step)) * step
    return bias + (rounded - bias).detach()


def halves_away_from_int8_zero(average, minimum, maximum, bits, window):
    """`fake_quant.halves_away_from_int8_zero` in torch."""
    scale = activation_step(minimum, maximum, bits)
    minimum = torch.as_tensor(minimum, device=scale.device).to(torch.float32)
    zero_point = torch.floor(_divide(-minimum, scale) + 0.5)
    int8_zero = (128.0 - zero_point) * scale
    return average + torch.sign(average - int8_zero) * _divide(scale, 4.0 * window)


# The interface's functions (keras_bn/backend/__init__.py) defined here, which the backend
# package imports with `*`.
__all__ = [name for name in INTERFACE if name in globals()]

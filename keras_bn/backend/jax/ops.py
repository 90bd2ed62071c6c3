"""keras_bn.BatchNormalization's maths under the JAX backend, in jnp.

The same maths as the TensorFlow composite path (keras_bn/backend/tensorflow/composite.py;
docs/architecture.md, "The maths"), for one channel over its m values (m_c under a mask):

    μ = Σx / m,   σ² = Σ(x − μ)² / m,   x̂ = (x − μ)/√(σ² + ε),   y = γ·x̂ + β

with a hand-written backward (`batch_norm_train`, a jax.custom_vjp):

    ∂l/∂β = Σg,   ∂l/∂γ = Σg·x̂,   ∂l/∂x = γ/√(σ² + ε) · (g − w·(Σg + x̂·Σg·x̂)/m)

(w the mask, 1 without one; the sums run over every position, as every position is
normalized). The moments are shifted sums about K, each channel's mean over its first few
values, redone about the mean when K lies more than 3σ from it (the arrangement of
keras_bn/backend/tensorflow/xla.py for TensorFlow's XLA:CPU; under a mask, always about the
mean: the corrected two-pass algorithm of the TensorFlow backend's statistics.py), never
E[x²] − E[x]²; float16/bfloat16 inputs get float32 statistics. The backward is regrouped into
per-channel coefficients (`_normalize_backward`).
The moving statistics take m/(m−1)·σ² (Ioffe & Szegedy 2015, Algorithm 2) only where m ≥ 2
and the batch is finite, as on TensorFlow (`usable`).

Shapes are static under JAX, so m is a Python int unless a mask makes it per channel. Mask
readings and the ghost-batch checks are shared with the TensorFlow backend
(`keras_bn._axes.mask_axes`, `ghost.ghost_count`).
"""

import functools
import math

import jax
import jax.numpy as jnp

from keras_bn import _axes, ghost
from keras_bn.backend.constants import SHIFT_REDO_RATIO, SHIFT_SAMPLES


def statistics_dtype(dtype):
    """float64 for float64 inputs, else float32 (16-bit statistics overflow and round)."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def parameter(variable, default, shape, dtype):
    """A weight's value in `dtype`, or the constant standing for it when disabled (None)."""
    if variable is None:
        return jnp.full(shape, default, dtype)
    return jnp.asarray(variable.value, dtype)


def ghost_average(statistic):
    """Mean over the ghost axis of a (G, *channels) statistic."""
    return statistic.mean(axis=0)


def _reduction_axes(rank, channel_axes):
    return tuple(_axes.reduction_axes(rank, channel_axes))


def per_channel(t, x, channel_axes):
    """A per-channel tensor reshaped to broadcast against x (channel dims kept, others 1)."""
    return jnp.reshape(t, [x.shape[i] if i in channel_axes else 1 for i in range(x.ndim)])


def expand_mask(mask, x, channel_axes, channel_reading=True):
    """A mask as 0/1 of x's rank and statistics dtype, read by `keras_bn._axes.mask_axes`'s
    rules (ValueError when it fits no reading); `channel_reading` False for Keras's reading
    only (keras.layers.BatchNormalization's)."""
    mask = jnp.asarray(mask)
    covered = _axes.mask_axes(mask.shape, x.shape, channel_axes, channel_reading)
    mask = mask.astype(bool)
    for axis in range(x.ndim):
        if axis not in covered:
            mask = jnp.expand_dims(mask, axis)
    return mask.astype(statistics_dtype(x.dtype))


def ghost_split(x, virtual_batch_size, channel_axes, mask):
    """x as (v, G, ...) and its channel axes there, as the TensorFlow backend's
    `ghost_split` (tf-keras's ghosts)."""
    ghosts = ghost.ghost_count(virtual_batch_size, x.shape, mask)
    view = jnp.reshape(x, (virtual_batch_size, ghosts, *x.shape[1:]))
    return view, [1] + [a + 1 for a in channel_axes]


def element_count(x, channel_axes, mask=None, replica_context=None):
    """m: a Python int without a mask, else m_c per channel (shaped to broadcast against x).
    JAX has no replicas: `replica_context` is always None (`replica_context()`)."""
    del replica_context
    axes = _reduction_axes(x.ndim, channel_axes)
    if mask is None:
        return math.prod(x.shape[i] for i in axes)
    return jnp.sum(jnp.broadcast_to(mask, x.shape), axes, keepdims=True)


def batch_size_traced(x, channel_axes):
    """Whether x is traced (`fit`'s step, `jax.jit`, `jax.grad`) and its batch axis 0 reduced:
    where TensorFlow's `fit` traces the batch size as unknown, so that an m ≤ 1 from a short
    last batch is run-time data there (the channel outputs β), not the caller's mistake."""
    return isinstance(x, jax.core.Tracer) and 0 not in channel_axes


def run_time_count(count, shape, dtype):
    """A static m as a per-channel array of `shape`, for the guards that run at run time."""
    return jnp.full(shape, count, dtype)


def zero_unless_enough(gamma, count):
    """γ, or 0 in each channel with m_c ≤ 1 at run time (its output is β; its gradients to x
    and γ are 0). A Python int count was checked by the layer."""
    if isinstance(count, int):
        return gamma
    return jnp.where(jnp.reshape(count, gamma.shape) > 1, gamma, 0.0)


def _centered_moments(x, axes, mask, count):
    """(shift K, offset Δμ, variance), kept broadcastable to x, over the unmasked values: the
    shifted sums of `_shifted_moments`. Without a mask K is `_shift_estimate`'s, and the sums
    are redone about K + Δμ where K was too far from the mean (the TensorFlow backend's xla.py);
    with one K is the masked mean, which makes them the corrected two-pass algorithm of
    `statistics.centered_moments`."""
    if mask is not None:
        divisor = jnp.maximum(count, 1.0)  # a fully masked channel: 0, not NaN
        keep = mask > 0  # selected, not multiplied by 0: padding may hold NaN
        shift = jnp.sum(jnp.where(keep, x, 0.0), axes, keepdims=True) / divisor
        return _shifted_moments(x, shift, axes, keep, divisor)
    shift, offset, variance = _shifted_moments(x, _shift_estimate(x, axes), axes, None, count)
    return jax.lax.cond(
        jnp.any((jnp.square(offset) > SHIFT_REDO_RATIO * variance) | ~jnp.isfinite(variance)),
        lambda: _shifted_moments(x, shift + offset, axes, None, count),
        lambda: (shift, offset, variance),
    )


def _shift_estimate(x, axes):
    """K: each channel's mean over the first SHIFT_SAMPLES values along the first reduced axis
    (index 0 of the others), kept broadcastable to x; NaN for an empty batch."""
    first = axes[0]
    head = x[
        tuple(
            slice(0, SHIFT_SAMPLES) if a == first else slice(0, 1) if a in axes else slice(None)
            for a in range(x.ndim)
        )
    ]
    return jnp.mean(head, axes, keepdims=True)


def _shifted_moments(x, shift, axes, keep, divisor):
    """(K, Δμ, σ²) with t = x − K over the kept values: Δμ = Σt/m, σ² = Σt²/m − Δμ² (Chan,
    Golub & LeVeque 1983), which loses about a factor 1 + Δμ²/σ² of rounding: the caller
    keeps |Δμ| ≤ 3σ, or K is the mean and this the corrected two-pass algorithm."""
    centered = x - shift
    if keep is not None:
        centered = jnp.where(keep, centered, 0.0)
    offset = jnp.sum(centered, axes, keepdims=True) / divisor
    variance = jnp.sum(jnp.square(centered), axes, keepdims=True) / divisor - jnp.square(offset)
    return shift, offset, jnp.maximum(variance, 0.0)


def _materialized(*per_channel):
    """The per-channel values as computed arrays: an optimization barrier, without which XLA
    fuses their arithmetic (rsqrt, divisions by m) into the full-size loops that broadcast
    them, redoing it for every element: without the backward's barriers the float32 train step
    measured 1.07-1.30x Keras BN's on CPU instead of 0.83-0.90x (benchmarks/bench_layer.py
    --backend jax's shapes, 2026-11-26)."""
    values = jax.lax.optimization_barrier(per_channel)
    return values[0] if len(values) == 1 else values


def moments(x, channel_axes, mask=None, replica_context=None):
    """(mean, biased variance) per channel, kept broadcastable to x: the layer's shifted
    moments, `_centered_moments` (what `recalibrate` records of a BN's input), differentiable
    by autodiff (the QAT layers' batch statistics).

    Args:
        x: the input, in its statistics dtype.
        channel_axes: sorted non-negative axes that are not reduced.
        mask: optional output of `expand_mask`.
        replica_context: always None under JAX (no replicas).

    Returns:
        (mean, variance).
    """
    del replica_context
    count = element_count(x, channel_axes, mask)
    shift, offset, variance = _centered_moments(
        x, _reduction_axes(x.ndim, channel_axes), mask, count
    )
    return shift + offset, variance


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _normalize(x, gamma, beta, mask, channel_axes, epsilon):
    (y, mean, variance), _ = _normalize_forward(x, gamma, beta, mask, channel_axes, epsilon)
    return y, mean, variance


def _normalize_forward(x, gamma, beta, mask, channel_axes, epsilon):
    axes = _reduction_axes(x.ndim, channel_axes)
    count = element_count(x, channel_axes, mask)
    shift, offset, variance = _centered_moments(x, axes, mask, count)
    inv = jax.lax.rsqrt(variance + epsilon)
    scale = per_channel(gamma, x, channel_axes) * inv
    # y = γ·x̂ + β with x̂ = ((x − K) − Δμ)·inv: x − K is exact far out, Δμ joins β.
    bias = per_channel(beta, x, channel_axes) - offset * scale
    scale_m, bias_m, shift_m = _materialized(scale, bias, shift)
    y = (x - shift_m) * scale_m + bias_m
    mean = jnp.reshape(shift + offset, gamma.shape)
    outputs = (y, mean, jnp.reshape(variance, gamma.shape))
    return outputs, (x, scale, shift, offset, inv, mask, count)


def _normalize_backward(channel_axes, epsilon, saved, cotangents):
    """The paper's gradients, with x̂ = ((x − K) − Δμ)·inv never written out:

        Σg·x̂ = inv·(Σg·(x − K) − Δμ·Σg),
        ∂l/∂x = a·g + w·(b·(x − K) + c),  a = γ·inv,  b = −a·inv·Σg·x̂/m,
                                          c = a·(Δμ·inv·Σg·x̂ − Σg)/m,

    which is γ·inv·(g − w·(Σg + x̂·Σg·x̂)/m) regrouped per channel, so that ∂l/∂x is one
    elementwise pass."""
    del epsilon  # inv is saved
    x, scale, shift, offset, inv, mask, count = saved
    dy = cotangents[0]  # the statistics carry no gradient (the caller stops it)
    axes = _reduction_axes(x.ndim, channel_axes)
    sum_dy = jnp.sum(dy, axes, keepdims=True)
    centered_dot = jnp.sum(dy * (x - _materialized(shift)), axes, keepdims=True)
    sum_dy_x_hat = inv * (centered_dot - offset * sum_dy)
    m = count if mask is None else jnp.maximum(count, 1.0)
    slope = -scale * inv * sum_dy_x_hat / m
    intercept = scale * (offset * inv * sum_dy_x_hat - sum_dy) / m
    scale_m, slope_m, intercept_m, shift_m = _materialized(scale, slope, intercept, shift)
    correction = slope_m * (x - shift_m) + intercept_m
    dx = scale_m * dy + (correction if mask is None else mask * correction)
    param_shape = [x.shape[i] for i in channel_axes]
    d_mask = None if mask is None else jnp.zeros_like(mask)
    return (
        dx,
        jnp.reshape(sum_dy_x_hat, param_shape),
        jnp.reshape(sum_dy, param_shape),
        d_mask,
    )


_normalize.defvjp(_normalize_forward, _normalize_backward)


def batch_norm_train(
    x, gamma, beta, channel_axes, epsilon, mask=None, fused=None, replica_context=None
):
    """Train-mode batch normalization with the hand-written backward.

    Args:
        x: floating array, normalized in `statistics_dtype(x.dtype)`.
        gamma, beta: per-channel scale and offset in the statistics dtype.
        channel_axes: sorted non-negative axes that are not reduced.
        epsilon: added to the variance.
        mask: optional output of `expand_mask`; masked-out values do not enter μ or σ².
        fused: TensorFlow's kernel choice; one path here, so unused.
        replica_context: always None under JAX (no replicas).

    Returns:
        (y, mean, variance): the output in the statistics dtype, and the per-channel mean and
        biased variance shaped like gamma, carrying no gradient.
    """
    del fused, replica_context
    x = x.astype(statistics_dtype(x.dtype))
    y, mean, variance = _normalize(x, gamma, beta, mask, tuple(channel_axes), float(epsilon))
    return y, jax.lax.stop_gradient(mean), jax.lax.stop_gradient(variance)


def batch_norm_inference(x, a, b, channel_axes):
    """The per-channel affine y = a·x + b, in the statistics dtype."""
    x = x.astype(statistics_dtype(x.dtype))
    return x * per_channel(a, x, channel_axes) + per_channel(b, x, channel_axes)


def batch_norm_eval(x, mean, variance, gamma, beta, channel_axes, epsilon):
    """Inference BN, y = a·x + b with a = γ/√(variance + ε), b = β − a·mean."""
    a = gamma * jax.lax.rsqrt(variance + epsilon)
    return batch_norm_inference(x, a, beta - a * mean, channel_axes)


def renorm_corrections(mean, variance, renorm_mean, renorm_stddev, epsilon, clipping):
    """Batch renormalization's per-channel (r, d), without gradient: `renorm.corrections`."""
    stddev = jnp.sqrt(variance + epsilon)
    renorm_stddev = jnp.maximum(renorm_stddev, math.sqrt(epsilon))  # as Keras, early on
    r = stddev / renorm_stddev
    d = (mean - renorm_mean) / renorm_stddev
    clipping = clipping or {}
    r = jnp.clip(r, min=clipping.get("rmin"), max=clipping.get("rmax"))
    if "dmax" in clipping:
        d = jnp.clip(d, min=-clipping["dmax"], max=clipping["dmax"])
    return jax.lax.stop_gradient(r), jax.lax.stop_gradient(d)


def unbiased_estimates(mean, variance, count, epsilon, dtype, with_stddev):
    """The per-channel values the moving statistics take from a batch, in the variables'
    `dtype`: [μ_B, m/(m−1)·σ²_B] (and renorm's √(σ²_B + ε) `with_stddev`), and which channels
    have the m ≥ 2 values a variance needs: True for a static m (checked by the caller), else a
    boolean array per channel."""
    mean, variance = mean.astype(dtype), variance.astype(dtype)
    if isinstance(count, int):  # static m, checked ≥ 2 by the layer
        unbiased, enough = variance * (count / (count - 1)), True
    else:
        count = jnp.reshape(count, mean.shape).astype(dtype)
        enough = count > 1.0
        # A channel with m ≤ 1 is not updated; the divisor only keeps its value finite.
        unbiased = variance * count / jnp.maximum(count - 1.0, 1.0)
    values = [mean, unbiased] + ([jnp.sqrt(variance + epsilon)] if with_stddev else [])
    return values, enough


def usable(values, enough):
    """Which channels a moving-statistics update reaches: those with m ≥ 2 (`enough`), provided
    that every value of those channels is finite (else none does: one NaN batch cannot poison
    the averages)."""
    if enough is True:
        return jnp.all(jnp.isfinite(jnp.stack(values)))
    checked = [jnp.where(enough, v, 0.0) for v in values]
    return enough & jnp.all(jnp.isfinite(jnp.stack(checked)))


def replica_context():
    """None: JAX has no replicas (a `keras.distribution` batch is one sharded array, whose
    statistics are already the global batch's)."""
    return None


def pool_statistics(values, enough, weight, synchronized):
    """The values as they are, and which channels take them: no replicas to pool."""
    del weight, synchronized
    return values, usable(values, enough)


def moving_average(old, value, momentum, update):
    """momentum·old + (1 − momentum)·value where `update`, else old."""
    return jnp.where(update, momentum * old + (1.0 - momentum) * value, old)


def cumulative_average(old, value, seen, update):
    """The plain average after `seen` counted batches takes `value` with weight 1/(seen + 1),
    where `usable`. Written old + (value − old)/(seen + 1): JAX has no float64 without x64,
    and a float32 n/(n+1) would round to 1 from n = 2²⁴ (the TensorFlow layer divides in
    float64 instead); this form loses nothing of the new batch's weight at any count."""
    weight = 1.0 / (jnp.asarray(seen).astype(old.dtype) + 1.0)
    return jnp.where(update, old + (value - old) * weight, old)


def counter_dtype():
    """`num_batches_tracked`'s dtype: int64 where JAX has it (jax_enable_x64), else int32."""
    return str(jax.dtypes.canonicalize_dtype(jnp.int64))

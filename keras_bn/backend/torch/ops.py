"""keras_bn.BatchNormalization's maths under the PyTorch backend, in torch ops.

The maths of the JAX backend (keras_bn/backend/jax/ops.py; docs/architecture.md, "The
maths"), for one channel over its m values (m_c under a mask):

    μ = Σx / m,   σ² = Σ(x − μ)² / m,   x̂ = (x − μ)/√(σ² + ε),   y = γ·x̂ + β

with a hand-written backward (`batch_norm_train`, a torch.autograd.Function):

    ∂l/∂β = Σg,   ∂l/∂γ = Σg·x̂,   ∂l/∂x = γ/√(σ² + ε) · (g − w·(Σg + x̂·Σg·x̂)/m)

(w the mask, 1 without one). The moments are the JAX backend's shifted sums about K, each
channel's mean over its first few values, redone about the mean when K lies more than 3σ from
it (under a mask, always about the mean: the corrected two-pass algorithm), never
E[x²] − E[x]²; float16/bfloat16 inputs get float32 statistics. The moving statistics take
m/(m−1)·σ² only where m ≥ 2 and the batch is finite (`usable`), as on the other backends.

PyTorch runs eagerly: shapes are concrete, so m is a Python int unless a mask makes it per
channel, and a static m ≤ 1 is the caller's ValueError, in `fit` too (as torch.nn.BatchNorm
raises), except under torch.compile, where it is run-time data as in JAX's traced `fit`.
Tensors made here go to the device of the tensor they serve, or Keras's (`keras.ops`).
"""

import math

import keras
import torch

from keras_bn import _axes, ghost
from keras_bn.backend.constants import SHIFT_REDO_RATIO, SHIFT_SAMPLES


def torch_dtype(dtype):
    """A dtype as torch's: a torch.dtype as it is, a name ("float32") or numpy dtype looked up
    (the variables' dtypes are Keras's names)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, keras.backend.standardize_dtype(dtype))


def statistics_dtype(dtype):
    """float64 for float64 inputs, else float32 (16-bit statistics overflow and round)."""
    return torch.float64 if torch_dtype(dtype) == torch.float64 else torch.float32


def parameter(variable, default, shape, dtype):
    """A weight's value in `dtype`, or the constant standing for it when disabled (None)."""
    dtype = torch_dtype(dtype)
    if variable is None:
        return keras.ops.full(tuple(shape), default, dtype=keras.backend.standardize_dtype(dtype))
    return variable.value.to(dtype)


def ghost_average(statistic):
    """Mean over the ghost axis of a (G, *channels) statistic."""
    return statistic.mean(dim=0)


def _reduction_axes(rank, channel_axes):
    return tuple(_axes.reduction_axes(rank, channel_axes))


def per_channel(t, x, channel_axes):
    """A per-channel tensor reshaped to broadcast against x (channel dims kept, others 1)."""
    return torch.reshape(t, [x.shape[i] if i in channel_axes else 1 for i in range(x.ndim)])


def expand_mask(mask, x, channel_axes, channel_reading=True):
    """A mask as 0/1 of x's rank and statistics dtype, read by `keras_bn._axes.mask_axes`'s
    rules (ValueError when it fits no reading); `channel_reading` False for Keras's reading
    only (keras.layers.BatchNormalization's)."""
    mask = torch.as_tensor(mask, device=x.device)
    covered = _axes.mask_axes(tuple(mask.shape), tuple(x.shape), channel_axes, channel_reading)
    mask = mask.to(torch.bool)
    for axis in range(x.ndim):
        if axis not in covered:
            mask = mask.unsqueeze(axis)
    return mask.to(statistics_dtype(x.dtype))


def ghost_split(x, virtual_batch_size, channel_axes, mask):
    """x as (v, G, ...) and its channel axes there, as the other backends' `ghost_split`
    (tf-keras's ghosts: ghost g holds samples g, g+G, ...)."""
    ghosts = ghost.ghost_count(virtual_batch_size, tuple(x.shape), mask)
    view = torch.reshape(x, (virtual_batch_size, ghosts, *x.shape[1:]))
    return view, [1] + [a + 1 for a in channel_axes]


def element_count(x, channel_axes, mask=None, replica_context=None):
    """m: a Python int without a mask, else m_c per channel (shaped to broadcast against x).
    PyTorch's Keras backend has no replicas: `replica_context` is always None."""
    del replica_context
    axes = _reduction_axes(x.ndim, channel_axes)
    if mask is None:
        return math.prod(x.shape[i] for i in axes)
    return torch.sum(torch.broadcast_to(mask, x.shape), axes, keepdim=True)


def batch_size_traced(x, channel_axes):
    """Whether torch.compile is tracing x with its batch axis 0 reduced: there, as in JAX's
    traced `fit`, an m ≤ 1 is run-time data (the channel outputs β). Eager calls, `fit`'s
    included, see the concrete batch: a batch of one there is a ValueError, as in
    torch.nn.BatchNorm."""
    return torch.compiler.is_compiling() and 0 not in channel_axes


def run_time_count(count, shape, dtype):
    """A static m as a per-channel tensor of `shape`, for the guards that run at run time."""
    return keras.ops.full(tuple(shape), count, dtype=keras.backend.standardize_dtype(dtype))


def zero_unless_enough(gamma, count):
    """γ, or 0 in each channel with m_c ≤ 1 at run time (its output is β; its gradients to x
    and γ are 0). A Python int count was checked by the layer."""
    if isinstance(count, int):
        return gamma
    return torch.where(torch.reshape(count, gamma.shape) > 1, gamma, 0.0)


def _centered_moments(x, axes, mask, count):
    """(shift K, offset Δμ, variance, x − K), the first three kept broadcastable to x, over the
    unmasked values (x − K over all of them, for the forward and backward to reuse): the
    shifted sums of `_shifted_moments`. Without a mask K is `_shift_estimate`'s, and the sums
    are redone about K + Δμ where K was too far from the mean (a Python branch: PyTorch runs
    eagerly, so the redo costs a pass only when it happens; Keras's shape inference on the
    "meta" device, which has no values, never takes it); with one K is the masked mean, which
    makes them the corrected two-pass algorithm."""
    if mask is not None:
        divisor = torch.clamp(count, min=1.0)  # a fully masked channel: 0, not NaN
        keep = mask > 0  # selected, not multiplied by 0: padding may hold NaN
        shift = torch.sum(torch.where(keep, x, 0.0), axes, keepdim=True) / divisor
        return _shifted_moments(x, shift.detach(), axes, keep, divisor)
    found = _shifted_moments(x, _shift_estimate(x, axes), axes, None, count)
    shift, offset, variance, _ = found
    if x.device.type != "meta" and bool(
        torch.any((offset.square() > SHIFT_REDO_RATIO * variance) | ~torch.isfinite(variance))
    ):
        return _shifted_moments(x, (shift + offset).detach(), axes, None, count)
    return found


def _shift_estimate(x, axes):
    """K: each channel's mean over the first SHIFT_SAMPLES values along the first reduced axis
    (index 0 of the others), kept broadcastable to x; NaN for an empty batch. Without
    gradient: the shifted sums are identities in K (∂/∂K of K + Σ(x − K)/m is 0), so the
    moments' autodiff gradient is the same without it, and cheaper."""
    first = axes[0]
    head = x[
        tuple(
            slice(0, SHIFT_SAMPLES) if a == first else slice(0, 1) if a in axes else slice(None)
            for a in range(x.ndim)
        )
    ]
    return torch.mean(head.detach(), axes, keepdim=True)


def _shifted_moments(x, shift, axes, keep, divisor):
    """(K, Δμ, σ², t) with t = x − K (over every value), and the sums over the kept values:
    Δμ = Σt/m, σ² = Σt²/m − Δμ² (Chan, Golub & LeVeque 1983), which loses about a factor
    1 + Δμ²/σ² of rounding: the caller keeps |Δμ| ≤ 3σ, or K is the mean and this the
    corrected two-pass algorithm."""
    centered = x - shift
    summed = centered if keep is None else torch.where(keep, centered, 0.0)
    offset = torch.sum(summed, axes, keepdim=True) / divisor
    variance = torch.sum(torch.square(summed), axes, keepdim=True) / divisor - offset.square()
    return shift, offset, torch.clamp(variance, min=0.0), centered


def moments(x, channel_axes, mask=None, replica_context=None):
    """(mean, biased variance) per channel, kept broadcastable to x: the layer's shifted
    moments, `_centered_moments` (what `recalibrate` records of a BN's input), differentiable
    by autograd (the QAT layers' batch statistics).

    Args:
        x: the input, in its statistics dtype.
        channel_axes: sorted non-negative axes that are not reduced.
        mask: optional output of `expand_mask`.
        replica_context: always None under PyTorch (no replicas).

    Returns:
        (mean, variance).
    """
    del replica_context
    count = element_count(x, channel_axes, mask)
    shift, offset, variance, _ = _centered_moments(
        x, _reduction_axes(x.ndim, channel_axes), mask, count
    )
    return shift + offset, variance


class _Normalize(torch.autograd.Function):
    """y = γ·x̂ + β with the paper's backward; the statistics carry no gradient."""

    @staticmethod
    def forward(ctx, x, gamma, beta, mask, channel_axes, epsilon):
        axes = _reduction_axes(x.ndim, channel_axes)
        count = element_count(x, channel_axes, mask)
        shift, offset, variance, centered = _centered_moments(x, axes, mask, count)
        inv = torch.rsqrt(variance + epsilon)
        scale = per_channel(gamma, x, channel_axes) * inv
        # y = γ·x̂ + β with x̂ = ((x − K) − Δμ)·inv: x − K is exact far out, Δμ joins β. The
        # moments' x − K is reused, and the sum is taken in place (one new tensor, not two).
        # Not torch.addcmul: a fused multiply-add on the CPU, its single rounding changes the
        # outputs, and over a training run Keras's parity tests see it (renorm's weights).
        bias = per_channel(beta, x, channel_axes) - offset * scale
        y = torch.mul(centered, scale).add_(bias)
        mean = torch.reshape(shift + offset, gamma.shape)
        variance = torch.reshape(variance, gamma.shape)
        counted = None if isinstance(count, int) else count
        # x − K rather than x: the backward reads it as it is, not recomputing it.
        ctx.save_for_backward(centered, scale, offset, inv, mask, counted)
        ctx.channel_axes, ctx.count = channel_axes, count if counted is None else None
        ctx.mark_non_differentiable(mean, variance)
        return y, mean, variance

    @staticmethod
    def backward(ctx, dy, d_mean, d_variance):
        """The paper's gradients, with x̂ = ((x − K) − Δμ)·inv never written out:

            Σg·x̂ = inv·(Σg·(x − K) − Δμ·Σg),
            ∂l/∂x = a·g + w·(b·(x − K) + c),  a = γ·inv,  b = −a·inv·Σg·x̂/m,
                                              c = a·(Δμ·inv·Σg·x̂ − Σg)/m,

        which is γ·inv·(g − w·(Σg + x̂·Σg·x̂)/m) regrouped per channel, so that ∂l/∂x is one
        elementwise pass (the JAX backend's `_normalize_backward`); the sums in place, into
        the products' new tensors, as in the forward."""
        del d_mean, d_variance  # non-differentiable outputs
        centered, scale, offset, inv, mask, counted = ctx.saved_tensors
        count = ctx.count if counted is None else counted
        axes = _reduction_axes(centered.ndim, ctx.channel_axes)
        sum_dy = torch.sum(dy, axes, keepdim=True)
        sum_dy_x_hat = inv * (torch.sum(dy * centered, axes, keepdim=True) - offset * sum_dy)
        m = count if mask is None else torch.clamp(count, min=1.0)
        slope = -scale * inv * sum_dy_x_hat / m
        intercept = scale * (offset * inv * sum_dy_x_hat - sum_dy) / m
        correction = torch.mul(slope, centered).add_(intercept)
        if mask is not None:
            correction.mul_(mask)
        dx = torch.mul(scale, dy).add_(correction)
        param_shape = [centered.shape[i] for i in ctx.channel_axes]
        return (
            dx,
            torch.reshape(sum_dy_x_hat, param_shape),
            torch.reshape(sum_dy, param_shape),
            None,
            None,
            None,
        )


def batch_norm_train(
    x, gamma, beta, channel_axes, epsilon, mask=None, fused=None, replica_context=None
):
    """Train-mode batch normalization with the hand-written backward.

    Args:
        x: floating tensor, normalized in `statistics_dtype(x.dtype)`.
        gamma, beta: per-channel scale and offset in the statistics dtype.
        channel_axes: sorted non-negative axes that are not reduced.
        epsilon: added to the variance.
        mask: optional output of `expand_mask`; masked-out values do not enter μ or σ².
        fused: TensorFlow's kernel choice; one path here, so unused.
        replica_context: always None under PyTorch (no replicas).

    Returns:
        (y, mean, variance): the output in the statistics dtype, and the per-channel mean and
        biased variance shaped like gamma, carrying no gradient.
    """
    del fused, replica_context
    x = x.to(statistics_dtype(x.dtype))
    return _Normalize.apply(x, gamma, beta, mask, tuple(channel_axes), float(epsilon))


def batch_norm_inference(x, a, b, channel_axes):
    """The per-channel affine y = a·x + b, in the statistics dtype: the sum taken in place in
    the product's new tensor (the same values; on a CPU a second new full-size tensor cost
    more than the sum itself, its fresh memory's page faults)."""
    x = x.to(statistics_dtype(x.dtype))
    return torch.mul(x, per_channel(a, x, channel_axes)).add_(per_channel(b, x, channel_axes))


def batch_norm_eval(x, mean, variance, gamma, beta, channel_axes, epsilon):
    """Inference BN, y = a·x + b with a = γ/√(variance + ε), b = β − a·mean."""
    a = gamma * torch.rsqrt(variance + epsilon)
    return batch_norm_inference(x, a, beta - a * mean, channel_axes)


def renorm_corrections(mean, variance, renorm_mean, renorm_stddev, epsilon, clipping):
    """Batch renormalization's per-channel (r, d), without gradient: `renorm.corrections`."""
    stddev = torch.sqrt(variance + epsilon)
    renorm_stddev = torch.clamp(renorm_stddev, min=math.sqrt(epsilon))  # as Keras, early on
    r = stddev / renorm_stddev
    d = (mean - renorm_mean) / renorm_stddev
    clipping = clipping or {}
    if "rmin" in clipping or "rmax" in clipping:  # torch.clamp refuses two Nones
        r = torch.clamp(r, min=clipping.get("rmin"), max=clipping.get("rmax"))
    if "dmax" in clipping:
        d = torch.clamp(d, min=-clipping["dmax"], max=clipping["dmax"])
    return r.detach(), d.detach()


def unbiased_estimates(mean, variance, count, epsilon, dtype, with_stddev):
    """The per-channel values the moving statistics take from a batch, in the variables'
    `dtype`: [μ_B, m/(m−1)·σ²_B] (and renorm's √(σ²_B + ε) `with_stddev`), and which channels
    have the m ≥ 2 values a variance needs: True for a static m (checked by the caller), else a
    boolean tensor per channel."""
    dtype = torch_dtype(dtype)
    mean, variance = mean.to(dtype), variance.to(dtype)
    if isinstance(count, int):  # static m, checked ≥ 2 by the layer
        unbiased, enough = variance * (count / (count - 1)), True
    else:
        count = torch.reshape(count, mean.shape).to(dtype)
        enough = count > 1.0
        # A channel with m ≤ 1 is not updated; the divisor only keeps its value finite.
        unbiased = variance * count / torch.clamp(count - 1.0, min=1.0)
    values = [mean, unbiased] + ([torch.sqrt(variance + epsilon)] if with_stddev else [])
    return values, enough


def usable(values, enough):
    """Which channels a moving-statistics update reaches: those with m ≥ 2 (`enough`), provided
    that every value of those channels is finite (else none does: one NaN batch cannot poison
    the averages, as it poisons torch.nn.BatchNorm's running_var)."""
    if enough is True:
        return torch.all(torch.isfinite(torch.stack(values)))
    checked = [torch.where(enough, v, 0.0) for v in values]
    return enough & torch.all(torch.isfinite(torch.stack(checked)))


def replica_context():
    """None: PyTorch's Keras backend has no replicas (no keras.distribution there)."""
    return None


def pool_statistics(values, enough, weight, synchronized):
    """The values as they are, and which channels take them: no replicas to pool."""
    del weight, synchronized
    return values, usable(values, enough)


def moving_average(old, value, momentum, update):
    """momentum·old + (1 − momentum)·value where `update`, else old."""
    return torch.where(update, momentum * old + (1.0 - momentum) * value, old)


def cumulative_average(old, value, seen, update):
    """The plain average after `seen` counted batches takes `value` with weight 1/(seen + 1),
    where `update`: n/(n+1) and 1/(n+1) divided in float64, then cast, as the TensorFlow
    backend does (formed in float32, n/(n+1) would round to 1 from n = 2²⁴ and the average
    stop)."""
    n = torch.as_tensor(seen).to(torch.float64)
    keep, weight = (n / (n + 1.0)).to(old.dtype), (1.0 / (n + 1.0)).to(old.dtype)
    return torch.where(update, keep * old + weight * value, old)


def counter_dtype():
    """`num_batches_tracked`'s dtype (torch.nn.BatchNorm's too)."""
    return "int64"

"""Functional batch normalization: moments, the train-mode transform and the inference affine.

Notation (Ioffe & Szegedy 2015; design.md §3). For one channel, over the m elements reduced
(batch × spatial, or the unmasked ones under a mask):

    μ = Σx / m,   σ² = Σ(x − μ)² / m          (biased: this is what normalizes)
    x̂ = (x − μ) / √(σ² + ε),   y = γ·x̂ + β

The backward pass is the closed form of the chain rule, with g = ∂l/∂y and inv = 1/√(σ² + ε):

    ∂l/∂β = Σg,   ∂l/∂γ = Σg·x̂,   ∂l/∂x = γ·inv·(g − w·(Σg + x̂·Σg·x̂) / m)

where w is the mask (1 everywhere without one). Sums run over every position, masked or not,
because every output depends on μ and σ². The statistics are outputs without gradient.

The variance is always two-pass, Σ(x − μ)², never E[x²] − E[x]² (which cancels catastrophically
and has produced negative variances in Keras and XLA).

All functions take `channel_axes`: the sorted, non-negative axes that are *not* reduced.
Per-channel tensors (γ, β, μ, σ²) have the shape of those axes' dimensions, as the layer's
weights do.
"""

import tensorflow as tf


def reduction_axes(rank, channel_axes):
    """The axes a batch norm reduces over: every axis that is not a channel axis."""
    return [i for i in range(rank) if i not in channel_axes]


def _broadcast_shape(x, channel_axes):
    """Shape that lines a per-channel tensor up with `x`: channel dims kept, others 1."""
    static = x.shape
    dims = [static[i] if i in channel_axes else 1 for i in range(static.rank)]
    if all(d is not None for d in dims):
        return dims
    dynamic = tf.shape(x)
    return [dynamic[i] if i in channel_axes else 1 for i in range(static.rank)]


def _per_channel(t, x, channel_axes):
    return tf.reshape(t, _broadcast_shape(x, channel_axes))


def expand_mask(mask, x, channel_axes):
    """A mask over the non-channel axes, as a 0/1 tensor of x's dtype broadcastable to x.

    The mask's shape must be x's shape without the channel axes (Keras's convention, which for
    one trailing channel axis is `x.shape[:-1]`).
    """
    mask = tf.convert_to_tensor(mask)
    rank = x.shape.rank
    if mask.shape.rank != rank - len(channel_axes):
        raise ValueError(
            f"The mask must have the input's shape without its channel axes: input shape "
            f"{x.shape}, channel axes {list(channel_axes)}, so a mask of rank "
            f"{rank - len(channel_axes)}; received a mask of shape {mask.shape}."
        )
    expected = [x.shape[i] for i in reduction_axes(rank, channel_axes)]
    for got, want in zip(mask.shape, expected):
        if got is not None and want is not None and got != want:
            raise ValueError(
                f"The mask's shape {mask.shape} does not match the input's non-channel "
                f"dimensions {expected} (input shape {x.shape})."
            )
    for axis in channel_axes:
        mask = tf.expand_dims(mask, axis)
    return tf.cast(mask, x.dtype)


def element_count(x, channel_axes, mask=None):
    """m: how many elements each channel's statistics are taken over.

    A Python int when the shape is static and there is no mask (so callers can check it at
    trace time); otherwise a scalar tensor of x's dtype. `mask` is the output of `expand_mask`.
    """
    axes = reduction_axes(x.shape.rank, channel_axes)
    if mask is not None:
        return tf.reduce_sum(mask)
    dims = [x.shape[i] for i in axes]
    if all(d is not None for d in dims):
        m = 1
        for d in dims:
            m *= d
        return m
    return tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)


def moments(x, channel_axes, mask=None):
    """Per-channel mean and biased variance, two-pass, kept broadcastable to x."""
    axes = reduction_axes(x.shape.rank, channel_axes)
    if mask is None:
        mean = tf.reduce_mean(x, axes, keepdims=True)
        variance = tf.reduce_mean(tf.square(x - mean), axes, keepdims=True)
        return mean, variance
    count = tf.reduce_sum(mask)
    mean = tf.reduce_sum(mask * x, axes, keepdims=True) / count
    variance = tf.reduce_sum(mask * tf.square(x - mean), axes, keepdims=True) / count
    return mean, variance


def batch_norm_train(x, gamma, beta, channel_axes, epsilon, mask=None):
    """Train-mode batch normalization with a hand-written gradient.

    Args:
        x: floating tensor.
        gamma, beta: per-channel scale and offset (pass ones / zeros when disabled).
        channel_axes: sorted non-negative axes that are not reduced.
        epsilon: added to the variance.
        mask: optional output of `expand_mask`; masked-out elements do not enter μ or σ².

    Returns:
        (y, mean, variance): the normalized output and the batch's per-channel mean and
        biased variance, both shaped like gamma and carrying no gradient.
    """
    axes = reduction_axes(x.shape.rank, channel_axes)
    param_shape = tf.shape(gamma)

    @tf.custom_gradient
    def _normalize(x, gamma, beta):
        mean, variance = moments(x, channel_axes, mask)
        inv = tf.math.rsqrt(variance + epsilon)
        x_hat = (x - mean) * inv
        gamma_b = _per_channel(gamma, x, channel_axes)
        y = x_hat * gamma_b + _per_channel(beta, x, channel_axes)

        def grad(dy, *_unused_statistic_grads):
            sum_dy = tf.reduce_sum(dy, axes, keepdims=True)
            sum_dy_xhat = tf.reduce_sum(dy * x_hat, axes, keepdims=True)
            if mask is None:
                m = tf.cast(tf.size(x) // tf.size(gamma), x.dtype)
                dx = (gamma_b * inv / m) * (m * dy - sum_dy - x_hat * sum_dy_xhat)
            else:
                m = tf.reduce_sum(mask)
                dx = (gamma_b * inv) * (dy - mask * (sum_dy + x_hat * sum_dy_xhat) / m)
            return (dx, tf.reshape(sum_dy_xhat, param_shape), tf.reshape(sum_dy, param_shape))

        return (y, tf.reshape(mean, param_shape), tf.reshape(variance, param_shape)), grad

    y, mean, variance = _normalize(x, gamma, beta)
    return y, tf.stop_gradient(mean), tf.stop_gradient(variance)


def inference_affine(mean, variance, gamma, beta, epsilon):
    """Inference BN as y = a·x + b: a = γ/√(Var + ε), b = β − a·E[x] (per channel)."""
    a = gamma * tf.math.rsqrt(variance + epsilon)
    return a, beta - a * mean


def batch_norm_inference(x, a, b, channel_axes):
    """Apply the per-channel affine y = a·x + b."""
    return x * _per_channel(a, x, channel_axes) + _per_channel(b, x, channel_axes)

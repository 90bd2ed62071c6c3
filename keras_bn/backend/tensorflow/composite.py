"""The composite path: train-mode batch normalization from plain TensorFlow ops.

It runs wherever neither the fused kernels (fused.py) nor the XLA:CPU arrangement
(xla.py) apply: masks, synchronized replicas, other devices under XLA, float64 and
other layouts (see `ops.train_path`). The moments are statistics.py's corrected
two-pass ones. With g = ∂l/∂y and inv = 1/√(σ² + ε), the backward pass is the closed form of
the chain rule (notation of statistics.py):

    ∂l/∂β = Σg,   ∂l/∂γ = Σg·x̂,   ∂l/∂x = γ·inv·(g − w·(Σg + x̂·Σg·x̂) / m)

where w is the mask broadcast to x (1 everywhere without one) and m each channel's count m_c
(a mask over a channel axis gives each channel its own). Sums run over every position, masked
or not, because every output depends on μ and σ². The statistics are outputs without gradient.
With a replica context, Σg and Σg·x̂ are all-reduced as the forward sums are.

This module imports only the leaf statistics.py.
"""

import tensorflow as tf

from keras_bn.backend.tensorflow.statistics import (
    centered_moments,
    channel_sums,
    divisor,
    element_count,
    per_channel,
    reduction_axes,
    statistics_dtype,
)


def batch_norm_train(x, gamma, beta, channel_axes, epsilon, mask=None, replica_context=None):
    """Train-mode BN with the contract of `ops.batch_norm_train`, for any layout.

    Args:
        x: floating tensor, normalized in `statistics_dtype(x.dtype)`.
        gamma, beta: per-channel scale and offset in `statistics_dtype(x.dtype)`.
        channel_axes: sorted non-negative axes that are not reduced.
        epsilon: added to the variance.
        mask: optional output of `statistics.expand_mask`; masked-out elements do not enter μ or σ².
        replica_context: synchronized BN: the sums of both passes are all-reduced over the
            replicas; ∂l/∂γ and ∂l/∂β stay per replica.

    Returns:
        (y, mean, variance): the output in the statistics dtype, and the per-channel mean and
        biased variance shaped like gamma, carrying no gradient.
    """
    x = tf.cast(x, statistics_dtype(x.dtype))
    axes = reduction_axes(x.shape.rank, channel_axes)
    param_shape = tf.shape(gamma)
    m = divisor(element_count(x, channel_axes, mask, replica_context))
    weight = 1.0 if mask is None else mask

    @tf.custom_gradient
    def _normalize(x, gamma, beta):
        shift, residual, variance = centered_moments(x, channel_axes, mask, replica_context)
        inv = tf.math.rsqrt(variance + epsilon)
        gamma_b = per_channel(gamma, x, channel_axes)

        def normalized(x):  # x̂, centred in two steps (see statistics.centered_moments)
            return ((x - shift) - residual) * inv

        y = normalized(x) * gamma_b + per_channel(beta, x, channel_axes)

        def grad(dy, *_unused_statistic_grads):
            # x̂ is recomputed from x rather than saved: one tensor less to keep alive, and
            # XLA fuses the recomputation into the reductions below.
            x_hat = normalized(x)
            sum_dy, sum_dy_xhat = channel_sums([dy, dy * x_hat], axes)
            total_dy, total_dy_xhat = sum_dy, sum_dy_xhat
            if replica_context is not None:
                total_dy, total_dy_xhat = replica_context.all_reduce(
                    tf.distribute.ReduceOp.SUM, [sum_dy, sum_dy_xhat]
                )
            dx = (gamma_b * inv) * (dy - weight * (total_dy + x_hat * total_dy_xhat) / m)
            return dx, tf.reshape(sum_dy_xhat, param_shape), tf.reshape(sum_dy, param_shape)

        mean = tf.reshape(shift + residual, param_shape)
        return (y, mean, tf.reshape(variance, param_shape)), grad

    y, mean, variance = _normalize(x, gamma, beta)
    return y, tf.stop_gradient(mean), tf.stop_gradient(variance)

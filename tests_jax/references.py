"""Independent references for the JAX tests: numpy float64 formulas and a plain jnp batch norm
that JAX differentiates by itself (no keras_bn code)."""

import jax.numpy as jnp
import numpy as np


def reduced(rank, channel_axes):
    """The axes a batch norm with these channel axes reduces over."""
    return tuple(i for i in range(rank) if i not in channel_axes)


def numpy_train(x, gamma, beta, channel_axes, eps, kept=None):
    """Train-mode BN in float64: (y, mean, biased variance, m), the last three per channel.

    Args:
        x: the input.
        gamma, beta: per-channel, shaped like the layer's weights.
        channel_axes: sorted non-negative channel axes.
        eps: epsilon.
        kept: optional boolean array of x's shape: the positions that enter the statistics.
    """
    x = np.asarray(x, np.float64)
    axes = reduced(x.ndim, channel_axes)
    kept = np.ones(x.shape, bool) if kept is None else np.broadcast_to(kept, x.shape)
    m = kept.sum(axis=axes, keepdims=True).astype(np.float64)
    mean = np.where(kept, x, 0.0).sum(axis=axes, keepdims=True) / m
    variance = np.where(kept, (x - mean) ** 2, 0.0).sum(axis=axes, keepdims=True) / m
    shape = [x.shape[i] if i in channel_axes else 1 for i in range(x.ndim)]
    g = np.reshape(np.asarray(gamma, np.float64), shape)
    b = np.reshape(np.asarray(beta, np.float64), shape)
    y = g * (x - mean) / np.sqrt(variance + eps) + b
    squeeze = [x.shape[i] for i in channel_axes]
    return y, mean.reshape(squeeze), variance.reshape(squeeze), m.reshape(squeeze)


def jnp_train(x, gamma, beta, channel_axes, eps, weight=None):
    """Train-mode BN as plain jnp ops (differentiated by autodiff); `weight` an optional 0/1
    mask broadcastable to x."""
    axes = reduced(x.ndim, channel_axes)
    shape = [x.shape[i] if i in channel_axes else 1 for i in range(x.ndim)]
    w = jnp.ones(x.shape, x.dtype) if weight is None else jnp.broadcast_to(weight, x.shape)
    m = jnp.sum(w, axes, keepdims=True)
    mean = jnp.sum(w * x, axes, keepdims=True) / m
    variance = jnp.sum(w * (x - mean) ** 2, axes, keepdims=True) / m
    return (x - mean) / jnp.sqrt(variance + eps) * jnp.reshape(gamma, shape) + jnp.reshape(
        beta, shape
    )

"""Independent numpy float64 references of batch normalization, imported by the suites of the
backend-neutral tests (tests/framework_references.py re-exports them): no framework, no
keras_bn code."""

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

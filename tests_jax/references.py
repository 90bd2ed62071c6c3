"""Independent references for the JAX tests: numpy float64 formulas (tests/bn_references.py,
shared with tests_torch) and a plain jnp batch norm that JAX differentiates by itself (no
keras_bn code)."""

import jax.numpy as jnp
from bn_references import numpy_train, reduced  # noqa: F401  (re-exported: tests import it here)


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

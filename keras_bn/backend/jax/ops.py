"""keras_bn.BatchNormalization's maths under the JAX backend: what is JAX's own.

The maths is keras_bn/backend/shared_maths.py's, shared with the PyTorch backend (the formulas
are in its docstring); here is the `jax.custom_vjp` that gives `batch_norm_train` its
hand-written backward, and what depends on JAX: weights as jnp arrays, tracing (a traced batch
size makes m ≤ 1 run-time data), and the moving statistics' counter and plain average without
float64. Shapes are static under JAX, so m is a Python int unless a mask makes it per channel.
"""

import functools

import jax
import jax.numpy as jnp

from keras_bn.backend import INTERFACE, shared_maths
from keras_bn.backend.jax.arrays import statistics_dtype


def parameter(variable, default, shape, dtype):
    """A weight's value in `dtype`, or the constant standing for it when disabled (None)."""
    if variable is None:
        return jnp.full(shape, default, dtype)
    return jnp.asarray(variable.value, dtype)


def batch_size_traced(x, channel_axes):
    """Whether x is traced (`fit`'s step, `jax.jit`, `jax.grad`) and its batch axis 0 reduced:
    where TensorFlow's `fit` traces the batch size as unknown, so that an m ≤ 1 from a short
    last batch is run-time data there (the channel outputs β), not the caller's mistake."""
    return isinstance(x, jax.core.Tracer) and 0 not in channel_axes


def run_time_count(count, shape, dtype):
    """A static m as a per-channel array of `shape`, for the guards that run at run time."""
    return jnp.full(shape, count, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _normalize(x, gamma, beta, mask, channel_axes, epsilon):
    outputs, _ = shared_maths.normalize_forward(x, gamma, beta, mask, channel_axes, epsilon)
    return outputs


def _normalize_forward(x, gamma, beta, mask, channel_axes, epsilon):
    return shared_maths.normalize_forward(x, gamma, beta, mask, channel_axes, epsilon)


def _normalize_backward(channel_axes, epsilon, saved, cotangents):
    del epsilon  # inv is saved
    dy = cotangents[0]  # the statistics carry no gradient (the caller stops it)
    dx, d_gamma, d_beta = shared_maths.normalize_backward(dy, saved, channel_axes)
    mask = saved[5]
    return dx, d_gamma, d_beta, None if mask is None else jnp.zeros_like(mask)


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


# The interface's functions (keras_bn/backend/__init__.py) defined here, which the backend
# package imports with `*`.
__all__ = [name for name in INTERFACE if name in globals()]

"""The array functions that keras_bn/backend/shared_maths.py is written in, in jax.numpy and
jax.lax (the torch ones are keras_bn/backend/torch/arrays.py; the names and signatures match)."""

import jax
import jax.numpy as jnp
from jax.lax import rsqrt, stop_gradient
from jax.numpy import (
    add,
    all,
    any,
    broadcast_to,
    isfinite,
    maximum,
    minimum,
    reshape,
    sqrt,
    square,
    stack,
    where,
)

# The arrays these functions take (tracers included), for `shared_maths.arrays_of`.
ARRAY_TYPE = jax.Array
# Whether recomputing an elementwise value where it is read is free: XLA fuses
# elementwise work into the loops that read it.
FUSES_ELEMENTWISE = True


def affine(x, a, b):
    """x·a + b (XLA fuses it into one loop)."""
    return x * a + b


def statistics_dtype(dtype):
    """float64 for float64 inputs, else float32 (16-bit statistics overflow and round)."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def as_array(value, like):
    """`value` (a mask, numpy or jax) as a jax array."""
    del like  # one device per array is JAX's business
    return jnp.asarray(value)


def astype(x, dtype):
    """x in `dtype` (a jnp dtype or Keras's name of one)."""
    return x.astype(dtype)


def expand_dims(x, axis):
    return jnp.expand_dims(x, axis)


def sum(x, axes, keepdims=False):
    return jnp.sum(x, axes, keepdims=keepdims)


def mean(x, axes, keepdims=False):
    return jnp.mean(x, axes, keepdims=keepdims)


def amin(x):
    """The least element (NaN where x holds one)."""
    return jnp.min(x)


def amax(x):
    """The greatest element (NaN where x holds one)."""
    return jnp.max(x)


def at_least(x, floor):
    """max(x, floor) elementwise (NaN stays NaN)."""
    return jnp.maximum(x, floor)


def clip(x, low, high):
    """x clipped to [low, high], either bound None for none."""
    return jnp.clip(x, min=low, max=high)


def cond(flag, compute, otherwise):
    """compute() where the scalar `flag` is true, else otherwise(), as one traced program; in
    an eager call (`flag` a concrete array) the branch it picks, run as it is: an eager
    lax.cond compiles its two fresh closures again at every call (0.17 s an eager training
    call on CPU)."""
    if not isinstance(flag, jax.core.Tracer):
        return compute() if bool(flag) else otherwise()
    return jax.lax.cond(flag, compute, otherwise)


def constant_for_the_shift(t):
    """t as it is: under JAX the shift stays in autodiff's graph (it is free under jit, and
    stopping it would change the rounding of the QAT layers' autodiff gradients)."""
    return t


def materialized(*per_channel):
    """The per-channel values as computed arrays: an optimization barrier, without which XLA
    fuses their arithmetic (rsqrt, divisions by m) into the full-size loops that broadcast
    them, redoing it for every element: without the backward's barriers the float32 train step
    measured 1.07-1.30x Keras BN's on CPU instead of 0.83-0.90x (benchmarks/bench_layer.py
    --backend jax's shapes, 2026-11-26)."""
    values = jax.lax.optimization_barrier(per_channel)
    return values[0] if len(values) == 1 else values

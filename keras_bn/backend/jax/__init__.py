"""The JAX backend: keras_bn's maths in jnp, with `jax.custom_vjp`.

Every name in keras_bn/backend/tensorflow/__init__.py is here too, with the same signature
(the interface is listed in keras_bn/backend/__init__.py): ops.py holds the batch norm's maths,
fake_quant.py TensorFlow's FakeQuant kernels bit for bit. JAX has no tf.distribute replicas:
`replica_context` is None and `pool_statistics` pools nothing.
"""

import contextlib

import jax.numpy as jnp
import keras

from keras_bn.backend import INTERFACE
from keras_bn.backend.jax.fake_quant import (
    activation_step,
    fake_quant_activations,
    fake_quant_weights,
    halves_away_from_int8_zero,
    round_bias,
    weight_max_abs,
    weight_step,
)
from keras_bn.backend.jax.ops import (
    batch_norm_eval,
    batch_norm_inference,
    batch_norm_train,
    batch_size_traced,
    counter_dtype,
    cumulative_average,
    element_count,
    expand_mask,
    ghost_average,
    ghost_split,
    moments,
    moving_average,
    parameter,
    per_channel,
    pool_statistics,
    renorm_corrections,
    replica_context,
    run_time_count,
    statistics_dtype,
    unbiased_estimates,
    usable,
    zero_unless_enough,
)

__all__ = list(INTERFACE)


def is_floating(x):
    """Whether x is a floating-point array."""
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(x.dtype))


def read(variable):
    """A variable's value as an array."""
    return jnp.asarray(variable.value)


def unit_affine(x, channel_axes, dtype):
    """Ones and zeros of x's per-channel shape (γ = 1, β = 0: x̂ itself)."""
    shape = [x.shape[a] for a in channel_axes]
    return jnp.ones(shape, dtype), jnp.zeros(shape, dtype)


def reshape_like(y, x):
    """y reshaped to x's shape (static under JAX)."""
    return jnp.reshape(y, x.shape)


def input_moments(x, channel_axes, mask=None):
    """(mean, biased variance) per channel of a BN's input, kept broadcastable to x: the
    layer's own moments (what `recalibrate` records)."""
    return moments(x, channel_axes, mask)


def local_copies(variable, strategy=None):
    """The variable itself: JAX has one copy of each."""
    del strategy
    return [variable]


def compiled(function, **options):
    """`function` as it is: under JAX the recalibration passes run eagerly (a jax.jit would
    bake the variables' current values into the trace)."""
    del options
    return function


def name_scope(name):
    """No graph to name under JAX."""
    del name
    return contextlib.nullcontext()


def add(x, y):
    """x + y broadcast as numpy does."""
    return jnp.add(x, y)


def fused_layout(x, channel_axes, epsilon):
    """None: TensorFlow's fused kernels do not exist here."""
    del x, channel_axes, epsilon
    return None


def cond(flag, compute, otherwise):
    """compute() where the scalar `flag` is true, else otherwise(): a select (lax.cond would
    trace both branches anyway)."""
    return jnp.where(flag, compute(), otherwise())


def specialized(function, signatures):
    """`function` itself: `compiled` traces nothing under JAX."""
    del signatures
    return function

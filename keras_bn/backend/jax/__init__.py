"""The JAX backend: keras_bn's maths in jnp, with `jax.custom_vjp`.

Every name in keras_bn/backend/tensorflow/__init__.py is here too, with the same signature
(the interface is listed in keras_bn/backend/__init__.py): keras_bn/backend/shared_maths.py
holds the batch norm's maths (the PyTorch backend's too), ops.py what is JAX's own (the
custom_vjp, tracing), fake_quant.py TensorFlow's FakeQuant kernels bit for bit. JAX has no
tf.distribute replicas: `replica_context` is None and `pool_statistics` pools nothing.
"""

import jax
import jax.numpy as jnp

from keras_bn.backend import INTERFACE, shared_maths
from keras_bn.backend.jax import arrays
from keras_bn.backend.jax.arrays import statistics_dtype
from keras_bn.backend.jax.fake_quant import *  # noqa: F403
from keras_bn.backend.jax.ops import *  # noqa: F403
from keras_bn.backend.shared_maths import *  # noqa: F403

__all__ = list(INTERFACE)
shared_maths.register_arrays("jax", arrays)


def read(variable):
    """A variable's value as an array."""
    return jnp.asarray(variable.value)


def unit_affine(x, channel_axes, dtype):
    """Ones and zeros of x's per-channel shape (γ = 1, β = 0: x̂ itself)."""
    shape = [x.shape[a] for a in channel_axes]
    return jnp.ones(shape, dtype), jnp.zeros(shape, dtype)


def input_moments(x, channel_axes, mask=None):
    """(mean, biased variance) per channel of a BN's input, kept broadcastable to x: the
    layer's own moments (what `recalibrate` records)."""
    return shared_maths.moments(x, channel_axes, mask)


def compiled(function, **options):
    """`function` as it is: under JAX the recalibration passes run eagerly (a jax.jit would
    bake the variables' current values into the trace)."""
    del options
    return function


def cond(flag, compute, otherwise):
    """compute() where the scalar `flag` is true, else otherwise() (`arrays.cond`: lax.cond
    when traced, the branch the flag picks when eager)."""
    return arrays.cond(flag, compute, otherwise)


def recalibration_processes():
    """None: JAX pools recalibration's sums in one process. Under jax.distributed (several
    processes) `recalibrate(synchronized=True)` is not supported yet: refused, not computed
    per process unseen.

    Raises:
        NotImplementedError: several JAX processes.
    """
    if jax.process_count() > 1:
        raise NotImplementedError(
            f"recalibrate(synchronized=True) under jax.distributed ({jax.process_count()} "
            f"processes) is not supported yet; recalibrate in one process on all the data."
        )
    return None

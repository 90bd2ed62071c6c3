"""The JAX backend: keras_bn's maths in jnp, with `jax.custom_vjp`.

Every name in keras_bn/backend/tensorflow/__init__.py is here too, with the same signature
(the interface is listed in keras_bn/backend/__init__.py): keras_bn/backend/shared_maths.py
holds the batch norm's maths (the PyTorch backend's too), ops.py what is JAX's own (the
custom_vjp, tracing), fake_quant.py TensorFlow's FakeQuant kernels bit for bit. JAX has no
tf.distribute replicas: `replica_context` is None and `pool_statistics` pools nothing (under
`keras.distribution.DataParallel` a batch is one array sharded over every device, of every
process, and its statistics are already global); `recalibration_processes` adds up
recalibration's sums over jax.distributed's processes.
"""

import jax
import jax.numpy as jnp
import numpy as np

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
    """The processes `recalibrate(synchronized=True)` pools over: under jax.distributed with
    two or more processes, a `_ProcessAllgather` (a `backend.ProcessSum`); with one process,
    None (this process's data alone)."""
    return None if jax.process_count() == 1 else _ProcessAllgather()


class _ProcessAllgather:
    """`all_sum_array` over jax.distributed's processes, exact in float64 whether or not
    jax_enable_x64 is on: each process's values travel as their float64 bits (uint32 pairs,
    which JAX does not cast) in one `multihost_utils.process_allgather`, and numpy adds them
    up in process order, so every process gets the same bits."""

    def all_sum_array(self, values):
        from jax.experimental import multihost_utils

        exact = np.ascontiguousarray(values, dtype=np.float64)
        bits = exact.reshape(-1).view(np.uint32)
        gathered = np.ascontiguousarray(multihost_utils.process_allgather(bits))
        per_process = gathered.view(np.float64).reshape(-1, *exact.shape)
        return per_process.sum(axis=0, dtype=np.float64)

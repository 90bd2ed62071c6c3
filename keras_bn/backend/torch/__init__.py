"""The PyTorch backend: keras_bn's maths in torch ops, with `torch.autograd.Function`.

Every name in keras_bn/backend/jax/__init__.py is here too, with the same signature (the
interface is listed in keras_bn/backend/__init__.py): keras_bn/backend/shared_maths.py holds
the batch norm's maths (the JAX backend's too), ops.py what is PyTorch's own (the
autograd.Function, torch.compile), fake_quant.py TensorFlow's FakeQuant kernels bit for bit.
Keras's PyTorch backend runs eagerly and has no distribution API: synchronized BN spans the
processes of torch.distributed's default group (distributed.py: `replica_context`,
`element_count`), whose statistics are already global, so `pool_statistics` pools nothing;
`compiled` and `specialized` return the function as it is.
"""

import torch

from keras_bn.backend import INTERFACE, shared_maths
from keras_bn.backend.shared_maths import *  # noqa: F403
from keras_bn.backend.torch import arrays
from keras_bn.backend.torch.arrays import statistics_dtype, torch_dtype
from keras_bn.backend.torch.distributed import *  # noqa: F403
from keras_bn.backend.torch.fake_quant import *  # noqa: F403
from keras_bn.backend.torch.ops import *  # noqa: F403

__all__ = list(INTERFACE)
shared_maths.register_arrays("torch", arrays)


def unit_affine(x, channel_axes, dtype):
    """Ones and zeros of x's per-channel shape (γ = 1, β = 0: x̂ itself)."""
    shape = [x.shape[a] for a in channel_axes]
    dtype = torch_dtype(dtype)
    return torch.ones(shape, dtype=dtype, device=x.device), torch.zeros(
        shape, dtype=dtype, device=x.device
    )


def input_moments(x, channel_axes, mask=None):
    """(mean, biased variance) per channel of a BN's input, kept broadcastable to x: the
    layer's own moments (what `recalibrate` records), without recording a graph for them."""
    with torch.no_grad():
        return shared_maths.moments(x, channel_axes, mask)


def compiled(function, **options):
    """`function` run eagerly without recording an autograd graph: the passes given here
    (recalibration's, check_batchnorm's) are never differentiated, and their outputs go to
    numpy, which refuses a tensor that requires grad. No torch.compile: it would cost a
    compilation for every new shape, for passes run a few hundred times."""
    del options
    return torch.no_grad()(function)


def cond(flag, compute, otherwise):
    """compute() where the scalar `flag` is true, else otherwise() (`arrays.cond`: one branch
    runs, as with tf.cond)."""
    return arrays.cond(flag, compute, otherwise)

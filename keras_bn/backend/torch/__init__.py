"""The PyTorch backend: keras_bn's maths in torch ops, with `torch.autograd.Function`.

Every name in keras_bn/backend/jax/__init__.py is here too, with the same signature (the
interface is listed in keras_bn/backend/__init__.py): ops.py holds the batch norm's maths,
fake_quant.py TensorFlow's FakeQuant kernels bit for bit. Keras's PyTorch backend runs
eagerly and has no replicas: `replica_context` is None, `pool_statistics` pools nothing, and
`compiled` and `specialized` return the function as it is.
"""

import contextlib

import keras
import torch

from keras_bn.backend import INTERFACE
from keras_bn.backend.torch.fake_quant import (
    activation_step,
    fake_quant_activations,
    fake_quant_weights,
    halves_away_from_int8_zero,
    round_bias,
    weight_max_abs,
    weight_step,
)
from keras_bn.backend.torch.ops import (
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
    torch_dtype,
    unbiased_estimates,
    usable,
    zero_unless_enough,
)

__all__ = list(INTERFACE)


def is_floating(x):
    """Whether x is a floating-point tensor."""
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(x.dtype))


def read(variable):
    """A variable's value as a tensor (its torch.nn.Parameter: what a later `assign` changes
    in place, so the callers read it where they use it)."""
    return variable.value


def unit_affine(x, channel_axes, dtype):
    """Ones and zeros of x's per-channel shape (γ = 1, β = 0: x̂ itself)."""
    shape = [x.shape[a] for a in channel_axes]
    dtype = torch_dtype(dtype)
    return torch.ones(shape, dtype=dtype, device=x.device), torch.zeros(
        shape, dtype=dtype, device=x.device
    )


def reshape_like(y, x):
    """y reshaped to x's shape."""
    return torch.reshape(y, x.shape)


def input_moments(x, channel_axes, mask=None):
    """(mean, biased variance) per channel of a BN's input, kept broadcastable to x: the
    layer's own moments (what `recalibrate` records), without recording a graph for them."""
    with torch.no_grad():
        return moments(x, channel_axes, mask)


def local_copies(variable, strategy=None):
    """The variable itself: PyTorch's Keras backend has one copy of each."""
    del strategy
    return [variable]


def compiled(function, **options):
    """`function` run eagerly without recording an autograd graph: the passes given here
    (recalibration's, check_batchnorm's) are never differentiated, and their outputs go to
    numpy, which refuses a tensor that requires grad. No torch.compile: it would cost a
    compilation for every new shape, for passes run a few hundred times."""
    del options
    return torch.no_grad()(function)


def name_scope(name):
    """No graph to name under eager PyTorch."""
    del name
    return contextlib.nullcontext()


def add(x, y):
    """x + y broadcast as numpy does."""
    return torch.add(x, y)


def fused_layout(x, channel_axes, epsilon):
    """None: TensorFlow's fused kernels do not exist here."""
    del x, channel_axes, epsilon
    return None


def cond(flag, compute, otherwise):
    """compute() where the scalar `flag` is true, else otherwise(): one branch runs, as with
    tf.cond (keras.ops.cond, which takes the first on the "meta" device of Keras's shape
    inference, where the flag has no value)."""
    return keras.ops.cond(flag, compute, otherwise)


def specialized(function, signatures):
    """`function` itself: `compiled` traces nothing under PyTorch."""
    del signatures
    return function

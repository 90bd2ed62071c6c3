"""The array functions that keras_bn/backend/shared_maths.py is written in, in torch (the JAX
ones are keras_bn/backend/jax/arrays.py; the names and signatures match). PyTorch runs
eagerly: each is one torch call, and `cond` a Python branch."""

import keras
import torch
from torch import add, all, any, broadcast_to, isfinite, reshape, rsqrt, sqrt, square, stack, where

# The arrays these functions take, for `shared_maths.arrays_of`.
ARRAY_TYPE = torch.Tensor
# Whether recomputing an elementwise value where it is read is free: eager torch
# writes every intermediate out in full, so it is not.
FUSES_ELEMENTWISE = False


def affine(x, a, b):
    """x·a + b, the sum taken in place in the product's new tensor: the same values, and on a
    CPU a second new full-size tensor cost more than the sum itself (its fresh memory's page
    faults: torch.profiler, 256x128x512, 15 ms against 3 ms for the in-place sum)."""
    return torch.mul(x, a).add_(b)


def torch_dtype(dtype):
    """A dtype as torch's: a torch.dtype as it is, a name ("float32") or numpy dtype looked up
    (the variables' dtypes are Keras's names)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, keras.backend.standardize_dtype(dtype))


def statistics_dtype(dtype):
    """float64 for float64 inputs, else float32 (16-bit statistics overflow and round)."""
    return torch.float64 if torch_dtype(dtype) == torch.float64 else torch.float32


def as_array(value, like):
    """`value` (a mask, numpy or torch) as a tensor on `like`'s device."""
    return torch.as_tensor(value, device=like.device)


def astype(x, dtype):
    """x in `dtype` (a torch dtype, Keras's name of one, or `bool`)."""
    return x.to(torch_dtype(dtype))


def expand_dims(x, axis):
    return x.unsqueeze(axis)


def sum(x, axes, keepdims=False):
    return torch.sum(x, axes, keepdim=keepdims)


def mean(x, axes, keepdims=False):
    return torch.mean(x, axes, keepdim=keepdims)


def amin(x):
    """The least element (NaN where x holds one)."""
    return torch.amin(x)


def amax(x):
    """The greatest element (NaN where x holds one)."""
    return torch.amax(x)


def minimum(x, y):
    """min(x, y) elementwise, y a number (torch.minimum of its tensor, as keras.ops's)."""
    return torch.minimum(x, torch.as_tensor(y, dtype=x.dtype, device=x.device))


def maximum(x, y):
    """max(x, y) elementwise, y a number (torch.maximum of its tensor, as keras.ops's)."""
    return torch.maximum(x, torch.as_tensor(y, dtype=x.dtype, device=x.device))


def at_least(x, floor):
    """max(x, floor) elementwise (NaN stays NaN)."""
    return torch.clamp(x, min=floor)


def clip(x, low, high):
    """x clipped to [low, high], either bound None for none (torch.clamp refuses two Nones)."""
    if low is None and high is None:
        return x
    return torch.clamp(x, min=low, max=high)


def cond(flag, compute, otherwise):
    """compute() where the scalar `flag` is true, else otherwise(): eagerly a Python branch,
    so the branch not taken costs nothing. Under torch.compile a select of both: reading the
    flag in Python would break the graph at every call (and wait for the device). On the
    "meta" device of Keras's shape inference the flag has no value: otherwise() there (both
    give the same shapes)."""
    if torch.compiler.is_compiling():
        return torch.utils._pytree.tree_map(
            lambda chosen, other: torch.where(flag, chosen, other), compute(), otherwise()
        )
    if flag.device.type != "meta" and bool(flag):
        return compute()
    return otherwise()


def constant_for_the_shift(t):
    """t without gradient: the shifted sums are identities in the shift K (∂/∂K of
    K + Σ(x − K)/m is 0), so the moments' autograd gradient is the same without it, and
    cheaper."""
    return t.detach()


def stop_gradient(t):
    return t.detach()


def materialized(*per_channel):
    """The values as they are: eager torch computes each once (XLA's fusion, which the JAX
    backend's barrier stops, does not happen here)."""
    return per_channel[0] if len(per_channel) == 1 else per_channel

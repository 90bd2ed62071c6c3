"""keras_bn.BatchNormalization's maths under the PyTorch backend: what is PyTorch's own.

The maths is keras_bn/backend/shared_maths.py's, shared with the JAX backend (the formulas are
in its docstring); here is the `torch.autograd.Function` that gives `batch_norm_train` its
hand-written backward, and what depends on PyTorch: weights as tensors on Keras's device,
torch.compile (where a batch size is traced), and the moving statistics' counter and plain
average.

PyTorch runs eagerly: shapes are concrete, so m is a Python int unless a mask makes it per
channel, and a static m ≤ 1 is the caller's ValueError, in `fit` too (as torch.nn.BatchNorm
raises), except under torch.compile, where it is run-time data as in JAX's traced `fit`.
Tensors made here go to the device of the tensor they serve, or Keras's (`keras.ops`).
"""

import keras
import torch

from keras_bn.backend import INTERFACE, shared_maths
from keras_bn.backend.torch.arrays import statistics_dtype, torch_dtype


def parameter(variable, default, shape, dtype):
    """A weight's value in `dtype`, or the constant standing for it when disabled (None)."""
    dtype = torch_dtype(dtype)
    if variable is None:
        return keras.ops.full(tuple(shape), default, dtype=keras.backend.standardize_dtype(dtype))
    return variable.value.to(dtype)


def batch_size_traced(x, channel_axes):
    """Whether torch.compile is tracing x with its batch axis 0 reduced: there, as in JAX's
    traced `fit`, an m ≤ 1 is run-time data (the channel outputs β). Eager calls, `fit`'s
    included, see the concrete batch: a batch of one there is a ValueError, as in
    torch.nn.BatchNorm."""
    return torch.compiler.is_compiling() and 0 not in channel_axes


def run_time_count(count, shape, dtype):
    """A static m as a per-channel tensor of `shape`, for the guards that run at run time."""
    return keras.ops.full(tuple(shape), count, dtype=keras.backend.standardize_dtype(dtype))


class _Normalize(torch.autograd.Function):
    """y = γ·x̂ + β with the paper's backward (`shared_maths.normalize_backward`); the
    statistics carry no gradient."""

    @staticmethod
    def forward(ctx, x, gamma, beta, mask, channel_axes, epsilon):
        outputs, saved = shared_maths.normalize_forward(x, gamma, beta, mask, channel_axes, epsilon)
        *tensors, count = saved
        # autograd saves tensors only: a Python int m rides on ctx.
        counted = None if isinstance(count, int) else count
        ctx.save_for_backward(*tensors, counted)
        ctx.channel_axes, ctx.count = channel_axes, count if counted is None else None
        ctx.mark_non_differentiable(outputs[1], outputs[2])
        return outputs

    @staticmethod
    def backward(ctx, dy, d_mean, d_variance):
        del d_mean, d_variance  # non-differentiable outputs
        *tensors, counted = ctx.saved_tensors
        saved = (*tensors, ctx.count if counted is None else counted)
        dx, d_gamma, d_beta = shared_maths.normalize_backward(dy, saved, ctx.channel_axes)
        return dx, d_gamma, d_beta, None, None, None


def batch_norm_train(
    x, gamma, beta, channel_axes, epsilon, mask=None, fused=None, replica_context=None
):
    """Train-mode batch normalization with the hand-written backward (`_Normalize`): the
    arguments and results of the JAX backend's `batch_norm_train`, in tensors; `fused` and
    `replica_context` unused (one path, no replicas)."""
    del fused, replica_context
    x = x.to(statistics_dtype(x.dtype))
    return _Normalize.apply(x, gamma, beta, mask, tuple(channel_axes), float(epsilon))


def batch_norm_eval(x, mean, variance, gamma, beta, channel_axes, epsilon):
    """Inference BN, y = (x − mean)·a + β with a = γ/√(variance + ε): `shared_maths`'s
    order of operations (x − mean first, exact far from zero), with the product and sum taken
    in the difference's new tensor (`torch.addcmul(..., out=)`), so that it writes one
    full-size tensor, as the folded a·x + b did; where autograd records (a gradient through
    an inference call), which `out=` does not allow, in a second one."""
    x = x.to(statistics_dtype(x.dtype))
    a = gamma * torch.rsqrt(variance + epsilon)
    difference = torch.sub(x, shared_maths.per_channel(mean, x, channel_axes))
    terms = (
        shared_maths.per_channel(beta, x, channel_axes),
        difference,
        shared_maths.per_channel(a, x, channel_axes),
    )
    if torch.is_grad_enabled() and any(t.requires_grad for t in terms):
        return torch.addcmul(*terms)
    return torch.addcmul(*terms, out=difference)


def cumulative_average(old, value, seen, update):
    """The plain average after `seen` counted batches takes `value` with weight 1/(seen + 1),
    where `update`: n/(n+1) and 1/(n+1) divided in float64, then cast, as the TensorFlow
    backend does (formed in float32, n/(n+1) would round to 1 from n = 2²⁴ and the average
    stop)."""
    n = torch.as_tensor(seen).to(torch.float64)
    keep, weight = (n / (n + 1.0)).to(old.dtype), (1.0 / (n + 1.0)).to(old.dtype)
    return torch.where(update, keep * old + weight * value, old)


def counter_dtype():
    """`num_batches_tracked`'s dtype (torch.nn.BatchNorm's too)."""
    return "int64"


# The interface's functions (keras_bn/backend/__init__.py) defined here, which the backend
# package imports with `*`.
__all__ = [name for name in INTERFACE if name in globals()]

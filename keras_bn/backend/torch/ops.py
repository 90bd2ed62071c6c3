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

from keras_bn.backend import INTERFACE, constants, shared_maths
from keras_bn.backend.torch import distributed
from keras_bn.backend.torch.arrays import statistics_dtype, torch_dtype


@torch.library.custom_op("keras_bn::snapshot", mutates_args=())
def _snapshot(value: torch.Tensor) -> torch.Tensor:
    """A copy of `value`, as an op that torch.compile's partitioner saves for the backward
    rather than recomputes there (it is not on its list of recomputable ops)."""
    return value.clone()


@_snapshot.register_fake
def _(value):
    return torch.empty_like(value)


_snapshot.register_autograd(lambda ctx, grad: grad)


def read(variable):
    """A variable's value as a tensor (its torch.nn.Parameter: what a later `assign` changes
    in place, so the callers read it where they use it). Under torch.compile a snapshot of
    a non-trainable one (a moving statistic, a range, renorm's averages: what a step assigns):
    AOTAutograd's partitioner recomputed such a read in the backward, after the step's
    `assign` had changed it, which gave gradients 2–6% off (a QAT step, renorm) with no
    error. A clone, or a copy into a new tensor, does not stop it: inductor reads through
    them to the input (pytorch/pytorch#197039). A trainable weight, which the optimizer
    assigns after the backward, is read as it is: AOTAutograd then sees the backward depend
    on it, and refuses a double backward with its own clear error. Nor where no backward
    is recorded (grad off), nor under `torch.export`, whose program would then need keras_bn
    imported to load."""
    if (
        torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()
        and torch.is_grad_enabled()
        and not variable.trainable
    ):
        return _snapshot(variable.value)
    return variable.value


def statistics_update():
    """The context of the moving statistics' update: no autograd recording. Nothing
    differentiates it, and under torch.compile its reads then need no snapshot (`read`),
    which made a compiled ResNet step 10% slower."""
    return torch.no_grad()


def parameter(variable, default, shape, dtype):
    """A weight's value in `dtype` (`read`: renorm's averages, updated later in the step,
    gave a compiled backward r and d from after the update), or the constant standing for
    it when disabled (None)."""
    dtype = torch_dtype(dtype)
    if variable is None:
        return keras.ops.full(tuple(shape), default, dtype=keras.backend.standardize_dtype(dtype))
    return read(variable).to(dtype)


def batch_size_traced(x, channel_axes):
    """Whether torch.compile is tracing x with its batch axis 0 reduced: there, as in JAX's
    traced `fit`, an m ≤ 1 is run-time data (the channel outputs β). Eager calls, `fit`'s
    included, see the concrete batch: a batch of one there is a ValueError, as in
    torch.nn.BatchNorm."""
    return torch.compiler.is_compiling() and 0 not in channel_axes


def run_time_count(count, shape, dtype):
    """A static m as a per-channel tensor of `shape`, for the guards that run at run time."""
    return keras.ops.full(tuple(shape), count, dtype=keras.backend.standardize_dtype(dtype))


class _NormalizeCompiled(torch.autograd.Function):
    """y = γ·x̂ + β with the paper's backward (`shared_maths.normalize_backward`); the
    statistics carry no gradient.

    Higher-order gradients: the first-order backward reads the per-channel values the forward
    saved, computed without autograd history. Where the backward is itself differentiated
    (`create_graph=True`, `torch.func.grad`, `gradgradcheck`: grad mode is on in the
    backward), it recomputes the moments from x − K instead, with autograd recording. x − K
    (K, the shift, is a constant: x̂ does not depend on it) is therefore an output of this
    Function, ∂(x − K)/∂x = 1 added in `backward`, so that it keeps its history to x without
    saving x itself (the tensor saved is the one the forward made anyway). γ is saved as the
    input it is. `jvp` is forward mode's closed form (`torch.func.jvp`,
    `torch.autograd.forward_ad`). Written in the `setup_context` style, which torch.func
    requires; `vmap` maps slices that are batches of their own."""

    @staticmethod
    def forward(x, gamma, beta, mask, channel_axes, epsilon):
        outputs, saved = shared_maths.normalize_forward(x, gamma, beta, mask, channel_axes, epsilon)
        difference, scale, shift, offset, inv, _, count = saved
        # Every value the backward reads is an output (setup_context sees only these): x − K
        # differentiable, the rest marked non-differentiable; a Python int m rides as it is.
        return (*outputs, difference, scale, shift, offset, inv, count)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, gamma, _, mask, channel_axes, epsilon = inputs
        _, mean, variance, difference, scale, shift, offset, inv, count = output
        counted = count if isinstance(count, torch.Tensor) else None
        ctx.save_for_backward(difference, gamma, scale, shift, offset, inv, mask, counted)
        ctx.save_for_forward(difference, gamma, offset, inv, mask, counted)
        ctx.channel_axes, ctx.epsilon = channel_axes, epsilon
        ctx.count = count if counted is None else None
        ctx.mark_non_differentiable(
            *(t for t in (mean, variance, scale, shift, offset, inv, counted) if t is not None)
        )
        # None, not zeros, for the gradients of unused outputs: x − K's is full size.
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dy, d_mean, d_variance, d_difference, *_per_channel):
        del d_mean, d_variance  # non-differentiable outputs
        difference, gamma, scale, shift, offset, inv, mask, counted = ctx.saved_tensors
        count = ctx.count if counted is None else counted
        dx = d_gamma = d_beta = None
        if dy is not None:
            if torch.is_grad_enabled():  # the backward is differentiated: recompute with history
                saved = _differentiable_saved(
                    difference, gamma, mask, count, ctx.channel_axes, ctx.epsilon
                )
            else:
                saved = (difference, scale, shift, offset, inv, mask, count)
            dx, d_gamma, d_beta = shared_maths.normalize_backward(dy, saved, ctx.channel_axes)
        if d_difference is not None:  # ∂(x − K)/∂x = 1
            dx = d_difference if dx is None else dx + d_difference
        return dx, d_gamma, d_beta, None, None, None


class _Normalize(_NormalizeCompiled):
    """`_NormalizeCompiled` with forward mode and `torch.func.vmap`: what runs eagerly.
    torch.compile cannot trace a Function that defines `jvp` (a graph break at every call),
    so under it `batch_norm_train` applies `_NormalizeCompiled`."""

    @staticmethod
    def jvp(ctx, x_t, gamma_t, beta_t, *_constants):
        """Forward mode: with ẋ, γ̇, β̇ the tangents and sums over the kept values,
        μ̇ = Σẋ/m and ẏ = γ̇·x̂ + β̇ + γ·inv·(ẋ − μ̇ − x̂·Σx̂·ẋ/m); x − K's is ẋ."""
        difference, gamma, offset, inv, mask, counted = ctx.saved_tensors
        count = ctx.count if counted is None else counted
        axes = shared_maths.reduction_axes(difference.ndim, ctx.channel_axes)
        x_hat = (difference - offset) * inv
        if x_t is None:
            x_t = torch.zeros_like(difference)
        kept = x_t if mask is None else torch.where(mask > 0, x_t, 0.0)
        m = count if mask is None else torch.clamp(count, min=1.0)
        mean_t = torch.sum(kept, axes, keepdim=True) / m
        x_hat_t = torch.sum(x_hat * kept, axes, keepdim=True) / m  # Σx̂·ẋ/m
        y_t = (shared_maths.per_channel(gamma, difference, ctx.channel_axes) * inv) * (
            x_t - mean_t - x_hat * x_hat_t
        )
        if gamma_t is not None:
            y_t = y_t + x_hat * shared_maths.per_channel(gamma_t, difference, ctx.channel_axes)
        if beta_t is not None:
            y_t = y_t + shared_maths.per_channel(beta_t, difference, ctx.channel_axes)
        # The non-differentiable outputs (the statistics, the saved values) get no tangent.
        return y_t, None, None, x_t, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, gamma, beta, mask, channel_axes, epsilon):
        """`torch.func.vmap`: each mapped slice is its own batch with its own statistics, so
        the mapped axis joins the channel axes, as axis 0 of every tensor."""

        def leading(t, dim, shape):
            if t is None:
                return None
            return t.movedim(dim, 0) if dim is not None else t.expand(info.batch_size, *shape)

        x_dim, gamma_dim, beta_dim, mask_dim = in_dims[:4]
        x_shape = x.shape if x_dim is None else x.movedim(x_dim, 0).shape[1:]
        param_shape = gamma.shape if gamma_dim is None else gamma.movedim(gamma_dim, 0).shape[1:]
        x = leading(x, x_dim, x_shape)
        if mask is not None:
            mask = mask.movedim(mask_dim, 0) if mask_dim is not None else mask.unsqueeze(0)
        outputs = _Normalize.apply(
            x,
            leading(gamma, gamma_dim, param_shape),
            leading(beta, beta_dim, param_shape),
            mask,
            (0, *(a + 1 for a in channel_axes)),
            epsilon,
        )
        return outputs, tuple(0 if isinstance(t, torch.Tensor) else None for t in outputs)


def _differentiable_saved(difference, gamma, mask, count, channel_axes, epsilon):
    """`normalize_forward`'s saved values recomputed from x − K with autograd recording, so
    that the backward built from them is differentiable in x (through x − K) and γ: the
    forward's shifted sums about the same K (`shared_maths.centered_moments`, whose K was
    already close enough to the mean), the same operations in the same order."""
    axes = shared_maths.reduction_axes(difference.ndim, channel_axes)
    if mask is None:
        centered, divisor = difference, count
    else:
        centered = torch.where(mask > 0, difference, 0.0)
        divisor = torch.clamp(count, min=1.0)
    offset = torch.sum(centered, axes, keepdim=True) / divisor
    variance = torch.sum(torch.square(centered), axes, keepdim=True) / divisor
    inv = torch.rsqrt(torch.clamp(variance - torch.square(offset), min=0.0) + epsilon)
    scale = shared_maths.per_channel(gamma, difference, channel_axes) * inv
    # The shift is unused where x − K is saved (torch's `normalize_backward`).
    return difference, scale, None, offset, inv, mask, count


def batch_norm_train(
    x, gamma, beta, channel_axes, epsilon, mask=None, fused=None, replica_context=None
):
    """Train-mode batch normalization with the hand-written backward (`_Normalize`): the
    arguments and results of the JAX backend's `batch_norm_train`, in tensors; `fused`
    unused (one path). With a `replica_context` (synchronized BN under torch.distributed,
    distributed.py) the statistics and the backward's sums span every process."""
    del fused
    x = x.to(statistics_dtype(x.dtype))
    if replica_context is not None:
        return distributed.batch_norm_train_synchronized(
            x, gamma, beta, channel_axes, epsilon, mask, replica_context
        )
    function = _NormalizeCompiled if torch.compiler.is_compiling() else _Normalize
    outputs = function.apply(x, gamma, beta, mask, tuple(channel_axes), float(epsilon))
    return outputs[:3]  # y, mean, variance; the rest is what the backward reads


def batch_norm_eval(x, mean, variance, gamma, beta, channel_axes, epsilon):
    """Inference BN, y = (x − mean)·a + β with a = γ/√(variance + ε).

    On a CPU, where no channel is far from zero (`constants.EVAL_RECENTRE_STDDEVS`, a check of
    the statistics that costs no device sync there) and the channels are axis 1 or a 4D/5D
    input's last (a channels-last view), `F.batch_norm`'s one-pass fold a·x + (β − a·mean):
    within a few roundings of the output's scale there, and 2-5× faster than two elementwise
    passes. Elsewhere `shared_maths`'s order of operations (x − mean first, exact far from
    zero), the product and sum taken in the difference's new tensor (`torch.addcmul(...,
    out=)`), so that it writes one full-size tensor; where autograd records (a gradient
    through an inference call) or under torch.func's transforms, which `out=` does not
    allow, in a second one. Under torch.compile, which fuses the three ops into one loop,
    under torch.jit.trace and torch.func, and on other devices (where the check would wait
    for the device), always the latter.

    The fold's error is about (|mean|/σ + 1)·|γ|·2⁻²⁴, a few roundings of |γ| where it is
    taken: of the output's scale where the data spreads as its statistics say; where the
    data sits within a small fraction of σ of the mean, the exact form's error is smaller
    still, relative to that narrower output."""
    x = x.to(statistics_dtype(x.dtype))
    # Under torch.func's transforms (vmap, jvp, grad) neither the test's bool nor `out=` is
    # allowed: x − mean first, in a new tensor. (Dynamo would break the graph at the test
    # of a wrapper; under torch.compile the fold is not taken anyway.)
    transformed = not torch.compiler.is_compiling() and any(
        map(_functorch_wrapped, (x, mean, variance, gamma, beta))
    )
    channels_second = None if transformed else _channels_second(x, channel_axes)
    if channels_second is not None and not _far_from_zero(x, mean, variance, epsilon):
        y = torch.nn.functional.batch_norm(
            channels_second, mean, variance, gamma, beta, False, 0.0, epsilon
        )
        return y.movedim(1, channel_axes[0])
    a = gamma * torch.rsqrt(variance + epsilon)
    difference = torch.sub(x, shared_maths.per_channel(mean, x, channel_axes))
    terms = (
        shared_maths.per_channel(beta, x, channel_axes),
        difference,
        shared_maths.per_channel(a, x, channel_axes),
    )
    if transformed or (torch.is_grad_enabled() and any(t.requires_grad for t in terms)):
        return torch.addcmul(*terms)
    return torch.addcmul(*terms, out=difference)


def _functorch_wrapped(tensor):
    """Whether `tensor` is one of torch.func's wrappers (a vmap batch, a jvp dual, a grad
    input)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def _channels_second(x, channel_axes):
    """x as F.batch_norm's (N, C, ...) without a copy, where its kernel reads that view in one
    pass: channels on axis 1, or on a contiguous 4D/5D input's last axis (a view in PyTorch's
    channels_last memory format); else None. None under torch.jit.trace too, which would
    record the test's outcome as a constant of the traced graph."""
    if x.device.type != "cpu" or len(channel_axes) != 1:
        return None
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None
    axis = channel_axes[0] % x.ndim
    if x.ndim >= 2 and axis == 1:
        return x
    if x.ndim in (4, 5) and axis == x.ndim - 1 and x.is_contiguous():
        return x.movedim(axis, 1)
    return None


def _far_from_zero(x, mean, variance, epsilon):
    """Whether inference must take x − mean first: some channel's |mean| exceeds
    `EVAL_RECENTRE_STDDEVS`·√(variance + ε), or a statistic needs a gradient (F.batch_norm
    gives its running statistics none), or x is empty."""
    if mean.requires_grad or variance.requires_grad or x.numel() == 0:
        return True
    limit = constants.EVAL_RECENTRE_STDDEVS * torch.sqrt(variance + epsilon)
    return bool(torch.any(torch.abs(mean) > limit))


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

"""Synchronized batch normalization under torch.distributed: SyncBatchNorm's semantics.

With `synchronized=True` and a default process group of two or more processes, a training
call normalizes every process's share of the batch with the statistics of the whole batch:
each process's count m_i, mean μ_i and biased variance σ²_i per channel are merged by count
in float64 (Chan, Golub & LeVeque 1983: μ = Σ m_i·μ_i / m, σ² = Σ m_i·(σ²_i + (μ_i − μ)²) / m,
m = Σ m_i), so shares of unequal size are right and no E[x²] − E[x]² cancels. The backward
sums Σg and Σg·x̂ over the processes for ∂l/∂x, as the forward's statistics span them; ∂l/∂γ
and ∂l/∂β stay each process's own (the caller all-reduces them with every other gradient, as
DistributedDataParallel does). The moving statistics move by the global m and statistics, so
they are equal on every process. Without a process group, or in a world of one, it is plain
batch normalization. Every process must make the same synchronized calls: a collective that
some processes skip waits for them (gloo and NCCL time out after the process group's
`timeout`).
"""

import torch
import torch.distributed as dist

from keras_bn.backend import INTERFACE, shared_maths


class ProcessGroup:
    """The replica context of synchronized BN under torch.distributed: the default group."""

    def __init__(self) -> None:
        self.size = dist.get_world_size()

    def all_sum_array(self, values):
        """A float64 numpy array summed over the processes (one all-reduce), on a device the
        group's backend serves (NCCL serves CUDA tensors only)."""
        total = torch.as_tensor(values, dtype=torch.float64).contiguous().to(_device())
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.cpu().numpy()

    def all_sum(self, *tensors):
        """Each tensor summed over the processes, in float64, cast back to its dtype (one
        all-reduce for all of them, which must have one shape)."""
        packed = torch.stack([t.to(torch.float64) for t in tensors])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        return tuple(total.to(t.dtype) for total, t in zip(packed, tensors))


def _device():
    """The CPU where the default group's backend serves it (gloo, "cpu:gloo,cuda:nccl"), else
    this process's CUDA device (NCCL)."""
    config = str(dist.get_backend_config())
    serves_cpu = "cpu:" in config or (":" not in config and config != "nccl")
    return torch.device("cpu") if serves_cpu else torch.device("cuda", torch.cuda.current_device())


def recalibration_processes():
    """The `ProcessGroup` whose processes `recalibrate(synchronized=True)` pools over: the
    default group of two or more processes, else None (this process's data alone)."""
    return replica_context()


def replica_context():
    """A `ProcessGroup` when torch.distributed runs two or more processes, else None (plain
    BN)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    return ProcessGroup()


def element_count(x, channel_axes, mask=None, replica_context=None):
    """m: this call's count (`shared_maths.element_count`), summed over the processes under
    synchronized BN (a Python int without a mask, m_c per channel with one)."""
    count = shared_maths.element_count(x, channel_axes, mask)
    if replica_context is None:
        return count
    if isinstance(count, int):
        (total,) = replica_context.all_sum(torch.tensor(float(count), device=x.device))
        return round(float(total))
    (total,) = replica_context.all_sum(count)
    return total


def pooled_moments(x, channel_axes, mask, group):
    """(x − K, Δμ = μ − K, σ², μ, m) of synchronized BN, μ, σ² and m the global batch's:
    this process's shifted moments about its own K, merged with the others' by count in
    float64 (μ and σ² are then the same bits on every process; Δμ is this process's)."""
    axes = shared_maths.reduction_axes(x.ndim, channel_axes)
    local = shared_maths.element_count(x, channel_axes, mask)
    shift, offset, variance, difference = shared_maths.centered_moments(
        x, axes, mask, local, with_difference=True
    )
    m_i = torch.broadcast_to(torch.as_tensor(local, dtype=torch.float64), shift.shape)
    m_i = m_i.to(shift.device)
    # An empty share has no K (NaN): 0 keeps Δμ, and the backward's Δμ·Σg, finite there.
    shift = torch.where(m_i > 0, shift, 0.0)
    # K + Δμ in float64: far from zero their float32 sum would lose digits the others keep.
    mean_i = torch.where(m_i > 0, shift.to(torch.float64) + offset.to(torch.float64), 0.0)
    m, weighted = group.all_sum(m_i, m_i * mean_i)
    mean = weighted / torch.clamp(m, min=1.0)
    spread = torch.where(m_i > 0, m_i * (variance.to(torch.float64) + (mean_i - mean) ** 2), 0.0)
    (total,) = group.all_sum(spread)
    global_variance = (total / torch.clamp(m, min=1.0)).to(x.dtype)
    global_offset = (mean - shift.to(torch.float64)).to(x.dtype)
    count = m.to(x.dtype) if mask is not None else round(float(m.flatten()[0]))
    return difference, global_offset, global_variance, mean.to(x.dtype), count


class SynchronizedNormalize(torch.autograd.Function):
    """y = γ·x̂ + β over the whole process group's batch, with the paper's backward
    (`shared_maths.normalize_backward`) whose sums are all-reduced. First order only: a
    backward that is itself differentiated raises."""

    @staticmethod
    def forward(ctx, x, gamma, beta, mask, channel_axes, epsilon, group):
        difference, offset, variance, mean, count = pooled_moments(x, channel_axes, mask, group)
        inv = torch.rsqrt(variance + epsilon)
        scale = shared_maths.per_channel(gamma, x, channel_axes) * inv
        bias = shared_maths.per_channel(beta, x, channel_axes) - offset * scale
        y = difference * scale + bias
        counted = count if isinstance(count, torch.Tensor) else None
        ctx.save_for_backward(difference, scale, offset, inv, mask, counted)
        ctx.count, ctx.channel_axes, ctx.group = count, channel_axes, group
        mean = torch.reshape(mean, gamma.shape)
        variance = torch.reshape(variance, gamma.shape)
        ctx.mark_non_differentiable(mean, variance)
        return y, mean, variance

    @staticmethod
    def backward(ctx, dy, d_mean, d_variance):
        del d_mean, d_variance  # non-differentiable outputs
        if torch.is_grad_enabled():
            raise RuntimeError(
                "keras_bn.BatchNormalization(synchronized=True) under torch.distributed has "
                "first-order gradients only: a gradient penalty (create_graph=True) through it "
                "is not supported. Use synchronized=False for that loss."
            )
        difference, scale, offset, inv, mask, counted = ctx.saved_tensors
        count = ctx.count if counted is None else counted
        saved = (difference, scale, None, offset, inv, mask, count)
        dx, d_gamma, d_beta = shared_maths.normalize_backward(
            dy, saved, ctx.channel_axes, ctx.group.all_sum
        )
        return dx, d_gamma, d_beta, None, None, None, None


def batch_norm_train_synchronized(x, gamma, beta, channel_axes, epsilon, mask, group):
    """(y, mean, variance) of synchronized BN over `group`'s processes."""
    return SynchronizedNormalize.apply(
        x, gamma, beta, mask, tuple(channel_axes), float(epsilon), group
    )


# The interface's functions (keras_bn/backend/__init__.py) defined here, which the backend
# package imports with `*` after shared_maths, so that these replace its no-replica ones.
__all__ = [name for name in INTERFACE if name in globals()]

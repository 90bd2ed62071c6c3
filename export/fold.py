"""Batch-norm folding maths: pure numpy, one function per host kind, no Keras graph code.

Inference BN is a per-channel affine map y = scale·x + shift, with scale = γ/√(Var + ε) and
shift = β − scale·E[x] (`keras_bn._graph.bn_layers.inference_affine`). Folding it into a
linear neighbour ("host") is therefore exact.

Backward fold (host → BN): BN(host(x)) = scale·(W∗x + b) + shift, so every output channel o of
the kernel is multiplied by scale[o] and the new bias is scale·b + shift. Only where the output
channel sits in the kernel differs between hosts; the `fold_*` functions say which.

Forward fold (BN → host): host(scale·x + shift) = (W·scale)∗x + (b + Σ W·shift). This is
exact only when every kernel tap sees a BN output, never added zero padding: Dense, or a conv
with padding="valid".

Every `fold_*` function takes the host's Keras kernel and bias (None when use_bias=False: the
folded layer gains a bias) and returns the new (kernel, bias) as float arrays of the kernel's
dtype.

int8 readiness: a fold scales whole channels, so channels of one kernel may end up with very
different ranges. `output_channel_ranges` / `input_channel_ranges` give max |w| per channel and
`channel_spread` their max / min, which the fold report compares with a threshold.
"""

import numpy as np
import numpy.typing as npt


def fold_dense(
    kernel: npt.ArrayLike, bias: npt.ArrayLike | None, scale: npt.ArrayLike, shift: npt.ArrayLike
) -> tuple[np.ndarray, np.ndarray]:
    """Dense → BN. Kernel (in, out): output channel on the last axis."""
    return _fold_output_axis(kernel, bias, scale, shift, axis=-1)


def fold_conv(
    kernel: npt.ArrayLike, bias: npt.ArrayLike | None, scale: npt.ArrayLike, shift: npt.ArrayLike
) -> tuple[np.ndarray, np.ndarray]:
    """Conv1D/2D/3D → BN, any groups and data format. Kernel (*k, in/groups, out)."""
    return _fold_output_axis(kernel, bias, scale, shift, axis=-1)


def fold_conv_transpose(
    kernel: npt.ArrayLike, bias: npt.ArrayLike | None, scale: npt.ArrayLike, shift: npt.ArrayLike
) -> tuple[np.ndarray, np.ndarray]:
    """Conv1D/2D/3DTranspose → BN. Kernel (*k, out, in): output channel on axis −2."""
    return _fold_output_axis(kernel, bias, scale, shift, axis=-2)


def fold_depthwise(
    kernel: npt.ArrayLike, bias: npt.ArrayLike | None, scale: npt.ArrayLike, shift: npt.ArrayLike
) -> tuple[np.ndarray, np.ndarray]:
    """DepthwiseConv1D/2D → BN. Kernel (*k, C, M); output channel c·M + m.

    All C·M scales are used: reshaping them to (C, M) lines each one up with its own filter
    (a fold that only reads the first C scales is wrong whenever M > 1).
    """
    kernel = np.asarray(kernel)
    channels, multiplier = kernel.shape[-2:]
    scale, shift = _check_per_channel(scale, shift, channels * multiplier, "depthwise C·M")
    new_kernel = kernel * scale.reshape(channels, multiplier)
    return new_kernel.astype(kernel.dtype), _fold_bias(bias, scale, shift, kernel.dtype)


def fold_separable(
    pointwise_kernel: npt.ArrayLike,
    bias: npt.ArrayLike | None,
    scale: npt.ArrayLike,
    shift: npt.ArrayLike,
) -> tuple[np.ndarray, np.ndarray]:
    """SeparableConv1D/2D → BN: the pointwise kernel (1[, 1], C·M, out) is the one scaled.

    The depthwise kernel is unchanged; returns the new (pointwise_kernel, bias).
    """
    return _fold_output_axis(pointwise_kernel, bias, scale, shift, axis=-1)


def fold_forward(
    kernel: npt.ArrayLike,
    bias: npt.ArrayLike | None,
    scale: npt.ArrayLike,
    shift: npt.ArrayLike,
    groups: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """BN → Dense, or BN → Conv1D/2D/3D with padding="valid" (kernel (*k, in/groups, out)).

    With g groups, output channel o reads input channels (o // (out/g))·(in/g) + j for the
    kernel's input index j, so the per-input-channel scale and shift are laid out to match.
    """
    kernel = _check_kernel(kernel, groups)
    per_group_in, out = kernel.shape[-2:]
    scale, shift = _check_per_channel(scale, shift, per_group_in * groups, "input")
    # (groups, in/g) → one column per output channel: column o holds its group's channels.
    group_of_output = np.arange(out) // (out // groups)
    scale_io = scale.reshape(groups, per_group_in)[group_of_output].T
    shift_io = shift.reshape(groups, per_group_in)[group_of_output].T
    new_kernel = kernel * scale_io
    old_bias = np.zeros(out) if bias is None else np.asarray(bias, np.float64)
    spatial_axes = tuple(range(kernel.ndim - 2))
    new_bias = old_bias + (kernel.astype(np.float64).sum(axis=spatial_axes) * shift_io).sum(0)
    return new_kernel.astype(kernel.dtype), new_bias.astype(kernel.dtype)


def _fold_output_axis(
    kernel: npt.ArrayLike,
    bias: npt.ArrayLike | None,
    scale: npt.ArrayLike,
    shift: npt.ArrayLike,
    axis: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Backward fold for kernels whose output channels lie on one axis."""
    kernel = _check_kernel(kernel)
    scale, shift = _check_per_channel(scale, shift, kernel.shape[axis], f"kernel axis {axis}")
    shape = [1] * kernel.ndim
    shape[axis] = -1
    new_kernel = kernel * scale.reshape(shape)
    return new_kernel.astype(kernel.dtype), _fold_bias(bias, scale, shift, kernel.dtype)


def _check_kernel(kernel: npt.ArrayLike, groups: int = 1) -> np.ndarray:
    """`kernel` as an array; a ValueError unless it has 2+ dimensions and `groups` divides its
    (last-axis) output channels."""
    kernel = np.asarray(kernel)
    if kernel.ndim < 2:
        raise ValueError(f"A kernel needs at least 2 dimensions; received shape {kernel.shape}.")
    if groups < 1 or kernel.shape[-1] % groups:
        raise ValueError(
            f"groups={groups} does not divide the kernel's {kernel.shape[-1]} output channels "
            f"(kernel shape {kernel.shape})."
        )
    return kernel


def _fold_bias(
    bias: npt.ArrayLike | None, scale: np.ndarray, shift: np.ndarray, dtype: npt.DTypeLike
) -> np.ndarray:
    """scale·b + shift, where a missing bias is zero."""
    if bias is None:
        return shift.astype(dtype)
    bias = np.asarray(bias)
    if bias.shape != scale.shape:
        raise ValueError(
            f"The bias has shape {bias.shape}, but the batch norm has {scale.shape[0]} channels."
        )
    return (scale * bias + shift).astype(dtype)


def _check_per_channel(
    scale: npt.ArrayLike, shift: npt.ArrayLike, channels: int, where: str
) -> tuple[np.ndarray, np.ndarray]:
    scale = np.asarray(scale, np.float64)
    shift = np.asarray(shift, np.float64)
    for name, value in (("scale", scale), ("shift", shift)):
        if value.shape != (channels,):
            raise ValueError(
                f"The batch norm's {name} has shape {value.shape}, but the host has {channels} "
                f"channels on its {where} axis."
            )
        if not np.all(np.isfinite(value)):
            raise ValueError(f"The batch norm's {name} is not finite: {value}.")
    return scale, shift


# The kernel layouts `output_channel_ranges` knows: where a host's output channels lie.
LAST, TRANSPOSE, DEPTHWISE = "last", "transpose", "depthwise"


def output_channel_ranges(kernel: npt.ArrayLike, layout: str = LAST) -> np.ndarray:
    """max |w| of each output channel of a (folded) kernel, in float64.

    Args:
        kernel: the host's kernel.
        layout: where its output channels lie: "last" (Dense (in, out), Conv (*k, in/g, out),
            a SeparableConv's pointwise kernel), "transpose" (ConvTranspose (*k, out, in): axis
            −2) or "depthwise" (DepthwiseConv (*k, C, M): channel c·M + m, C·M in all).

    Returns:
        A 1-D float64 array, one entry per output channel (NaN where a weight is NaN).

    Raises:
        ValueError: an unknown layout, or a kernel with fewer than 2 dimensions.
    """
    kernel = np.abs(_check_kernel(kernel).astype(np.float64))
    if layout == DEPTHWISE:
        kernel = kernel.reshape(*kernel.shape[:-2], -1)
    elif layout == TRANSPOSE:
        kernel = np.moveaxis(kernel, -2, -1)
    elif layout != LAST:
        raise ValueError(
            f"layout must be one of {(LAST, TRANSPOSE, DEPTHWISE)}; received layout={layout!r}."
        )
    # np.max propagates NaN (a NaN weight must never read as a small range); initial=0 for
    # a kernel with no taps.
    return np.max(kernel.reshape(-1, kernel.shape[-1]), axis=0, initial=0.0)


def input_channel_ranges(kernel: npt.ArrayLike, groups: int = 1) -> np.ndarray:
    """max |w| of each input channel of a Dense or Conv kernel, in float64: what a forward
    fold scales.

    Args:
        kernel: (*k, in/groups, out).
        groups: the layer's groups. Input channel (group i, index j) is read by the kernel's
            index j of group i's output channels only, as in `fold_forward`.

    Returns:
        A 1-D float64 array of in/groups·groups entries (NaN where a weight is NaN).

    Raises:
        ValueError: a kernel with fewer than 2 dimensions, or groups that do not divide its
            output channels.
    """
    kernel = np.abs(_check_kernel(kernel, groups).astype(np.float64))
    per_group_in, out = kernel.shape[-2:]
    # (..., in/g, g, out/g) → group-major input channels (g, in/g), as fold_forward lays out.
    by_group = kernel.reshape(-1, per_group_in, groups, out // groups)
    return np.max(by_group, axis=(0, 3), initial=0.0).T.reshape(-1)


def channel_spread(ranges: npt.ArrayLike) -> float:
    """max / min of per-channel ranges (max |w| per channel): how many times finer the
    smallest channel's weights are than the largest's, where all share one int8 scale.

    Channels whose weights are all exactly zero are left out: int8 represents them exactly,
    whatever the scale (a pruned or γ = 0 channel loses nothing), so they carry no risk. A
    tiny but non-zero channel counts, and its spread is huge: per-tensor int8 rounds it to 0.

    Args:
        ranges: max |w| per channel (`output_channel_ranges`, `input_channel_ranges`).

    Returns:
        A float ≥ 1: 1.0 when fewer than two channels are non-zero; inf when a range is
        infinite; NaN when a range is NaN. Compare with `not spread <= threshold`, so that
        NaN never reads as fine.
    """
    ranges = np.asarray(ranges, np.float64).reshape(-1)
    if np.isnan(ranges).any():
        return float("nan")
    nonzero = ranges[ranges != 0]
    if nonzero.size < 2:
        return 1.0
    largest, smallest = nonzero.max(), nonzero.min()
    if np.isinf(largest):
        return float("inf")
    return float(largest / smallest)

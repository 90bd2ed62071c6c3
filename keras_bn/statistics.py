"""Per-channel batch statistics: the moments, the count m, masks and per-channel shapes.

Notation (Ioffe & Szegedy 2015; docs/architecture.md, "The maths"). For one channel, over the
m elements reduced (batch × spatial, or the unmasked ones under a mask):

    μ = Σx / m,   σ² = Σ(x − μ)² / m          (biased: this is what normalizes)

The variance is always computed about the mean, never as E[x²] − E[x]² (which cancels
catastrophically and has produced negative variances in Keras and XLA). It is the corrected
two-pass algorithm (Chan, Golub & LeVeque 1983): with c = x − mean(x) from the first pass,
σ² = mean(c²) − mean(c)², where mean(c) is the first pass's rounding error, so the second term
is tiny and corrects the float32 error of a mean taken over large offsets.

All functions take `channel_axes`: the sorted, non-negative axes that are *not* reduced.
Per-channel tensors (γ, β, μ, σ²) have the shape of those axes' dimensions, as the layer's
weights do.

This module is the leaf the three train paths (keras_bn/fused.py, keras_bn/xla.py,
keras_bn/composite.py) and keras_bn/ops.py share: it imports only TensorFlow.
"""

import tensorflow as tf


def reduction_axes(rank, channel_axes):
    """The axes a batch norm reduces over: every axis that is not a channel axis."""
    return [i for i in range(rank) if i not in channel_axes]


def _broadcast_shape(x, channel_axes):
    """Shape that lines a per-channel tensor up with `x`: channel dims kept, others 1."""
    static = x.shape
    dims = [static[i] if i in channel_axes else 1 for i in range(static.rank)]
    if all(d is not None for d in dims):
        return dims
    dynamic = tf.shape(x)
    return [dynamic[i] if i in channel_axes else 1 for i in range(static.rank)]


def per_channel(t, x, channel_axes):
    """A per-channel tensor `t` reshaped to broadcast against `x` (channel dims kept, others 1)."""
    return tf.reshape(t, _broadcast_shape(x, channel_axes))


def expand_mask(mask, x, channel_axes):
    """A mask over the non-channel axes, as a 0/1 tensor of x's dtype broadcastable to x.

    The mask has the rank of x's shape without the channel axes, and each of its dimensions is
    that dimension of x or 1 (it broadcasts, as Keras's masks do): for one trailing channel
    axis, `x.shape[:-1]` or e.g. (batch, 1, ...). A lower rank is refused rather than aligned
    from the right, which would silently pair a per-sample mask with another axis. Non-zero
    values count as True, as in Keras. The result takes the statistics dtype (float16 cannot
    count past 2048 exactly) and the full non-channel shape, so that summing it counts m.
    """
    mask = tf.convert_to_tensor(mask)
    rank = x.shape.rank
    if mask.shape.rank != rank - len(channel_axes):
        raise ValueError(
            f"The mask must have the input's shape without its channel axes: input shape "
            f"{x.shape}, channel axes {list(channel_axes)}, so a mask of rank "
            f"{rank - len(channel_axes)}; received a mask of shape {mask.shape}."
        )
    axes = reduction_axes(rank, channel_axes)
    expected = [x.shape[i] for i in axes]
    for got, want in zip(mask.shape, expected):
        if got is not None and want is not None and got not in (want, 1):
            raise ValueError(
                f"The mask's shape {mask.shape} does not match the input's non-channel "
                f"dimensions {expected} (input shape {x.shape}): each dimension must be "
                f"that size or 1."
            )
    if mask.dtype != tf.bool:
        mask = tf.cast(mask, tf.bool)
    if mask.shape.as_list() != expected or None in expected:
        mask = tf.broadcast_to(mask, tf.gather(tf.shape(x), axes))
    for axis in channel_axes:
        mask = tf.expand_dims(mask, axis)
    return tf.cast(mask, statistics_dtype(x.dtype))


def element_count(x, channel_axes, mask=None, replica_context=None):
    """m: how many elements each channel's statistics are taken over.

    A Python int when the shape is static, there is no mask and no replica context (so callers
    can check it at trace time); otherwise a scalar tensor of `statistics_dtype(x.dtype)`,
    which may be 0 or 1 (see `divisor`). `mask` is the output of `expand_mask`. With a
    `replica_context` (synchronized BN) it is the count over every replica's batch.
    """
    axes = reduction_axes(x.shape.rank, channel_axes)
    dims = [x.shape[i] for i in axes]
    if mask is not None:
        local = tf.reduce_sum(mask)
    elif all(d is not None for d in dims):
        local = 1
        for d in dims:
            local *= d
    else:
        local = tf.reduce_prod(tf.gather(tf.shape(x), axes))
    if replica_context is None and isinstance(local, int):
        return local
    local = tf.cast(local, statistics_dtype(x.dtype))
    if replica_context is None:
        return local
    return replica_context.all_reduce(tf.distribute.ReduceOp.SUM, local)


def divisor(count):
    """`element_count` as a divisor: a run-time m of 0 (a fully masked batch) divides as 1, so
    its statistics and gradient are 0 rather than NaN. Such a batch (any m ≤ 1) outputs β and
    leaves the moving statistics alone; see BatchNormalization."""
    return count if isinstance(count, int) else tf.maximum(count, tf.ones_like(count))


def channel_sums(tensors, axes, mask=None, replica_context=None):
    """Per-channel sums over the reduced axes (of the unmasked elements), added up across
    replicas in one batched all-reduce when a replica context is given.

    Masked-out elements are selected away, not multiplied by 0: padding may hold NaN or inf
    (0·NaN = NaN), and must not reach the statistics (as in Keras, which selects too).
    """
    if mask is not None:
        keep = mask > 0
        tensors = [tf.where(keep, t, tf.zeros_like(t)) for t in tensors]
    sums = [tf.reduce_sum(t, axes, keepdims=True) for t in tensors]
    if replica_context is not None:
        sums = replica_context.all_reduce(tf.distribute.ReduceOp.SUM, sums)
    return sums


def moments(x, channel_axes, mask=None, replica_context=None):
    """Per-channel mean and biased variance (corrected two-pass), kept broadcastable to x.

    With a replica context the sums run over every replica's batch: the global statistics.
    """
    axes = reduction_axes(x.shape.rank, channel_axes)
    if mask is None and replica_context is None:

        def average(*tensors):
            return [tf.reduce_mean(t, axes, keepdims=True) for t in tensors]
    else:
        count = divisor(element_count(x, channel_axes, mask, replica_context))

        def average(*tensors):
            return [s / count for s in channel_sums(tensors, axes, mask, replica_context)]

    (shift,) = average(x)
    centered = x - shift
    residual, mean_square = average(centered, tf.square(centered))  # residual: pass 1's error
    variance = tf.maximum(mean_square - tf.square(residual), 0.0)
    return shift + residual, variance


def statistics_dtype(dtype):
    """float16/bfloat16 statistics overflow and lose precision: they are kept in float32."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32

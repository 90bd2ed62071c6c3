"""Per-channel batch statistics: the moments, the count m, masks and per-channel shapes.

Notation (Ioffe & Szegedy 2015; docs/architecture.md, "The maths"). For one channel, over the
m elements reduced (batch × spatial, or the unmasked ones under a mask, whose count m_c may
differ per channel; see `expand_mask`):

    μ = Σx / m,   σ² = Σ(x − μ)² / m          (biased: this is what normalizes)

The variance is always computed about the mean, never as E[x²] − E[x]² (which cancels
catastrophically and has produced negative variances in Keras and XLA). It is the corrected
two-pass algorithm (Chan, Golub & LeVeque 1983): with c = x − mean(x) from the first pass,
σ² = mean(c²) − mean(c)², where mean(c) is the first pass's rounding error, so the second term
is tiny and corrects the float32 error of a mean taken over large offsets.

All functions take `channel_axes`: the sorted, non-negative axes that are *not* reduced.
Per-channel tensors (γ, β, μ, σ²) have the shape of those axes' dimensions, as the layer's
weights do.

This module is the leaf the three train paths (fused.py, xla.py, composite.py) and ops.py of
this backend share.
"""

import tensorflow as tf

from keras_bn._axes import mask_axes, reduction_axes


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


def expand_mask(mask, x, channel_axes, channel_reading=True):
    """A mask as a 0/1 tensor of x's rank and statistics dtype, broadcastable to x.

    A mask covers some axes of x, in order (`keras_bn._axes.mask_axes` says which), and
    broadcasts over the others. Non-zero values count as True, as in Keras. The result has the
    statistics dtype (float16 cannot count past 2048 exactly).

    Args:
        mask: the mask, of any dtype.
        x: the input it masks.
        channel_axes: sorted non-negative channel axes of x.
        channel_reading: whether reading 2 is allowed (keras_bn's layer); False for
            `keras.layers.BatchNormalization`, which has only Keras's reading.

    Returns:
        The mask as 0/1 of x's rank, size 1 on the axes it broadcasts over.

    Raises:
        ValueError: the mask fits no allowed reading; the message names each reading's shape.
    """
    mask = tf.convert_to_tensor(mask)
    covered = mask_axes(mask.shape, x.shape, channel_axes, channel_reading)
    if mask.dtype != tf.bool:
        mask = tf.cast(mask, tf.bool)
    for axis in range(x.shape.rank):
        if axis not in covered:
            mask = tf.expand_dims(mask, axis)
    return tf.cast(mask, statistics_dtype(x.dtype))


def element_count(x, channel_axes, mask=None, replica_context=None):
    """m: how many elements each channel's statistics are taken over.

    Without a mask every channel has the same m: a Python int when the shape is static and
    there is no replica context (so callers can check it at trace time), else a scalar tensor
    of `statistics_dtype(x.dtype)`. With a mask (the output of `expand_mask`) the counts m_c
    may differ per channel: a tensor of the per-channel shape broadcastable to x (channel
    dims kept, others 1), each count the broadcast mask's True positions in that channel. A
    count may be 0 or 1 at run time (see `divisor`). With a `replica_context` (synchronized
    BN) it is the count over every replica's batch.
    """
    axes = reduction_axes(x.shape.rank, channel_axes)
    dims = [x.shape[i] for i in axes]
    if mask is not None:
        local = tf.reduce_sum(mask, axes, keepdims=True)
        # A size-1 mask dimension stands for every position of x's axis that it covers.
        mask_shape, x_shape = tf.shape(mask), tf.shape(x)
        for axis in axes:
            local *= tf.cast(tf.where(mask_shape[axis] == 1, x_shape[axis], 1), local.dtype)
        local = tf.broadcast_to(local, _broadcast_shape(x, channel_axes))
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
    """`element_count` as a divisor: a run-time m of 0 (a fully masked batch or channel)
    divides as 1, so its statistics and gradient are 0 rather than NaN. Such a channel (any
    m_c ≤ 1) outputs β and its moving statistics are left alone; see BatchNormalization."""
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

    Under a mask each channel's moments are over its own unmasked values (its count m_c).
    With a replica context the sums run over every replica's batch: the global statistics.
    """
    shift, residual, variance = centered_moments(x, channel_axes, mask, replica_context)
    return shift + residual, variance


def centered_moments(x, channel_axes, mask=None, replica_context=None):
    """`moments` in parts: (shift, residual, variance), with mean = shift + residual.

    The shift is the first pass's mean and the residual the second pass's correction to it
    (its rounding error). Centre x as (x − shift) − residual, never as x − mean: far from zero
    the mean itself rounds (by ~6e-5 at 1e3 in float32), which x − mean would carry into every
    output, while x − shift is exact there and the residual is small.
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
    return shift, residual, variance


def statistics_dtype(dtype):
    """float16/bfloat16 statistics overflow and lose precision: they are kept in float32."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32

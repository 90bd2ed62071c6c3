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
this backend share; it imports only the leaf placement.py. Its sums are `blocked_sum`'s, whose
float32 rounding does not grow with the count.
"""

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla as tf2xla

from keras_bn.backend.axes import mask_axes, reduction_axes
from keras_bn.backend.constants import SHIFT_SAMPLES
from keras_bn.backend.tensorflow import placement

# The most terms one stage of `blocked_sum` adds up (where the shape allows). A float32 sum of
# 4096 N(0, 1) squares was off by at most 4e-7 (TF 2.21, CPU); accumulated in one stage, 2²⁰ of
# them were off by 4.8e-4 (reduce_sum) and 1.4e-5 (XLA:CPU).
SUM_BLOCK = 4096


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

    A mask covers some axes of x, in order (`keras_bn.backend.axes.mask_axes` says which), and
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
    sums = [blocked_sum(t, axes) for t in tensors]
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


def shift_estimate(x, reduced):
    """K: each channel's mean over the first SHIFT_SAMPLES positions of the first reduced axis
    (index 0 of the others), per-channel shaped, in x's dtype: a shift within a few σ of the
    mean, taken from a few values, so exact where the batch's own sums are not. A batch may
    be empty (known at run time, or traced with a size 0): it is padded by one, so that the
    shift is then 0 and the statistics NaN (so the layer leaves its moving statistics alone),
    as on the other paths.
    """
    rank = x.shape.rank
    first = reduced[0]
    # At least 1: the pad below is then what an empty batch's shift is taken from.
    samples = tf.clip_by_value(tf.shape(x)[first], 1, SHIFT_SAMPLES)
    if any(x.shape[a] in (None, 0) for a in reduced):
        x = tf.pad(x, [[0, 1] if a in reduced else [0, 0] for a in range(rank)])
    size = [samples if a == first else 1 if a in reduced else -1 for a in range(rank)]
    head = tf.slice(x, [0] * rank, tf.stack(size))
    # Each term divided before the sum, which then cannot overflow where the values do not.
    return tf.reduce_sum(head / tf.cast(samples, x.dtype), axis=reduced, keepdims=True)


def moments_about(x, channel_axes, shift):
    """Per-channel mean and biased variance from one pass of blocked sums of t = x − shift:
    μ = K + Σt/m and σ² = Σt²/m − (Σt/m)², kept broadcastable to x.

    Exact to float32 rounding at any count when the shift is close to the mean (within a few
    σ; the fused kernel's own mean is), as in the corrected two-pass formula.

    Args:
        x: the batch (no mask, one device).
        channel_axes: sorted non-negative axes that are not reduced.
        shift: per-channel values near the mean, in the statistics dtype.
    """
    axes = reduction_axes(x.shape.rank, channel_axes)
    dtype = statistics_dtype(x.dtype)
    count = tf.cast(element_count(x, channel_axes), dtype)
    shifted = tf.cast(x, dtype) - per_channel(tf.cast(shift, dtype), x, channel_axes)
    offset, mean_square = [blocked_sum(t, axes) / count for t in (shifted, tf.square(shifted))]
    return per_channel(shift, x, channel_axes) + offset, mean_square - tf.square(offset)


def centered_moments(x, channel_axes, mask=None, replica_context=None):
    """`moments` in parts: (shift, residual, variance), with mean = shift + residual.

    The shift is the first pass's mean and the residual the second pass's correction to it
    (its rounding error). Centre x as (x − shift) − residual, never as x − mean: far from zero
    the mean itself rounds (by ~6e-5 at 1e3 in float32), which x − mean would carry into every
    output, while x − shift is exact there and the residual is small.
    """
    axes = reduction_axes(x.shape.rank, channel_axes)
    if mask is None and replica_context is None:
        count = element_count(x, channel_axes)

        def average(*tensors):
            return [blocked_sum(t, axes) / tf.cast(count, t.dtype) for t in tensors]
    else:
        count = divisor(element_count(x, channel_axes, mask, replica_context))

        def average(*tensors):
            return [s / count for s in channel_sums(tensors, axes, mask, replica_context)]

    (shift,) = average(x)
    centered = x - shift
    residual, mean_square = average(centered, tf.square(centered))  # residual: pass 1's error
    variance = tf.maximum(mean_square - tf.square(residual), 0.0)
    return shift, residual, variance


def blocked_sum(t, axes):
    """Σt over `axes` (kept, so broadcastable to t), added up in stages of at most about
    `SUM_BLOCK` terms where the shape allows, so that its float32 rounding stays bounded as
    the count m grows.

    Accumulated term after term, a sum of m terms is off by up to ~m·u of its size (u = 2⁻²⁴):
    TensorFlow's CPU reduce_sum over x's reduced axes was off by 6e-5 at m = 2¹⁸ and 4.8e-4 at
    2²⁰. Summed in two stages, b terms and then the m/b partial sums, it is off by ~(b + m/b)·u
    at most, and measured 2e-7–5e-7 at both counts. The stages:

    - the reduced axes but the first (each sample's H×W values in NHWC or NCHW; blocked again,
      recursively, where they hold more than SUM_BLOCK), then the first (the batch);
    - a single reduced axis of static size above SUM_BLOCK is split (a free reshape) into
      blocks of its largest divisor up to SUM_BLOCK; one with no such divisor, or a size known
      only at run time, is summed in one stage.

    Under XLA an optimization barrier keeps the stages apart: XLA's simplifier merges a
    reduce of a reduce into one (and the error was then the one-stage one, 1.4e-5 at 2²⁰).
    """
    axes = sorted(axes)
    dims = [t.shape[a] for a in axes]
    if all(d is not None for d in dims) and _product(dims) <= SUM_BLOCK:
        return tf.reduce_sum(t, axes, keepdims=True)
    if len(axes) == 1:
        return _blocked_axis_sum(t, axes[0])
    inner = axes[1:]
    if (
        all(t.shape[a] is not None for a in inner)
        and _product(t.shape[a] for a in inner) <= SUM_BLOCK
    ):
        partial = tf.reduce_sum(t, inner, keepdims=True)
    else:
        partial = blocked_sum(t, inner)
    if placement.in_xla_context():
        partial = _barrier(partial)
    return tf.reduce_sum(partial, axes[:1], keepdims=True)


@tf.custom_gradient
def _barrier(t):
    """XLA's optimization barrier, the identity to the gradient (TensorFlow registers none for
    it: a QAT layer under XLA differentiates through its batch statistics)."""
    (kept,) = tf2xla.optimization_barrier(t)
    return kept, lambda upstream: upstream


def _blocked_axis_sum(t, axis):
    """`blocked_sum` over the one `axis`: split into (size/b, b), b its largest divisor up to
    SUM_BLOCK, when the size is static."""
    size = t.shape[axis]
    block = next((b for b in range(min(size or 1, SUM_BLOCK), 1, -1) if size % b == 0), 1)
    if block == 1:
        return tf.reduce_sum(t, axis, keepdims=True)
    shape = [d if d is not None else tf.shape(t)[i] for i, d in enumerate(t.shape)]
    split = tf.reshape(t, shape[:axis] + [size // block, block] + shape[axis + 1 :])
    return tf.reshape(blocked_sum(split, [axis, axis + 1]), shape[:axis] + [1] + shape[axis + 1 :])


def _product(dims):
    result = 1
    for d in dims:
        result *= d
    return result


def statistics_dtype(dtype):
    """float16/bfloat16 statistics overflow and lose precision: they are kept in float32."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32

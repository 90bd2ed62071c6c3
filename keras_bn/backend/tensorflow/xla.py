"""Train-mode batch normalization written for XLA on CPU.

The maths is the composite path's (see composite.py); only the arrangement differs,
because XLA:CPU (TensorFlow 2.21) never fuses a reduction with the expression it sums: every
Σf(x) writes f(x) out and reads it back. Three arrangements avoid that, and the train step then
reads x three times (forward sums; backward Σg and Σg·x̂; ∂l/∂x), the floor for a backward that
needs two global sums before ∂l/∂x:

- A sum over the reduced axes starts as a tree of adds over `GROUPS` equal slices of one reduced
  axis (not the minor one). That is elementwise work, which XLA fuses with the summand; a small
  reduce_sum finishes the partials, 1/GROUPS of the size.
- Both sums of a pass come from one read: the two summands are stacked on a new leading axis of
  size 2 with tf.where. (A concat would not fuse; a new minor axis of size 2 fuses but breaks
  the vectorised loop over x's minor axis: 0-30% slower on bench_layer.py's shapes.)
- The summands are computed per slice, from slices of x, each used twice. Computed once for the
  whole tensor, a summand feeds 2·GROUPS consumers, and XLA writes out a producer with more than
  15 (measured at GROUPS = 8).
- Only per-channel values are saved; the backward recomputes x̂ from x.
- The reduce_sum that finishes the partials is `statistics.blocked_sum`'s, in stages of at most
  about 4096 terms, whose float32 rounding does not grow with the count.

The moments are shifted sums about K, each channel's mean over a few samples (Chan, Golub &
LeVeque 1983): with t = x − K, μ = K + Σt/m and σ² = Σt²/m − (Σt/m)². The second form loses
a factor of about 1 + (μ − K)²/σ² of float32 rounding, so when (μ − K)² > SHIFT_REDO_RATIO·σ² in
any channel, or σ² is not finite (Σt² overflowed), the pass is redone with K = μ, which makes it
the corrected two-pass algorithm. Outputs are computed as ((x − K) − Δμ)·inv with
Δμ = Σt/m, never with a large mean folded into an offset.

`ops.train_path` picks this path under XLA on a CPU (placement.py says where the graph
runs). This module imports only the leaf statistics.py of this backend.
"""

import tensorflow as tf

from keras_bn.backend.axes import reduction_axes
from keras_bn.backend.constants import SHIFT_REDO_RATIO
from keras_bn.backend.tensorflow.statistics import (
    blocked_sum,
    element_count,
    shift_estimate,
    statistics_dtype,
)

# Slices added elementwise before the reduce_sum: the partials are 1/GROUPS of x. 4 was as
# fast as 8 or faster on every shape of benchmarks/bench_layer.py (0-20%, interleaved runs),
# with a smaller program to compile; 2 was slower.
GROUPS = 4


def group_axis(shape, channel_axes):
    """The axis the sums are grouped along, or None when there is none: a reduced axis other
    than the minor one (slicing that would break XLA's vectorised loops); the first whose
    static size GROUPS divides, else the first (then padded, see `_paired_sums`)."""
    rank = len(shape)
    candidates = [a for a in reduction_axes(rank, channel_axes) if a != rank - 1]
    for a in candidates:
        if shape[a] is not None and shape[a] % GROUPS == 0:
            return a
    return candidates[0] if candidates else None


def batch_norm_train(x, gamma, beta, channel_axes, epsilon):
    """Train-mode BN with the contract of `ops.batch_norm_train` (no mask, one device).

    Args:
        x: floating tensor with a reduced axis other than its last (see `group_axis`).
        gamma, beta: per-channel scale and offset in `statistics_dtype(x.dtype)`.
        channel_axes: sorted non-negative axes that are not reduced.
        epsilon: added to the variance.

    Returns:
        (y, mean, variance): the output in the statistics dtype, and the per-channel mean and
        biased variance shaped like gamma, carrying no gradient.
    """
    x = tf.cast(x, statistics_dtype(x.dtype))
    sums = _grouped_sums(x, channel_axes)
    m = element_count(x, channel_axes)
    param_shape = tf.shape(gamma)

    @tf.custom_gradient
    def _normalize(x, gamma, beta):
        shift, offset, variance = _moments(x, channel_axes, m, sums)
        inv = tf.math.rsqrt(variance + epsilon)
        gamma_b = tf.reshape(gamma, tf.shape(shift))  # shift has the per-channel shape
        y = ((x - shift) - offset) * (inv * gamma_b) + tf.reshape(beta, tf.shape(shift))

        def grad(dy, *_unused_statistic_grads):
            def normalized(x):
                return ((x - shift) - offset) * inv

            sum_dy, sum_dy_xhat = sums(lambda dy, x: (dy, dy * normalized(x)), dy, x)
            dx = (gamma_b * inv) * (dy - (sum_dy + normalized(x) * sum_dy_xhat) / m)
            return dx, tf.reshape(sum_dy_xhat, param_shape), tf.reshape(sum_dy, param_shape)

        mean = tf.reshape(shift + offset, param_shape)
        return (y, mean, tf.reshape(variance, param_shape)), grad

    y, mean, variance = _normalize(x, gamma, beta)
    return y, tf.stop_gradient(mean), tf.stop_gradient(variance)


def moments(x, channel_axes):
    """Per-channel mean and biased variance of x (kept broadcastable), arranged for XLA:CPU:
    one fused read of x for the shifted sums, a second only where `SHIFT_REDO_RATIO` asks.

    recalibrate's recording (keras_bn/_recalibration/hooks.py) runs it as its own XLA cluster: the
    statistics at about a third of the cost of `statistics.moments`' unfused passes.

    Args:
        x: a float32 or float64 tensor with a reduced axis other than its last (`group_axis`).
        channel_axes: sorted non-negative axes that are not reduced.

    Returns:
        (mean, variance).
    """
    m = element_count(x, channel_axes)
    shift, offset, variance = _moments(x, channel_axes, m, _grouped_sums(x, channel_axes))
    return shift + offset, variance


def _grouped_sums(x, channel_axes):
    """`_paired_sums` over x's reduced axes, grouped along `group_axis`."""
    reduced = reduction_axes(x.shape.rank, channel_axes)
    axis = group_axis(x.shape, channel_axes)
    return lambda summands, *tensors: _paired_sums(summands, tensors, axis, reduced)


def _moments(x, channel_axes, m, sums):
    """(K, Δμ, σ²): the shifted sums about `statistics.shift_estimate`'s K, redone about the
    mean when K was too far from it (or σ² is not finite)."""
    reduced = reduction_axes(x.shape.rank, channel_axes)
    shift, offset, variance = _shifted_moments(x, shift_estimate(x, reduced), m, sums)
    return tf.cond(
        tf.reduce_any(
            (tf.square(offset) > SHIFT_REDO_RATIO * variance) | ~tf.math.is_finite(variance)
        ),
        lambda: _shifted_moments(x, shift + offset, m, sums),
        lambda: (shift, offset, variance),
    )


def _shifted_moments(x, shift, m, sums):
    """(K, Δμ, σ²) from one read of x: Δμ = Σ(x − K)/m, σ² = Σ(x − K)²/m − Δμ²."""

    def summands(x):
        t = x - shift
        return t, tf.square(t)

    sum_t, sum_t2 = sums(summands, x)
    offset = sum_t / m
    return shift, offset, tf.maximum(sum_t2 / m - tf.square(offset), 0.0)


def _paired_sums(summands, tensors, axis, reduced):
    """Per-channel sums, over `reduced` and kept broadcastable, of the two tensors that
    `summands` computes from `tensors` (of one shape), arranged so that XLA:CPU computes both in
    one fused read (see the module docstring): `summands` runs on each of GROUPS slices of the
    tensors along `axis`.
    """
    size = tensors[0].shape[axis]
    padded = size is None or size % GROUPS != 0
    if padded:  # zeros up to a multiple of GROUPS, weighted out of both sums below
        size = tf.shape(tensors[0])[axis]
        paddings = [[0, 0]] * tensors[0].shape.rank
        paddings[axis] = [0, (-size) % GROUPS]
        tensors = [tf.pad(t, paddings) for t in tensors]
        index_shape = [-1 if a == axis else 1 for a in range(tensors[0].shape.rank)]
        valid = tf.split(
            tf.reshape(tf.range(tf.shape(tensors[0])[axis]) < size, index_shape), GROUPS, axis
        )
    slices = [tf.split(t, GROUPS, axis) for t in tensors]
    first_of_pair = tf.reshape(tf.constant([True, False]), [2] + [1] * tensors[0].shape.rank)
    parts = []
    for group in range(GROUPS):
        first, second = summands(*(s[group] for s in slices))
        if padded:
            first, second = (tf.where(valid[group], t, 0.0) for t in (first, second))
        # The pair on a new leading axis: one read gives both, and x's minor axis stays minor.
        parts.append(tf.where(first_of_pair, first[None], second[None]))
    while len(parts) > 1:  # a balanced tree of elementwise adds: log2(GROUPS) levels
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    # Blocked: summed in one reduce, the float32 rounding grew with the count (1.2e-4 of σ²
    # at 2²⁰ values with K 2.9σ from the mean, against 5e-6 blocked).
    total = blocked_sum(parts[0], [a + 1 for a in reduced])
    return total[0], total[1]

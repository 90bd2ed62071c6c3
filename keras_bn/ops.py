"""Functional batch normalization: moments, the train-mode transform and the inference affine.

Notation (Ioffe & Szegedy 2015; docs/architecture.md, "The maths"). For one channel, over the
m elements reduced (batch × spatial, or the unmasked ones under a mask):

    μ = Σx / m,   σ² = Σ(x − μ)² / m          (biased: this is what normalizes)
    x̂ = (x − μ) / √(σ² + ε),   y = γ·x̂ + β

The backward pass is the closed form of the chain rule, with g = ∂l/∂y and inv = 1/√(σ² + ε):

    ∂l/∂β = Σg,   ∂l/∂γ = Σg·x̂,   ∂l/∂x = γ·inv·(g − w·(Σg + x̂·Σg·x̂) / m)

where w is the mask (1 everywhere without one). Sums run over every position, masked or not,
because every output depends on μ and σ². The statistics are outputs without gradient.

The variance is always computed about the mean, never as E[x²] − E[x]² (which cancels
catastrophically and has produced negative variances in Keras and XLA). It is the corrected
two-pass algorithm (Chan, Golub & LeVeque 1983): with c = x − mean(x) from the first pass,
σ² = mean(c²) − mean(c)², where mean(c) is the first pass's rounding error, so the second term
is tiny and corrects the float32 error of a mean taken over large offsets.

All functions take `channel_axes`: the sorted, non-negative axes that are *not* reduced.
Per-channel tensors (γ, β, μ, σ²) have the shape of those axes' dimensions, as the layer's
weights do.
"""

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from keras_bn import xla


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


def _per_channel(t, x, channel_axes):
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


def _channel_sums(tensors, axes, mask=None, replica_context=None):
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
            return [s / count for s in _channel_sums(tensors, axes, mask, replica_context)]

    (shift,) = average(x)
    centered = x - shift
    residual, mean_square = average(centered, tf.square(centered))  # residual: pass 1's error
    variance = tf.maximum(mean_square - tf.square(residual), 0.0)
    return shift + residual, variance


def statistics_dtype(dtype):
    """float16/bfloat16 statistics overflow and lose precision: they are kept in float32."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


# The smallest epsilon cuDNN accepts; below it the fused kernel would silently change ε on GPU.
_FUSED_MIN_EPSILON = 1.001e-5


def _in_xla_context():
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def fused_data_format(x, channel_axes, epsilon, mask=None):
    """ "NHWC" or "NCHW" when FusedBatchNormV3 can compute this batch norm exactly on a 4D view
    of x (one channel axis, last or second; no mask; a 16/32-bit float), else None.

    Never under XLA: XLA lowers the kernel's training mode to E[x²] − E[x]², whose float32
    variance was off by a factor of thousands at a mean of 1e3 and std of 1e-2 (TF 2.21). Under
    XLA, `train_path` picks keras_bn/xla.py's arrangement on CPU, the composite path elsewhere.
    """
    if (
        _in_xla_context()
        or mask is not None
        or len(channel_axes) != 1
        or x.dtype not in (tf.float16, tf.bfloat16, tf.float32)
        or epsilon < _FUSED_MIN_EPSILON
    ):
        return None
    rank, channel = x.shape.rank, channel_axes[0]
    if rank >= 2 and channel == rank - 1:
        return "NHWC"
    if rank >= 3 and channel == 1:
        return "NCHW"
    return None


def _fused_view(x, data_format):
    """x as the 4D tensor the kernel expects; a reshape, so free (no data movement)."""
    if x.shape.rank == 4:
        return x
    if data_format == "NHWC":  # (..., C) -> (M, 1, 1, C)
        return tf.reshape(x, [-1, 1, 1, x.shape[-1]])
    return tf.reshape(x, [tf.shape(x)[0], x.shape[1], -1, 1])  # (N, C, ...) -> (N, C, R, 1)


def train_path(x, channel_axes, epsilon, mask=None, fused=None, replica_context=None):
    """Which implementation `batch_norm_train` runs: "fused", "xla_cpu" or "composite".

    "fused" where `fused_data_format` allows (never under XLA); "xla_cpu" under XLA on a CPU
    (see keras_bn/xla.py; its arrangement is tuned to XLA:CPU's fusion rules, so other devices
    keep the composite path until measured there) without a mask or synchronized replicas, when
    x has a reduced axis other than its last; "composite" everywhere else. `fused=False` always
    gives "composite"; `fused=True` raises where "fused" does not apply.
    """
    if fused is not False and replica_context is None:
        if fused_data_format(x, channel_axes, epsilon, mask) is not None:
            return "fused"
        if (
            fused is None
            and mask is None
            and xla.group_axis(x.shape, channel_axes) is not None
            and _in_xla_context()
            and xla.runs_on_cpu()
        ):
            return "xla_cpu"
    if fused:
        raise ValueError(
            f"The fused batch-norm kernel does not apply here: input shape {x.shape}, dtype "
            f"{x.dtype.name}, channel axes {list(channel_axes)}, epsilon {epsilon}, "
            f"mask {'given' if mask is not None else 'none'}, XLA {_in_xla_context()}, "
            f"synchronized {replica_context is not None}."
        )
    return "composite"


def batch_norm_train(
    x, gamma, beta, channel_axes, epsilon, mask=None, fused=None, replica_context=None
):
    """Train-mode batch normalization with a hand-written gradient.

    Three implementations of the same maths, chosen by `train_path`. Where the layout allows
    (see `fused_data_format`) the forward pass is TensorFlow's FusedBatchNormV3 kernel and the
    backward pass its FusedBatchNormGradV3, fed the saved reserve spaces; that is 2-3× faster
    than composite ops. Under XLA on a CPU, `xla.batch_norm_train` arranges the same sums so
    that XLA fuses them (3 reads of x per train step). Everywhere else (masks, synchronized
    replicas, other devices under XLA, other layouts) the composite path below computes the
    moments two-pass and the closed-form gradient of the module docstring.

    Args:
        x: floating tensor. float16/bfloat16 statistics are computed in float32.
        gamma, beta: per-channel scale and offset in `statistics_dtype(x.dtype)` (pass ones /
            zeros when disabled).
        channel_axes: sorted non-negative axes that are not reduced.
        epsilon: added to the variance.
        mask: optional output of `expand_mask`; masked-out elements do not enter μ or σ².
        fused: None picks the implementation (`train_path`); False forces the composite path;
            True requires the fused kernel (ValueError where it does not apply).
        replica_context: synchronized BN. The statistics, m, and the backward pass's Σg and
            Σg·x̂ are all-reduced over the replicas, so each replica's y and ∂l/∂x are its slice
            of single-device BN on the global batch; ∂l/∂γ and ∂l/∂β stay per replica, because
            the optimizer's all-reduce adds them up. Always the composite path.

    Returns:
        (y, mean, variance): the normalized output (x's dtype on the fused path, the
        statistics dtype on the others) and the batch's per-channel mean and biased
        variance, shaped like gamma and carrying no gradient.

    Raises:
        ValueError: `fused=True` where the fused kernel does not apply.
    """
    path = train_path(x, channel_axes, epsilon, mask, fused, replica_context)
    if path == "fused":
        data_format = fused_data_format(x, channel_axes, epsilon, mask)
        return _fused_train(x, gamma, beta, channel_axes, epsilon, data_format)
    if path == "xla_cpu":
        return xla.batch_norm_train(x, gamma, beta, channel_axes, epsilon)
    return _composite_train(x, gamma, beta, channel_axes, epsilon, mask, replica_context)


def _fused_train(x, gamma, beta, channel_axes, epsilon, data_format):
    empty = tf.constant([], gamma.dtype)

    @tf.custom_gradient
    def _normalize(x4, gamma, beta):
        y, mean, unbiased_variance, saved_1, saved_2, saved_3 = tf.raw_ops.FusedBatchNormV3(
            x=x4,
            scale=gamma,
            offset=beta,
            mean=empty,
            variance=empty,
            epsilon=epsilon,
            exponential_avg_factor=1.0,
            data_format=data_format,
            is_training=True,
        )

        def grad(dy, *_unused_statistic_grads):
            dx, dgamma, dbeta, _, _ = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=dy,
                x=x4,
                scale=gamma,
                reserve_space_1=saved_1,
                reserve_space_2=saved_2,
                reserve_space_3=saved_3,
                epsilon=epsilon,
                data_format=data_format,
                is_training=True,
            )
            return dx, dgamma, dbeta

        return (y, mean, unbiased_variance), grad

    y, mean, unbiased_variance = _normalize(_fused_view(x, data_format), gamma, beta)
    # The kernel reports the Bessel-corrected variance on every device (its reserve spaces
    # differ between CPU and GPU); undo the correction to return the biased σ² like the
    # composite path. The layer's moving update re-applies m/(m−1).
    m = element_count(x, channel_axes)
    if isinstance(m, int):
        variance = unbiased_variance * (max(m - 1, 0) / m)
    else:
        variance = unbiased_variance * tf.maximum(m - 1.0, 0.0) / m
    return tf.reshape(y, tf.shape(x)), tf.stop_gradient(mean), tf.stop_gradient(variance)


def _composite_train(x, gamma, beta, channel_axes, epsilon, mask, replica_context):
    x = tf.cast(x, statistics_dtype(x.dtype))
    axes = reduction_axes(x.shape.rank, channel_axes)
    param_shape = tf.shape(gamma)
    m = divisor(element_count(x, channel_axes, mask, replica_context))
    weight = 1.0 if mask is None else mask

    @tf.custom_gradient
    def _normalize(x, gamma, beta):
        mean, variance = moments(x, channel_axes, mask, replica_context)
        inv = tf.math.rsqrt(variance + epsilon)
        gamma_b = _per_channel(gamma, x, channel_axes)
        y = (x - mean) * inv * gamma_b + _per_channel(beta, x, channel_axes)

        def grad(dy, *_unused_statistic_grads):
            # x̂ is recomputed from x rather than saved: one tensor less to keep alive, and
            # XLA fuses the recomputation into the reductions below.
            x_hat = (x - mean) * inv
            sum_dy, sum_dy_xhat = _channel_sums([dy, dy * x_hat], axes)
            total_dy, total_dy_xhat = sum_dy, sum_dy_xhat
            if replica_context is not None:
                total_dy, total_dy_xhat = replica_context.all_reduce(
                    tf.distribute.ReduceOp.SUM, [sum_dy, sum_dy_xhat]
                )
            dx = (gamma_b * inv) * (dy - weight * (total_dy + x_hat * total_dy_xhat) / m)
            return dx, tf.reshape(sum_dy_xhat, param_shape), tf.reshape(sum_dy, param_shape)

        return (y, tf.reshape(mean, param_shape), tf.reshape(variance, param_shape)), grad

    y, mean, variance = _normalize(x, gamma, beta)
    return y, tf.stop_gradient(mean), tf.stop_gradient(variance)


def inference_affine(mean, variance, gamma, beta, epsilon):
    """Inference BN as y = a·x + b: a = γ/√(Var + ε), b = β − a·E[x] (per channel)."""
    a = gamma * tf.math.rsqrt(variance + epsilon)
    return a, beta - a * mean


def batch_norm_inference(x, a, b, channel_axes):
    """Apply the per-channel affine y = a·x + b."""
    return x * _per_channel(a, x, channel_axes) + _per_channel(b, x, channel_axes)


def batch_norm_eval(x, mean, variance, gamma, beta, channel_axes, epsilon):
    """Inference BN from given statistics, y = γ(x − mean)/√(variance + ε) + β = a·x + b.

    Channel-last inputs go through FusedBatchNormV3's inference mode: the same affine in one
    pass, computed in float32 for 16-bit inputs, about twice as fast on CPU as the two-op
    a·x + b. Other layouts (and XLA, which fuses the affine itself) use `batch_norm_inference`
    in the statistics dtype; channels-first is not fused because the CPU kernel transposes.
    Returns x's dtype on the fused path, the statistics dtype otherwise.
    """
    if fused_data_format(x, channel_axes, epsilon) == "NHWC":
        y = tf.raw_ops.FusedBatchNormV3(
            x=_fused_view(x, "NHWC"),
            scale=gamma,
            offset=beta,
            mean=mean,
            variance=variance,
            epsilon=epsilon,
            exponential_avg_factor=1.0,
            data_format="NHWC",
            is_training=False,
        )[0]
        return tf.reshape(y, tf.shape(x))
    a, b = inference_affine(mean, variance, gamma, beta, epsilon)
    return batch_norm_inference(tf.cast(x, statistics_dtype(x.dtype)), a, b, channel_axes)

"""The fused path: TensorFlow's FusedBatchNormV3 kernel, forward and backward.

Where the layout allows (see `fused_data_format`) the train-mode forward pass is
FusedBatchNormV3 and the backward pass its FusedBatchNormGradV3, fed the saved reserve spaces;
that is 2-3× faster than composite ops. The kernels see a 4D view of x, a reshape. Inference
on channel-last inputs goes through the same kernel's inference mode (`batch_norm_eval`).

The kernels are never used under XLA, which lowers their training mode to E[x²] − E[x]² (see
`fused_data_format`). This module imports only the leaves statistics.py and
placement.py.

Far from zero the CPU kernel loses accuracy: at a mean of 1e3 and std of 1e-2 (float32) its
output was off by up to 1.3e-2 of the output's scale and its variance by 2.6e-3 (TF 2.21;
benchmarks/offset_accuracy.py), against 1e-7 for xla.py. Normalization is
shift-invariant, so when the kernel's first pass finds some channel's mean more than
`RECENTRE_STDDEVS` standard deviations from zero, a tf.cond runs it again on x minus that mean
(rounded to x's dtype), adds the mean back to the batch mean, and hands the backward kernel the
re-centred x (∂l/∂x is the same). The test reads only the per-channel statistics the first pass
returns, so where it is false (usual activations) it costs a few per-channel ops: within the
noise of benchmarks/bench_layer.py's re-centring table. On a GPU (cuDNN) the kernel runs once,
as before: its accuracy there is not measured.
"""

import tensorflow as tf

from keras_bn.backend import constants
from keras_bn.backend.tensorflow import placement
from keras_bn.backend.tensorflow.statistics import element_count, shift_estimate

# The smallest epsilon cuDNN accepts; below it the fused kernel would silently change ε on GPU.
_MIN_EPSILON = 1.001e-5
# Re-run the kernel on re-centred x when some channel's |mean| exceeds this many standard
# deviations. The CPU kernel's output error grows with |μ|/σ: 6e-7 of the output's scale at 3,
# 2e-6 at 10, 9e-6 at 30, 1.5e-5 at 100, 1.3e-2 at 1e5 (float32, TF 2.21); below 10 it stays
# near float32 rounding, and usual activations (|μ|/σ of a few) never pay for the re-run. Read
# when the graph is traced: None turns the re-centring off, 0 forces the re-run
# (benchmarks/bench_layer.py times both).
RECENTRE_STDDEVS = 10.0
# The kernel sums each channel's values in one stage, so its variance's float32 rounding grows
# with the count m: on N(0, 1) data, 1.0e-6 (NHWC) / 1.8e-6 (NCHW) at m = 2¹⁴, 4.2e-6 / 9.8e-6
# at 2¹⁶, 2.6e-5 / 6.7e-5 at 2¹⁸, 1.7e-4 / 4.7e-4 at 2²⁰ (TF 2.21, CPU, graph mode). Above this
# count `ops.batch_norm_train` recomputes the statistics it returns (the moving statistics')
# from blocked sums, in one more pass over x; y stays the kernel's. The blocked sums stay under
# 1e-6 at any m where the shape allows stages (`statistics.blocked_sum`): a single reduced axis
# (a rank-2 batch) of a size known only at run time, or with no divisor up to 4096, is summed
# in one stage (4.7e-4 at 2²⁰ rows).
MAX_COUNT = 2**16


def fused_data_format(x, channel_axes, epsilon, mask=None):
    """ "NHWC" or "NCHW" when FusedBatchNormV3 can compute this batch norm exactly on a 4D view
    of x (one channel axis, last or second; no mask; a 16/32-bit float), else None.

    Never under XLA: XLA lowers the kernel's training mode to E[x²] − E[x]², whose float32
    variance was off by a factor of thousands at a mean of 1e3 and std of 1e-2 (TF 2.21). Under
    XLA, `ops.train_path` picks xla.py's arrangement on CPU, the composite path
    elsewhere.
    """
    if (
        placement.in_xla_context()
        or mask is not None
        or len(channel_axes) != 1
        or x.dtype not in (tf.float16, tf.bfloat16, tf.float32)
        or epsilon < _MIN_EPSILON
    ):
        return None
    rank, channel = x.shape.rank, channel_axes[0]
    if rank >= 2 and channel == rank - 1:
        return "NHWC"
    if rank >= 3 and channel == 1:
        return "NCHW"
    return None


def _view_4d(x, data_format):
    """x as the 4D tensor the kernel expects; a reshape, so free (no data movement)."""
    if x.shape.rank == 4:
        return x
    if data_format == "NHWC":  # (..., C) -> (M, 1, 1, C)
        return tf.reshape(x, [-1, 1, 1, x.shape[-1]])
    return tf.reshape(x, [tf.shape(x)[0], x.shape[1], -1, 1])  # (N, C, ...) -> (N, C, R, 1)


def _fused(x4, gamma, beta, mean, variance, epsilon, data_format, is_training):
    """FusedBatchNormV3's outputs (y, mean, variance, three reserve spaces): in training the
    batch's statistics (`mean` and `variance` empty), else the given ones; no moving average
    of its own (exponential_avg_factor=1)."""
    return tf.raw_ops.FusedBatchNormV3(
        x=x4,
        scale=gamma,
        offset=beta,
        mean=mean,
        variance=variance,
        epsilon=epsilon,
        exponential_avg_factor=1.0,
        data_format=data_format,
        is_training=is_training,
    )


def batch_norm_train(x, gamma, beta, channel_axes, epsilon, data_format):
    """Train-mode BN with the contract of `ops.batch_norm_train` (no mask, one device).

    Args:
        x: a float16, bfloat16 or float32 tensor that `fused_data_format` accepts.
        gamma, beta: per-channel scale and offset in `statistics_dtype(x.dtype)`.
        channel_axes: the one channel axis, in a list.
        epsilon: added to the variance.
        data_format: what `fused_data_format` returned for these arguments.

    Returns:
        (y, mean, variance): the output in x's dtype, and the per-channel mean and biased
        variance shaped like gamma, carrying no gradient.
    """
    empty = tf.constant([], gamma.dtype)
    per_channel = [1, -1, 1, 1] if data_format == "NCHW" else [1, 1, 1, -1]
    reduced = [0, 2, 3] if data_format == "NCHW" else [0, 1, 2]

    @tf.custom_gradient
    def _normalize(x4, gamma, beta):
        def kernel(x4):
            return _fused(x4, gamma, beta, empty, empty, epsilon, data_format, is_training=True)

        outputs = kernel(x4)
        mean, unbiased_variance = outputs[1], outputs[2]
        normalized, shift = x4, tf.zeros_like(mean)
        # CPU only: the loss was measured on the CPU kernel; on a GPU the test's predicate
        # would have to reach the host, and neither that cost nor cuDNN's accuracy there has
        # been measured.
        if RECENTRE_STDDEVS is not None and placement.runs_on_cpu():
            # NaN (an empty batch, NaN in x) makes the test false: the first pass stands.
            far = tf.reduce_any(tf.abs(mean) > RECENTRE_STDDEVS * tf.sqrt(unbiased_variance))

            def recentred():
                # The mean of each channel's first values (in x's dtype: the value actually
                # subtracted), not the first pass's mean, which far from zero at a large count
                # is itself off by hundreds of σ. A channel whose shift is not finite is left.
                estimate = tf.reshape(shift_estimate(x4, reduced), tf.shape(mean))
                finite = tf.where(tf.math.is_finite(estimate), estimate, tf.zeros_like(estimate))
                shift = tf.cast(finite, mean.dtype)
                shifted = x4 - tf.reshape(tf.cast(shift, x4.dtype), per_channel)
                return (shifted, shift, *kernel(shifted))

            normalized, shift, *outputs = tf.cond(
                far, recentred, lambda: (normalized, shift, *outputs)
            )
        y, mean, unbiased_variance, saved_1, saved_2, saved_3 = outputs

        def grad(dy, *_unused_statistic_grads):
            # x̂ is the same for x and x − shift, and so is ∂l/∂x.
            dx, dgamma, dbeta, _, _ = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=dy,
                x=normalized,
                scale=gamma,
                reserve_space_1=saved_1,
                reserve_space_2=saved_2,
                reserve_space_3=saved_3,
                epsilon=epsilon,
                data_format=data_format,
                is_training=True,
            )
            return dx, dgamma, dbeta

        return (y, mean + shift, unbiased_variance), grad

    y, mean, unbiased_variance = _normalize(_view_4d(x, data_format), gamma, beta)
    # The kernel reports the Bessel-corrected variance on every device (its reserve spaces
    # differ between CPU and GPU); undo the correction to return the biased σ² like the
    # composite path. The layer's moving update re-applies m/(m−1).
    m = element_count(x, channel_axes)
    if isinstance(m, int):
        variance = unbiased_variance * (max(m - 1, 0) / m)
    else:
        variance = unbiased_variance * tf.maximum(m - 1.0, 0.0) / m
    return tf.reshape(y, tf.shape(x)), tf.stop_gradient(mean), tf.stop_gradient(variance)


def far_from_zero(mean, variance, epsilon):
    """A bool scalar: some channel's |mean| exceeds `constants.EVAL_RECENTRE_STDDEVS` times
    √(variance + ε), where inference's one-pass fold would lose accuracy."""
    limit = constants.EVAL_RECENTRE_STDDEVS * tf.sqrt(variance + epsilon)
    return tf.reduce_any(tf.abs(mean) > limit)


def batch_norm_eval(x, mean, variance, gamma, beta, epsilon):
    """Inference BN of a channel-last x through FusedBatchNormV3's inference mode: the affine
    y = γ(x − mean)/√(variance + ε) + β in one pass, computed in float32 for 16-bit inputs.

    The CPU kernel (oneDNN's, TF 2.21) folds the statistics into y = a·x + (β − a·mean), which
    rounds a·x and a·mean each to about |a·mean|·2⁻²⁴: (|mean|/σ)·2⁻²⁴ of the output's scale,
    2.1e-2 at mean 1e4, σ 1e-2. Where some channel's |mean| is far from zero
    (`far_from_zero`), a tf.cond feeds the kernel x − mean (in float32, exact where x lies
    within a factor 2 of the mean) and a mean of 0 instead, one more pass over x; elsewhere the
    fold's error stays within a few float32 roundings of the output's scale and the kernel
    runs alone, as fast as before (a few per-channel ops more).

    Args:
        x: a tensor for which `fused_data_format` returns "NHWC".
        mean, variance, gamma, beta: per-channel statistics and parameters in
            `statistics_dtype(x.dtype)`.
        epsilon: added to the variance.

    Its gradient is the composite form's (`_eval_composite`), not FusedBatchNormGradV3's:
    taken through the tf.cond in a tf.function, that one's second derivatives came out wrong
    (∂²/∂γ² 0 where the formula gives 2e4, TF 2.21), while the composite form is
    differentiable to any order. It costs one more pass over x in a backward through
    inference, which training never takes.

    Returns:
        y, in x's dtype and shape.
    """

    @tf.custom_gradient
    def evaluated(x, mean, variance, gamma, beta):
        view = _view_4d(x, "NHWC")

        def kernel(inputs, centre):
            outputs = _fused(inputs, gamma, beta, centre, variance, epsilon, "NHWC", False)
            return outputs[0]

        def centred():
            difference = tf.cast(view, mean.dtype) - mean
            return tf.cast(kernel(difference, tf.zeros_like(mean)), x.dtype)

        far = far_from_zero(mean, variance, epsilon)
        y = tf.reshape(tf.cond(far, centred, lambda: kernel(view, mean)), tf.shape(x))

        def gradient(dy):
            arguments = [x, mean, variance, gamma, beta]
            with tf.GradientTape() as tape:
                tape.watch(arguments)
                y = _eval_composite(x, mean, variance, gamma, beta, epsilon)
            return tape.gradient(y, arguments, output_gradients=dy)

        return y, gradient

    return evaluated(x, mean, variance, gamma, beta)


def _eval_composite(x, mean, variance, gamma, beta, epsilon):
    """Channels-last inference BN as elementwise ops, (x − mean)·γ/√(variance + ε) + β in the
    statistics' dtype, cast to x's: `batch_norm_eval`'s value, for its gradient."""
    a = gamma * tf.math.rsqrt(variance + epsilon)
    return tf.cast((tf.cast(x, mean.dtype) - mean) * a + beta, x.dtype)

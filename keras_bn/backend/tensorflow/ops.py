"""Functional batch normalization: the train-mode transform and the inference affine.

The maths (Ioffe & Szegedy 2015; docs/architecture.md, "The maths"), with μ and σ² the
per-channel mean and biased variance over the m elements reduced:

    x̂ = (x − μ) / √(σ² + ε),   y = γ·x̂ + β

Where each part lives:

- statistics.py: the moments (corrected two-pass, never E[x²] − E[x]²), the count m,
  masks and per-channel shapes; the leaf every other module here imports.
- fused.py: the fused path, TensorFlow's FusedBatchNormV3 kernels.
- xla.py: the XLA:CPU path, the same sums arranged for XLA:CPU's fusion rules.
- composite.py: the composite path, plain ops with the closed-form gradient, for masks,
  synchronized replicas and every other layout.
- placement.py: where the traced graph runs (under XLA; on a CPU).

The three paths import only those leaves, never each other; this module chooses between them
(`train_path`) and holds the functional API the layer calls. All functions take `channel_axes`:
the sorted, non-negative axes that are *not* reduced. Per-channel tensors (γ, β, μ, σ²) have the
shape of those axes' dimensions, as the layer's weights do.
"""

import tensorflow as tf

from keras_bn.backend.tensorflow import composite, placement, xla
from keras_bn.backend.tensorflow import (
    fused as fused_kernel,
)  # `fused` is an argument of the functions below
from keras_bn.backend.tensorflow.statistics import (
    element_count,
    moments_about,
    per_channel,
    statistics_dtype,
)


def train_path(x, channel_axes, epsilon, mask=None, fused=None, replica_context=None):
    """Which implementation `batch_norm_train` runs: "fused", "xla_cpu" or "composite".

    The first that applies, in this order:

    1. "fused" where `fused.fused_data_format` allows (one channel axis, last or second; no
       mask; a 16/32-bit float; never under XLA) and the replicas are not synchronized.
    2. "xla_cpu" under XLA on a CPU, without a mask or synchronized replicas, when x has a
       reduced axis other than its last (xla.py; its arrangement is tuned to XLA:CPU's
       fusion rules, so other devices keep the composite path until measured there).
    3. "composite" everywhere else.

    Args:
        x: the input tensor (its shape, dtype and the graph it is traced in decide).
        channel_axes: sorted non-negative axes that are not reduced.
        epsilon: added to the variance (the fused kernels require at least 1.001e-5).
        mask: optional output of `statistics.expand_mask`.
        fused: None picks as above; False always gives "composite"; True gives "fused" and
            raises where it does not apply.
        replica_context: the replica context of synchronized BN, or None.

    Returns:
        "fused", "xla_cpu" or "composite".

    Raises:
        ValueError: `fused=True` where the fused kernel does not apply.
    """
    # 1. The fused kernels (fused.py).
    if (
        fused is not False
        and replica_context is None
        and fused_kernel.fused_data_format(x, channel_axes, epsilon, mask) is not None
    ):
        return "fused"
    if fused:  # True demands the fused kernels, and step 1 found they do not apply
        raise ValueError(
            f"The fused batch-norm kernel does not apply here: input shape {x.shape}, dtype "
            f"{x.dtype.name}, channel axes {list(channel_axes)}, epsilon {epsilon}, "
            f"mask {'given' if mask is not None else 'none'}, XLA "
            f"{placement.in_xla_context()}, synchronized {replica_context is not None}."
        )
    # 2. The XLA:CPU arrangement (xla.py); fused=False forces step 3 instead.
    if (
        fused is None
        and replica_context is None
        and mask is None
        and xla.group_axis(x.shape, channel_axes) is not None
        and placement.in_xla_context()
        and placement.runs_on_cpu()
    ):
        return "xla_cpu"
    # 3. Composite ops (composite.py).
    return "composite"


def batch_norm_train(
    x, gamma, beta, channel_axes, epsilon, mask=None, fused=None, replica_context=None
):
    """Train-mode batch normalization with a hand-written gradient.

    Three implementations of the same maths, chosen by `train_path`: TensorFlow's
    FusedBatchNormV3 and FusedBatchNormGradV3 kernels (fused.py), 2-3× faster than
    composite ops; under XLA on a CPU, the same sums arranged so that XLA fuses them, 3 reads of
    x per train step (xla.py); everywhere else (masks, synchronized replicas, other
    devices under XLA, other layouts) composite ops with the two-pass moments and the
    closed-form gradient (composite.py).

    Args:
        x: floating tensor. float16/bfloat16 statistics are computed in float32.
        gamma, beta: per-channel scale and offset in `statistics_dtype(x.dtype)` (pass ones /
            zeros when disabled).
        channel_axes: sorted non-negative axes that are not reduced.
        epsilon: added to the variance.
        mask: optional output of `statistics.expand_mask`; masked-out elements do not enter μ or σ².
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
    if path == "xla_cpu":
        return xla.batch_norm_train(x, gamma, beta, channel_axes, epsilon)
    if path == "composite":
        return composite.batch_norm_train(
            x, gamma, beta, channel_axes, epsilon, mask, replica_context
        )
    data_format = fused_kernel.fused_data_format(x, channel_axes, epsilon, mask)
    y, mean, variance = fused_kernel.batch_norm_train(
        x, gamma, beta, channel_axes, epsilon, data_format
    )
    return (y, *_statistics_beyond_the_kernel(x, channel_axes, mean, variance))


def _statistics_beyond_the_kernel(x, channel_axes, mean, variance):
    """The fused kernel's (mean, variance), recomputed from blocked sums above
    `fused.MAX_COUNT` values per channel, where the kernel's one-stage sums lose precision.

    One pass over x about the kernel's own mean (`statistics.moments_about`), with no
    gradient: y and the backward stay the kernel's, whose σ² error (1.9e-4 at 2²⁰ values)
    lies well inside the batch's own sampling spread (√(2/m) = 1.4e-3 there), while the
    moving statistics, which average many batches, get the exact values. A count known only at
    run time (fit's batch size) is checked then."""
    count = element_count(x, channel_axes)
    if isinstance(count, int) and count <= fused_kernel.MAX_COUNT:
        return mean, variance

    def blocked():
        exact = moments_about(tf.stop_gradient(x), channel_axes, mean)
        return [tf.reshape(t, tf.shape(mean)) for t in exact]

    if isinstance(count, int):
        return blocked()
    return tf.cond(count > fused_kernel.MAX_COUNT, blocked, lambda: [mean, variance])


def inference_affine(mean, variance, gamma, beta, epsilon):
    """Inference BN as y = a·x + b: a = γ/√(Var + ε), b = β − a·E[x] (per channel)."""
    a = gamma * tf.math.rsqrt(variance + epsilon)
    return a, beta - a * mean


def batch_norm_inference(x, a, b, channel_axes):
    """Apply the per-channel affine y = a·x + b."""
    return x * per_channel(a, x, channel_axes) + per_channel(b, x, channel_axes)


def batch_norm_eval(x, mean, variance, gamma, beta, channel_axes, epsilon):
    """Inference BN from given statistics, y = (x − mean)·a + β with a = γ/√(variance + ε).

    x − mean first, never the fold a·x + (β − a·mean), which rounds a·x and a·mean each to
    about |a·mean|·2⁻²⁴: (|mean|/σ)·2⁻²⁴ of the output's scale far from zero (2.2e-2 at mean
    1e4, σ 1e-2); x − mean is exact wherever x lies within a factor 2 of the mean.

    Channel-last inputs go through FusedBatchNormV3's inference mode (`fused.batch_norm_eval`,
    fed x − mean where the kernel's own fold would lose accuracy): one pass, computed in
    float32 for 16-bit inputs, about twice as fast on CPU as composite ops. Other layouts
    compute it in the statistics dtype (channels-first is not fused because the CPU kernel
    transposes): under XLA, which fuses the three ops into one loop, as written; elsewhere
    the two-pass fold a·x + (β − a·mean) unless some channel is far from zero
    (`fused.far_from_zero`, a tf.cond), where x − mean costs a third pass. Returns x's dtype
    on the fused path, the statistics dtype otherwise.
    """
    if fused_kernel.fused_data_format(x, channel_axes, epsilon) == "NHWC":
        return fused_kernel.batch_norm_eval(x, mean, variance, gamma, beta, epsilon)
    x = tf.cast(x, statistics_dtype(x.dtype))
    a = gamma * tf.math.rsqrt(variance + epsilon)

    def exact():
        difference = x - per_channel(mean, x, channel_axes)
        return difference * per_channel(a, x, channel_axes) + per_channel(beta, x, channel_axes)

    if placement.in_xla_context():
        return exact()
    return tf.cond(
        fused_kernel.far_from_zero(mean, variance, epsilon),
        exact,
        lambda: batch_norm_inference(x, a, beta - a * mean, channel_axes),
    )

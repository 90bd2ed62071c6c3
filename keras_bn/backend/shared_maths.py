"""The batch norm's maths that the JAX and PyTorch backends share, written once.

For one channel over its m values (m_c under a mask):

    μ = Σx / m,   σ² = Σ(x − μ)² / m,   x̂ = (x − μ)/√(σ² + ε),   y = γ·x̂ + β

with the paper's backward (`normalize_backward`, which each backend wraps: a jax.custom_vjp,
a torch.autograd.Function):

    ∂l/∂β = Σg,   ∂l/∂γ = Σg·x̂,   ∂l/∂x = γ/√(σ² + ε) · (g − w·(Σg + x̂·Σg·x̂)/m)

(w the mask, 1 without one; the sums run over every position, as every position is
normalized). The moments are shifted sums about K, each channel's mean over its first few
values, redone about the mean when K lies more than 3σ from it (the arrangement of
keras_bn/backend/tensorflow/xla.py for TensorFlow's XLA:CPU; under a mask, always about the
mean: the corrected two-pass algorithm of the TensorFlow backend's statistics.py), never
E[x²] − E[x]²; float16/bfloat16 inputs get float32 statistics. The moving statistics take
m/(m−1)·σ² (Ioffe & Szegedy 2015, Algorithm 2) only where m ≥ 2 and the batch is finite
(`usable`), as on TensorFlow.

Every function runs in the array functions of its arrays' framework (`arrays_of`:
keras_bn/backend/jax/arrays.py or keras_bn/backend/torch/arrays.py, registered by the backend
package that imports it, so that neither backend needs the other's framework): the same
operations in the same order, so that both backends round alike. Shapes are concrete on both,
so m is a Python int unless a mask makes it per channel. The TensorFlow backend takes one
function from here, `moved_range` (QAT's activation ranges), in keras_bn/backend/tensorflow/
arrays.py's functions.
"""

import contextlib
import importlib
import math

import keras

from keras_bn.backend import INTERFACE, ghost
from keras_bn.backend import axes as _axes
from keras_bn.backend.constants import SHIFT_REDO_RATIO, SHIFT_SAMPLES

# Each backend package registers its arrays module when it loads (`register_arrays`), so
# that `arrays_of` finds an array's by isinstance, which torch.compile traces: reading the
# type's module name or importing in a traced call would break its graph.
_ARRAYS: dict = {}


def register_arrays(framework, module):
    """Make `module` (keras_bn.backend.<framework>.arrays) the array functions of its
    ARRAY_TYPE, and of `framework` as a Keras backend."""
    _ARRAYS[framework] = module


def arrays_of(array):
    """The array functions for `array`'s framework: keras_bn.backend.jax.arrays for a jax
    array or tracer, keras_bn.backend.torch.arrays for a tensor; for anything else (a numpy
    array, a number) those of the Keras backend in use."""
    for module in _ARRAYS.values():
        if isinstance(array, module.ARRAY_TYPE):
            return module
    framework = keras.backend.backend()
    if framework not in _ARRAYS:
        register_arrays(framework, importlib.import_module(f"keras_bn.backend.{framework}.arrays"))
    return _ARRAYS[framework]


def is_floating(x):
    """Whether x is a floating-point array."""
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(x.dtype))


def ghost_average(statistic):
    """Mean over the ghost axis of a (G, *channels) statistic."""
    return arrays_of(statistic).mean(statistic, 0)


def per_channel(t, x, channel_axes):
    """A per-channel array reshaped to broadcast against x (channel dims kept, others 1)."""
    shape = [x.shape[i] if i in channel_axes else 1 for i in range(x.ndim)]
    return arrays_of(t).reshape(t, shape)


def reshape_like(y, x):
    """y reshaped to x's (concrete) shape."""
    return arrays_of(y).reshape(y, x.shape)


def add(x, y):
    """x + y broadcast as numpy does."""
    return arrays_of(x).add(x, y)


def expand_mask(mask, x, channel_axes, channel_reading=True):
    """A mask as 0/1 of x's rank and statistics dtype, read by `keras_bn.backend.axes.mask_axes`'s
    rules (ValueError when it fits no reading); `channel_reading` False for Keras's reading
    only (keras.layers.BatchNormalization's)."""
    xp = arrays_of(x)
    mask = xp.as_array(mask, x)
    covered = _axes.mask_axes(tuple(mask.shape), tuple(x.shape), channel_axes, channel_reading)
    mask = xp.astype(mask, bool)
    for axis in range(x.ndim):
        if axis not in covered:
            mask = xp.expand_dims(mask, axis)
    return xp.astype(mask, xp.statistics_dtype(x.dtype))


def ghost_split(x, virtual_batch_size, channel_axes, mask):
    """x as (v, G, ...) and its channel axes there, as the TensorFlow backend's
    `ghost_split` (tf-keras's ghosts: ghost g holds samples g, g+G, ...)."""
    ghosts = ghost.ghost_count(virtual_batch_size, tuple(x.shape), mask)
    view = arrays_of(x).reshape(x, (virtual_batch_size, ghosts, *x.shape[1:]))
    return view, [1] + [a + 1 for a in channel_axes]


def element_count(x, channel_axes, mask=None, replica_context=None):
    """m: a Python int without a mask, else m_c per channel (shaped to broadcast against x).
    JAX and PyTorch have no replicas here: `replica_context` is always None."""
    del replica_context
    axes = reduction_axes(x.ndim, channel_axes)
    if mask is None:
        return math.prod([x.shape[i] for i in axes])  # a list: torch.compile traces it
    xp = arrays_of(x)
    return xp.sum(xp.broadcast_to(mask, x.shape), axes, keepdims=True)


def reduction_axes(rank, channel_axes):
    return tuple(_axes.reduction_axes(rank, channel_axes))


def zero_unless_enough(gamma, count):
    """γ, or 0 in each channel with m_c ≤ 1 at run time (its output is β; its gradients to x
    and γ are 0). A Python int count was checked by the layer."""
    if isinstance(count, int):
        return gamma
    xp = arrays_of(gamma)
    return xp.where(xp.reshape(count, gamma.shape) > 1, gamma, 0.0)


def centered_moments(x, axes, mask, count, with_difference=False):
    """(shift K, offset Δμ, variance), kept broadcastable to x, over the unmasked values: the
    shifted sums of `_shifted_moments`. Without a mask K is `_shift_estimate`'s, and the sums
    are redone about K + Δμ where K was too far from the mean (the TensorFlow backend's xla.py);
    with one K is the masked mean, which makes them the corrected two-pass algorithm of
    `statistics.centered_moments`. `with_difference` adds x − K (over every value) for the
    caller to reuse."""
    xp = arrays_of(x)
    kept = slice(None) if with_difference else slice(3)
    if mask is not None:
        divisor = xp.at_least(count, 1.0)  # a fully masked channel: 0, not NaN
        keep = mask > 0  # selected, not multiplied by 0: padding may hold NaN
        shift = xp.sum(xp.where(keep, x, 0.0), axes, keepdims=True) / divisor
        found = _shifted_moments(xp, x, xp.constant_for_the_shift(shift), axes, keep, divisor)
        return found[kept]
    found = _shifted_moments(xp, x, _shift_estimate(xp, x, axes), axes, None, count)
    shift, offset, variance, _ = found
    return xp.cond(
        xp.any((xp.square(offset) > SHIFT_REDO_RATIO * variance) | ~xp.isfinite(variance)),
        lambda: _shifted_moments(
            xp, x, xp.constant_for_the_shift(shift + offset), axes, None, count
        )[kept],
        lambda: found[kept],
    )


def _shift_estimate(xp, x, axes):
    """K: each channel's mean over the first SHIFT_SAMPLES values along the first reduced axis
    (index 0 of the others), kept broadcastable to x; NaN for an empty batch."""
    first = axes[0]
    head = x[
        tuple(
            slice(0, SHIFT_SAMPLES) if a == first else slice(0, 1) if a in axes else slice(None)
            for a in range(x.ndim)
        )
    ]
    return xp.mean(xp.constant_for_the_shift(head), axes, keepdims=True)


def _shifted_moments(xp, x, shift, axes, keep, divisor):
    """(K, Δμ, σ², x − K) with t = x − K over the kept values: Δμ = Σt/m, σ² = Σt²/m − Δμ²
    (Chan, Golub & LeVeque 1983), which loses about a factor 1 + Δμ²/σ² of rounding: the
    caller keeps |Δμ| ≤ 3σ, or K is the mean and this the corrected two-pass algorithm."""
    difference = x - shift
    centered = difference if keep is None else xp.where(keep, difference, 0.0)
    offset = xp.sum(centered, axes, keepdims=True) / divisor
    variance = xp.sum(xp.square(centered), axes, keepdims=True) / divisor - xp.square(offset)
    return shift, offset, xp.at_least(variance, 0.0), difference


def moments(x, channel_axes, mask=None, replica_context=None):
    """(mean, biased variance) per channel, kept broadcastable to x: the layer's shifted
    moments, `centered_moments` (what `recalibrate` records of a BN's input), differentiable
    by autodiff (the QAT layers' batch statistics).

    Args:
        x: the input, in its statistics dtype.
        channel_axes: sorted non-negative axes that are not reduced.
        mask: optional output of `expand_mask`.
        replica_context: always None (no replicas).

    Returns:
        (mean, variance).
    """
    del replica_context
    count = element_count(x, channel_axes, mask)
    shift, offset, variance = centered_moments(x, reduction_axes(x.ndim, channel_axes), mask, count)
    return shift + offset, variance


def normalize_forward(x, gamma, beta, mask, channel_axes, epsilon):
    """y = γ·x̂ + β and the batch's (mean, variance) shaped like gamma, and what
    `normalize_backward` needs: (x, scale, shift, offset, inv, mask, count)."""
    xp = arrays_of(x)
    count = element_count(x, channel_axes, mask)
    axes = reduction_axes(x.ndim, channel_axes)
    # XLA recomputes x − K inside each loop that reads it; eager torch keeps the moments' one
    # for y and for the backward (saved in x's place: one full-size tensor fewer each way).
    reuse = not xp.FUSES_ELEMENTWISE
    shift, offset, variance, *difference = centered_moments(x, axes, mask, count, reuse)
    inv = xp.rsqrt(variance + epsilon)
    scale = per_channel(gamma, x, channel_axes) * inv
    # y = γ·x̂ + β with x̂ = ((x − K) − Δμ)·inv: x − K is exact far out, Δμ joins β.
    bias = per_channel(beta, x, channel_axes) - offset * scale
    scale_m, bias_m, shift_m = xp.materialized(scale, bias, shift)
    source = difference[0] if reuse else x
    y = xp.affine(source if reuse else x - shift_m, scale_m, bias_m)
    mean = xp.reshape(shift + offset, gamma.shape)
    outputs = (y, mean, xp.reshape(variance, gamma.shape))
    return outputs, (source, scale, shift, offset, inv, mask, count)


def normalize_backward(dy, saved, channel_axes, all_sum=None):
    """(∂l/∂x, ∂l/∂γ, ∂l/∂β) from the upstream `dy` and `normalize_forward`'s `saved`: the
    paper's gradients, with x̂ = ((x − K) − Δμ)·inv never written out:

        Σg·x̂ = inv·(Σg·(x − K) − Δμ·Σg),
        ∂l/∂x = a·g + w·(b·(x − K) + c),  a = γ·inv,  b = −a·inv·Σg·x̂/m,
                                          c = a·(Δμ·inv·Σg·x̂ − Σg)/m,

    which is γ·inv·(g − w·(Σg + x̂·Σg·x̂)/m) regrouped per channel, so that ∂l/∂x is one
    elementwise pass. `saved` holds x, or x − K itself where the forward kept it (torch).
    Synchronized BN passes `all_sum`, which sums (Σg, Σg·x̂) over the processes for ∂l/∂x
    (m is then the global count); ∂l/∂γ and ∂l/∂β stay this process's, as for every other
    weight's gradient."""
    source, scale, shift, offset, inv, mask, count = saved
    xp = arrays_of(source)
    reuse = not xp.FUSES_ELEMENTWISE
    axes = reduction_axes(source.ndim, channel_axes)
    sum_dy = xp.sum(dy, axes, keepdims=True)
    centered = source if reuse else source - xp.materialized(shift)
    sum_dy_x_hat = inv * (xp.sum(dy * centered, axes, keepdims=True) - offset * sum_dy)
    total_dy, total_dy_x_hat = (
        (sum_dy, sum_dy_x_hat) if all_sum is None else all_sum(sum_dy, sum_dy_x_hat)
    )
    m = count if mask is None else xp.at_least(count, 1.0)
    slope = -scale * inv * total_dy_x_hat / m
    intercept = scale * (offset * inv * total_dy_x_hat - total_dy) / m
    scale_m, slope_m, intercept_m, shift_m = xp.materialized(scale, slope, intercept, shift)
    if not reuse:
        # XLA recomputes x − K inside dx's loop for free; reusing `centered` would write it
        # out in full and read it back (the float32 train step measured 1.9-2.1x Keras BN's
        # that way instead of 0.89-0.93x, bench_layer.py --backend jax, 2026-11-27).
        centered = source - shift_m
    correction = xp.affine(centered, slope_m, intercept_m)
    dx = xp.affine(dy, scale_m, correction if mask is None else mask * correction)
    param_shape = [source.shape[i] for i in channel_axes]
    return dx, xp.reshape(sum_dy_x_hat, param_shape), xp.reshape(sum_dy, param_shape)


def batch_norm_inference(x, a, b, channel_axes):
    """The per-channel affine y = a·x + b, in the statistics dtype."""
    xp = arrays_of(x)
    x = xp.astype(x, xp.statistics_dtype(x.dtype))
    return xp.affine(x, per_channel(a, x, channel_axes), per_channel(b, x, channel_axes))


def batch_norm_eval(x, mean, variance, gamma, beta, channel_axes, epsilon):
    """Inference BN, y = (x − mean)·a + β with a = γ/√(variance + ε), in the statistics dtype.

    x − mean first, never a·x + (β − a·mean): that fold rounds a·x and a·mean each to about
    |a·mean|·2⁻²⁴, which far from zero is (|mean|/σ)·2⁻²⁴ of the output's scale (2.7e-2 at
    mean 1e4, σ 1e-2). x − mean is exact wherever x lies within a factor 2 of mean, and what
    remains is a few roundings of y itself. Under jit XLA fuses the three ops into one loop;
    the PyTorch backend's `batch_norm_eval` computes the same in one new tensor, or on a CPU
    F.batch_norm's one-pass fold where no channel is far from zero."""
    xp = arrays_of(x)
    x = xp.astype(x, xp.statistics_dtype(x.dtype))
    a = gamma * arrays_of(variance).rsqrt(variance + epsilon)
    difference = x - per_channel(mean, x, channel_axes)
    a, beta = per_channel(a, x, channel_axes), per_channel(beta, x, channel_axes)
    return xp.affine(difference, a, beta)


def renorm_corrections(mean, variance, renorm_mean, renorm_stddev, epsilon, clipping):
    """Batch renormalization's per-channel (r, d), without gradient: `renorm.corrections`."""
    xp = arrays_of(variance)
    stddev = xp.sqrt(variance + epsilon)
    renorm_stddev = xp.at_least(renorm_stddev, math.sqrt(epsilon))  # as Keras, early on
    r = stddev / renorm_stddev
    d = (mean - renorm_mean) / renorm_stddev
    clipping = clipping or {}
    r = xp.clip(r, clipping.get("rmin"), clipping.get("rmax"))
    if "dmax" in clipping:
        d = xp.clip(d, -clipping["dmax"], clipping["dmax"])
    return xp.stop_gradient(r), xp.stop_gradient(d)


def unbiased_estimates(mean, variance, count, epsilon, dtype, with_stddev):
    """([μ_B, m/(m−1)·σ²_B], and renorm's √(σ²_B + ε) `with_stddev`), in the variables'
    `dtype`: what the moving statistics take from a batch; and `enough`, the channels with the
    m ≥ 2 values a variance needs (True for a static m, which the caller checked, else a
    boolean array per channel)."""
    xp = arrays_of(mean)
    mean, variance = xp.astype(mean, dtype), xp.astype(variance, dtype)
    if isinstance(count, int):  # static m, checked ≥ 2 by the layer
        unbiased, enough = variance * (count / (count - 1)), True
    else:
        count = xp.astype(xp.reshape(count, mean.shape), dtype)
        enough = count > 1.0
        # A channel with m ≤ 1 is not updated; the divisor only keeps its value finite.
        unbiased = variance * count / xp.at_least(count - 1.0, 1.0)
    values = [mean, unbiased] + ([xp.sqrt(variance + epsilon)] if with_stddev else [])
    return values, enough


def usable(values, enough):
    """Which channels a moving-statistics update reaches: those with m ≥ 2 (`enough`), provided
    that every value of those channels is finite (else none does: one NaN batch cannot poison
    the averages, as it poisons torch.nn.BatchNorm's running_var)."""
    xp = arrays_of(values[0])
    if enough is True:
        return xp.all(xp.isfinite(xp.stack(values)))
    checked = [xp.where(enough, v, 0.0) for v in values]
    return enough & xp.all(xp.isfinite(xp.stack(checked)))


def replica_context():
    """None: no replicas (a JAX `keras.distribution` batch is one sharded array, whose
    statistics are already the global batch's; PyTorch's Keras backend has no distribution)."""
    return None


def pool_statistics(values, enough, weight, synchronized):
    """The values as they are, and which channels take them: no replicas to pool."""
    del weight, synchronized
    return values, usable(values, enough)


def moving_average(old, value, momentum, update):
    """momentum·old + (1 − momentum)·value where `update`, else old."""
    return arrays_of(old).where(update, momentum * old + (1.0 - momentum) * value, old)


def moved_range(x, low, high, initialized, frozen, momentum):
    """An activation quantizer's range (`keras_bn.quantize.ActivationQuantizer`) moved toward
    x's min and max: the EMA low ← momentum·low + (1 − momentum)·min(x) (then min(·, 0)),
    high likewise (then max(·, 0)), or x's own where no range has been seen (`initialized`
    false); kept as it was where `frozen` or x's min or max is not finite. No gradient flows
    through min(x) and max(x): the range is a statistic (Jacob et al. 2018).

    In the array functions of x's framework, for all three backends: through keras.ops,
    each call dozens of inlined calls more for Dynamo, torch.compile traced a QAT step 18%
    longer.

    Args:
        x: float32 tensor.
        low, high: the stored range, float32 scalars.
        initialized, frozen: the quantizer's flags, bool scalars.
        momentum: the weight of the old range, a Python float in [0, 1).

    Returns:
        (low, high, initialized) after this batch.
    """
    xp = arrays_of(x)
    # No gradient through the batch's min and max (PyTorch's observers see detached tensors
    # too), which would also cost two more passes over the tensor in every backward.
    observed = xp.stop_gradient(x)
    batch_low, batch_high = xp.amin(observed), xp.amax(observed)
    new_low = xp.where(initialized, momentum * low + (1.0 - momentum) * batch_low, batch_low)
    new_high = xp.where(initialized, momentum * high + (1.0 - momentum) * batch_high, batch_high)
    new_low, new_high = xp.minimum(new_low, 0.0), xp.maximum(new_high, 0.0)
    usable = xp.isfinite(batch_low) & xp.isfinite(batch_high) & ~frozen
    return xp.where(usable, new_low, low), xp.where(usable, new_high, high), initialized | usable


def local_copies(variable, strategy=None):
    """The variable itself: one copy of each (no tf.distribute)."""
    del strategy
    return [variable]


def name_scope(name):
    """No graph to name."""
    del name
    return contextlib.nullcontext()


def statistics_update():
    """The context of the moving statistics' update: nothing to switch off, no gradient is
    traced that the step does not ask for."""
    return contextlib.nullcontext()


def specialized(function, signatures):
    """`function` itself: `compiled` traces nothing on these backends."""
    del signatures
    return function


def takes_tf_data():
    """False: a tf.data dataset's elements are TensorFlow tensors, read here as numpy arrays."""
    return False


def traced_functions_read_weights():
    """False: a function traced here keeps the weights it saw as constants (JAX's jit), or is
    not traced at all (PyTorch): running the model is what sees its current weights."""
    return False


def bias_add_may_miss_channels_first():
    """False: Keras adds a channels_first layer's bias on its channel axis here, as numpy
    broadcasting does."""
    return False


# The interface's functions (keras_bn/backend/__init__.py) defined here, which the JAX and
# PyTorch backend packages import with `*`.
__all__ = [name for name in INTERFACE if name in globals()]

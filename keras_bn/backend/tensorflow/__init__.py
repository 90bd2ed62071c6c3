"""The TensorFlow backend: keras_bn's maths in TensorFlow ops, with `tf.custom_gradient`.

Every name in keras_bn/backend/jax/__init__.py is here too, with the same signature (the
interface is listed in keras_bn/backend/__init__.py). What only TensorFlow has stays inside
this package: the choice between the fused, XLA:CPU and composite train paths (ops.py), and
the pooling of statistics across `tf.distribute` replicas (`replica_context`,
`pool_statistics`).
"""

import contextlib
import math

import numpy as np
import tensorflow as tf

from keras_bn.backend import INTERFACE, ghost, shared_maths
from keras_bn.backend.shared_maths import moved_range
from keras_bn.backend.tensorflow import arrays, placement, statistics, xla
from keras_bn.backend.tensorflow.fake_quant import *  # noqa: F403
from keras_bn.backend.tensorflow.ops import batch_norm_eval, batch_norm_inference, batch_norm_train
from keras_bn.backend.tensorflow.statistics import (
    element_count,
    expand_mask,
    moments,
    per_channel,
    statistics_dtype,
)

__all__ = list(INTERFACE)
shared_maths.register_arrays("tensorflow", arrays)


def is_floating(x):
    """Whether x is a floating-point tensor."""
    return tf.as_dtype(x.dtype).is_floating


def read(variable):
    """A variable's value as a tensor (a read: `tf.custom_gradient` must not see the variable)."""
    return tf.convert_to_tensor(variable)


def parameter(variable, default, shape, dtype):
    """A weight's value in `dtype`, or the constant standing for it when disabled (None)."""
    if variable is None:
        return tf.fill(list(shape), tf.constant(default, dtype))
    return tf.cast(variable, dtype)


def unit_affine(x, channel_axes, dtype):
    """Ones and zeros of x's per-channel shape (γ = 1, β = 0: x̂ itself)."""
    shape = tf.gather(tf.shape(x), channel_axes)
    return tf.ones(shape, dtype), tf.zeros(shape, dtype)


def reshape_like(y, x):
    """y reshaped to x's (dynamic) shape."""
    return tf.reshape(y, tf.shape(x))


def ghost_split(x, virtual_batch_size, channel_axes, mask):
    """x as (v, G, ...) and the channel axes there (`ghost`'s module docstring): the ghost
    axis 1, then each original channel axis shifted by one. Raises when v does not divide the
    batch, at run time where the batch size is known only then."""
    ghosts = ghost.ghost_count(virtual_batch_size, x.shape, mask)
    if ghosts is None:
        message = ghost.divide_message(virtual_batch_size, x.shape)
        dynamic = tf.shape(x)[0]
        check = tf.debugging.Assert(
            tf.equal(dynamic % virtual_batch_size, 0),
            [message.format("a size known only at run time"), "batch size:", dynamic],
        )
        with tf.control_dependencies([check]):
            x = tf.identity(x)
        ghosts = -1
    rest = [d if d is not None else tf.shape(x)[i + 1] for i, d in enumerate(x.shape[1:])]
    view = tf.reshape(x, [virtual_batch_size, ghosts] + rest)
    return view, [1] + [a + 1 for a in channel_axes]


def ghost_average(statistic):
    """Mean over the ghost axis of a (G, *channels) statistic."""
    return tf.reduce_mean(statistic, axis=0)


def batch_size_traced(x, channel_axes):
    """False: TensorFlow's `fit` traces the batch size as unknown, so a short last batch's m
    is already a run-time count (`element_count` returns a tensor)."""
    del x, channel_axes
    return False


def run_time_count(count, shape, dtype):
    """A static m as a per-channel tensor of `shape`, for the guards that run at run time."""
    return tf.fill(list(shape), tf.constant(count, dtype))


def zero_unless_enough(gamma, count):
    """γ, or 0 in each channel with m_c ≤ 1 at run time (its output is β; its gradients to x
    and γ are 0). A Python int count was checked by the caller."""
    if isinstance(count, int):
        return gamma
    if count.shape.rank:  # m_c per channel, broadcastable to x: the weights' shape
        count = tf.reshape(count, tf.shape(gamma))
    return tf.where(count > 1, gamma, tf.zeros_like(gamma))


def renorm_corrections(mean, variance, renorm_mean, renorm_stddev, epsilon, clipping):
    """Batch renormalization's per-channel (r, d) for a batch's mean and biased variance,
    without gradient (keras_bn/renorm.py has the maths)."""
    stddev = tf.sqrt(variance + epsilon)
    # The floor avoids dividing by ~0 early in training (as Keras does).
    renorm_stddev = tf.maximum(renorm_stddev, math.sqrt(epsilon))
    r = stddev / renorm_stddev
    d = (mean - renorm_mean) / renorm_stddev
    clipping = clipping or {}
    if "rmin" in clipping:
        r = tf.maximum(r, clipping["rmin"])
    if "rmax" in clipping:
        r = tf.minimum(r, clipping["rmax"])
    if "dmax" in clipping:
        d = tf.clip_by_value(d, -clipping["dmax"], clipping["dmax"])
    return tf.stop_gradient(r), tf.stop_gradient(d)


def unbiased_estimates(mean, variance, count, epsilon, dtype, with_stddev):
    """The per-channel values the moving statistics take from a batch, in the variables'
    `dtype`: [μ_B, m/(m−1)·σ²_B] (and renorm's √(σ²_B + ε) `with_stddev`), and which channels
    have the m ≥ 2 values a variance needs: True for a static m (checked by the caller), else a
    boolean tensor, scalar or per channel."""
    mean, variance = tf.cast(mean, dtype), tf.cast(variance, dtype)
    if isinstance(count, int):  # static m, already checked ≥ 2: the factor costs no op
        unbiased, enough = variance * (count / (count - 1)), True
    else:
        count = tf.cast(count, dtype)
        if count.shape.rank:  # m_c per channel, broadcastable to x: the weights' shape
            count = tf.reshape(count, tf.shape(mean))
        enough = count > 1.0
        # A channel with m ≤ 1 is not updated; the divisor only keeps its value finite.
        unbiased = variance * count / tf.maximum(count - 1.0, 1.0)
    values = [mean, unbiased] + ([tf.sqrt(variance + epsilon)] if with_stddev else [])
    return values, enough


def usable(values, enough):
    """Which channels a moving-statistics update reaches: those with m ≥ 2 (`enough`), provided
    that every value of those channels is finite (a non-finite one skips the whole batch, so
    that one NaN batch cannot poison the averages)."""
    if enough is not True:
        values = [tf.where(enough, v, tf.zeros_like(v)) for v in values]
    finite = tf.reduce_all(tf.math.is_finite(tf.stack(values)))
    return finite if enough is True else enough & finite


def replica_context():
    """The current replica context when a tf.distribute strategy runs several replicas;
    None outside a replica function or with one replica."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1:
        return None
    return context


def recalibration_processes():
    """The replicas `recalibrate(synchronized=True)` pools over: the tf.distribute strategy in
    scope, if it has several (a MultiWorkerMirroredStrategy's workers; a MirroredStrategy's
    replicas share this process's data, and pool it as it is); else None.

    Raises:
        ValueError: TF_CONFIG names several workers but no strategy of several replicas is
            in scope (each worker would recalibrate on its shard alone).
    """
    strategy = tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync > 1:
        return _StrategySum(strategy)
    workers = len(
        tf.distribute.cluster_resolver.TFConfigClusterResolver()
        .cluster_spec()
        .as_dict()
        .get("worker", [])
    )
    if workers > 1:
        raise ValueError(
            f"recalibrate(synchronized=True) with TF_CONFIG naming {workers} workers, outside "
            f"the scope of a strategy of several replicas: call it within "
            f"`strategy.scope()` of your MultiWorkerMirroredStrategy."
        )
    return None


class _StrategySum:
    """`all_sum_array` over a strategy's replicas: each replica adds this process's array, in
    float64, in one reduce; divided by the replicas of this process, which all added it."""

    def __init__(self, strategy):
        self.strategy = strategy

        def copy(values):
            return tf.identity(values)  # on the replica's device

        def all_sum(values):
            per_replica = strategy.run(copy, args=(values,))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        # In a tf.function: a strategy's `run` called eagerly warns of its overhead each time.
        self._all_sum = tf.function(all_sum)

    def all_sum_array(self, values):
        total = self._all_sum(tf.constant(np.asarray(values, np.float64)))
        return total.numpy() / len(self.strategy.extended.worker_devices)


def pool_statistics(values, enough, weight, synchronized):
    """The per-channel `values` every replica averages into its moving statistics, and which
    channels take them (`usable`).

    Synchronized BN's statistics are already global, and one replica has nothing to pool: the
    values are returned as they are. Otherwise one all-reduce gives each replica the same
    count-weighted average Σ wᵢ·vᵢ / Σ wᵢ over the replicas i, per channel, wᵢ (`weight`)
    being the number of values replica i reduced. A replica's channel with m < 2 counts with
    weight 0; a non-finite value on any replica makes its channel's sum non-finite, so all
    replicas skip the batch together. One all-reduce of the packed vector [w, w·v...].
    """
    context = None if synchronized else replica_context()
    if context is None:
        return values, usable(values, enough)
    dtype, shape = values[0].dtype, tf.shape(values[0])
    weight = tf.cast(weight, dtype)
    if weight.shape.rank:  # m_c per channel, broadcastable to x: the weights' shape
        weight = tf.reshape(weight, shape)
    weight = tf.broadcast_to(weight, shape)
    if enough is not True:
        weight = tf.where(enough, weight, tf.zeros_like(weight))
        values = [tf.where(enough, v, tf.zeros_like(v)) for v in values]
    packed = tf.concat([tf.reshape(t, [-1]) for t in [weight] + [weight * v for v in values]], 0)
    total_weight, *totals = (
        tf.reshape(part, shape)
        for part in tf.split(
            context.all_reduce(tf.distribute.ReduceOp.SUM, packed), 1 + len(values)
        )
    )
    some = total_weight > 0
    averages = [t / tf.where(some, total_weight, tf.ones_like(total_weight)) for t in totals]
    return averages, usable(averages, some)


def moving_average(old, value, momentum, update):
    """momentum·old + (1 − momentum)·value where `update` (per channel, or one boolean), else
    old."""
    old = tf.convert_to_tensor(old)
    return tf.where(update, momentum * old + (1.0 - momentum) * value, old)


def cumulative_average(old, value, seen, update):
    """The plain average after `seen` counted batches takes `value` with weight 1/(seen + 1),
    where `update`: n/(n+1) and 1/(n+1) divided in float64, then cast. Formed in float32,
    n/(n+1) loses the new batch's weight (0.14% off at 1e5 batches, 4.6% at 4e6) and rounds to
    1 from n = 2²⁴, where the average would stop."""
    old = tf.convert_to_tensor(old)
    n = tf.cast(tf.convert_to_tensor(seen), tf.float64)
    keep, weight = tf.cast(n / (n + 1.0), old.dtype), tf.cast(1.0 / (n + 1.0), old.dtype)
    return tf.where(update, keep * old + weight * value, old)


def counter_dtype():
    """`num_batches_tracked`'s dtype."""
    return "int64"


def input_moments(x, channel_axes, mask=None):
    """(mean, biased variance) per channel of a BN's input, kept broadcastable to x: what
    `recalibrate` records. Without a mask they are xla.py's, compiled on their own: XLA fuses
    their sums into one read of the input, where `statistics.moments`' ops each read it again
    (recalibrate's one pass took 1.59× a predict pass on the small ResNet of
    benchmarks/bench_recalibrate.py with those, 1.34× with these, 2026-11-26)."""
    if mask is not None or xla.group_axis(x.shape, channel_axes) is None:
        return statistics.moments(x, channel_axes, mask)
    key = (x.shape.rank, tuple(channel_axes))
    if key not in _XLA_MOMENTS:
        _XLA_MOMENTS[key] = tf.function(
            lambda x: xla.moments(x, key[1]),
            jit_compile=True,
            autograph=False,
            reduce_retracing=True,
        )
    return _XLA_MOMENTS[key](x)


# One function per rank and channel axes (a shape-relaxed trace must keep its rank), shared by
# every model; XLA compiles it once per input shape.
_XLA_MOMENTS: dict = {}


def local_copies(variable, strategy=None):
    """Every replica's copy of a variable under `strategy` (the current one when None): what a
    snapshot must save and put back one by one."""
    strategy = strategy or tf.distribute.get_strategy()
    return strategy.experimental_local_results(variable.value)


def compiled(function, **options):
    """`function` as a tf.function (retracing relaxed), for the passes run many times."""
    return tf.function(function, reduce_retracing=True, **options)


def name_scope(name):
    """A graph name scope, so traced ops say who made them."""
    return tf.name_scope(name)


def statistics_update():
    """The context of the moving statistics' update: as it is (their values come from the
    batch statistics, which carry no gradient)."""
    return contextlib.nullcontext()


def add(x, y):
    """x + y broadcast as numpy does (Keras 3.15's TensorFlow `ops.add` guesses a bias's axis
    from the shapes instead: keras_bn.export.ChannelBias needs this one)."""
    return tf.add(x, y)


def takes_tf_data():
    """True: a tf.data dataset's tensors feed the model as they are."""
    return True


def traced_functions_read_weights():
    """True: a tf.function reads the model's variables each time it runs."""
    return True


def bias_add_may_miss_channels_first():
    """True: Keras 3.15's TensorFlow backend adds the bias of a channels_first Dense or
    convolution on the output's last axis when that axis has as many entries as there are
    channels (or an unknown size), not on the channel axis."""
    return True


def cond(flag, compute, otherwise):
    """compute() where the scalar `flag` is true, else otherwise(): tf.cond, which runs one
    branch (a select would cost a pass over the tensor and one more over its gradient, for a
    flag that is true after the first training batch). Under XLA a select of both: XLA
    refuses the gradient of a cond whose branch sums over a dynamic batch axis ("Asked to
    propagate a dynamic dimension ... to XlaOptimizationBarrier"), as a QAT layer's does."""
    if placement.in_xla_context():
        return tf.nest.map_structure(
            lambda chosen, other: tf.where(flag, chosen, other), compute(), otherwise()
        )
    return tf.cond(flag, compute, otherwise)


def specialized(function, signatures):
    """`function`'s (a `compiled` one) trace for arguments of every given shape: each of its
    tuple of (value, mask) arguments gets the most specific TensorSpec common to all of its
    `signatures` (a list, per argument, of ((shape, dtype), mask's or None) per call), so that
    a smaller last batch does not trace it again; `function` itself where they have none."""
    specs = []
    for per_call in signatures:
        values, masks = zip(*per_call)
        value = _common_spec(values)
        mask = None if masks[0] is None else _common_spec(masks)
        if value is None or (masks[0] is not None and mask is None):
            return function  # no common spec: let tf.function trace per shape
        specs.append((value, mask))
    return function.get_concrete_function(tuple(specs))


def _common_spec(signatures):
    if any(s is None for s in signatures):
        return None
    first, *rest = (tf.TensorSpec(shape, tf.as_dtype(dtype)) for shape, dtype in signatures)
    return first.most_specific_common_supertype(rest)

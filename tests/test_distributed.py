"""Synchronized BN on real tf.distribute replicas (logical CPU devices, see conftest.py) and
across two real worker processes: exactly single-device BN on the global batch."""

import itertools

import keras
import multiworker_worker as worker
import numpy as np
import pytest
import tensorflow as tf

import keras_bn
import keras_bn.backend.tensorflow
from helpers import assert_close
from tf_helpers import mirrored_strategy

pytestmark = pytest.mark.backends("tensorflow")

EPS = 1e-3
# (global input shape, axis)
LAYOUTS = {"nhwc": ((16, 4, 4, 3), -1), "nchw": ((16, 3, 4, 4), 1), "2d": ((16, 5), -1)}


def _weights(layer, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.uniform(0.5, 1.5, size=w.shape).astype("float32") for w in layer.weights]


def _single_device(x, upstream, axis, momentum=0.5):
    layer = keras_bn.BatchNormalization(axis=axis, momentum=momentum)
    layer.build(x.shape)
    layer.set_weights(_weights(layer))
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y * upstream)
    dx, dgamma, dbeta = tape.gradient(loss, [x] + layer.trainable_weights)
    return {
        "y": y,
        "dx": dx,
        "dgamma": dgamma,
        "dbeta": dbeta,
        "moving_mean": layer.moving_mean,
        "moving_variance": layer.moving_variance,
    }


def _per_replica(strategy, arrays, splits):
    """Distributed values: replica i gets the next splits[i] rows of every array in
    `arrays`, as a tuple."""
    bounds = np.cumsum([0] + list(splits))

    def shard(context):
        rows = slice(*bounds[context.replica_id_in_sync_group :][:2])
        return tuple(tf.constant(a[rows]) for a in arrays)

    return strategy.experimental_distribute_values_from_function(shard)


def _copies(strategy, variable):
    """Every replica's copy of a variable, as numpy arrays."""
    return [np.asarray(c) for c in strategy.experimental_local_results(variable.value)]


def _replicated(x, upstream, axis, replicas, synchronized=True, momentum=0.5):
    """One training step of the layer on `replicas` devices, each given its slice of x.
    Returns the replicas' outputs and input gradients concatenated, the weight gradients
    summed (what the optimizer's all-reduce does) and every replica's moving statistics."""
    strategy = mirrored_strategy(replicas)
    per_replica = len(x) // replicas
    with strategy.scope():
        layer = keras_bn.BatchNormalization(axis=axis, momentum=momentum, synchronized=synchronized)
        layer.build((per_replica,) + x.shape[1:])
        layer.set_weights(_weights(layer))

    inputs = _per_replica(strategy, (x, upstream), [per_replica] * replicas)

    def replica_step(pair):
        xs, us = pair
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = layer(xs, training=True)
            loss = tf.reduce_sum(y * us)
        return [y] + tape.gradient(loss, [xs] + layer.trainable_weights)

    results = tf.function(lambda d: strategy.run(replica_step, args=(d,)))(inputs)
    local = [strategy.experimental_local_results(r) for r in results]
    return {
        "y": tf.concat(local[0], 0),
        "dx": tf.concat(local[1], 0),
        "dgamma": tf.add_n(local[2]),
        "dbeta": tf.add_n(local[3]),
        "replica_moving_mean": _copies(strategy, layer.moving_mean),
        "replica_moving_variance": _copies(strategy, layer.moving_variance),
    }


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(2.0, 3.0, size=shape).astype("float32")
    x[len(x) // 2 :] += 5.0  # replicas see different distributions
    return x, rng.normal(size=shape).astype("float32")


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_synchronized_equals_single_device_on_global_batch(layout, replicas):
    shape, axis = LAYOUTS[layout]
    x, upstream = _data(shape)
    single = _single_device(x, upstream, axis)
    multi = _replicated(x, upstream, axis, replicas)
    for key in ("y", "dx", "dgamma", "dbeta"):
        assert_close(multi[key], single[key], 1e-5)
    for name in ("moving_mean", "moving_variance"):
        copies = multi[f"replica_{name}"]
        assert len(copies) == replicas
        for copy in copies:
            assert_close(copy, single[name], 1e-5)


def test_global_m_counts_every_replica():
    """Two replicas with one example each: m = 2 globally, so synchronized BN trains where a
    single replica's batch alone could not (m = 1)."""
    x, upstream = _data((2, 5))
    single = _single_device(x, upstream, -1)
    multi = _replicated(x, upstream, -1, replicas=2)
    # (With m = 2, x̂ = ±1 whatever x is, so ∂l/∂x is rounding noise: not compared.)
    assert_close(multi["y"], single["y"], 1e-5)
    for name in ("moving_mean", "moving_variance"):
        for copy in multi[f"replica_{name}"]:
            assert_close(copy, single[name], 1e-5)


def test_unsynchronized_normalizes_per_replica_and_keeps_copies_identical():
    shape, axis = LAYOUTS["nhwc"]
    x, upstream = _data(shape)
    multi = _replicated(x, upstream, axis, replicas=2, synchronized=False, momentum=0.5)
    halves = [
        _single_device(x[i * 8 : (i + 1) * 8], upstream[i * 8 : (i + 1) * 8], axis)
        for i in range(2)
    ]
    assert_close(multi["y"], np.concatenate([h["y"] for h in halves]), 1e-5)
    assert_close(multi["dx"], np.concatenate([h["dx"] for h in halves]), 1e-5)
    for name in ("moving_mean", "moving_variance"):
        average = (halves[0][name].numpy() + halves[1][name].numpy()) / 2
        for copy in multi[f"replica_{name}"]:
            assert_close(copy, average, 1e-5)


def test_one_replica_or_no_strategy_is_unsynchronized_bn():
    shape, axis = LAYOUTS["nhwc"]
    x, upstream = _data(shape)
    single = _single_device(x, upstream, axis)
    one = _replicated(x, upstream, axis, replicas=1)
    for key in ("y", "dx", "dgamma", "dbeta"):
        assert_close(one[key], single[key], 1e-5)
    layer = keras_bn.BatchNormalization(synchronized=True)
    plain = keras_bn.BatchNormalization()
    for bn in (layer, plain):
        bn.build(shape)
        bn.set_weights(_weights(bn))
    assert_close(layer(x, training=True), plain(x, training=True), 1e-6)


def test_fit_under_mirrored_strategy_matches_single_device():
    """Tolerance 1e-5 relative: float32 sums are added in a different order per replica, which
    moves each step's results by ~1e-7 relative; three SGD steps stay far below 1e-5."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(48, 6)).astype("float32")
    x[np.arange(48) % 16 >= 8] += 3.0  # each batch's second half: replica 1's slice
    y = rng.normal(size=(48, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    reference = worker.build_model(synchronized=False)
    initial = reference.get_weights()
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)

    strategy = mirrored_strategy(2)
    with strategy.scope():
        model = worker.build_model(synchronized=True)
        model.set_weights(initial)
        model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for ours, theirs in zip(model.weights, reference.weights):
        copies = strategy.experimental_local_results(ours.value)
        for copy in copies:
            assert_close(copy, theirs, 1e-5)
    # The layer's statistics really moved: the test would notice a no-op.
    assert not np.allclose(reference.layers[1].moving_mean, 0.0)


# ------------------------------------------------------------- faults: NaN, unequal replicas


def _groups(x, splits, synchronized, virtual_batch_size=None, mask=None):
    """The sample groups whose statistics the moving update averages: the global batch
    (synchronized), or each replica's rows, or each replica's ghost batches (ghost g of a
    replica's B rows holds rows g, g + B/v, g + 2B/v, ...); only the rows a mask keeps."""
    keep = np.ones(len(x), bool) if mask is None else mask
    if synchronized:
        return [x[keep]]
    bounds = np.cumsum([0] + list(splits))
    rows = [x[a:b][keep[a:b]] for a, b in itertools.pairwise(bounds)]
    if virtual_batch_size is None:
        return rows
    return [
        r[g :: len(r) // virtual_batch_size]
        for r in rows
        for g in range(len(r) // virtual_batch_size)
    ]


def _moving_targets(groups, eps=EPS):
    """Numpy: what the moving statistics move toward, each an average over the groups
    weighted by their value counts m: the mean, the unbiased variance (ddof=1) and renorm's
    √(σ² + ε) (channel-last groups)."""
    flat = [g.reshape(-1, g.shape[-1]).astype(np.float64) for g in groups]
    m = np.array([len(f) for f in flat], np.float64)[:, None]

    def weighted(values):
        return (m * np.stack(values)).sum(0) / m.sum()

    return {
        "mean": weighted([f.mean(0) for f in flat]),
        "unbiased": weighted([f.var(0, ddof=1) for f in flat]),
        "stddev": weighted([np.sqrt(f.var(0) + eps) for f in flat]),
    }


def _train_replicas(strategy, layer, batches, splits, mask=None):
    """Training-mode calls of `layer`, one per global batch, split over the replicas (with
    the same mask over the batch axis for every batch, if given)."""

    def call(arrays):
        return layer(arrays[0], training=True, mask=arrays[1] if mask is not None else None)

    step = tf.function(lambda d: strategy.run(call, args=(d,)))
    for x in batches:
        step(_per_replica(strategy, (x,) if mask is None else (x, mask), splits))


def _replica_layer(strategy, input_shape, **kwargs):
    with strategy.scope():
        layer = keras_bn.BatchNormalization(**kwargs)
        layer.build(input_shape)
    return layer


@pytest.mark.parametrize("bad_replica,bad_value", [(0, np.inf), (1, np.nan)])
@pytest.mark.parametrize("synchronized", [False, True])
@pytest.mark.parametrize("momentum", [0.5, None])
def test_non_finite_batch_on_one_replica_updates_no_replica(
    momentum, synchronized, bad_replica, bad_value
):
    """Three global batches, the second with an inf or a NaN in one replica's rows: every
    replica skips that batch (the counter of momentum=None too) and takes the other two."""
    strategy = mirrored_strategy(2)
    batches = [_data((8, 3), seed)[0] for seed in range(3)]
    batches[1][4 * bad_replica + 1, 2] = bad_value
    layer = _replica_layer(strategy, (4, 3), momentum=momentum, synchronized=synchronized)
    _train_replicas(strategy, layer, batches, (4, 4))

    mean, variance = np.zeros(3), np.ones(3)
    for n, x in enumerate((batches[0], batches[2]), start=1):
        target = _moving_targets(_groups(x, (4, 4), synchronized))
        keep = (n - 1) / n if momentum is None else momentum
        mean = keep * mean + (1 - keep) * target["mean"]
        variance = keep * variance + (1 - keep) * target["unbiased"]
    for copy in _copies(strategy, layer.moving_mean):
        assert_close(copy, mean, 1e-6)
    for copy in _copies(strategy, layer.moving_variance):
        assert_close(copy, variance, 1e-6)
    if momentum is None:
        assert _copies(strategy, layer.num_batches_tracked) == [2, 2]


@pytest.mark.parametrize(
    "values,weights,enough,expected",
    [
        ([[1.0, 2.0], [3.0, 4.0]], [5, 3], [True, True], [1.75, 2.75]),
        # A replica with m < 2 (at run time: a fully masked or empty share) weighs 0, NaN or not.
        ([[1.0, 2.0], [np.nan, 4.0]], [5, 1], [True, False], [1.0, 2.0]),
        ([[1.0, 2.0], [np.nan, 4.0]], [5, 3], [True, True], None),  # a NaN with m ≥ 2: skip
        ([[1.0, 2.0], [3.0, 4.0]], [1, 0], [False, False], None),  # nobody has m ≥ 2: skip
        # Per-channel counts (a mask over a channel axis): each channel pools its own weights.
        (
            [[1.0, 2.0], [3.0, 4.0]],
            [[5, 1], [3, 3]],
            [[True, False], [True, True]],
            [1.75, 4.0],
        ),
        # A channel no replica gives m ≥ 2 is not updated; the others are (NaN there or not).
        (
            [[1.0, np.nan], [3.0, 4.0]],
            [[5, 1], [3, 0]],
            [[True, False], [True, False]],
            [1.75, None],
        ),
        # A NaN in a channel some replica counts skips every channel.
        ([[1.0, np.nan], [3.0, 4.0]], [[5, 2], [3, 3]], [[True, True], [True, True]], None),
    ],
)
def test_count_weighted_average_across_real_replicas(values, weights, enough, expected):
    """The pooling function alone, on 2 replicas: every replica gets Σwᵢvᵢ/Σwᵢ over the
    replicas with m ≥ 2, per channel, and the same verdict on which channels to update (None:
    skip all; a None entry: skip that channel)."""
    strategy = mirrored_strategy(2)

    def shard(context):
        i = context.replica_id_in_sync_group
        return (
            tf.constant(values[i], tf.float32),
            tf.constant(weights[i], tf.float32),
            tf.constant(enough[i]),
        )

    def pool(args):
        value, weight, has_enough = args
        averages, updated = keras_bn.backend.tensorflow.pool_statistics(
            [value], has_enough, weight, synchronized=False
        )
        return averages[0], tf.broadcast_to(updated, tf.shape(value))

    averages, updated = tf.function(lambda d: strategy.run(pool, args=(d,)))(
        strategy.experimental_distribute_values_from_function(shard)
    )
    expected = [None, None] if expected is None else expected
    for verdict in strategy.experimental_local_results(updated):
        np.testing.assert_array_equal(verdict, [e is not None for e in expected])
    for average in strategy.experimental_local_results(averages):
        for channel, want in enumerate(expected):
            if want is not None:
                assert_close(average[channel], want, 1e-7)


UNEQUAL = {  # (global batch shape, layer arguments)
    "2d": ((8, 3), {}),
    "nhwc": ((8, 2, 2, 3), {}),
    "cumulative": ((8, 2, 2, 3), {"momentum": None}),
    "renorm": ((8, 2, 2, 3), {"renorm": True, "renorm_momentum": 0.5}),
    "ghost": ((8, 2, 2, 3), {"virtual_batch_size": 1}),
    "masked": ((8, 3), {}),  # m counts the unmasked rows: 3 and 2
}
MASK = np.array([1, 0, 1, 1, 0, 1, 0, 1], bool)


@pytest.mark.parametrize(
    "case,synchronized",
    [
        (case, synchronized)
        for case in UNEQUAL
        for synchronized in (False, True)
        if not (synchronized and "virtual_batch_size" in UNEQUAL[case][1])  # exclusive options
    ],
)
def test_unequal_replica_batches_weight_the_update_by_count(case, synchronized):
    """A global batch of 8 split 5/3. Unsynchronized, the moving mean moves toward
    (5·μ₁ + 3·μ₂)/8, the global batch mean, and the moving variance toward (5·s₁² + 3·s₂²)/8,
    sᵢ² replica i's unbiased variance (m counts spatial positions too, and only unmasked
    rows; with ghost batches the average runs over every replica's ghosts). Synchronized,
    toward the global batch's mean and unbiased variance."""
    shape, kwargs = UNEQUAL[case]
    momentum = kwargs.get("momentum", 0.5)
    strategy = mirrored_strategy(2)
    x = _data(shape, seed=3)[0]
    mask = MASK if case == "masked" else None
    layer = _replica_layer(
        strategy, (None,) + shape[1:], synchronized=synchronized, **{"momentum": momentum, **kwargs}
    )
    _train_replicas(strategy, layer, [x], (5, 3), mask)

    target = _moving_targets(
        _groups(x, (5, 3), synchronized, kwargs.get("virtual_batch_size"), mask)
    )
    channels = (x if mask is None else x[mask]).reshape(-1, shape[-1])
    if "virtual_batch_size" not in kwargs:
        assert_close(target["mean"], channels.mean(0), 1e-6)  # the global batch mean
    keep = 0.0 if momentum is None else momentum
    expected = {
        "moving_mean": (1 - keep) * target["mean"],
        "moving_variance": keep + (1 - keep) * target["unbiased"],
    }
    if kwargs.get("renorm"):
        expected.update(
            renorm_mean=0.5 * target["mean"], renorm_stddev=0.5 + 0.5 * target["stddev"]
        )
    for name, value in expected.items():
        for copy in _copies(strategy, getattr(layer, name)):
            assert_close(copy, value, 1e-6)
    if momentum is None:  # once per global step, not once per replica
        assert _copies(strategy, layer.num_batches_tracked) == [1, 1]


def test_fit_with_an_uneven_last_batch_moves_toward_its_global_mean():
    """Keras fit under 2 replicas: 21 examples in batches of 8 end with a batch of 5, which TF
    splits unevenly. With momentum=0 the moving mean is that batch's statistic, and the
    count-weighted rule makes it the batch's global mean, whatever the split."""
    rng = np.random.default_rng(2)
    x = rng.normal(2.0, 3.0, size=(21, 3)).astype("float32")
    x[-2:] += 10.0  # the last batch's replicas differ
    strategy = mirrored_strategy(2)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((3,)), keras_bn.BatchNormalization(momentum=0.0), keras.layers.Dense(1)]
        )
        model.compile(keras.optimizers.SGD(0.0), "mse")
    model.fit(x, np.zeros((21, 1), "float32"), batch_size=8, shuffle=False, verbose=0)
    for copy in _copies(strategy, model.layers[0].moving_mean):
        assert_close(copy, x[16:].mean(0), 1e-6)


# --------------------------------------------------------------------------- multi-worker


@pytest.mark.slow
def test_multi_worker_mirrored_strategy_matches_one_process(tmp_path):
    """Two worker processes on 127.0.0.1 train with MultiWorkerMirroredStrategy, each on its
    half of every global batch; their weights and moving statistics equal one process
    training on the global batch."""
    keras.utils.set_random_seed(0)
    init = tmp_path / "init.npz"
    np.savez(init, *worker.build_model().get_weights())
    reference = worker.train(None, str(init))

    worker.run_cluster(
        [["loop", str(init), str(tmp_path / f"worker{index}.npz")] for index in range(2)],
        str(tmp_path),
        "loop",
        timeout=worker.CLUSTER_TIMEOUT_S,
    )
    for index in range(2):
        result = np.load(tmp_path / f"worker{index}.npz")
        assert len(result.files) == len(reference)
        for i, expected in enumerate(reference):
            assert_close(result[f"arr_{i}"], expected, 1e-5)


@pytest.mark.slow
def test_recalibrate_synchronized_across_two_workers_gives_both_the_union(tmp_path):
    """Two MultiWorkerMirroredStrategy workers on 127.0.0.1 each recalibrate (synchronized)
    on their own shard, 40 and 21 rows of different means: both get the statistics (and the
    momentum=None layer's batch counter) one process gets from every shard's batches."""
    keras.utils.set_random_seed(0)
    init = tmp_path / "init.npz"
    np.savez(init, *worker.build_model(cumulative=True).get_weights())
    reference = worker.recalibrated(None, str(init), worker.recalibration_shards())
    worker.run_cluster(
        [["recalibrate", str(init), str(tmp_path / f"worker{index}.npz")] for index in range(2)],
        str(tmp_path),
        "recalibrate",
        timeout=worker.CLUSTER_TIMEOUT_S,
    )
    for index in range(2):
        result = np.load(tmp_path / f"worker{index}.npz")
        assert len(result.files) == len(reference) == 5
        for i, expected in enumerate(reference):
            assert_close(result[f"arr_{i}"], expected, 1e-5)

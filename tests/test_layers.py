"""keras_bn.BatchNormalization: numpy references, keras.layers.BatchNormalization parity,
training semantics, guards, serialisation, mixed precision and XLA. Under every backend; the
traced calls in each backend's own way (`helpers.training_modes`: tf.function and XLA under
TensorFlow, jax.jit under JAX), tf.distribute and TensorFlow's XLA against its eager call under
TensorFlow only, and the float64 layers where the backend has float64 (not JAX without x64)."""

import re

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from helpers import assert_close, numpy_bn_train, python_json, training_call, training_modes

BACKEND = keras.backend.backend()
# float64 layers at 1e-12: JAX runs without x64.
float64_backends = pytest.mark.backends("tensorflow", "torch")

EPS = 1e-3


def _data(shape, seed=0, dtype="float32", loc=2.0, scale=3.0):
    return np.random.default_rng(seed).normal(loc, scale, size=shape).astype(dtype)


def _randomize_weights(layer, seed=1):
    rng = np.random.default_rng(seed)
    weights = []
    for w in layer.get_weights():
        weights.append(rng.uniform(0.5, 1.5, size=w.shape).astype(w.dtype))
    layer.set_weights(weights)
    return weights


# --------------------------------------------------------------------------- forward


@float64_backends
@pytest.mark.parametrize(
    "shape,axis,channel_axes",
    [
        ((16, 5), -1, [1]),
        ((8, 4, 4, 3), -1, [3]),
        ((8, 3, 4, 4), 1, [1]),
        ((8, 6, 5), -1, [2]),
        ((8, 3, 4, 5), [1, -1], [1, 3]),
    ],
    ids=["2d", "nhwc", "nchw", "sequence", "list_axis"],
)
def test_train_and_inference_match_numpy(shape, axis, channel_axes):
    x = _data(shape).astype(np.float64)
    layer = keras_bn.BatchNormalization(axis=axis, dtype="float64")
    layer.build(shape)
    gamma, beta, moving_mean, moving_var = _randomize_weights(layer)
    assert_close(layer(x, training=True), numpy_bn_train(x, gamma, beta, channel_axes)[0], 1e-12)
    layer.set_weights([gamma, beta, moving_mean, moving_var])
    bshape = [shape[i] if i in channel_axes else 1 for i in range(len(shape))]
    r = lambda v: v.reshape(bshape)  # noqa: E731
    expected = r(gamma) * (x - r(moving_mean)) / np.sqrt(r(moving_var) + EPS) + r(beta)
    assert_close(layer(x, training=False), expected, 1e-12)


def test_weights_named_and_shaped_like_keras():
    ours = keras_bn.BatchNormalization(axis=1)
    theirs = keras.layers.BatchNormalization(axis=1)
    ours.build((None, 7, 4, 4))
    theirs.build((None, 7, 4, 4))
    names = lambda layer: [w.name for w in layer.weights]  # noqa: E731
    assert names(ours) == names(theirs) == ["gamma", "beta", "moving_mean", "moving_variance"]
    assert [w.shape for w in ours.weights] == [w.shape for w in theirs.weights]
    assert [w.trainable for w in ours.weights] == [True, True, False, False]
    assert ours.gamma is ours.weights[0] and ours.moving_variance is ours.weights[3]
    frozen_off = keras_bn.BatchNormalization(center=False, scale=False)
    frozen_off.build((None, 3))
    assert frozen_off.gamma is None and frozen_off.beta is None
    assert [w.name for w in frozen_off.weights] == ["moving_mean", "moving_variance"]


# --------------------------------------------------------------------------- moving statistics


@pytest.mark.parametrize(
    "shape,axis",
    [((16, 5), -1), ((6, 3, 4, 4), 1), ((4, 7, 3), -1)],
    ids=["2d", "nchw", "sequence"],
)
def test_moving_statistics_follow_unbiased_recurrence(shape, axis):
    momentum, steps = 0.9, 5
    layer = keras_bn.BatchNormalization(axis=axis, momentum=momentum)
    rank = len(shape)
    channel = axis % rank
    red = tuple(i for i in range(rank) if i != channel)
    m = int(np.prod([shape[i] for i in red]))
    mean_ref = np.zeros(shape[channel])
    var_ref = np.ones(shape[channel])
    for step in range(steps):
        x = _data(shape, seed=step)
        layer(x, training=True)
        x64 = x.astype(np.float64)
        mean_ref = momentum * mean_ref + (1 - momentum) * x64.mean(axis=red)
        var_ref = momentum * var_ref + (1 - momentum) * x64.var(axis=red) * m / (m - 1)
    assert_close(layer.moving_mean, mean_ref, 1e-5)
    assert_close(layer.moving_variance, var_ref, 1e-5)


def test_masked_moving_statistics_count_unmasked_elements():
    momentum = 0.8
    x = _data((4, 6, 3))
    mask = np.random.default_rng(7).uniform(size=(4, 6)) > 0.4
    layer = keras_bn.BatchNormalization(momentum=momentum)
    y = layer(x, training=True, mask=mask)
    kept = x[mask].astype(np.float64)  # (m, 3)
    m = kept.shape[0]
    mean, var = kept.mean(axis=0), kept.var(axis=0)
    assert_close(layer.moving_mean, (1 - momentum) * mean, 1e-5)
    assert_close(layer.moving_variance, momentum + (1 - momentum) * var * m / (m - 1), 1e-5)
    # Every position is normalized with the unmasked statistics.
    assert_close(y, (x - mean) / np.sqrt(var + EPS), 1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("mode", training_modes("eager", "graph", "xla", "jit"))
def test_non_finite_masked_out_values_do_not_enter_the_statistics(bad, mode):
    """Padding may hold anything (NaN, inf): as in Keras, which selects the unmasked values
    rather than multiplying by the mask (0·NaN = NaN), only they enter the statistics, so the
    moving statistics update and the unmasked outputs are finite, on the numpy values."""
    x = _data((4, 6, 3))
    mask = np.random.default_rng(7).uniform(size=(4, 1)) > 0.4  # broadcast over time
    mask[0] = True
    padded = x.copy()
    padded[~np.broadcast_to(mask, (4, 6))] = bad
    layer = keras_bn.BatchNormalization(momentum=0.0)
    y = array(training_call(layer, mode)(padded, mask))
    kept = x[np.broadcast_to(mask, (4, 6))].astype(np.float64)
    m = kept.shape[0]
    mean, var = kept.mean(axis=0), kept.var(axis=0)
    assert_close(layer.moving_mean, mean, 1e-5)
    assert_close(layer.moving_variance, var * m / (m - 1), 1e-5)
    unmasked = np.broadcast_to(mask, (4, 6))
    assert_close(y[unmasked], ((x - mean) / np.sqrt(var + EPS))[unmasked], 1e-5)


def test_channels_first_mask():
    """axis=1 with a mask over (batch, time): the mask has the input's shape less axis 1."""
    x = _data((4, 3, 6))  # (batch, channels, time)
    mask = np.random.default_rng(8).uniform(size=(4, 6)) > 0.4
    layer = keras_bn.BatchNormalization(axis=1, momentum=0.0)
    y = layer(x, training=True, mask=mask)
    kept = np.transpose(x, (0, 2, 1))[mask].astype(np.float64)  # (m, 3)
    m = kept.shape[0]
    mean, var = kept.mean(axis=0), kept.var(axis=0)
    assert_close(layer.moving_mean, mean, 1e-5)
    assert_close(layer.moving_variance, var * m / (m - 1), 1e-5)
    assert_close(y, (x - mean[:, None]) / np.sqrt(var[:, None] + EPS), 1e-5)


def test_mask_propagates_from_embedding():
    tokens = np.array([[3, 5, 2, 0, 0], [4, 1, 0, 0, 0], [2, 2, 2, 2, 1]])
    inputs = keras.Input((5,), dtype="int32")
    embedded = keras.layers.Embedding(8, 4, mask_zero=True)(inputs)
    bn = keras_bn.BatchNormalization(momentum=0.0)
    model = keras.Model(inputs, bn(embedded))
    model(tokens, training=True)
    vectors = array(model.layers[1](tokens))[tokens != 0].astype(np.float64)
    assert_close(bn.moving_mean, vectors.mean(axis=0), 1e-5)
    m = len(vectors)
    assert_close(bn.moving_variance, vectors.var(axis=0) * m / (m - 1), 1e-5)


def test_wrong_shaped_mask_is_rejected():
    layer = keras_bn.BatchNormalization()
    with pytest.raises(ValueError, match="mask"):
        layer(_data((4, 6, 3)), training=True, mask=np.ones((4, 6, 3), bool))


@pytest.mark.parametrize(
    "mask_shape", [(4, 1), (1, 6), (1, 1)], ids=["per-sample", "per-step", "scalar"]
)
@pytest.mark.parametrize("mode", training_modes("eager", "graph", "xla", "jit"))
def test_broadcastable_mask_counts_the_broadcast_positions(mask_shape, mode):
    """A mask whose size-1 dimensions broadcast over the non-channel shape (Keras accepts
    them): statistics over the broadcast True positions, m counting each of them."""
    x = _data((4, 6, 3))
    rng = np.random.default_rng(5)
    mask = rng.uniform(size=mask_shape) > 0.3
    mask.flat[0] = True
    layer = keras_bn.BatchNormalization(momentum=0.0)
    y = training_call(layer, mode)(x, mask)
    kept = x[np.broadcast_to(mask, (4, 6))].astype(np.float64)
    m = len(kept)
    mean, var = kept.mean(axis=0), kept.var(axis=0)
    assert_close(layer.moving_mean, mean, 1e-5)
    assert_close(layer.moving_variance, var * m / (m - 1), 1e-5)
    assert_close(y, (x - mean) / np.sqrt(var + EPS), 1e-5)


def test_float_mask_counts_non_zero_as_true():
    """Keras casts masks to bool: a float mask is not a weighting."""
    x = _data((4, 6, 3))
    weights = np.random.default_rng(6).choice([0.0, 0.5, 2.0], size=(4, 6)).astype("float32")
    ours = keras_bn.BatchNormalization(momentum=0.0)
    ours(x, training=True, mask=weights)
    reference = keras_bn.BatchNormalization(momentum=0.0)
    reference(x, training=True, mask=weights != 0)
    np.testing.assert_array_equal(array(ours.moving_variance), array(reference.moving_variance))


@pytest.mark.parametrize("mask_shape", [(4, 5), (4,), (4, 6, 1)])
def test_mask_that_does_not_broadcast_is_rejected(mask_shape):
    layer = keras_bn.BatchNormalization()
    with pytest.raises(ValueError, match=r"mask"):
        layer(_data((4, 6, 3)), training=True, mask=np.ones(mask_shape, bool))


@pytest.mark.backends("tensorflow")  # tf.distribute
def test_synchronized_masked_count_is_global():
    """Two replicas, one unmasked value each: m = 2 over the global batch, so it normalizes
    (not β) and matches masked BN on the whole batch; with one value in all, m = 1: β."""
    import tensorflow as tf

    from tf_helpers import mirrored_strategy

    strategy = mirrored_strategy(2)
    x = _data((4, 3, 2))
    with strategy.scope():
        layer = keras_bn.BatchNormalization(momentum=0.0, synchronized=True)
        layer.build((2, 3, 2))
        _randomize_weights(layer)
    gamma, beta = layer.gamma.numpy(), layer.beta.numpy()

    def run(mask):
        def shard(context):
            rows = slice(2 * context.replica_id_in_sync_group, None)
            return tf.constant(x[rows][:2]), tf.constant(mask[rows][:2])

        def replica_step(pair):
            return layer(pair[0], training=True, mask=pair[1])

        inputs = strategy.experimental_distribute_values_from_function(shard)
        y = tf.function(lambda d: strategy.run(replica_step, args=(d,)))(inputs)
        return np.concatenate(strategy.experimental_local_results(y))

    two = np.zeros((4, 3), bool)
    two[0, 1] = two[3, 2] = True  # one value on each replica
    y, _, var = numpy_bn_train(x.astype(np.float64), gamma, beta, [2], mask=two[..., None])
    assert_close(run(two), y, 1e-5)
    assert_close(layer.moving_variance, var * 2.0, 1e-5)  # m/(m−1) = 2
    before = [w.numpy().copy() for w in layer.non_trainable_weights]
    one = np.zeros((4, 3), bool)
    one[3, 0] = True
    np.testing.assert_array_equal(run(one), np.broadcast_to(beta, x.shape))
    for w, b in zip(layer.non_trainable_weights, before):
        np.testing.assert_array_equal(w, b)


# --------------------------------------------------------------------------- Keras parity


@pytest.mark.parametrize("shape,axis", [((32, 6), -1), ((8, 5, 5, 4), -1), ((8, 4, 5, 5), 1)])
def test_matches_keras_except_unbiased_moving_variance(shape, axis):
    momentum = 0.9
    ours = keras_bn.BatchNormalization(axis=axis, momentum=momentum)
    theirs = keras.layers.BatchNormalization(axis=axis, momentum=momentum)
    ours.build(shape)
    theirs.build(shape)
    theirs.set_weights(_randomize_weights(ours))
    x = _data(shape)
    assert_close(ours(x, training=False), theirs(x, training=False), 1e-6)

    initial = array(ours.moving_variance).astype(np.float64)
    assert_close(ours(x, training=True), theirs(x, training=True), 1e-5)
    assert_close(ours.moving_mean, theirs.moving_mean, 1e-6)
    m = x.size // shape[axis]
    ours_new = array(ours.moving_variance) - momentum * initial
    theirs_new = array(theirs.moving_variance) - momentum * initial
    assert_close(ours_new, theirs_new * m / (m - 1), 1e-5)
    assert not np.allclose(
        array(ours.moving_variance), array(theirs.moving_variance), rtol=1e-7, atol=0
    )

    # Weights move both ways; with equal weights, inference is equal again.
    ours.set_weights(theirs.get_weights())
    assert_close(ours(x, training=False), theirs(x, training=False), 1e-6)


def test_keras_config_loads_into_keras_bn():
    """A Keras BN's config builds an equivalent keras_bn layer."""
    theirs = keras.layers.BatchNormalization(axis=1, momentum=0.8, epsilon=1e-4, center=False)
    config = theirs.get_config()  # every argument, renorm and synchronized included
    ours = keras_bn.BatchNormalization.from_config(config)
    assert (ours.axis, ours.momentum, ours.epsilon, ours.center) == (1, 0.8, 1e-4, False)
    assert ours.synchronized is False


# --------------------------------------------------------------------------- training semantics


class _FrozenStatsModel(keras.Model):
    """Calls its BN with an explicit training=False, whatever the model is called with."""

    def __init__(self, norm):
        super().__init__()
        self.bn = norm()

    def call(self, x, training=None):
        return self.bn(x, training=False)


@pytest.mark.parametrize("norm", [keras_bn.BatchNormalization, keras.layers.BatchNormalization])
def test_training_argument_wins_over_the_call_context(norm):
    model = _FrozenStatsModel(norm)
    x = _data((16, 4))
    y = model(x, training=True)
    np.testing.assert_array_equal(array(model.bn.moving_mean), np.zeros(4))
    assert_close(y, x / np.sqrt(1.0 + EPS), 1e-6)


def test_functional_call_context_matches_keras():
    """Keras 3 functional models pass the model's own `training` down to every layer, over
    what was given when the graph was built; keras_bn does exactly what Keras BN does."""
    x = _data((16, 4))
    results = []
    for norm in (keras_bn.BatchNormalization, keras.layers.BatchNormalization):
        inputs = keras.Input((4,))
        bn = norm()
        model = keras.Model(inputs, bn(inputs, training=False))
        results.append((array(model(x, training=True)), array(bn.moving_mean)))
    for ours, theirs in zip(*results):
        assert_close(ours, theirs, 1e-6)


def test_trainable_false_means_inference_without_updates():
    layer = keras_bn.BatchNormalization()
    x = _data((16, 4))
    layer.build(x.shape)
    layer.trainable = False
    y = layer(x, training=True)
    assert_close(y, x / np.sqrt(1.0 + EPS), 1e-6)
    np.testing.assert_array_equal(array(layer.moving_variance), np.ones(4))


def test_fit_updates_statistics_evaluate_and_predict_do_not():
    model = keras.Sequential(
        [keras.Input((4,)), keras_bn.BatchNormalization(momentum=0.5), keras.layers.Dense(1)]
    )
    model.compile("sgd", "mse")
    x, y = _data((64, 4)), _data((64, 1))
    bn = model.layers[0]
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    after_fit = array(bn.moving_mean)
    assert not np.allclose(after_fit, 0.0)
    model.evaluate(x, y, verbose=0)
    predicted = model.predict(x, verbose=0)
    np.testing.assert_array_equal(array(bn.moving_mean), after_fit)
    assert_close(predicted, model(x, training=False), 1e-6)


# --------------------------------------------------------------------------- gradients in the layer


@float64_backends
@pytest.mark.parametrize("center,scale", [(False, True), (True, False), (False, False)])
def test_layer_gradient_with_center_or_scale_off(center, scale, framework):
    """The training step's gradients against the framework's autodiff of the plain formula
    (γ = 1 and β = 0, the layer's own, where they are off), and its whole Jacobian ∂y/∂x
    against float64 central differences of its forward (tf.test.compute_gradient's check)."""
    shape = (6, 3, 4)
    x = _data(shape, dtype="float64")
    layer = keras_bn.BatchNormalization(center=center, scale=scale, dtype="float64")
    layer.build(shape)
    upstream = _data(shape, seed=3, dtype="float64")
    _, dx, dgamma, dbeta = framework.train_step(layer, x, upstream)
    want_dx, want_dgamma, want_dbeta = framework.plain_bn_gradients(
        x, np.ones(4), np.zeros(4), [2], EPS, upstream
    )
    assert_close(dx, want_dx, 1e-5)
    assert (dgamma is None) is not scale and (dbeta is None) is not center
    if scale:
        assert_close(dgamma, want_dgamma, 1e-5)
    if center:
        assert_close(dbeta, want_dbeta, 1e-5)
    delta, size = 1e-6, x.size
    theoretical, numerical = np.empty((size, size)), np.empty((size, size))
    for i in range(size):
        one_hot = np.zeros(size)
        one_hot[i] = 1.0
        theoretical[i] = framework.train_step(layer, x, one_hot.reshape(shape))[1].reshape(-1)
        step = (delta * one_hot).reshape(shape)
        plus, minus = (array(layer(x + s, training=True)) for s in (step, -step))
        numerical[:, i] = (plus - minus).reshape(-1) / (2 * delta)
    assert_close(theoretical, numerical, 1e-5)


# --------------------------------------------------------------------------- guards


def test_m_equal_one_static_is_value_error():
    layer = keras_bn.BatchNormalization()
    with pytest.raises(ValueError, match=r"at least 2 values per channel.*m=1"):
        layer(_data((1, 3)), training=True)
    # Inference with one sample is fine.
    assert layer(_data((1, 3)), training=False).shape == (1, 3)


# Run-time m ≤ 1: (input shape, mask or None). The batch axis is dynamic where traced.
_AT_MOST_ONE = {
    "all masked (m=0)": ((3, 5, 4), np.zeros((3, 5), bool)),
    "one unmasked value (m=1)": ((3, 5, 4), np.arange(15).reshape(3, 5) == 7),
    "broadcast mask (batch, 1), none kept (m=0)": ((3, 5, 4), np.zeros((3, 1), bool)),
    "dynamic batch of 1": ((1, 4), None),
}
# (case, mode, fused): masks force the composite path; eager shapes are static (ValueError,
# above), so the dynamic batch of 1 is traced (TensorFlow: a tf.function with the batch size
# unknown), on the fused kernel and the composite path. "step": the framework's training step
# (TensorFlow: eager, under a tape; JAX: jax.jit of stateless_call; PyTorch: eager autograd).
_AT_MOST_ONE_RUNS = [
    pytest.param(
        case,
        mode,
        None,
        marks=() if mode == "step" else pytest.mark.backends("tensorflow"),
        id=f"{case}-{'eager' if mode == 'step' else mode}-auto",
    )
    for case in list(_AT_MOST_ONE)[:3]
    for mode in ("step", "graph", "xla")
] + [
    pytest.param(
        "dynamic batch of 1",
        mode,
        fused,
        marks=pytest.mark.backends("tensorflow"),
        id=f"dynamic batch of 1-{mode}-{'auto' if fused is None else 'composite'}",
    )
    for mode in ("graph", "xla")
    for fused in (None, False)
]
_STATEFUL = {"plain": {}, "renorm, momentum=None": {"renorm": True, "momentum": None}}


@pytest.mark.slow
@pytest.mark.parametrize("variant", _STATEFUL)
@pytest.mark.parametrize("case,mode,fused", _AT_MOST_ONE_RUNS)
def test_run_time_m_at_most_one_outputs_beta_and_updates_nothing(
    case, mode, fused, variant, framework
):
    """A batch that leaves m ≤ 1 values per channel only at run time: the output is β, the
    gradients are those of y = β (Σg for β, 0 for x and γ), every statistic and the batch
    counter are untouched, nothing is NaN, and the next batch trains normally."""
    shape, mask = _AT_MOST_ONE[case]
    layer = keras_bn.BatchNormalization(**_STATEFUL[variant])
    layer.build((None,) + shape[1:])
    layer._fused = fused
    _randomize_weights(layer)
    if layer.num_batches_tracked is not None:
        layer.num_batches_tracked.assign(3)
    x, upstream = _data(shape), _data(shape, seed=1)
    before = [array(w).copy() for w in layer.non_trainable_weights]
    if mode == "step":
        y, dx, dgamma, dbeta = framework.train_step(layer, x, upstream, mask)
    else:
        import tensorflow as tf

        def step(x, *mask):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True, mask=mask[0] if mask else None)
                loss = tf.reduce_sum(y * upstream)
            return [y] + tape.gradient(loss, [x, layer.gamma, layer.beta])

        inputs = [tf.constant(x)] + ([] if mask is None else [tf.constant(mask)])
        spec = [tf.TensorSpec((None,) + t.shape[1:], t.dtype) for t in inputs]
        step = tf.function(step, jit_compile=(mode == "xla"), input_signature=spec)
        y, dx, dgamma, dbeta = (array(t) for t in step(*inputs))
    np.testing.assert_array_equal(y, np.broadcast_to(array(layer.beta), shape))
    np.testing.assert_array_equal(dx, np.zeros(shape))
    np.testing.assert_array_equal(dgamma, np.zeros(shape[-1]))
    assert_close(dbeta, upstream.reshape(-1, shape[-1]).sum(axis=0), 1e-6)
    for w, b in zip(layer.non_trainable_weights, before):
        np.testing.assert_array_equal(array(w), b, err_msg=w.name)
    # The next, ordinary batch updates as usual.
    layer(
        _data((4,) + shape[1:], seed=2),
        training=True,
        mask=None if mask is None else np.ones((4,) + shape[1:-1], bool),
    )
    assert not np.array_equal(array(layer.moving_mean), before[0])
    if layer.num_batches_tracked is not None:
        assert int(array(layer.num_batches_tracked)) == 4


# Each backend's compiled call: XLA under TensorFlow, jax.jit under JAX; PyTorch's eager.
_COMPILED = training_modes("xla", "jit") + [
    pytest.param("eager", marks=pytest.mark.backends("torch"), id="eager")
]


@pytest.mark.parametrize("mode", _COMPILED)
def test_run_time_m_of_one_under_mixed_float16_outputs_beta(mode):
    keras.mixed_precision.set_global_policy("mixed_float16")
    layer = keras_bn.BatchNormalization()
    layer.build((None, 5, 4))
    _randomize_weights(layer)
    x = keras.ops.convert_to_tensor(_data((3, 5, 4)), "float16")
    y = training_call(layer, mode)(x, keras.ops.zeros((3, 5), "bool"))
    assert keras.backend.standardize_dtype(y.dtype) == "float16"
    np.testing.assert_array_equal(
        array(y), np.broadcast_to(array(layer.beta).astype("float16"), (3, 5, 4))
    )


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("mode", training_modes("eager", "graph", "xla", "jit"))
def test_non_finite_batch_leaves_moving_statistics_unchanged(bad, mode):
    layer = keras_bn.BatchNormalization(momentum=0.5)
    good = _data((8, 3))
    step = training_call(layer, mode)
    step(good)
    before = [array(w) for w in layer.non_trainable_weights]
    poisoned = good.copy()
    poisoned[2, 1] = bad
    y = array(step(poisoned))
    assert not np.isfinite(y[:, 1]).all()  # the bad value shows in the output
    for w, b in zip(layer.non_trainable_weights, before):
        np.testing.assert_array_equal(array(w), b)
    step(good)  # and a later good batch still updates
    assert not np.array_equal(array(layer.moving_mean), before[0])


# --------------------------------------------------------------------------- momentum=None


def test_momentum_none_is_the_cumulative_average():
    """PyTorch's momentum=None: the plain average of every batch's μ_B and m/(m−1)·σ²_B."""
    layer = keras_bn.BatchNormalization(momentum=None)
    # Traced where the backend traces (a tf.function, jax.jit); PyTorch's call is eager.
    step = training_call(layer, {"tensorflow": "graph", "jax": "jit"}.get(BACKEND, "eager"))
    batches = [_data((8, 3), seed=s) for s in range(5)]
    for x in batches[:3]:
        step(x)
    poisoned = batches[3].copy()
    poisoned[0, 0] = np.nan
    step(poisoned)  # skipped, and not counted
    step(batches[4])
    used = [b.astype(np.float64) for b in batches[:3] + batches[4:]]
    assert int(array(layer.num_batches_tracked)) == 4
    assert_close(layer.moving_mean, np.mean([b.mean(axis=0) for b in used], axis=0), 1e-6)
    assert_close(
        layer.moving_variance, np.mean([b.var(axis=0, ddof=1) for b in used], axis=0), 1e-6
    )
    assert [w.name for w in layer.weights][-1] == "num_batches_tracked"
    assert layer.get_config()["momentum"] is None


# num_batches_tracked is int32 under JAX without x64: 2⁴⁰ is for the int64 counters.
_INT64_COUNTERS = ("tensorflow", "torch")


@pytest.mark.parametrize(
    "seen, mode",
    [
        pytest.param(seen, mode.values[0], marks=mode.marks, id=f"{seen}-{mode.id}")
        for seen in (100_000, 4_000_000, 2**24, 2**40)
        for mode in training_modes(
            "eager", "graph", "xla", "jit", backends=_INT64_COUNTERS if seen == 2**40 else None
        )
    ],
)
def test_momentum_none_weight_is_exact_after_many_batches(seen, mode):
    """The new batch's weight 1/(n+1) is divided in float64 from the int64 counter, then
    cast: formed in float32, n/(n+1) was 0.14% off at 1e5 batches, 4.6% at 4e6, and exactly
    1 from n = 2²⁴, where the average stopped while the counter kept counting. Moving
    statistics of 0 make the float32 result resolve the tiny step."""
    layer = keras_bn.BatchNormalization(momentum=None)
    layer.build((None, 3))
    layer.moving_mean.assign(np.zeros(3, "float32"))
    layer.moving_variance.assign(np.zeros(3, "float32"))
    layer.num_batches_tracked.assign(seen)
    x = _data((8, 3))
    training_call(layer, mode)(x)
    x64 = x.astype(np.float64)
    weight = 1.0 / (seen + 1.0)
    assert_close(layer.moving_mean, weight * x64.mean(axis=0), 1e-6)
    assert_close(layer.moving_variance, weight * x64.var(axis=0, ddof=1), 1e-6)
    assert int(array(layer.num_batches_tracked)) == seen + 1


def test_momentum_none_counter_survives_keras_file(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras_bn.BatchNormalization(momentum=None)])
    for seed in range(3):
        model(_data((8, 3), seed=seed), training=True)
    path = tmp_path / "cumulative.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert int(array(loaded.layers[0].num_batches_tracked)) == 3
    # Both continue the same average: the fourth batch gets weight 1/4 in each.
    x = _data((8, 3), seed=3)
    model(x, training=True)
    loaded(x, training=True)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(array(a), array(b))
    assert int(array(loaded.layers[0].num_batches_tracked)) == 4


@pytest.mark.parametrize("momentum", [-0.1, 1.0, 1.5, float("nan"), "0.9"])
def test_bad_momentum(momentum):
    with pytest.raises(ValueError, match=rf"momentum.*{momentum}"):
        keras_bn.BatchNormalization(momentum=momentum)


@pytest.mark.parametrize("epsilon", [0.0, -1e-3, float("inf"), None])
def test_bad_epsilon(epsilon):
    with pytest.raises(ValueError, match=rf"epsilon.*{epsilon}"):
        keras_bn.BatchNormalization(epsilon=epsilon)


@pytest.mark.parametrize("axis", [4, -5, [1, 7]])
def test_axis_out_of_range(axis):
    layer = keras_bn.BatchNormalization(axis=axis)
    with pytest.raises(ValueError, match=re.escape(f"axis={axis} is out of range")):
        layer(_data((2, 3, 3, 2)))


@pytest.mark.parametrize("axis", ["1", 1.0, [], True])
def test_axis_wrong_type(axis):
    with pytest.raises(TypeError, match="axis"):
        keras_bn.BatchNormalization(axis=axis)


def test_axis_covering_every_dimension():
    with pytest.raises(ValueError, match="at least one axis to reduce"):
        keras_bn.BatchNormalization(axis=[0, 1]).build((4, 3))


def test_unknown_channel_dimension():
    with pytest.raises(ValueError, match=r"known size on its channel axis"):
        keras_bn.BatchNormalization().build((None, 4, None))


def test_wrong_rank_after_build():
    layer = keras_bn.BatchNormalization()
    layer(_data((4, 3)))
    with pytest.raises(ValueError, match="ndim"):
        layer(_data((4, 2, 3)))


def test_integer_input():
    with pytest.raises(TypeError, match=r"floating-point inputs.*int32"):
        keras_bn.BatchNormalization()(keras.ops.ones([4, 3], "int32"), training=True)


_BACKEND_GUARD_SCRIPT = """
import importlib, json, sys

import keras_bn  # lazy: no backend is needed yet

found = {"keras imported by import keras_bn": "keras" in sys.modules}
uses = {
    "keras_bn.BatchNormalization": lambda: keras_bn.BatchNormalization,
    "import keras_bn.layers": lambda: importlib.import_module("keras_bn.layers"),
    "keras_bn.convert": lambda: keras_bn.convert,
    "keras_bn.export.fold_batch_norms": lambda: importlib.import_module(
        "keras_bn.export"
    ).fold_batch_norms,
    "keras_bn.quantize": lambda: keras_bn.quantize.quantize_model(None),
    "keras_bn.export.export_tflite": lambda: importlib.import_module(
        "keras_bn.export"
    ).export_tflite,
}
for name, use in uses.items():
    try:
        use()
        found[name] = "no error"
    except ImportError as error:
        found[name] = str(error)
    except TypeError as error:
        found[name] = "TypeError: " + str(error)
import keras

found["backend"] = keras.backend.backend()
print(json.dumps(found))
"""


# A Python of its own under `backend`, whichever this run's: it runs once, under TensorFlow.
@pytest.mark.backends("tensorflow")
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "numpy"])
def test_other_backends_get_the_layer_or_a_clear_import_error(backend):
    """`import keras_bn` works under any backend (it is lazy). Under JAX the layer, convert,
    fold_batch_norms and quantize work and the first use of any other keras_bn name raises
    the guard's ImportError, which says what works there (tests/ under JAX tests what works);
    under a backend the layer does not support (NumPy here; tests/ under PyTorch tests it) the
    layer raises too."""
    found = python_json(_BACKEND_GUARD_SCRIPT, KERAS_BACKEND=backend)
    assert found.pop("keras imported by import keras_bn") is False
    assert found.pop("backend") == backend
    if backend == "jax":
        works = (
            " Under JAX keras_bn.BatchNormalization, recalibrate, callbacks.Recalibrate, "
            "diagnostics.check_batchnorm, convert, keras_bn.export.fold_batch_norms and "
            "quantize work; the diagnostics' gradient probes and the TFLite and ONNX writers "
            "need TensorFlow."
        )
        hint = (
            ' Save the model (model.save("model.keras")) and load the .keras file under '
            "KERAS_BACKEND=tensorflow to write TFLite or ONNX (a .keras file crosses backends)."
        )
        assert found == {
            "keras_bn.BatchNormalization": "no error",
            "import keras_bn.layers": "no error",
            "keras_bn.convert": "no error",
            "keras_bn.export.fold_batch_norms": "no error",
            # past the guard: quantize_model's own check of its argument
            "keras_bn.quantize": "TypeError: quantize_model takes a keras.Model; received "
            "model=None.",
            "keras_bn.export.export_tflite": "keras_bn.export.export_tflite needs the "
            f"TensorFlow Keras backend, but Keras is using 'jax'.{works}{hint} Set "
            "KERAS_BACKEND=tensorflow before importing keras.",
        }
        return
    layer_message = (
        " needs the TensorFlow, JAX or PyTorch Keras backend, but Keras is using 'numpy'. Set "
        "KERAS_BACKEND=tensorflow, KERAS_BACKEND=jax or KERAS_BACKEND=torch"
    )
    assert found["keras_bn.BatchNormalization"].startswith(
        "keras_bn.BatchNormalization" + layer_message
    )
    assert found["import keras_bn.layers"].startswith("keras_bn.BatchNormalization" + layer_message)
    for name in ("keras_bn.convert", "keras_bn.export.fold_batch_norms"):
        assert found[name].startswith(name + layer_message)
    assert found["keras_bn.quantize"].startswith("keras_bn.quantize" + layer_message)
    assert found["keras_bn.export.export_tflite"].startswith(
        "keras_bn.export.export_tflite needs the TensorFlow Keras backend, but Keras is using "
        "'numpy'. Save the model"
    )


# --------------------------------------------------------------------------- serialisation


def _non_default_layer(momentum=0.7):
    return keras_bn.BatchNormalization(
        axis=[1, -1],
        momentum=momentum,
        epsilon=1e-4,
        center=False,
        scale=True,
        beta_initializer="ones",
        gamma_initializer=keras.initializers.RandomUniform(0.5, 1.5),
        moving_mean_initializer="ones",
        moving_variance_initializer=keras.initializers.Constant(2.0),
        beta_regularizer="l2",
        gamma_regularizer=keras.regularizers.L1(0.01),
        beta_constraint="non_neg",
        gamma_constraint=keras.constraints.MaxNorm(2.0),
        renorm=True,
        renorm_clipping={"rmax": 2.0, "rmin": 0.5, "dmax": 1.0},
        renorm_momentum=0.8,
        synchronized=True,
        name="custom_bn",
        trainable=False,
    )


@pytest.mark.parametrize("momentum", [0.7, None])
def test_get_config_round_trips_every_argument(momentum):
    layer = _non_default_layer(momentum)
    config = layer.get_config()
    clone = keras_bn.BatchNormalization.from_config(config)
    assert clone.get_config() == config
    assert config["axis"] == [1, -1] and config["epsilon"] == 1e-4
    assert config["momentum"] == momentum
    assert config["center"] is False and config["trainable"] is False
    assert config["renorm"] is True and config["renorm_momentum"] == 0.8
    assert config["renorm_clipping"] == {"rmax": 2.0, "rmin": 0.5, "dmax": 1.0}
    assert config["virtual_batch_size"] is None and config["synchronized"] is True
    assert isinstance(clone.gamma_regularizer, keras.regularizers.L1)
    assert isinstance(clone.gamma_constraint, keras.constraints.MaxNorm)
    assert isinstance(clone.moving_variance_initializer, keras.initializers.Constant)
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == "keras_bn>BatchNormalization"
    assert keras.saving.deserialize_keras_object(serialized).get_config() == config


def test_keras_file_round_trip(tmp_path):
    model = keras.Sequential(
        [
            keras.Input((4, 4, 3)),
            keras.layers.Conv2D(5, 3, use_bias=False),
            keras_bn.BatchNormalization(momentum=0.5, epsilon=1e-2),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    x = _data((8, 4, 4, 3))
    model.compile("adam", "mse")
    model.fit(x, _data((8, 2)), epochs=2, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    # Loads without custom_objects: the class is registered under "keras_bn".
    loaded = keras.saving.load_model(path)
    assert type(loaded.layers[1]) is keras_bn.BatchNormalization
    assert loaded.layers[1].get_config() == model.layers[1].get_config()
    for a, b in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(array(a), array(b))
    np.testing.assert_array_equal(array(loaded(x, training=False)), array(model(x, training=False)))
    np.testing.assert_array_equal(array(loaded(x, training=True)), array(model(x, training=True)))


# --------------------------------------------------------------------------- mixed precision, XLA


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_keeps_float32_statistics(policy):
    x = _data((16, 4, 4, 3), loc=100.0, scale=5.0)
    reference = keras_bn.BatchNormalization(momentum=0.5)
    reference(x, training=True)
    keras.mixed_precision.set_global_policy(policy)
    layer = keras_bn.BatchNormalization(momentum=0.5)
    y = layer(x, training=True)
    half = policy.split("_")[1]
    assert keras.backend.standardize_dtype(y.dtype) == half
    assert all(w.dtype == "float32" for w in layer.weights)
    # Statistics come from the float16-rounded input, computed in float32.
    x_half = array(keras.ops.cast(keras.ops.cast(x, half), "float32")).astype(np.float64)
    assert_close(layer.moving_mean, 0.5 * x_half.mean(axis=(0, 1, 2)), 1e-6)
    assert_close(layer.moving_variance, reference.moving_variance, 2e-2)
    assert np.isfinite(array(keras.ops.cast(layer(x, training=False), "float32"))).all()


def test_mixed_float16_training_step_has_float32_gradients():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8),
            keras_bn.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    # Compiled where the backend compiles fit (XLA, jax.jit); PyTorch's fit runs eagerly.
    model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=BACKEND != "torch")
    history = model.fit(_data((64, 6)), _data((64, 1)), batch_size=16, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    bn = model.layers[1]
    assert bn.moving_variance.dtype == "float32" and bn.gamma.dtype == "float32"
    assert not np.allclose(array(bn.moving_mean), 0.0)


@pytest.mark.backends("tensorflow")  # TensorFlow's XLA against its eager call
def test_xla_train_step_matches_eager():
    import tensorflow as tf

    x = _data((8, 5, 5, 4))
    upstream = _data((8, 5, 5, 4), seed=9)
    layers = [keras_bn.BatchNormalization(momentum=0.7) for _ in range(2)]
    for layer in layers:
        layer.build(x.shape)
        layer.set_weights(_randomize_weights(layers[0]))

    def step(layer, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) * upstream)
        return tape.gradient(loss, [x] + layer.trainable_weights)

    eager = step(layers[0], tf.constant(x))
    compiled = tf.function(lambda t: step(layers[1], t), jit_compile=True)(tf.constant(x))
    for e, c in zip(eager, compiled):
        assert_close(c, e, 1e-5)
    for a, b in zip(layers[0].weights, layers[1].weights):
        assert_close(b, a, 1e-6)


# --------------------------------------------------------------------------- convergence


@pytest.mark.backends("tensorflow")  # examples/digits.py trains with TensorFlow
@pytest.mark.slow
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_digits_cnn_converges(jit_compile):
    import digits

    _, accuracy = digits.train(epochs=10, jit_compile=jit_compile)
    assert accuracy >= 0.90


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"synchronized": 1}, r"synchronized must be True or False; received synchronized=1"),
        ({"synchronized": True, "virtual_batch_size": 4}, r"virtual_batch_size=4 contradict"),
    ],
)
def test_bad_synchronized(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_bn.BatchNormalization(**kwargs)

"""Ghost batches (virtual_batch_size, tf-keras semantics) against numpy and autodiff; XLA,
mixed precision, divisibility and argument checks. Under every backend but the checks written
in TensorFlow (its tape, tf.function, XLA) and the float64 layers, which JAX (without x64)
does not have."""

import numpy as np
import pytest

import keras_bn
from helpers import assert_close

# float64 layers at 1e-12: JAX runs without x64.
float64_backends = pytest.mark.backends("tensorflow", "torch")

EPS = 1e-3


def _data(shape, seed=0, dtype="float32", loc=2.0, scale=3.0):
    return np.random.default_rng(seed).normal(loc, scale, size=shape).astype(dtype)


def _ghosts(x, v):
    """tf-keras's ghost g: samples g, g+G, g+2G, ... with G = B / v."""
    groups = x.shape[0] // v
    return [x[g::groups] for g in range(groups)]


def _numpy_ghost_output(x, v, gamma, beta):
    y = np.empty_like(x)
    groups = x.shape[0] // v
    red = tuple(range(x.ndim - 1))
    for g in range(groups):
        part = x[g::groups]
        mean, var = part.mean(axis=red), part.var(axis=red)
        y[g::groups] = gamma * (part - mean) / np.sqrt(var + EPS) + beta
    return y


@float64_backends
@pytest.mark.parametrize("shape,v", [((12, 5), 3), ((8, 3, 3, 4), 2)], ids=["2d", "nhwc"])
def test_output_and_moving_statistics_match_numpy(shape, v):
    x = _data(shape).astype(np.float64)
    layer = keras_bn.BatchNormalization(virtual_batch_size=v, momentum=0.5, dtype="float64")
    layer.build(shape)
    rng = np.random.default_rng(1)
    gamma, beta = rng.uniform(0.5, 1.5, shape[-1]), rng.uniform(-1, 1, shape[-1])
    layer.gamma.assign(gamma)
    layer.beta.assign(beta)
    assert_close(layer(x, training=True), _numpy_ghost_output(x, v, gamma, beta), 1e-12)
    ghosts = _ghosts(x, v)
    red = tuple(range(x.ndim - 1))
    m = ghosts[0].size // shape[-1]
    mean = np.mean([g.mean(axis=red) for g in ghosts], axis=0)
    var = np.mean([g.var(axis=red) * m / (m - 1) for g in ghosts], axis=0)
    assert_close(layer.moving_mean, 0.5 * mean, 1e-12)
    assert_close(layer.moving_variance, 0.5 + 0.5 * var, 1e-12)
    # Inference is unaffected by ghost batching.
    plain = keras_bn.BatchNormalization(dtype="float64")
    plain.build(shape)
    plain.set_weights(layer.get_weights())
    assert_close(layer(x, training=False), plain(x, training=False), 1e-12)


@pytest.mark.backends("tensorflow")
def test_gradient_matches_autodiff_reference():
    import tensorflow as tf

    shape, v = (12, 2, 3), 4
    x = tf.constant(_data(shape, dtype="float64"))
    upstream = tf.constant(_data(shape, seed=3, dtype="float64"))
    layer = keras_bn.BatchNormalization(virtual_batch_size=v, dtype="float64")
    layer.build(shape)
    layer.gamma.assign([0.5, 1.5, 2.0])
    layer.beta.assign([0.1, -0.2, 0.3])

    def reference(x, gamma, beta):
        view = tf.reshape(x, (v, -1, 2, 3))  # tf-keras's view: ghost axis 1
        mean = tf.reduce_mean(view, [0, 2], keepdims=True)
        var = tf.reduce_mean(tf.square(view - mean), [0, 2], keepdims=True)
        return tf.reshape(gamma * (view - mean) / tf.sqrt(var + EPS) + beta, shape)

    targets = [x, layer.gamma, layer.beta]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours = tf.reduce_sum(layer(x, training=True) * upstream)
        ref = tf.reduce_sum(reference(x, layer.gamma, layer.beta) * upstream)
    for got, want in zip(tape.gradient(ours, targets), tape.gradient(ref, targets)):
        assert_close(got, want, 1e-10)


@float64_backends
def test_combined_with_renorm_follows_tf_keras():
    """tf-keras takes r and d from the ghost-averaged mean and variance."""
    shape, v = (8, 3), 4
    x = _data(shape).astype(np.float64)
    layer = keras_bn.BatchNormalization(virtual_batch_size=v, renorm=True, dtype="float64")
    layer.build(shape)
    layer.renorm_mean.assign([1.0, 2.0, 3.0])
    layer.renorm_stddev.assign([2.0, 3.0, 4.0])
    ghosts = _ghosts(x, v)
    mean = np.mean([g.mean(axis=0) for g in ghosts], axis=0)
    var = np.mean([g.var(axis=0) for g in ghosts], axis=0)
    r = np.sqrt(var + EPS) / np.array([2.0, 3.0, 4.0])
    d = (mean - [1.0, 2.0, 3.0]) / np.array([2.0, 3.0, 4.0])
    x_hat = _numpy_ghost_output(x, v, np.ones(3), np.zeros(3))
    assert_close(layer(x, training=True), x_hat * r + d, 1e-12)


@pytest.mark.backends("tensorflow")  # tf.function's run-time check
def test_batch_not_divisible_is_an_error():
    import tensorflow as tf

    layer = keras_bn.BatchNormalization(virtual_batch_size=4)
    with pytest.raises(
        ValueError,
        match=r"virtual_batch_size=4 must divide the batch size; "
        r"received a batch of 10",
    ):
        layer(_data((10, 3)), training=True)
    assert layer(_data((10, 3)), training=False).shape == (10, 3)  # inference does not split
    step = tf.function(
        lambda x: layer(x, training=True), input_signature=[tf.TensorSpec([None, 3])]
    )
    step(_data((8, 3)))
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"(?s)virtual_batch_size=4 must divide.*batch size:.*\[6\]",
    ):
        step(_data((6, 3)))


@pytest.mark.backends("tensorflow")
def test_xla_matches_eager():
    from tf_helpers import assert_xla_step_matches_eager

    assert_xla_step_matches_eager(
        lambda: keras_bn.BatchNormalization(virtual_batch_size=2, momentum=0.7), (8, 5, 5, 4)
    )


@pytest.mark.backends("tensorflow")
def test_mixed_float16_training():
    from tf_helpers import fit_under_mixed_float16

    fit_under_mixed_float16(lambda: keras_bn.BatchNormalization(virtual_batch_size=4))


@pytest.mark.parametrize("value", [0, -2, 2.0, True, "4"])
def test_bad_virtual_batch_size(value):
    with pytest.raises(ValueError, match=rf"virtual_batch_size=.*{value}"):
        keras_bn.BatchNormalization(virtual_batch_size=value)


def test_batch_axis_as_channel_and_mask_are_errors():
    with pytest.raises(ValueError, match=r"axis 0 cannot be a channel axis"):
        keras_bn.BatchNormalization(axis=[0, -1], virtual_batch_size=2).build((4, 3))
    layer = keras_bn.BatchNormalization(virtual_batch_size=2)
    with pytest.raises(ValueError, match="does not support a mask"):
        layer(_data((4, 5, 3)), training=True, mask=np.ones((4, 5), bool))


def test_config_round_trip_and_no_extra_weights():
    layer = keras_bn.BatchNormalization(virtual_batch_size=8)
    config = layer.get_config()
    assert config["virtual_batch_size"] == 8
    assert keras_bn.BatchNormalization.from_config(config).get_config() == config
    layer.build((None, 3))
    assert [w.name for w in layer.weights] == ["gamma", "beta", "moving_mean", "moving_variance"]

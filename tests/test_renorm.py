"""Batch renormalization (renorm=True): forward and backward against an autodiff reference,
moving statistics against numpy, parity with keras.layers.BatchNormalization(renorm=True),
XLA and mixed precision, argument checks. Under every backend but the checks written in
TensorFlow and the float64 layers, which JAX (without x64) does not have."""

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from helpers import assert_close

# float64 layers at 1e-12: JAX runs without x64.
float64_backends = pytest.mark.backends("tensorflow", "torch")

EPS = 1e-3
CLIPPING = {"rmax": 1.5, "rmin": 0.7, "dmax": 0.5}


def _data(shape, seed=0, dtype="float32", loc=2.0, scale=3.0):
    return np.random.default_rng(seed).normal(loc, scale, size=shape).astype(dtype)


def _renorm_layer(shape, dtype="float32", **kwargs):
    """A built renorm layer whose renorm statistics make r and d clip on some channels."""
    layer = keras_bn.BatchNormalization(
        renorm=True,
        renorm_clipping=CLIPPING,
        renorm_momentum=0.8,
        momentum=0.9,
        dtype=dtype,
        **kwargs,
    )
    layer.build(shape)
    channels = layer.gamma.shape[0]
    rng = np.random.default_rng(5)
    layer.gamma.assign(rng.uniform(0.5, 1.5, channels))
    layer.beta.assign(rng.uniform(-1, 1, channels))
    # The data has mean 2 and std 3: r ≈ 6, 1, 0.15 (clipped to rmax, free, clipped to rmin)
    # and d ≈ −6 (clipped), −0.17, 0.01 on the first three channels.
    layer.renorm_mean.assign(2.0 + np.resize([3.0, 0.5, -0.2], channels))
    layer.renorm_stddev.assign(np.resize([0.5, 3.0, 20.0], channels))
    return layer


def _reference(x, gamma, beta, renorm_mean, renorm_stddev, red):
    """Ioffe 2017 with plain TF ops: autodiff gives the reference gradient; r and d are
    computed in numpy from the batch, so they are constants."""
    import tensorflow as tf

    mean = tf.reduce_mean(x, red, keepdims=True)
    var = tf.reduce_mean(tf.square(x - mean), red, keepdims=True)
    std = np.sqrt(var.numpy() + EPS)
    r = np.clip(std / renorm_stddev, CLIPPING["rmin"], CLIPPING["rmax"])
    d = np.clip((mean.numpy() - renorm_mean) / renorm_stddev, -CLIPPING["dmax"], CLIPPING["dmax"])
    x_hat = (x - mean) / tf.sqrt(var + EPS)
    return gamma * (x_hat * r + d) + beta, r, d


@pytest.mark.parametrize(
    "shape,dtype,fused",
    [((16, 5), "float64", None), ((8, 4, 4, 3), "float32", None), ((8, 4, 4, 3), "float32", False)],
    ids=["2d_float64", "nhwc_fused", "nhwc_composite"],
)
@pytest.mark.backends("tensorflow")  # TensorFlow's tape and its fused path
def test_forward_and_backward_match_autodiff_reference(shape, dtype, fused):
    import tensorflow as tf

    layer = _renorm_layer(shape, dtype)
    layer._fused = fused
    x = tf.constant(_data(shape, dtype=dtype))
    upstream = tf.constant(_data(shape, seed=4, dtype=dtype))
    red = list(range(len(shape) - 1))
    stats = [w.numpy().astype(dtype) for w in (layer.renorm_mean, layer.renorm_stddev)]
    gamma, beta = layer.gamma, layer.beta
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours = layer(x, training=True)
        ref, r, d = _reference(x, tf.cast(gamma, dtype), tf.cast(beta, dtype), *stats, red)
        loss_ours = tf.reduce_sum(ours * upstream)
        loss_ref = tf.reduce_sum(ref * upstream)
    # Both clip bounds are hit somewhere, so the test covers clipping.
    assert (r == CLIPPING["rmin"]).any() and (r == CLIPPING["rmax"]).any()
    assert (np.abs(d) == CLIPPING["dmax"]).any() and (np.abs(d) < CLIPPING["dmax"]).any()
    rtol = 1e-10 if dtype == "float64" else 2e-5
    assert_close(ours, ref, rtol)
    targets = [x, gamma, beta]
    for got, want in zip(tape.gradient(loss_ours, targets), tape.gradient(loss_ref, targets)):
        assert_close(got, want, rtol)


@float64_backends
def test_statistics_updates_match_numpy():
    shape = (32, 3)
    layer = _renorm_layer(shape, "float64")
    renorm_mean, renorm_stddev = array(layer.renorm_mean), array(layer.renorm_stddev)
    moving_mean, moving_var = np.zeros(3), np.ones(3)
    for step in range(3):
        x = _data(shape, seed=step).astype(np.float64)
        layer(x, training=True)
        mean, var = x.mean(axis=0), x.var(axis=0)
        renorm_mean = 0.8 * renorm_mean + 0.2 * mean
        renorm_stddev = 0.8 * renorm_stddev + 0.2 * np.sqrt(var + EPS)
        moving_mean = 0.9 * moving_mean + 0.1 * mean
        moving_var = 0.9 * moving_var + 0.1 * var * 32 / 31  # unbiased, as without renorm
    assert_close(layer.renorm_mean, renorm_mean, 1e-12)
    assert_close(layer.renorm_stddev, renorm_stddev, 1e-12)
    assert_close(layer.moving_mean, moving_mean, 1e-12)
    assert_close(layer.moving_variance, moving_var, 1e-12)
    assert_close(layer.moving_stddev, np.sqrt(moving_var + EPS), 1e-12)


def test_matches_keras_renorm_and_inference_uses_moving_statistics():
    shape = (16, 4, 4, 3)
    ours = _renorm_layer(shape)
    theirs = keras.layers.BatchNormalization(
        renorm=True, renorm_clipping=CLIPPING, renorm_momentum=0.8, momentum=0.9
    )
    theirs.build(shape)
    assert (
        [w.name for w in ours.weights]
        == [w.name for w in theirs.weights]
        == [
            "gamma",
            "beta",
            "moving_mean",
            "moving_variance",
            "moving_stddev",
            "renorm_mean",
            "renorm_stddev",
        ]
    )
    theirs.set_weights(ours.get_weights())
    x = _data(shape)
    assert_close(ours(x, training=True), theirs(x, training=True), 2e-5)
    for name in ("renorm_mean", "renorm_stddev", "moving_mean"):
        assert_close(getattr(ours, name), getattr(theirs, name), 1e-5)
    # Inference is the plain BN of the four Keras weights, as without renorm (folding holds).
    plain = keras_bn.BatchNormalization()
    plain.build(shape)
    plain.set_weights(ours.get_weights()[:4])
    assert_close(ours(x, training=False), plain(x, training=False), 1e-6)


@pytest.mark.backends("tensorflow")
def test_xla_matches_eager():
    from tf_helpers import assert_xla_step_matches_eager

    assert_xla_step_matches_eager(lambda: _renorm_layer((8, 5, 5, 4)), (8, 5, 5, 4))


@pytest.mark.backends("tensorflow")
def test_mixed_float16_training():
    import tensorflow as tf

    from tf_helpers import fit_under_mixed_float16

    bn = fit_under_mixed_float16(
        lambda: keras_bn.BatchNormalization(renorm=True, renorm_clipping=CLIPPING)
    )
    assert bn(tf.ones((4, 8), "float16"), training=True).dtype == "float16"
    assert not np.allclose(bn.renorm_mean, 0.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"renorm_clipping": {"rmax": 2.0, "bad": 1.0}}, r"unknown key.*'bad'"),
        ({"renorm_clipping": {"rmax": 0.5, "rmin": 2.0}}, r"rmax=0.5, rmin=2.0"),
        ({"renorm_clipping": {"dmax": -1.0}}, r"dmax=-1.0"),
        ({"renorm_clipping": {"rmax": "3"}}, r"renorm_clipping\['rmax'\].*'3'"),
        ({"renorm_clipping": [3.0]}, r"renorm_clipping=\[3.0\]"),
        ({"renorm_momentum": 1.0}, r"renorm_momentum.*1.0"),
        ({"renorm_momentum": None}, r"renorm_momentum=None"),
    ],
)
def test_bad_renorm_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_bn.BatchNormalization(renorm=True, **kwargs)


def test_renorm_must_be_a_bool():
    with pytest.raises(ValueError, match=r"renorm='yes'"):
        keras_bn.BatchNormalization(renorm="yes")


def test_clipping_without_renorm_is_an_error():
    with pytest.raises(ValueError, match=r"no effect without renorm=True"):
        keras_bn.BatchNormalization(renorm_clipping={"rmax": 3.0})


def test_weights_only_with_renorm_and_config_round_trip():
    plain = keras_bn.BatchNormalization()
    plain.build((None, 3))
    assert [w.name for w in plain.weights] == ["gamma", "beta", "moving_mean", "moving_variance"]
    layer = keras_bn.BatchNormalization(
        renorm=True, renorm_clipping={"rmax": 3, "dmax": 5}, renorm_momentum=0.5
    )
    config = layer.get_config()
    assert config["renorm"] is True and config["renorm_momentum"] == 0.5
    assert config["renorm_clipping"] == {"rmax": 3.0, "dmax": 5.0}
    assert keras_bn.BatchNormalization.from_config(config).get_config() == config

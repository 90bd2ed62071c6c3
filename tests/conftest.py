import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# TensorFlow turns oneDNN on by default only on CPUs with AVX-512; without it, an eager
# channels_first convolution fails ("Conv2D op currently only supports the NHWC tensor format
# on the CPU"), and the channels_first fold and export tests could not run.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import tensorflow as tf  # noqa: E402

# Four logical CPU devices, for the tf.distribute tests' real MirroredStrategy replicas. This
# must run before TensorFlow initialises its devices; ops without a device scope still run on
# /CPU:0, so the rest of the suite is unaffected.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property-based tests: "ci" (the default) runs 700 examples per property, over 2,000 in all;
# HYPOTHESIS_PROFILE=thorough runs ten times more.
for _name, _examples in (("ci", 700), ("thorough", 7000)):
    settings.register_profile(
        _name, max_examples=_examples, deadline=None, derandomize=(_name == "ci"),
        database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def assert_close(actual, expected, rtol):
    """Equal to within `rtol` of the expected tensor's scale (max |expected|).

    Scale-relative rather than elementwise, so that entries near zero (a gradient component
    that happens to vanish) do not demand absolute precision no computation can give.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def broadcast_shape(shape, channel_axes):
    """Shape of a per-channel array lined up with an input of `shape`."""
    return [shape[i] if i in channel_axes else 1 for i in range(len(shape))]


def numpy_bn_train(x, gamma, beta, channel_axes, eps=1e-3, mask=None):
    """Forward BN from the article's formulas; returns (y, mean, biased var) in param shape."""
    axes = tuple(i for i in range(x.ndim) if i not in channel_axes)
    bshape = broadcast_shape(x.shape, channel_axes)
    w = np.ones_like(x) if mask is None else np.broadcast_to(mask, x.shape).astype(x.dtype)
    m = w.sum(axis=axes, keepdims=True)
    mean = (w * x).sum(axis=axes, keepdims=True) / m
    var = (w * (x - mean) ** 2).sum(axis=axes, keepdims=True) / m
    y = gamma.reshape(bshape) * (x - mean) / np.sqrt(var + eps) + beta.reshape(bshape)
    pshape = gamma.shape
    return y, mean.reshape(pshape), var.reshape(pshape)


def tf_reference_bn(x, gamma, beta, channel_axes, eps=1e-3, mask=None):
    """The same BN as plain TF ops, for autodiff to differentiate (no custom gradient)."""
    axes = [i for i in range(x.shape.rank) if i not in channel_axes]
    bshape = broadcast_shape(x.shape, channel_axes)
    w = tf.ones_like(x) if mask is None else tf.broadcast_to(tf.cast(mask, x.dtype), x.shape)
    m = tf.reduce_sum(w, axes, keepdims=True)
    mean = tf.reduce_sum(w * x, axes, keepdims=True) / m
    var = tf.reduce_sum(w * tf.square(x - mean), axes, keepdims=True) / m
    return tf.reshape(gamma, bshape) * (x - mean) / tf.sqrt(var + eps) + tf.reshape(beta, bshape)


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Each test starts from the float32 policy and a fixed seed."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.mixed_precision.set_global_policy("float32")


def randomise_batch_norms(model, seed=0):
    """Give every BN (nested ones too) random, well-conditioned statistics and affine params.

    Freshly built BNs are the identity map, which would let a wrong fold pass unnoticed.
    """
    rng = np.random.default_rng(seed)
    for layer in model._flatten_layers(include_self=False):
        if "BatchNormalization" not in type(layer).__name__:
            continue
        n = layer.moving_mean.shape
        values = {
            "gamma": rng.uniform(0.5, 1.5, n), "beta": rng.normal(0, 0.2, n),
            "moving_mean": rng.normal(0, 0.2, n), "moving_variance": rng.uniform(0.5, 1.5, n),
        }
        for name, value in values.items():
            variable = getattr(layer, name)
            if variable is not None:
                variable.assign(value.astype("float32"))
    return model


def assert_xla_step_matches_eager(make_layer, shape, rtol=2e-5):
    """One training step (output, gradients, state updates) of two identical layers, one
    eager and one under jit_compile=True, agree."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(2.0, 3.0, shape).astype("float32"))
    upstream = tf.constant(rng.normal(0.0, 1.0, shape).astype("float32"))
    layers = [make_layer(), make_layer()]

    def step(layer, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) * upstream)
        return tape.gradient(loss, [x] + layer.trainable_weights)

    eager = step(layers[0], x)
    compiled = tf.function(lambda t: step(layers[1], t), jit_compile=True)(x)
    for e, c in zip(eager, compiled):
        assert_close(c, e, rtol)
    for a, b in zip(layers[0].weights, layers[1].weights):
        assert_close(b, a, 1e-6)


def fit_under_mixed_float16(bn):
    """Two XLA-compiled epochs of Dense → `bn` → Dense under mixed_float16; returns `bn`
    after checking the loss is finite and the weights stayed float32."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)), rng.normal(size=(64, 1))
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), bn(),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=True)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    layer = model.layers[1]
    assert all(w.dtype == "float32" for w in layer.weights if w.dtype != "int64")
    assert not np.allclose(layer.moving_mean, 0.0)
    return layer

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402


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


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Each test starts from the float32 policy and a fixed seed."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.mixed_precision.set_global_policy("float32")


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

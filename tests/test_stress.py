"""Numerical stress, in eager mode, graph mode and XLA: large offsets, float16 near its
range, constant channels, and very many and very few channels."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_bn
from helpers import assert_close, numpy_bn_train

pytestmark = pytest.mark.backends("tensorflow")

MODES = ["eager", "graph", "xla"]


def _train_call(layer, mode):
    def call(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.square(tf.cast(y, tf.float32)))
        return y, tape.gradient(loss, [x] + layer.trainable_weights)

    return call if mode == "eager" else tf.function(call, jit_compile=(mode == "xla"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "std,epsilon", [(1e-2, 1e-7), (1e-1, 1e-5)], ids=["std1e-2_composite", "std1e-1_fused"]
)
def test_large_offset_normalizes_to_unit_std(mode, std, epsilon):
    """Mean 1e4: E[x²]−E[x]² would cancel every digit; the output std must be 1 within 1%.
    (ε is kept far below σ² so that it does not shrink the std itself; ε < 1.001e-5 also
    sends eager/graph to the composite path, ε = 1e-5 to the fused kernel.)"""
    x = tf.constant(
        1e4 + std * np.random.default_rng(0).standard_normal((256, 8, 8, 4)), tf.float32
    )
    layer = keras_bn.BatchNormalization(epsilon=epsilon, momentum=0.0)
    y, grads = _train_call(layer, mode)(x)
    std_out = y.numpy().astype(np.float64).std(axis=(0, 1, 2))
    np.testing.assert_allclose(std_out, 1.0, rtol=1e-2)
    quantized = x.numpy().astype(np.float64)  # the statistics of the float32 inputs
    m = quantized.size // 4
    assert_close(layer.moving_variance, quantized.var(axis=(0, 1, 2)) * m / (m - 1), 1e-2)
    assert all(np.isfinite(g.numpy()).all() for g in grads)


@pytest.mark.parametrize("mode", MODES)
def test_float16_near_its_range_does_not_overflow(mode):
    """float16 tops out at 65504; squares of such values overflow unless the statistics are
    kept in float32."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(1)
    x = tf.constant(rng.uniform(1e4, 6e4, (64, 4, 4, 3)), tf.float16)
    layer = keras_bn.BatchNormalization(momentum=0.0)
    y, grads = _train_call(layer, mode)(x)
    x64 = tf.cast(x, tf.float64).numpy()
    expected, mean, var = numpy_bn_train(x64, np.ones(3), np.zeros(3), [3])
    assert y.dtype == tf.float16
    assert_close(tf.cast(y, tf.float64), expected, 4e-3)
    m = x64.size // 3
    assert_close(layer.moving_mean, mean, 1e-5)
    assert_close(layer.moving_variance, var * m / (m - 1), 1e-4)
    assert all(np.isfinite(tf.cast(g, tf.float32).numpy()).all() for g in grads)


@pytest.mark.parametrize("mode", MODES)
def test_constant_channel_outputs_beta_with_finite_gradients(mode):
    x = np.random.default_rng(2).normal(size=(16, 5, 3)).astype("float32")
    x[..., 1] = 7.25  # zero variance
    layer = keras_bn.BatchNormalization(momentum=0.0)
    layer.build(x.shape)
    layer.set_weights(
        [
            np.array([2.0, 3.0, 4.0], "float32"),
            np.array([0.5, -1.5, 2.0], "float32"),
            np.zeros(3, "float32"),
            np.ones(3, "float32"),
        ]
    )
    y, grads = _train_call(layer, mode)(tf.constant(x))
    np.testing.assert_allclose(y.numpy()[..., 1], -1.5, atol=1e-6)
    assert all(np.isfinite(g.numpy()).all() for g in grads)
    assert layer.moving_variance.numpy()[1] == 0.0
    assert layer.moving_mean.numpy()[1] == pytest.approx(7.25)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "shape",
    [(16, 8192), (4, 2, 2, 8192), (64, 1), (8, 4, 4, 1)],
    ids=["2d_8192", "nhwc_8192", "2d_1", "nhwc_1"],
)
def test_many_and_few_channels_match_numpy(mode, shape):
    x = np.random.default_rng(3).normal(1.0, 2.0, shape).astype("float32")
    layer = keras_bn.BatchNormalization(momentum=0.5)
    y, _ = _train_call(layer, mode)(tf.constant(x))
    channels = shape[-1]
    expected, mean, var = numpy_bn_train(
        x.astype(np.float64), np.ones(channels), np.zeros(channels), [len(shape) - 1]
    )
    assert_close(y, expected, 2e-5)
    m = x.size // channels
    assert_close(layer.moving_mean, 0.5 * mean, 1e-5)
    assert_close(layer.moving_variance, 0.5 + 0.5 * var * m / (m - 1), 1e-5)

"""Helpers of the TensorFlow-only tests: the same batch norm as plain TF ops (for autodiff),
the large-offset accuracy step, XLA and mixed-precision steps, the tf.distribute strategy, and
each export format's writer and runtime runner. The backend-neutral helpers are helpers.py's.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_bn
from helpers import assert_close, broadcast_shape, numpy_bn_train
from keras_bn.export import export_onnx, export_tflite
from keras_bn.export import onnx as onnx_export
from keras_bn.export import tflite as tflite_export

# Each export format's writer and its runtime's runner, for tests parametrized over both.
EXPORTERS = {"tflite": export_tflite, "onnx": export_onnx}
RUNNERS = {"tflite": tflite_export.run, "onnx": onnx_export.run}


def tf_reference_bn(x, gamma, beta, channel_axes, eps=1e-3, mask=None):
    """The same BN as plain TF ops, for autodiff to differentiate (no custom gradient)."""
    axes = [i for i in range(x.shape.rank) if i not in channel_axes]
    bshape = broadcast_shape(x.shape, channel_axes)
    w = tf.ones_like(x) if mask is None else tf.broadcast_to(tf.cast(mask, x.dtype), x.shape)
    m = tf.reduce_sum(w, axes, keepdims=True)
    mean = tf.reduce_sum(w * x, axes, keepdims=True) / m
    var = tf.reduce_sum(w * tf.square(x - mean), axes, keepdims=True) / m
    return tf.reshape(gamma, bshape) * (x - mean) / tf.sqrt(var + eps) + tf.reshape(beta, bshape)


def large_offset_errors(shape, axis, mode, composite=False):
    """One train step of a momentum-0 keras_bn layer on x ~ N(1e3, 1e-2²) in float32 (resolution
    6e-5 at 1e3, σ/160), against float64: numpy's y, μ and σ² (`numpy_bn_train`) and
    autodiff's ∂l/∂x (`tf_reference_bn`), for l = Σ y·u with a random u.

    Args:
        shape, axis: the input's shape and the layer's channel axis.
        mode: "eager", "graph" (tf.function) or "xla" (jit_compile=True); it and the layout
            pick the path (`keras_bn.backend.tensorflow.ops.train_path`).
        composite: force the composite path (the layer's `_fused = False`).

    Returns:
        {"y", "dx", "moving_mean", "moving_variance"}: max |error| / max |reference|, the
        moving variance against m/(m−1)·σ².
    """
    rng = np.random.default_rng(7)
    x = (1e3 + 1e-2 * rng.standard_normal(shape)).astype("float32")
    upstream = rng.standard_normal(shape)
    channel_axes = [axis % len(shape)]
    ones, zeros = np.ones(shape[axis]), np.zeros(shape[axis])
    expected_y, mean, variance = numpy_bn_train(x.astype(np.float64), ones, zeros, channel_axes)
    x64 = tf.constant(x, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(x64)
        loss = tf.reduce_sum(tf_reference_bn(x64, ones, zeros, channel_axes) * upstream)
    expected_dx = tape.gradient(loss, x64).numpy()
    layer = keras_bn.BatchNormalization(axis=axis, momentum=0.0)
    layer.build(shape)
    layer._fused = False if composite else None
    x, upstream = tf.constant(x), tf.constant(upstream, tf.float32)

    def train_step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * upstream)
        return y, tape.gradient(loss, x)

    y, dx = (
        train_step() if mode == "eager" else tf.function(train_step, jit_compile=mode == "xla")()
    )
    m = x.shape.num_elements() / shape[axis]

    def relative(actual, expected):
        actual = np.asarray(actual, np.float64)
        return float(np.abs(actual - expected).max() / np.abs(expected).max())

    return {
        "y": relative(y, expected_y),
        "dx": relative(dx, expected_dx),
        "moving_mean": relative(layer.moving_mean, mean),
        "moving_variance": relative(layer.moving_variance, variance * m / (m - 1)),
    }


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
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8), bn(), keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=True)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    layer = model.layers[1]
    assert all(w.dtype == "float32" for w in layer.weights if w.dtype != "int64")
    assert not np.allclose(layer.moving_mean, 0.0)
    return layer


def _devices(n):
    return [f"/cpu:{i}" for i in range(n)]


_STRATEGIES = {}


def mirrored_strategy(replicas):
    """A MirroredStrategy over `replicas` logical CPUs, one per size for the whole process.

    TF numbers collective groups from 1 in every MirroredStrategy, so strategies of two sizes
    in one process collide ("joining a group with size 4, but that group has size 2"); a key
    base of its own per size keeps their groups apart.
    """
    if replicas not in _STRATEGIES:
        cls = type(
            f"MirroredStrategy{replicas}",
            (tf.distribute.MirroredStrategy,),
            {"_collective_key_base": 1000 * replicas},
        )
        _STRATEGIES[replicas] = cls(_devices(replicas))
    return _STRATEGIES[replicas]

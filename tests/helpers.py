"""Helpers shared by the test modules: references (numpy and plain-TF batch norm), tolerance
checks, model set-up, the tf.distribute strategy and the command line. Fixtures and settings
stay in conftest.py, which tests do not import.
"""

import json
import os
import shutil
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf
from checks import assert_close, docs_page  # noqa: F401  (re-exported: tests import them here)

import keras_bn
from keras_bn.export import export_onnx, export_tflite, fold
from keras_bn.export import onnx as onnx_export
from keras_bn.export import tflite as tflite_export

L = keras.layers
# Each export format's writer and its runtime's runner, for tests parametrized over both.
EXPORTERS = {"tflite": export_tflite, "onnx": export_onnx}
RUNNERS = {"tflite": tflite_export.run, "onnx": onnx_export.run}


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
            "gamma": rng.uniform(0.5, 1.5, n),
            "beta": rng.normal(0, 0.2, n),
            "moving_mean": rng.normal(0, 0.2, n),
            "moving_variance": rng.uniform(0.5, 1.5, n),
        }
        for name, value in values.items():
            variable = getattr(layer, name)
            if variable is not None:
                variable.assign(value.astype("float32"))
    return model


def hidden_bn_model():
    """A functional model whose Keras BN sits inside a custom layer's own code (an attribute
    its `call` uses), where no graph walk can reach it."""

    class Holder(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.bn = keras.layers.BatchNormalization()

        def call(self, x):
            return self.bn(x)

    inputs = keras.Input((3,))
    return keras.Model(inputs, Holder()(inputs))


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


# Host layers for a backward fold: kind → (make(data_format, use_bias), spatial rank, fold).
BACKWARD_HOSTS = {
    "Dense": (lambda df, b: L.Dense(6, use_bias=b), 0, fold.fold_dense),
    "Conv1D": (
        lambda df, b: L.Conv1D(6, 3, padding="same", data_format=df, use_bias=b),
        1,
        fold.fold_conv,
    ),
    "Conv1D_groups": (
        lambda df, b: L.Conv1D(6, 3, groups=2, data_format=df, use_bias=b),
        1,
        fold.fold_conv,
    ),
    "Conv2D": (
        lambda df, b: L.Conv2D(6, 3, strides=2, data_format=df, use_bias=b),
        2,
        fold.fold_conv,
    ),
    "Conv2D_groups": (
        lambda df, b: L.Conv2D(6, 3, padding="same", groups=2, data_format=df, use_bias=b),
        2,
        fold.fold_conv,
    ),
    "Conv3D": (lambda df, b: L.Conv3D(6, 2, data_format=df, use_bias=b), 3, fold.fold_conv),
    "Conv3D_groups": (
        lambda df, b: L.Conv3D(6, 2, groups=2, data_format=df, use_bias=b),
        3,
        fold.fold_conv,
    ),
    "DepthwiseConv1D_m1": (
        lambda df, b: L.DepthwiseConv1D(3, data_format=df, use_bias=b),
        1,
        fold.fold_depthwise,
    ),
    "DepthwiseConv1D_m3": (
        lambda df, b: L.DepthwiseConv1D(3, depth_multiplier=3, data_format=df, use_bias=b),
        1,
        fold.fold_depthwise,
    ),
    "DepthwiseConv2D_m1": (
        lambda df, b: L.DepthwiseConv2D(3, padding="same", data_format=df, use_bias=b),
        2,
        fold.fold_depthwise,
    ),
    "DepthwiseConv2D_m3": (
        lambda df, b: L.DepthwiseConv2D(3, depth_multiplier=3, data_format=df, use_bias=b),
        2,
        fold.fold_depthwise,
    ),
    "SeparableConv1D": (
        lambda df, b: L.SeparableConv1D(6, 3, depth_multiplier=2, data_format=df, use_bias=b),
        1,
        fold.fold_separable,
    ),
    "SeparableConv2D": (
        lambda df, b: L.SeparableConv2D(
            6, 3, depth_multiplier=2, padding="same", data_format=df, use_bias=b
        ),
        2,
        fold.fold_separable,
    ),
    "Conv1DTranspose": (
        lambda df, b: L.Conv1DTranspose(6, 3, strides=2, data_format=df, use_bias=b),
        1,
        fold.fold_conv_transpose,
    ),
    "Conv2DTranspose": (
        lambda df, b: L.Conv2DTranspose(6, 3, padding="same", data_format=df, use_bias=b),
        2,
        fold.fold_conv_transpose,
    ),
    "Conv3DTranspose": (
        lambda df, b: L.Conv3DTranspose(6, 2, strides=2, data_format=df, use_bias=b),
        3,
        fold.fold_conv_transpose,
    ),
}


def fold_input(rank, channels, data_format, rng):
    """A random float32 input of `channels` channels for a host of spatial rank `rank` (0:
    Dense), with sizes that keep clear of a Keras bias bug (below)."""
    # These tests load folded weights into a Keras host with its own bias. Keras 3.15's TF
    # backend misplaces a channels_first conv's bias when the last spatial output size equals
    # the filter count (6 here), in the host and in the reference alike, so these sizes keep
    # clear of it: they check the fold maths. fold_batch_norms guards that bug (ChannelBias);
    # test_fold.py's test_fold_batch_norms_is_exact_at_every_input_size tests it at the sizes
    # that trigger it.
    spatial = {1: (9,), 2: (7, 5), 3: (8, 3, 10)}[rank] if rank else ()
    shape = (3, channels, *spatial) if data_format == "channels_first" else (3, *spatial, channels)
    return rng.normal(size=shape).astype("float32")


CLI_SCRIPT = shutil.which("keras-bn-export", path=os.path.dirname(sys.executable))


def run_cli(*args, cwd=None, env=None):
    """Run the installed keras-bn-export console script with `args` (paths allowed), in `cwd`,
    with `env` (default: this process's environment, TensorFlow's C++ logging off); returns
    the subprocess.CompletedProcess (text stdout and stderr)."""
    if env is None:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run(
        [CLI_SCRIPT, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def python_json(source, *args, timeout=300, **env):
    """Run `source` with `python -c` in a fresh process (`args` as its sys.argv[1:], `env` added
    to this process's environment, TensorFlow's C++ logging off); asserts it exits 0 and
    returns the JSON its last stdout line holds."""
    result = subprocess.run(
        [sys.executable, "-c", source, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env},
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def cli_in_process(capfd, *args):
    """keras-bn-export's `main` run on `args` (paths allowed) in this process, its output read
    at the file descriptors with pytest's `capfd`: a subprocess.CompletedProcess as `run_cli`
    returns, without a new Python importing TensorFlow (seconds a call). For tests of what the
    command does with its arguments and files; `run_cli` stays for tests of the installed
    command itself (its start-up, its environment, its process's stderr)."""
    from keras_bn.export import cli

    argv = [str(arg) for arg in args]
    capfd.readouterr()  # what the test printed before
    code = cli.main(argv)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["keras-bn-export", *argv], code, out, err)

"""Helpers shared by the test modules, importable under every Keras backend (no TensorFlow):
the numpy reference, tolerance checks, model set-up, the fold's host layers and the command
line. TensorFlow's own (the plain-TF batch norm, tf.distribute, XLA, the file writers) are in
tf_helpers.py. Fixtures and settings stay in conftest.py, which tests do not import.
"""

import json
import os
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest
from checks import assert_close, docs_page  # noqa: F401  (re-exported: tests import them here)

import keras_bn
from keras_bn.export import fold

L = keras.layers


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


# A training call's modes, each under the backends that have it: eager everywhere; a
# tf.function graph and XLA (jit_compile=True) under TensorFlow; jax.jit of stateless_call
# under JAX (as JAX's fit runs it).
_MODE_BACKENDS = {
    "eager": ("tensorflow", "jax", "torch"),
    "graph": ("tensorflow",),
    "xla": ("tensorflow",),
    "jit": ("jax",),
}


def training_modes(*names, backends=None):
    """pytest parameters for `training_call`'s modes `names`, each marked with its backends
    (those of `backends` only, when given: a mode none of them runs is left out)."""
    chosen = {n: [b for b in _MODE_BACKENDS[n] if backends is None or b in backends] for n in names}
    return [
        pytest.param(n, marks=pytest.mark.backends(*chosen[n]), id=n) for n in names if chosen[n]
    ]


def training_call(layer, mode):
    """`layer`'s training call, (x, mask=None) -> y, in `mode` (see training_modes); under
    "jit" its updated statistics are assigned, as a stateful call assigns them."""
    if mode == "eager":
        return lambda x, mask=None: layer(x, training=True, mask=mask)
    if mode in ("graph", "xla"):
        import tensorflow as tf

        return tf.function(
            lambda x, mask=None: layer(x, training=True, mask=mask), jit_compile=mode == "xla"
        )
    assert mode == "jit", mode
    import jax

    @jax.jit
    def step(trainable, fixed, x, mask):
        return layer.stateless_call(trainable, fixed, x, training=True, mask=mask)

    def call(x, mask=None):
        if not layer.built:
            layer.build(np.shape(x))
        trainable = [v.value for v in layer.trainable_variables]
        fixed = [v.value for v in layer.non_trainable_variables]
        y, new = step(trainable, fixed, x, mask)
        for variable, value in zip(layer.non_trainable_variables, new):
            variable.assign(value)
        return y

    return call


def random_affine_bn(shape, axis=-1, momentum=0.9, epsilon=1e-3, seed=0, **kwargs):
    """A keras_bn layer built for `shape`, with random γ and β (so that a swapped pair would
    show)."""
    layer = keras_bn.BatchNormalization(axis=axis, momentum=momentum, epsilon=epsilon, **kwargs)
    layer.build(shape)
    rng = np.random.default_rng(seed)
    for weight in (layer.gamma, layer.beta):
        if weight is not None:
            weight.assign(rng.uniform(0.5, 1.5, weight.shape).astype("float32"))
    return layer


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


def relu_then_bn_block():
    """A nested model "inner": Dense(4) with its ReLU, then a keras_bn BN ("after_relu"),
    which the fold keeps (unfoldable)."""
    return keras.Sequential(
        [
            keras.Input((4,)),
            L.Dense(4, activation="relu"),
            keras_bn.BatchNormalization(name="after_relu"),
        ],
        name="inner",
    )


def mistaken_model():
    """Three BN mistakes for check_batchnorm to find: statistics far from the data ("shifted",
    a Keras BN), statistics never updated ("untrained", which the fold keeps too: no host
    before it), and a BN after a ReLU in a nested model ("inner/after_relu", its statistics
    off their initial values)."""
    inner = relu_then_bn_block()
    model = keras.Sequential(
        [
            keras.Input((3,)),
            L.Dense(4),
            L.BatchNormalization(name="shifted"),
            keras_bn.BatchNormalization(name="untrained"),
            inner,
            L.Dense(2),
        ],
        name="mistaken",
    )
    model.get_layer("shifted").moving_mean.assign(np.array([9.0, -9.0, 9.0, -9.0], "float32"))
    after_relu = inner.get_layer("after_relu")
    after_relu.moving_mean.assign(np.full(4, 0.3, "float32"))
    after_relu.moving_variance.assign(np.full(4, 0.7, "float32"))
    return model


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

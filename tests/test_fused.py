"""The fused fast path (FusedBatchNormV3 + FusedBatchNormGradV3) against the composite
analytic path: outputs, gradients and moving statistics, eager, graph and XLA."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_bn
from helpers import assert_close, numpy_bn_train
from keras_bn.backend.tensorflow import fused, ops
from keras_bn.backend.tensorflow.fused import fused_data_format
from tf_helpers import large_offset_errors

pytestmark = pytest.mark.backends("tensorflow")

# (shape, axis): every layout the fast path takes.
FUSED_LAYOUTS = {
    "nhwc": ((8, 5, 5, 6), -1),
    "nchw": ((8, 6, 5, 5), 1),
    "2d": ((32, 6), -1),
    "sequence": ((4, 7, 6), -1),
    "sequence_channels_first": ((4, 6, 7), 1),
    "ndhwc": ((3, 3, 4, 4, 6), -1),
    "ncdhw": ((3, 6, 3, 4, 4), 1),
}
MODES = ["eager", "graph", "xla"]


def _run(fn, mode):
    if mode == "eager":
        return fn()
    return tf.function(fn, jit_compile=(mode == "xla"))()


def _layer_pair(shape, axis, momentum=0.8):
    fused, composite = (keras_bn.BatchNormalization(axis=axis, momentum=momentum) for _ in range(2))
    composite._fused = False
    rng = np.random.default_rng(0)
    for layer in (fused, composite):
        layer.build(shape)
    weights = [rng.uniform(0.5, 1.5, size=w.shape).astype("float32") for w in fused.weights]
    for layer in (fused, composite):
        layer.set_weights(weights)
    return fused, composite


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", FUSED_LAYOUTS)
def test_fused_matches_composite(layout, mode):
    shape, axis = FUSED_LAYOUTS[layout]
    fused, composite = _layer_pair(shape, axis)
    rng = np.random.default_rng(1)
    upstream = tf.constant(rng.normal(size=shape).astype("float32"))
    batches = [
        tf.constant(rng.normal(2.0 - step, 3.0, size=shape).astype("float32")) for step in range(3)
    ]
    results = {}
    for name, layer in (("fused", fused), ("composite", composite)):
        for x in batches:

            def train_step(layer=layer, x=x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = layer(x, training=True)
                    loss = tf.reduce_sum(y * upstream)
                return [y] + tape.gradient(loss, [x] + layer.trainable_weights)

            out = _run(train_step, mode)
        results[name] = [t.numpy() for t in out] + [w.numpy() for w in layer.non_trainable_weights]
    # y, dx, dgamma, dbeta, moving_mean, moving_variance
    for f, c in zip(results["fused"], results["composite"]):
        assert_close(f, c, 1e-5)


def test_fast_path_is_taken_exactly_where_it_applies():
    f32 = tf.zeros([4, 3, 3, 2])
    assert fused_data_format(f32, [3], 1e-3) == "NHWC"
    assert fused_data_format(tf.zeros([4, 2, 3, 3]), [1], 1e-3) == "NCHW"
    assert fused_data_format(tf.zeros([4, 2], tf.bfloat16), [1], 1e-3) == "NHWC"
    assert fused_data_format(tf.zeros([4, 3, 3, 2], tf.float64), [3], 1e-3) is None
    assert fused_data_format(f32, [1, 3], 1e-3) is None
    assert fused_data_format(f32, [2], 1e-3) is None
    assert fused_data_format(f32, [3], 1e-6) is None  # below cuDNN's minimum epsilon
    assert fused_data_format(f32, [3], 1e-3, mask=tf.ones([4, 3, 3, 1])) is None
    with pytest.raises(ValueError, match="fused batch-norm kernel does not apply"):
        ops.batch_norm_train(f32, tf.ones([2, 2]), tf.zeros([2, 2]), [1, 3], 1e-3, fused=True)


def test_fused_op_really_runs_the_fused_kernel():
    x = tf.zeros([4, 3, 3, 2])
    graph = (
        tf.function(lambda x: ops.batch_norm_train(x, tf.ones([2]), tf.zeros([2]), [3], 1e-3)[0])
        .get_concrete_function(x)
        .graph
    )
    assert "FusedBatchNormV3" in {op.type for op in graph.get_operations()}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_fused_half_precision_matches_composite(policy, mode):
    """16-bit inputs go to the kernel as they are, statistics in float32."""
    keras.mixed_precision.set_global_policy(policy)
    shape, axis = FUSED_LAYOUTS["nhwc"]
    fused, composite = _layer_pair(shape, axis)
    x = tf.constant(np.random.default_rng(2).normal(50.0, 4.0, size=shape).astype("float32"))
    for layer in (fused, composite):
        y = _run(lambda layer=layer: layer(tf.cast(x, policy.split("_")[1]), training=True), mode)
        assert y.dtype == policy.split("_")[1]
        layer.output_value = y
    tol = 1e-2 if policy == "mixed_bfloat16" else 2e-3
    assert_close(fused.output_value, composite.output_value, tol)
    for f, c in zip(fused.non_trainable_weights, composite.non_trainable_weights):
        assert f.dtype == "float32"
        assert_close(f, c, 1e-5)


@pytest.mark.parametrize("dtype,loc,scale", [("float32", 1e3, 1e-2), ("float16", 1e3, 1.0)])
def test_xla_keeps_accurate_statistics_at_large_offsets(dtype, loc, scale):
    """XLA lowers the fused kernel's variance to E[x²]−E[x]² (off by ×1000s here), so under
    jit_compile the composite path must be used instead."""
    x = tf.cast(np.random.default_rng(2).normal(loc, scale, size=(8, 5, 5, 6)), dtype)
    exact = tf.cast(x, tf.float64).numpy().var(axis=(0, 1, 2))
    step = tf.function(
        lambda x: ops.batch_norm_train(x, tf.ones([6]), tf.zeros([6]), [3], 1e-3),
        jit_compile=True,
    )
    _, _, variance = step(x)
    assert_close(variance, exact, 1e-5)
    with pytest.raises(ValueError, match="XLA True"):
        tf.function(
            lambda x: ops.batch_norm_train(x, tf.ones([6]), tf.zeros([6]), [3], 1e-3, fused=True),
            jit_compile=True,
        )(x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", FUSED_LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_inference_matches_affine_reference(layout, mode, dtype):
    """`batch_norm_eval` (the fused kernel's inference mode where the layout allows) equals
    a·x + b computed in float64 from the same statistics."""
    shape, axis = FUSED_LAYOUTS[layout]
    channels = shape[axis]
    rng = np.random.default_rng(3)
    x = tf.cast(rng.normal(1.0, 2.0, size=shape), dtype)
    mean, gamma, beta = (rng.normal(size=channels) for _ in range(3))
    variance = rng.uniform(0.5, 2.0, size=channels)
    params = [tf.constant(p, tf.float32) for p in (mean, variance, gamma, beta)]
    channel_axes = [axis % len(shape)]
    y = _run(lambda: ops.batch_norm_eval(x, *params, channel_axes, 1e-3), mode)
    bshape = [channels if i in channel_axes else 1 for i in range(len(shape))]
    a = (gamma / np.sqrt(variance + 1e-3)).reshape(bshape)
    expected = a * tf.cast(x, tf.float64).numpy() + (
        beta.reshape(bshape) - a * mean.reshape(bshape)
    )
    tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}[dtype]
    assert_close(tf.cast(y, tf.float64), expected, tol)


# Mean 1e3, std 1e-2 in float32 (resolution 6e-5 at 1e3, σ/160): each path's documented
# accuracy there (docs/guide/layer.md, "Far from zero"), scale-relative, against float64.
LARGE_OFFSET_BOUNDS = {  # path: (output and ∂l/∂x, moving variance)
    "fused": (1e-5, 1e-5),  # the kernel re-run on re-centred x (backend/tensorflow/fused.py)
    "xla_cpu": (1e-5, 1e-5),
    "composite": (1e-5, 1e-5),  # x centred as (x − shift) − residual (statistics.py)
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", FUSED_LAYOUTS)
def test_each_path_keeps_its_documented_accuracy_at_a_large_offset(layout, mode):
    shape, axis = FUSED_LAYOUTS[layout]
    automatic = "xla_cpu" if mode == "xla" else "fused"
    for path, composite in ((automatic, False), ("composite", True)):
        errors = large_offset_errors(shape, axis, mode, composite)
        output_bound, variance_bound = LARGE_OFFSET_BOUNDS[path]
        assert errors["y"] < output_bound, (path, errors)
        assert errors["dx"] < max(output_bound, 2e-4), (path, errors)
        assert errors["moving_variance"] < variance_bound, (path, errors)
        assert errors["moving_mean"] < 1e-6, (path, errors)  # float32 resolution: 6e-8


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_without_recentring_the_fused_kernel_is_off_at_a_large_offset(monkeypatch, mode):
    """The kernel's own accuracy there (docs/guide/layer.md): what the re-centring fixes."""
    monkeypatch.setattr(fused, "RECENTRE_STDDEVS", None)
    errors = large_offset_errors(*FUSED_LAYOUTS["nhwc"], mode)
    assert errors["y"] > 1e-3 and errors["moving_variance"] > 1e-4, errors
    assert errors["y"] < 2e-2 and errors["moving_variance"] < 5e-3, errors  # the documented


def _fused_train(x, channel_axes, mode):
    channels = x.shape[channel_axes[0]]
    data_format = fused_data_format(x, channel_axes, 1e-3)
    return _run(
        lambda: fused.batch_norm_train(
            x, tf.ones([channels]), tf.zeros([channels]), channel_axes, 1e-3, data_format
        ),
        mode,
    )


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("shape,axis", [((16, 4, 4, 3), 3), ((16, 3, 4, 4), 1)])
def test_recentring_reruns_the_kernel_only_where_a_channel_is_far_from_zero(
    monkeypatch, shape, axis, mode
):
    rng = np.random.default_rng(8)
    usual = rng.normal(1.0, 2.0, shape).astype("float32")  # |μ|/σ = 0.5
    shipped = _fused_train(tf.constant(usual), [axis], mode)
    monkeypatch.setattr(fused, "RECENTRE_STDDEVS", None)
    off = _fused_train(tf.constant(usual), [axis], mode)
    monkeypatch.undo()
    for a, b in zip(shipped, off):  # the first pass stands: bit for bit
        np.testing.assert_array_equal(a, b)
    # Channel 1 at |μ|/σ = 1e5, channel 0 NaN at one position: channel 1 re-centred and
    # exact, channel 0 left as it is (NaN, as without the re-centring), channel 2 unharmed.
    far = usual.copy()
    index = [slice(None)] * len(shape)
    index[axis] = 1
    far[tuple(index)] = 1e3 + 1e-2 * far[tuple(index)]
    nan_at = [0] * len(shape)
    nan_at[axis] = 0
    far[tuple(nan_at)] = np.nan
    y, mean, variance = (t.numpy() for t in _fused_train(tf.constant(far), [axis], mode))
    expected, expected_mean, expected_variance = numpy_bn_train(
        far.astype(np.float64), np.ones(3), np.zeros(3), [axis]
    )
    assert np.all(np.isnan(np.take(y, 0, axis))) and np.isnan(mean[0]) and np.isnan(variance[0])
    for channel in (1, 2):
        assert_close(np.take(y, channel, axis), np.take(expected, channel, axis), 1e-5)
        assert_close(variance[channel], expected_variance[channel], 1e-5)
        # Within 2 float32 units: the shift plus the re-run's mean, each rounded.
        assert abs(mean[channel] - expected_mean[channel]) <= 2.4e-7 * abs(expected_mean[channel])

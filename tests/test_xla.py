"""The XLA:CPU train path (backend/tensorflow/xla.py): where it is selected, and that it is as
exact as the path without XLA. References: the same layer traced without XLA (the fused kernel or
the composite ops), and float64 numpy normalization of the same float32 data."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_bn
from helpers import assert_close
from keras_bn.backend.constants import SHIFT_REDO_RATIO
from keras_bn.backend.tensorflow import ops, xla
from tf_helpers import mirrored_strategy

pytestmark = pytest.mark.backends("tensorflow")

# (shape, axis): bench_layer's layouts at test size, sizes that GROUPS does not divide (padded
# sums), several channel axes and a 5D volume.
LAYOUTS = {
    "nhwc": ((16, 6, 6, 8), -1),
    "nchw": ((16, 8, 6, 6), 1),
    "2d": ((64, 12), -1),
    "sequence": ((8, 10, 12), -1),
    "odd_2d": ((37, 5), -1),
    "odd_nhwc": ((5, 3, 7, 4), -1),
    "odd_nchw": ((6, 4, 5, 3), 1),
    "two_axes": ((6, 4, 5, 3), [1, 3]),
    "ndhwc": ((3, 4, 4, 2, 6), -1),
}


def _layer(shape, axis, policy="float32", momentum=0.5, epsilon=1e-3):
    layer = keras_bn.BatchNormalization(axis=axis, momentum=momentum, epsilon=epsilon, dtype=policy)
    layer.build(shape)
    rng = np.random.default_rng(0)
    layer.set_weights([rng.uniform(0.5, 1.5, w.shape).astype("float32") for w in layer.weights])
    return layer


def _recording_step(layer, paths):
    """A train step of `layer`, (x, upstream) -> [y, ∂l/∂x, ∂l/∂γ, ∂l/∂β] for l = Σ y·upstream,
    that appends the path batch_norm_train takes to `paths` when traced."""

    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
        paths.append(ops.train_path(x, layer._channel_axes, layer.epsilon))
        return [y] + tape.gradient(loss, [x] + layer.trainable_weights)

    return step


def _train_steps(layer, batches, upstream, jit, signature=None):
    """Train steps of `layer` on each batch, traced with or without XLA. Returns the last
    step's [y, ∂l/∂x, ∂l/∂γ, ∂l/∂β] and the path that batch_norm_train took."""
    paths = []
    step = _recording_step(layer, paths)
    compiled = tf.function(lambda x: step(x, upstream), jit_compile=jit, input_signature=signature)
    for x in batches:
        out = compiled(tf.constant(x, layer.compute_dtype))
    return [tf.cast(t, tf.float64).numpy() for t in out], set(paths)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_xla_matches_the_non_xla_path(layout):
    """Outputs, gradients and moving statistics (after 3 steps) within 1e-5 of the same
    layer without XLA, on normal data."""
    shape, axis = LAYOUTS[layout]
    rng = np.random.default_rng(1)
    batches = [rng.normal(2.0 - step, 3.0, shape).astype("float32") for step in range(3)]
    upstream = tf.constant(rng.normal(size=shape), tf.float32)
    results = {}
    for jit in (False, True):
        layer = _layer(shape, axis)
        out, paths = _train_steps(layer, batches, upstream, jit)
        results[jit] = out + [w.numpy() for w in layer.non_trainable_weights]
        assert paths == {"xla_cpu"} if jit else "xla_cpu" not in paths
    for compiled, reference in zip(results[True], results[False]):
        assert_close(compiled, reference, 1e-5)


@pytest.mark.parametrize(
    "signature",
    [[None, 8, 8, 6], [None, 6, None, None], [None, 6]],
    ids=["batch", "nchw_spatial", "2d"],
)
def test_xla_with_dynamic_shapes_matches_the_non_xla_path(signature):
    """Shapes known only when XLA compiles (Keras retraces `fit` so after a short last
    batch): the grouped axis is padded, or a static one is used."""
    axis = 1 if signature[1] == 6 and len(signature) == 4 else -1
    shape = [11 if d is None else d for d in signature]
    rng = np.random.default_rng(2)
    batches = [rng.normal(-1.0, 2.0, shape).astype("float32")]
    upstream = tf.constant(rng.normal(size=shape), tf.float32)
    spec = [tf.TensorSpec(signature, tf.float32)]
    results = {}
    for jit in (False, True):
        layer = _layer(shape, axis)
        out, paths = _train_steps(layer, batches, upstream, jit, spec)
        results[jit] = out + [w.numpy() for w in layer.non_trainable_weights]
        assert jit is False or paths == {"xla_cpu"}
    for compiled, reference in zip(results[True], results[False]):
        assert_close(compiled, reference, 1e-5)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_xla_half_precision_matches_the_non_xla_path(policy):
    """16-bit inputs: float32 statistics within 1e-5, outputs within the 16-bit resolution."""
    keras.mixed_precision.set_global_policy(policy)
    shape, axis = LAYOUTS["nhwc"]
    rng = np.random.default_rng(3)
    batches = [rng.normal(5.0, 2.0, shape).astype("float32") for _ in range(2)]
    upstream = tf.constant(rng.normal(size=shape), tf.float32)
    results = {}
    for jit in (False, True):
        layer = _layer(shape, axis, policy=policy)
        out, paths = _train_steps(layer, batches, upstream, jit)
        assert jit is False or paths == {"xla_cpu"}
        results[jit] = out, [w.numpy() for w in layer.non_trainable_weights]
    tol = 1e-2 if policy == "mixed_bfloat16" else 2e-3
    for compiled, reference in zip(results[True][0], results[False][0]):
        assert_close(compiled, reference, tol)
    for compiled, reference in zip(results[True][1], results[False][1]):
        assert_close(compiled, reference, 1e-5)


def _normalized64(x, epsilon):
    x64 = x.astype(np.float64)
    axes = tuple(range(x.ndim - 1))
    return (x64 - x64.mean(axes)) / np.sqrt(x64.var(axes) + epsilon), x64.var(axes)


@pytest.mark.parametrize(
    "outlier",
    [None, (0, 0, 0), (100, 3, 5)],
    ids=["normal", "outlier_at_the_shift_sample", "outlier_inside"],
)
def test_xla_is_exact_at_a_large_offset(outlier):
    """Mean 1e4, std 1e-2 in float32 (resolution 1e-3, a tenth of σ): the output within 1e-3
    of a float64 normalization of the same float32 values, also with one sample 100σ away.
    At index 0 that sample is the shift K of the shifted sums: (μ − K)² ≈ 1e4·σ², far over the
    recentring threshold, so the moments are taken again about the mean."""
    rng = np.random.default_rng(4)
    x = 1e4 + 1e-2 * rng.standard_normal((256, 8, 8, 4))
    if outlier is not None:
        x[outlier] += 100 * 1e-2
    x = x.astype(np.float32)
    epsilon = 1e-6  # far below σ² = 1e-4, so that it hides nothing
    layer = _layer(x.shape, -1, momentum=0.0, epsilon=epsilon)
    layer.set_weights([np.ones(4), np.zeros(4), np.zeros(4), np.ones(4)])
    (y, dx, _, _), paths = _train_steps(layer, [x], tf.ones(x.shape), jit=True)
    assert paths == {"xla_cpu"}
    expected, variance = _normalized64(x, epsilon)
    # Absolute, in units of σ: relative to the largest output (the outlier's ≈ 80) would
    # hide errors in all the others.
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-3)
    m = x.size // 4
    assert_close(layer.moving_variance, variance * m / (m - 1), 1e-3)
    assert_close(layer.moving_mean, x.astype(np.float64).mean((0, 1, 2)), 1e-7)
    assert np.isfinite(dx).all()


@pytest.mark.slow
@pytest.mark.parametrize("sigmas", [3.0, 6.0, 7.9])
def test_a_first_sample_several_sigma_out_costs_no_accuracy(sigmas):
    """The first sample several σ from the mean (below the old 8σ recentring threshold, where
    the shifted sums lost up to 2.6e-5 of the variance): the moving variance, the output and
    ∂l/∂x stay within 5e-6 of float64, over 10 seeds."""
    m = 4096
    # One layer and one XLA compilation for the 10 seeds (_train_steps's step, with the
    # upstream gradient an argument): the weights and statistics are set again per seed, and
    # momentum 0 makes the moving statistics the batch's alone.
    layer = _layer((m, 1), -1, momentum=0.0, epsilon=1e-8)
    paths = []
    step = tf.function(_recording_step(layer, paths), jit_compile=True)

    for seed in range(10):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((m, 1))
        x[0] = x[1:].mean() + sigmas * x[1:].std()
        x = x.astype(np.float32)
        layer.set_weights([np.ones(1), np.zeros(1), np.zeros(1), np.ones(1)])
        upstream = rng.standard_normal(x.shape).astype(np.float32)
        out = step(tf.constant(x), tf.constant(upstream))
        y, dx, _, _ = [tf.cast(t, tf.float64).numpy() for t in out]
        assert set(paths) == {"xla_cpu"}
        x64 = x.astype(np.float64)
        expected, variance = _normalized64(x, 1e-8)
        assert_close(layer.moving_variance, variance * m / (m - 1), 5e-6)
        np.testing.assert_allclose(y, expected, rtol=0, atol=5e-6 * np.abs(expected).max())
        # ∂l/∂x of l = Σ g·x̂ in float64: (g − mean(g) − x̂·mean(g·x̂)) / σ
        g = upstream.astype(np.float64)
        dx64 = (g - g.mean(0) - expected * (g * expected).mean(0)) / np.sqrt(x64.var(0) + 1e-8)
        np.testing.assert_allclose(dx, dx64, rtol=0, atol=5e-6 * np.abs(dx64).max())


def test_squares_that_overflow_are_recentred_not_skipped():
    """Finite values whose squares about K overflow float32 (Σ(x − K)² = inf): the pass is
    redone about the mean instead of giving y = β and skipping every channel's update."""
    x = np.array([[5e18, 1.0], [-5e18, 2.0]] * 4, np.float32)
    layer = _layer(x.shape, -1, momentum=0.0)
    layer.set_weights([np.ones(2), np.zeros(2), np.zeros(2), np.ones(2)])
    (y, _, _, _), paths = _train_steps(layer, [x], tf.ones(x.shape), jit=True)
    assert paths == {"xla_cpu"}
    expected, variance = _normalized64(x, 1e-3)
    np.testing.assert_allclose(y, expected, rtol=1e-5)
    assert_close(layer.moving_variance, variance * 8 / 7, 1e-5)


def test_a_shift_from_values_near_the_float32_limit_does_not_overflow():
    """K, a mean of up to 8 samples, is summed from terms already divided by their count: a
    channel at 1e38 (8 of them sum past float32's 3.4e38) keeps K finite, and normalizes."""
    x = np.full((16, 2), 1e38, np.float32)
    x[:, 1] = np.arange(16)
    layer = _layer(x.shape, -1, momentum=0.0)
    layer.set_weights([np.ones(2), np.zeros(2), np.zeros(2), np.ones(2)])
    (y, _, _, _), paths = _train_steps(layer, [x], tf.ones(x.shape), jit=True)
    assert paths == {"xla_cpu"}
    expected, variance = _normalized64(x, 1e-3)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    assert_close(layer.moving_mean, [1e38, 7.5], 1e-6)
    assert_close(layer.moving_variance, variance * 16 / 15, 1e-5)


def test_shifted_sums_need_the_recentring_guard():
    """The failure the guard exists for, shown on the pieces: with K 1000σ away from the data,
    Σ(x − K)²/m − Δμ² loses the variance; one recentred pass recovers it."""
    rng = np.random.default_rng(5)
    x = (1e4 + 1e-2 * rng.standard_normal((4096, 1))).astype(np.float32)
    exact = x.astype(np.float64).var(axis=0)
    shift = tf.constant([[1e4 + 10.0]], tf.float32)  # 1000σ above the mean

    def sums(summands, *tensors):
        return xla._paired_sums(summands, tensors, 0, [0])

    _, offset, bare = xla._shifted_moments(tf.constant(x), shift, x.shape[0], sums)
    assert abs(float(bare[0, 0]) / exact[0] - 1) > 1e-2  # the cancellation
    assert float(tf.square(offset)[0, 0]) > SHIFT_REDO_RATIO * float(bare[0, 0])  # detected
    _, _, recentred = xla._shifted_moments(tf.constant(x), shift + offset, x.shape[0], sums)
    assert_close(recentred[0], exact, 1e-4)


def _path_when_traced(path_of, x, jit=True):
    """What `path_of(x)` returns while x is traced in a tf.function (XLA or not)."""
    paths = []

    def trace(t):
        paths.append(path_of(t))
        return t

    tf.function(trace, jit_compile=jit).get_concrete_function(tf.TensorSpec(x.shape, x.dtype))
    return paths[0]


def test_xla_path_is_selected_only_under_xla_on_cpu():
    nhwc = tf.zeros([8, 4, 4, 3])
    path = lambda x, **kw: ops.train_path(x, [3], 1e-3, **kw)  # noqa: E731
    assert _path_when_traced(path, nhwc, jit=False) == "fused"
    assert _path_when_traced(path, nhwc) == "xla_cpu"
    for dtype in (tf.float16, tf.bfloat16, tf.float64):
        assert _path_when_traced(path, tf.zeros([8, 4, 4, 3], dtype)) == "xla_cpu"
    assert _path_when_traced(lambda x: ops.train_path(x, [1, 3], 1e-3), nhwc) == "xla_cpu"
    # The composite path: forced, under a mask, or with only the minor axis reduced.
    assert _path_when_traced(lambda x: path(x, fused=False), nhwc) == "composite"
    mask = tf.ones([8, 4, 4, 1])
    assert _path_when_traced(lambda x: path(x, mask=mask), nhwc) == "composite"
    assert _path_when_traced(lambda x: ops.train_path(x, [0], 1e-3), tf.zeros([3, 8])) == (
        "composite"
    )

    def on_gpu(x):  # traced only: placing it needs no GPU
        with tf.device("/GPU:0"):
            return path(x)

    assert _path_when_traced(on_gpu, nhwc) == "composite"


def test_synchronized_replicas_keep_the_composite_path_under_xla():
    strategy = mirrored_strategy(2)
    paths = []

    def replica_step(x):
        context = tf.distribute.get_replica_context()
        paths.append(ops.train_path(x, [1], 1e-3, replica_context=context))
        return x

    step = tf.function(lambda x: strategy.run(replica_step, (x,)), jit_compile=True)
    step.get_concrete_function(tf.TensorSpec([8, 4]))
    assert paths == ["composite", "composite"]


def test_group_axis_prefers_a_static_axis_that_groups_divide():
    assert xla.group_axis([64, 32, 32, 16], [3]) == 0
    assert xla.group_axis([None, 32, 32, 16], [3]) == 1
    assert xla.group_axis([6, 16, 5, 5], [1]) == 0  # none divisible: the first, padded
    assert xla.group_axis([12, 16], [1]) == 0
    assert xla.group_axis([16, 12], [0]) is None  # only the minor axis is reduced


def test_empty_batch_known_only_at_run_time_changes_nothing_under_xla():
    """Under XLA an empty batch (m ≤ 1 known only at run time: docs/guide/errors.md) gives an
    empty output and leaves the moving statistics alone, as the composite path does."""
    for fused in (None, False):
        layer = _layer((4, 5, 3), -1)
        layer._fused = fused
        before = [w.numpy() for w in layer.weights]
        step = tf.function(
            lambda x, layer=layer: layer(x, training=True),
            jit_compile=True,
            input_signature=[tf.TensorSpec([None, None, 3])],
        )
        assert step(tf.zeros([0, 5, 3])).shape == (0, 5, 3)
        for w, b in zip(layer.weights, before):
            np.testing.assert_array_equal(w.numpy(), b)

"""The moments at 262,144 and 1,048,576 values per channel (issue 32, item 6), on every
TensorFlow train path (fused, XLA:CPU, composite), in the training step under JAX (jitted, as
fit runs it) and PyTorch, and in recalibrate under every backend, against float64 numpy.

The data is the issue's worst case for the shifted sums: N(0, 1) with the first 8 samples of
each channel at 2.9σ, so that the shift K (their mean) sits just under the 3σ redo and the
shifted sums lose their most (a factor 1 + 2.9² ≈ 9.4) to rounding.

The bound, 1e-5 of the variance, is what float32 sums can keep at any count: each stage of a
blocked sum adds up at most 4096 terms, measured 2e-7–5e-7 relative (TF 2.21, CPU), 5e-6 once
amplified by the shift. Summed in one stage the error grows with the count: 2e-5–6e-5 at
262,144 and 1.2e-4–4.7e-4 at 1,048,576 before the fix, depending on the path. XLA:CPU's
reductions under JAX already kept it (2.4e-6 at 2²⁰ before the TensorFlow fix): those tests
guard it.
"""

import keras
import numpy as np
import pytest
from bn_references import numpy_train
from framework_references import array

import keras_bn
from helpers import training_call, training_modes

# TensorFlow's train paths (its fused kernel, XLA, the composite ops under tf.function).
tensorflow_paths = pytest.mark.backends("tensorflow")

BOUND = 1e-5
CHANNELS = 4
# (batch, side): 262,144 and 1,048,576 values per channel.
SIZES = {"262k": (256, 32), "1M": (1024, 32)}
# Four channels, as in the issue: with one, XLA:CPU vectorises the sum across the reduced axis
# (8 accumulators), and its one-stage error was 10× smaller.


def _data(batch, side):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, side, side, CHANNELS)).astype(np.float32)
    x[:8, 0, 0, :] = 2.9  # K = the mean of the first 8 values: 2.9σ from the mean
    return x


@pytest.fixture(scope="module", params=list(SIZES))
def data(request):
    x = _data(*SIZES[request.param])
    return x, x.astype(np.float64).var(axis=(0, 1, 2))


def _relative(value, reference):
    return float(np.max(np.abs(np.asarray(value, np.float64).ravel() / reference - 1)))


def _trained_variance(x, jit_compile, fused=None, batch_known=True):
    """One training call of a keras_bn layer with momentum 0, traced in graph mode: its
    moving variance is then the batch's m/(m−1)·σ², returned as the biased σ²."""
    import tensorflow as tf

    layer = keras_bn.BatchNormalization(momentum=0.0)
    layer.build(x.shape)
    layer._fused = fused
    shape = x.shape if batch_known else (None,) + x.shape[1:]
    step = tf.function(
        lambda x: layer(x, training=True),
        jit_compile=jit_compile,
        input_signature=[tf.TensorSpec(shape, tf.float32)],
    )
    step(tf.constant(x))
    m = x.size // x.shape[-1]
    return layer.moving_variance.numpy() * (m - 1) / m


@tensorflow_paths
def test_fused_path_variance(data):
    x, reference = data
    assert _relative(_trained_variance(x, jit_compile=False), reference) < BOUND


@tensorflow_paths
def test_fused_path_variance_batch_size_known_at_run_time(data):
    """fit traces the batch size as unknown: the count is known only at run time."""
    x, reference = data
    assert _relative(_trained_variance(x, False, batch_known=False), reference) < BOUND


@tensorflow_paths
def test_fused_path_batch_variance_eager(data):
    import tensorflow as tf

    from keras_bn.backend.tensorflow import ops

    x, reference = data
    _, _, variance = ops.batch_norm_train(
        tf.constant(x), tf.ones(CHANNELS), tf.zeros(CHANNELS), [3], 1e-3
    )
    assert _relative(variance, reference) < BOUND


@tensorflow_paths
def test_xla_path_variance(data):
    x, reference = data
    assert _relative(_trained_variance(x, jit_compile=True), reference) < BOUND


@tensorflow_paths
def test_composite_path_variance(data):
    x, reference = data
    assert _relative(_trained_variance(x, jit_compile=False, fused=False), reference) < BOUND


@tensorflow_paths
def test_composite_path_batch_variance_under_xla(data):
    """fused=False under XLA: the composite ops compiled, where XLA would merge two-stage sums."""
    import tensorflow as tf

    from keras_bn.backend.tensorflow import ops

    x, reference = data
    train = tf.function(
        lambda x: ops.batch_norm_train(
            x, tf.ones(CHANNELS), tf.zeros(CHANNELS), [3], 1e-3, fused=False
        )[2],
        jit_compile=True,
    )
    assert _relative(train(tf.constant(x)), reference) < BOUND


# JAX's training step as its fit runs it, jitted; PyTorch's eager (TensorFlow's: above).
@pytest.mark.parametrize(
    "mode", training_modes("jit") + [pytest.param("eager", marks=pytest.mark.backends("torch"))]
)
def test_training_variance(data, mode):
    x, reference = data
    layer = keras_bn.BatchNormalization(momentum=0.0)
    layer.build(x.shape)
    training_call(layer, mode)(x)
    m = x.size // CHANNELS
    assert _relative(array(layer.moving_variance) * (m - 1) / m, reference) < BOUND


def test_recalibrate_variance(data):
    x, reference = data
    model = keras.Sequential([keras.Input(x.shape[1:]), keras_bn.BatchNormalization()])
    keras_bn.recalibrate(model, x, batch_size=len(x), progress=False)
    m = x.size // CHANNELS
    moving = array(model.layers[0].moving_variance) * (m - 1) / m
    assert _relative(moving, reference) < BOUND


@tensorflow_paths
@pytest.mark.parametrize("batch", [16, 128])  # 16,384 and 131,072 values: either side of 2¹⁶
def test_run_time_count_keeps_the_kernels_output_and_gradients(batch):
    """With the batch size known only at run time (fit) a tf.cond on the count recomputes the
    fused path's statistics above fused.MAX_COUNT: y and every gradient stay the kernel's, as
    with the batch size known, and the statistics are the same either way."""
    import tensorflow as tf

    from keras_bn.backend.tensorflow import ops

    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((batch, 32, 32, CHANNELS)).astype(np.float32))
    upstream = tf.constant(rng.standard_normal(x.shape).astype(np.float32))
    gamma, beta = tf.constant([1.3, 0.7, 1.0, 2.0]), tf.constant([0.2, 0.0, -1.0, 0.5])

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            y, mean, variance = ops.batch_norm_train(x, gamma, beta, [3], 1e-3, fused=True)
            loss = tf.reduce_sum(y * upstream)
        return [y, mean, variance, *tape.gradient(loss, [x, gamma, beta])]

    run_time = tf.TensorSpec((None, 32, 32, CHANNELS), tf.float32)
    routed = tf.function(step, input_signature=[run_time])(x)
    known = tf.function(step, input_signature=[tf.TensorSpec(x.shape, tf.float32)])(x)
    for got, want in zip(routed, known):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))


@tensorflow_paths
@pytest.mark.parametrize("batch_known", [True, False], ids=["batch_known", "batch_at_run_time"])
def test_far_from_zero_the_fused_step_stays_exact(batch_known):
    """At 1,048,576 values per channel with the mean 10⁵ σ from zero, y was off by 45% and ∂l/∂x
    by 33% (a re-audit's repro): the kernel re-centred on its own first-pass mean, itself off
    by hundreds of σ there. Re-centred on the mean of each channel's first values, y and
    ∂l/∂x keep the kernel's rounding on centred data at this count (1e-4 of their largest
    value), and the moving variance that of the blocked sums."""
    import tensorflow as tf

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((1024, 32, 32, CHANNELS)) + 1e5).astype(np.float32)
    upstream = rng.standard_normal(x.shape).astype(np.float32)
    layer = keras_bn.BatchNormalization(momentum=0.0)
    layer.build(x.shape)

    def step(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = layer(t, training=True)
            loss = tf.reduce_sum(y * upstream)
        return y, tape.gradient(loss, t)

    shape = x.shape if batch_known else (None,) + x.shape[1:]
    y, dx = tf.function(step, input_signature=[tf.TensorSpec(shape, tf.float32)])(x)
    want_y, _, variance, m = numpy_train(x, np.ones(4), np.zeros(4), [3], 1e-3)
    np.testing.assert_allclose(y, want_y, atol=2e-4 * np.abs(want_y).max())
    # ∂l/∂x = (γ/σ)·(g − mean(g) − x̂·mean(g·x̂)), in float64
    x_hat = want_y
    g = upstream.astype(np.float64)
    axes = (0, 1, 2)
    want_dx = (g - g.mean(axes) - x_hat * (g * x_hat).mean(axes)) / np.sqrt(variance + 1e-3)
    np.testing.assert_allclose(dx, want_dx, atol=2e-4 * np.abs(want_dx).max())
    moving = layer.moving_variance.numpy() * (m - 1) / m
    assert _relative(moving, variance) < BOUND

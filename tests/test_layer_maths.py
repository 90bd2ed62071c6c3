"""keras_bn.BatchNormalization's maths under every Keras backend, against independent
references: numpy float64 formulas for the forward pass and the moving statistics (Algorithm
2's m/(m−1)), the backend framework's own autodiff of a plain batch norm (JAX's, torch's
autograd, TensorFlow's tape: the `framework` fixture, tests/framework_references.py) and float64
finite differences for the hand-written backward."""

import keras
import numpy as np
import pytest
from framework_references import array, numpy_train

import keras_bn
from helpers import random_affine_bn, training_modes

EPS = 1e-3
MOMENTUM = 0.9

# (input shape, axis, the sorted channel axes it means)
LAYOUTS = [
    ((16, 5), -1, [1]),
    ((4, 3, 3, 6), -1, [3]),
    ((4, 6, 3, 2), 1, [1]),
    ((4, 3, 2, 5), [1, -1], [1, 3]),
]


def _data(shape, seed=1, loc=2.0, scale=3.0):
    return np.random.default_rng(seed).normal(loc, scale, shape).astype("float32")


def _assert_close(actual, expected, rtol, atol=0.0):
    np.testing.assert_allclose(array(actual).astype(np.float64), expected, rtol=rtol, atol=atol)


def _close(actual, expected, tolerance):
    """Equal within `tolerance` of max(1, max |expected|), elementwise."""
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(
        array(actual).astype(np.float64), expected, rtol=0, atol=tolerance * scale
    )


def _assert_gradients_close(got, want, tolerance=2e-5):
    """Each gradient within `tolerance` of its reference's largest entry."""
    for got_grad, expected in zip(got, want, strict=True):
        scale = float(np.max(np.abs(expected)))
        _assert_close(got_grad, expected, rtol=0, atol=tolerance * scale)


@pytest.mark.parametrize(("shape", "axis", "channel_axes"), LAYOUTS)
def test_forward_and_moving_statistics_match_float64(shape, axis, channel_axes):
    layer = random_affine_bn(shape, axis)
    gamma, beta = array(layer.gamma), array(layer.beta)
    x1, x2 = _data(shape, 1), _data(shape, 2, loc=-1.0, scale=0.5)
    y, mean1, var1, m = numpy_train(x1, gamma, beta, channel_axes, EPS)
    _assert_close(layer(x1, training=True), y, rtol=1e-5, atol=1e-5)
    _, mean2, var2, _ = numpy_train(x2, gamma, beta, channel_axes, EPS)
    layer(x2, training=True)
    unbiased = m / (m - 1)
    expected_mean = MOMENTUM * (MOMENTUM * 0.0 + 0.1 * mean1) + 0.1 * mean2
    expected_var = MOMENTUM * (MOMENTUM * 1.0 + 0.1 * unbiased * var1) + 0.1 * unbiased * var2
    _assert_close(array(layer.moving_mean), expected_mean, rtol=1e-5, atol=1e-6)
    _assert_close(array(layer.moving_variance), expected_var, rtol=1e-5)
    # Inference: the affine map of the moving statistics.
    shape_b = [shape[i] if i in channel_axes else 1 for i in range(len(shape))]
    a = gamma / np.sqrt(expected_var + EPS)
    expected = (x1 - expected_mean.reshape(shape_b)) * a.reshape(shape_b) + beta.reshape(shape_b)
    _assert_close(layer(x1, training=False), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("shape", "axis", "channel_axes"), LAYOUTS)
def test_backward_matches_autodiff_of_plain_batch_norm(shape, axis, channel_axes, framework):
    """The training step's gradients (JAX: `stateless_call` under jit; PyTorch: autograd
    through the call; TensorFlow: a GradientTape) against the framework's autodiff of the plain
    formula (float64 where the framework has it by default)."""
    layer = random_affine_bn(shape, axis)
    x, cotangent = _data(shape, 3), _data(shape, 4, loc=0.0, scale=1.0)
    gamma, beta = array(layer.gamma), array(layer.beta)
    _, dx, dgamma, dbeta = framework.train_step(layer, x, cotangent)
    want = framework.plain_bn_gradients(x, gamma, beta, channel_axes, EPS, cotangent)
    _assert_gradients_close((dx, dgamma, dbeta), want)
    # ... and it is the hand-written backward that gave it, not autodiff of the forward.
    assert framework.backward_is_hand_written(layer, x)


def test_backward_matches_float64_finite_differences(framework):
    """Central differences of the float64 numpy loss at a few inputs, γ and β."""
    shape, channel_axes = (6, 2, 3), [2]
    layer = random_affine_bn(shape)
    x, cotangent = _data(shape, 5), _data(shape, 6, loc=0.0, scale=1.0)
    _, dx, dgamma, dbeta = framework.train_step(layer, x, cotangent)
    x64 = x.astype(np.float64)
    gamma, beta = array(layer.gamma).astype(np.float64), array(layer.beta).astype(np.float64)

    def loss(x, gamma, beta):
        return float(np.sum(numpy_train(x, gamma, beta, channel_axes, EPS)[0] * cotangent))

    h = 1e-5
    args = [x64, gamma, beta]
    for which, got in ((0, dx), (1, dgamma), (2, dbeta)):
        flat = np.asarray(got).reshape(-1)
        for index in range(0, args[which].size, max(1, args[which].size // 7)):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[which].reshape(-1)[index] += h
            minus[which].reshape(-1)[index] -= h
            numeric = (loss(*plus) - loss(*minus)) / (2 * h)
            assert abs(flat[index] - numeric) <= 1e-3 * max(1.0, abs(numeric)), (which, index)


def test_mask_gives_each_channel_its_own_count(framework):
    """axis=1 on (batch, time, features) with a (batch, time) mask: Keras's reading, each time
    step a channel with its own m_c; masked-out positions (NaN padding) never reach the
    statistics, and the gradient is the framework's autodiff of the masked batch norm."""
    shape, channel_axes = (6, 4, 3), [1]
    layer = random_affine_bn(shape, axis=1)
    rng = np.random.default_rng(7)
    mask = rng.random(shape[:2]) < 0.7
    mask[:2] = True  # every time step has m_c ≥ 2 · 3 values
    x = _data(shape, 8)
    x[~mask] = np.nan  # padding that must be selected away, not multiplied by 0
    kept = np.broadcast_to(mask[..., None], shape)
    gamma, beta = array(layer.gamma), array(layer.beta)
    y, mean, var, m = numpy_train(np.where(kept, x, 0.0), gamma, beta, channel_axes, EPS, kept)
    assert len(set(m.tolist())) > 1  # the counts differ per channel
    got = array(layer(x, training=True, mask=mask))
    _assert_close(got[kept], y[kept], rtol=1e-5, atol=1e-5)
    _close(got[kept], y[kept], 1e-5)
    _assert_close(array(layer.moving_mean), 0.1 * mean, rtol=1e-5, atol=1e-6)
    _assert_close(array(layer.moving_variance), 0.9 + 0.1 * var * m / (m - 1), rtol=1e-5)

    finite = np.where(kept, x, 1.5).astype("float32")  # autodiff needs finite padding
    cotangent = _data(shape, 9, loc=0.0, scale=1.0)
    _, dx, dgamma, dbeta = framework.train_step(
        random_affine_bn(shape, axis=1), finite, cotangent, mask
    )
    weight = kept.astype("float32")
    want = framework.plain_bn_gradients(finite, gamma, beta, channel_axes, EPS, cotangent, weight)
    _assert_gradients_close((dx, dgamma, dbeta), want)


def test_mask_over_the_non_channel_axes():
    """(batch, channels, time) with axis=1 and a (batch, time) mask: Keras's reading does not
    fit, the non-channel one does; a mask fitting neither is a ValueError naming both."""
    shape = (5, 3, 4)
    layer = random_affine_bn(shape, axis=1)
    mask = np.random.default_rng(2).random((5, 4)) < 0.6
    mask[0] = True
    x = _data(shape, 3)
    kept = np.broadcast_to(mask[:, None, :], shape)
    y, *_ = numpy_train(x, array(layer.gamma), array(layer.beta), [1], EPS, kept)
    got = layer(x, training=True, mask=mask)
    _assert_close(got, y, rtol=1e-5, atol=1e-5)
    _close(got, y, 1e-5)
    with pytest.raises(ValueError, match="fits no reading"):
        layer(x, training=True, mask=np.ones((5, 2), bool))


def test_channel_with_one_value_outputs_beta_and_keeps_its_statistics(framework):
    """m_c ≤ 1 known only at run time (a mask): that channel outputs β, its statistics stay,
    its gradients to x and γ are 0; the others normalize and update. With momentum=None the
    whole batch is skipped, and not counted."""
    shape = (4, 3, 2)
    x = _data(shape, 4)
    mask = np.ones((4, 3), bool)
    mask[1:, 1] = False  # time step 1 keeps one sample
    # axis=[1, 2]: each (time, feature) is a channel, so channel (1, f) has m_c = 1.
    layer = random_affine_bn(shape, axis=[1, 2])
    beta = array(layer.beta)
    y = array(layer(x, training=True, mask=mask))
    np.testing.assert_array_equal(y[:, 1, :], np.broadcast_to(beta[1], (4, 2)))
    mean, variance = array(layer.moving_mean), array(layer.moving_variance)
    np.testing.assert_array_equal(mean[1], 0.0)
    np.testing.assert_array_equal(variance[1], 1.0)
    assert np.all(mean[[0, 2]] != 0.0) and np.all(variance[[0, 2]] != 1.0)
    # The gradient there is 0 (γ is replaced by 0) and finite elsewhere; a training step
    # (the same batch) keeps that channel's statistics too.
    y, dx, dgamma, _ = framework.train_step(layer, x, _data(shape, 5), mask)
    np.testing.assert_array_equal(y[:, 1, :], np.broadcast_to(beta[1], (4, 2)))
    np.testing.assert_array_equal(array(layer.moving_mean)[1], 0.0)
    np.testing.assert_array_equal(array(layer.moving_variance)[1], 1.0)
    assert np.all(dx[:, 1, :] == 0.0) and np.all(dgamma[1] == 0.0)
    assert np.all(np.isfinite(dx)) and np.any(dx != 0.0)
    # momentum=None: the whole batch is skipped, and not counted.
    cumulative = keras_bn.BatchNormalization(axis=[1, 2], momentum=None)
    cumulative(x, training=True, mask=mask)
    assert int(array(cumulative.num_batches_tracked)) == 0
    np.testing.assert_array_equal(array(cumulative.moving_mean), 0.0)
    cumulative(x, training=True)
    assert int(array(cumulative.num_batches_tracked)) == 1


def test_static_batch_of_one_is_a_value_error():
    """As torch.nn.BatchNorm raises in training (test_torch_layer.py); inference takes it."""
    layer = keras_bn.BatchNormalization()
    with pytest.raises(ValueError, match=r"at least 2 values per channel.*m=1"):
        layer(np.ones((1, 3), "float32"), training=True)
    inference = layer(np.ones((1, 3), "float32"))  # inference takes a batch of one
    _assert_close(inference, np.ones((1, 3)) / np.sqrt(1 + 1e-3), rtol=1e-6)


def test_non_finite_batch_leaves_the_statistics_alone():
    """A NaN or inf in one channel: the output shows it, and no statistic moves (torch's own
    BatchNorm lets the NaN into running_var for ever: test_torch_layer.py)."""
    shape = (8, 3)
    layer = random_affine_bn(shape)
    layer(_data(shape, 1), training=True)
    before = [array(v).copy() for v in layer.non_trainable_variables]
    bad = _data(shape, 2)
    bad[3, 1] = np.nan
    y = array(layer(bad, training=True))
    assert np.isnan(y[:, 1]).all() and np.isfinite(y[:, [0, 2]]).all()  # the output shows it
    for variable, value in zip(layer.non_trainable_variables, before):
        np.testing.assert_array_equal(array(variable), value)  # every channel: skipped
    bad[3, 1] = np.inf
    layer(bad, training=True)
    for variable, value in zip(layer.non_trainable_variables, before):
        np.testing.assert_array_equal(array(variable), value)


def test_momentum_none_is_the_plain_average_of_the_finite_batches():
    """torch's momentum=None, whose cumulative average of the unbiased variances this equals
    (test_torch_layer.py compares them), except that the NaN batch is skipped and not counted
    (torch's would turn NaN)."""
    shape = (6, 4)
    layer = keras_bn.BatchNormalization(momentum=None)
    batches = [_data(shape, seed, loc=seed, scale=seed) for seed in (1, 2, 3)]
    nan_batch = _data(shape, 9)
    nan_batch[0, 0] = np.nan
    for batch in (batches[0], nan_batch, batches[1], batches[2]):
        layer(batch, training=True)
    assert int(array(layer.num_batches_tracked)) == 3
    means = [b.astype(np.float64).mean(0) for b in batches]
    variances = [b.astype(np.float64).var(0, ddof=1) for b in batches]
    _assert_close(array(layer.moving_mean), np.mean(means, 0), rtol=1e-6)
    _assert_close(array(layer.moving_variance), np.mean(variances, 0), rtol=1e-6)


def test_renorm_matches_its_float64_formula(framework):
    """Batch renormalization: y = γ·(x̂·r + d) + β with r, d from the renorm averages, then
    clipped; the moving statistics as without renorm, and Keras's renorm weights; r and d
    constants for the gradient."""
    shape, rmax, dmax = (8, 3), 1.5, 0.3
    layer = random_affine_bn(
        shape, renorm=True, renorm_momentum=0.8, renorm_clipping={"rmax": rmax, "dmax": dmax}
    )
    layer.renorm_mean.assign(np.array([0.5, -1.0, 2.0], "float32"))
    layer.renorm_stddev.assign(np.array([1.0, 3.0, 0.5], "float32"))
    gamma, beta = array(layer.gamma), array(layer.beta)
    renorm_mean, renorm_stddev = array(layer.renorm_mean), array(layer.renorm_stddev)
    x = _data(shape, 3)
    x_hat, mean, var, m = numpy_train(x, np.ones(3), np.zeros(3), [1], EPS)
    stddev = np.sqrt(var + EPS)
    r = np.clip(stddev / renorm_stddev, None, rmax)
    d = np.clip((mean - renorm_mean) / renorm_stddev, -dmax, dmax)
    assert np.any(r == rmax) and np.any(np.abs(d) == dmax)  # both clips are exercised
    got = layer(x, training=True)
    _assert_close(got, gamma * (x_hat * r + d) + beta, rtol=1e-5, atol=1e-5)
    _close(got, gamma * (x_hat * r + d) + beta, 1e-5)
    variance = 0.9 + 0.1 * var * m / (m - 1)
    _assert_close(array(layer.moving_variance), variance, rtol=1e-6)
    _assert_close(array(layer.moving_stddev), np.sqrt(variance + EPS), rtol=1e-6)
    _assert_close(array(layer.renorm_mean), 0.8 * renorm_mean + 0.2 * mean, rtol=1e-6)
    _assert_close(array(layer.renorm_stddev), 0.8 * renorm_stddev + 0.2 * stddev, rtol=1e-6)
    # r and d are constants for the gradient: that of y = x̂·(γr) + (β + γd).
    cotangent = _data(shape, 4, loc=0.0, scale=1.0)
    fresh = random_affine_bn(shape, renorm=True, renorm_clipping={"rmax": rmax, "dmax": dmax})
    fresh.renorm_mean.assign(renorm_mean)
    fresh.renorm_stddev.assign(renorm_stddev)
    _, dx, dgamma, dbeta = framework.train_step(fresh, x, cotangent)
    r, d = framework.constant(r), framework.constant(d)

    def plain(x, gamma, beta):
        return framework.plain_bn(x, gamma * r, beta + gamma * d, [1], EPS)

    want = framework.gradients(plain, (x, gamma, beta), cotangent)
    _assert_gradients_close((dx, dgamma, dbeta), want)


def test_ghost_batches_normalize_each_interleaved_ghost():
    """virtual_batch_size=v: ghost g holds samples g, g+G, ...; each is normalized with its
    own statistics, and the moving statistics average the ghosts' (each with its m/(m−1))."""
    shape, v = (12, 2, 3), 4
    ghosts = shape[0] // v
    layer = random_affine_bn(shape, virtual_batch_size=v)
    gamma, beta = array(layer.gamma), array(layer.beta)
    x = _data(shape, 5)
    y = np.empty(shape)
    means, variances = [], []
    for g in range(ghosts):
        yg, mean, var, m = numpy_train(x[g::ghosts], gamma, beta, [2], EPS)
        y[g::ghosts] = yg
        means.append(mean)
        variances.append(var * m / (m - 1))
    got = layer(x, training=True)
    _assert_close(got, y, rtol=1e-5, atol=1e-5)
    _close(got, y, 1e-5)
    _assert_close(array(layer.moving_mean), 0.1 * np.mean(means, 0), rtol=1e-5, atol=1e-6)
    _assert_close(array(layer.moving_variance), 0.9 + 0.1 * np.mean(variances, 0), rtol=1e-5)
    with pytest.raises(ValueError, match="must divide the batch size; received a batch of 10"):
        layer(x[:10], training=True)


def test_exact_at_mean_1e4_and_std_1e_2():
    """Far from zero, the shifted moments keep float32 exact: vs float64."""
    shape = (64, 4)
    x = np.random.default_rng(0).normal(1e4, 1e-2, shape).astype("float32")
    layer = keras_bn.BatchNormalization(momentum=0.0, epsilon=1e-6)
    y, mean, var, m = numpy_train(x, np.ones(4), np.zeros(4), [1], 1e-6)
    got = array(layer(x, training=True)).astype(np.float64)
    assert np.max(np.abs(got - y)) < 2e-3  # one float32 ulp of x at 1e4 is 1e-3 of σ
    _assert_close(array(layer.moving_mean), mean, rtol=1e-7)
    _assert_close(array(layer.moving_variance), var * m / (m - 1), rtol=1e-3)


def _assert_train_step_exact(framework, x, y_atol, variance_rtol):
    """The layer's y, statistics and hand-written backward on x (a batch of rows, 4 channels)
    against the float64 formulas: x̂ = (x − μ)/√(σ² + ε), ∂l/∂x = γ/√(σ² + ε)·(g − mean g −
    x̂·mean g·x̂), ∂l/∂γ = Σg·x̂, ∂l/∂β = Σg."""
    layer = keras_bn.BatchNormalization(momentum=0.0, epsilon=1e-6)
    layer.build(x.shape)
    gamma = np.random.default_rng(2).uniform(0.5, 1.5, 4)
    layer.gamma.assign(gamma.astype("float32"))
    cotangent = _data(x.shape, 6, loc=0.0, scale=1.0)
    y, mean, var, m = numpy_train(x, gamma, np.zeros(4), [1], 1e-6)
    _, dx, dgamma, dbeta = framework.train_step(layer, x, cotangent)
    got = array(layer(x, training=True)).astype(np.float64)
    assert np.max(np.abs(got - y)) < y_atol
    _assert_close(array(layer.moving_mean), mean, rtol=1e-7, atol=1e-7)
    _assert_close(array(layer.moving_variance), var * m / (m - 1), rtol=variance_rtol)
    x_hat, g = (x - mean) / np.sqrt(var + 1e-6), cotangent.astype(np.float64)
    want_dx = gamma / np.sqrt(var + 1e-6) * (g - g.mean(0) - x_hat * (g * x_hat).mean(0))
    _assert_close(dx, want_dx, rtol=0, atol=2e-3 * np.max(np.abs(want_dx)))
    assert np.all(np.abs(np.asarray(dgamma) - np.sum(g * x_hat, 0)) < 2e-3 * np.sum(np.abs(g), 0))
    _assert_close(dbeta, np.sum(g, 0), rtol=1e-5, atol=1e-4)


def test_train_step_exact_at_mean_1e4_and_std_1e_2(framework):
    """Sums about the first values' mean K keep float32 exact far from zero, backward too."""
    x = np.random.default_rng(0).normal(1e4, 1e-2, (64, 4)).astype("float32")
    _assert_train_step_exact(
        framework, x, y_atol=3e-3, variance_rtol=1e-3
    )  # a float32 ulp at 1e4: 0.1σ


@pytest.mark.xfail(
    keras.backend.backend() == "tensorflow",
    strict=True,
    reason="product: TensorFlow's eager training call keeps the sums about K, σ² off by 1.7e-5",
)
def test_moments_are_redone_about_the_mean_when_the_first_values_are_far(framework):
    """K, the mean of the first 8 values, 2000 away from a mean 0 of 2¹⁶ values (≈ 90σ): the
    sums about K would lose ~1e-4 of σ² to rounding; redone about the mean, they do not."""
    x = np.random.default_rng(0).normal(0.0, 1.0, (2**16, 4)).astype("float32")
    x[:8] = 2000.0
    _assert_train_step_exact(framework, x, y_atol=1e-5, variance_rtol=1e-5)


def test_train_step_is_exact_far_from_zero(framework):
    """Mean 1e4, σ 1e-2, γ = 1: the shifted moments keep float32 exact (E[x²] − E[x]² would
    lose every digit); the backward's dx = γ/σ·(g − mean g − x̂·mean g·x̂) against float64."""
    shape = (64, 4)
    x = np.random.default_rng(0).normal(1e4, 1e-2, shape).astype("float32")
    layer = keras_bn.BatchNormalization(momentum=0.0, epsilon=1e-6)
    layer.build(shape)
    cotangent = _data(shape, 6, loc=0.0, scale=1.0)
    y, dx, dgamma, dbeta = framework.train_step(layer, x, cotangent)
    want_y, mean, var, m = numpy_train(x, np.ones(4), np.zeros(4), [1], 1e-6)
    assert np.max(np.abs(y - want_y)) < 3e-3  # a float32 ulp of x at 1e4 is 0.1σ
    np.testing.assert_allclose(array(layer.moving_mean), mean, rtol=1e-7)
    np.testing.assert_allclose(array(layer.moving_variance), var * m / (m - 1), rtol=1e-3)
    x_hat, g = (x - mean) / np.sqrt(var + 1e-6), cotangent.astype(np.float64)
    want_dx = (g - g.mean(0) - x_hat * (g * x_hat).mean(0)) / np.sqrt(var + 1e-6)
    _close(dx / np.max(np.abs(want_dx)), want_dx / np.max(np.abs(want_dx)), 2e-3)
    assert np.all(np.abs(dgamma - np.sum(g * x_hat, 0)) < 2e-3 * np.sum(np.abs(g), 0))
    _close(dbeta, np.sum(g, 0), 1e-5)


# float32's unit roundoff: |fl(t) − t| ≤ U·|t|.
U = 2.0**-24


def _inference_call(layer, mode):
    """`layer`'s inference call x -> y in `mode`: eager; a tf.function graph or XLA under
    TensorFlow; jax.jit of `stateless_call` under JAX."""
    if mode == "eager":
        return lambda x: layer(x, training=False)
    if mode in ("graph", "xla"):
        import tensorflow as tf

        return tf.function(lambda x: layer(x, training=False), jit_compile=mode == "xla")
    import jax

    step = jax.jit(lambda t, n, x: layer.stateless_call(t, n, x, training=False)[0])
    trainable = [v.value for v in layer.trainable_variables]
    fixed = [v.value for v in layer.non_trainable_variables]
    return lambda x: step(trainable, fixed, x)


@pytest.mark.parametrize("mode", training_modes("eager", "graph", "xla", "jit"))
@pytest.mark.parametrize("std", [1e-2, 1.0])
# Every channel at 1e4; one channel at 1e4 and the rest at 0 (the backends' one-pass fold,
# which they take where no channel's |mean| exceeds 3σ, must not be taken for the rest); every
# channel at 2.5σ, where it is taken and must stay as exact.
@pytest.mark.parametrize("centres", ["far", "one_far", "near"])
@pytest.mark.parametrize(
    ("shape", "axis", "channel_axes"),
    [
        ((256, 8), -1, [1]),  # rank 2 (its channels_first reading is the same axis)
        ((8, 16), 0, [0]),  # rank 2, channels on the first axis
        ((8, 6, 6, 8), -1, [3]),  # rank 4, channels_last (TensorFlow: the fused kernel)
        ((8, 8, 6, 6), 1, [1]),  # rank 4, channels_first
    ],
)
def test_inference_is_exact_far_from_zero(shape, axis, channel_axes, std, centres, mode):
    """Mean 1e4 and moving statistics equal to the data's own: y = (x − μ)·a + β against
    float64 from the same float32 weights. x − μ is exact (x within a factor 2 of μ), a =
    γ·rsqrt(v + ε) carries at most ~3U (the sum's and product's U/2 each, rsqrt's ≤ 2 ulp),
    the product U/2 more and the sum U/2 of |y|: ≤ 4U of the output's scale, checked at 6U
    (3.6e-7). The fold a·x + (β − a·μ) loses (|μ|/σ)·U: 2e-2 at σ 1e-2, 2e-4 at σ 1; at
    |μ| ≤ 3σ, about 2U."""
    rng = np.random.default_rng(0)
    reduced = tuple(i for i in range(len(shape)) if i not in channel_axes)
    centre = np.zeros([shape[i] if i in channel_axes else 1 for i in range(len(shape))])
    if centres == "near":
        centre += 2.5 * std
    else:
        centre.flat[0 if centres == "one_far" else slice(None)] = 1e4
    x = (rng.normal(0.0, std, shape) + centre).astype("float32")
    mean = x.astype(np.float64).mean(reduced).astype("float32")
    variance = x.astype(np.float64).var(reduced).astype("float32")
    gamma = rng.uniform(0.5, 1.5, mean.shape).astype("float32")
    beta = rng.uniform(-1.0, 1.0, mean.shape).astype("float32")
    layer = keras_bn.BatchNormalization(axis=axis, epsilon=1e-6)
    layer.build(shape)
    for variable, value in zip(
        (layer.moving_mean, layer.moving_variance, layer.gamma, layer.beta),
        (mean, variance, gamma, beta),
        strict=True,
    ):
        variable.assign(value)
    shape_b = [shape[i] if i in channel_axes else 1 for i in range(len(shape))]

    def f64(t):
        return t.astype(np.float64).reshape(shape_b)

    scaled = (x - f64(mean)) * f64(gamma) / np.sqrt(f64(variance) + 1e-6)
    want = scaled + f64(beta)
    got = array(_inference_call(layer, mode)(x)).astype(np.float64)
    scale = max(np.max(np.abs(want)), np.max(np.abs(scaled)))
    assert np.max(np.abs(got - want)) <= 6 * U * scale, np.max(np.abs(got - want)) / scale


def test_float16_inputs_keep_float32_statistics():
    keras.mixed_precision.set_global_policy("mixed_float16")
    layer = keras_bn.BatchNormalization()
    x = _data((32, 3), 1, loc=100.0, scale=50.0)
    y = layer(x.astype("float16"), training=True)
    assert keras.backend.standardize_dtype(y.dtype) == "float16"
    assert all(v.dtype == "float32" for v in layer.weights)
    _, mean, var, m = numpy_train(x.astype("float16"), np.ones(3), np.zeros(3), [1], EPS)
    _assert_close(array(layer.moving_mean), 0.01 * mean, rtol=1e-6)
    _assert_close(array(layer.moving_variance), 0.99 + 0.01 * var * m / (m - 1), rtol=1e-6)


def test_integer_input_is_a_type_error():
    with pytest.raises(TypeError, match=r"floating-point inputs.*int32"):
        keras_bn.BatchNormalization()(np.ones((4, 3), "int32"), training=True)


def test_frozen_layer_uses_its_moving_statistics():
    shape = (8, 3)
    layer = random_affine_bn(shape)
    layer.trainable = False
    x = _data(shape)
    expected = array(layer(x, training=False))
    np.testing.assert_array_equal(array(layer(x, training=True)), expected)
    np.testing.assert_array_equal(array(layer.moving_mean), 0.0)

"""keras_bn.BatchNormalization under PyTorch against independent references: torch.nn.BatchNorm
(which keeps the same unbiased running variance, m/(m−1)·σ²_B) for the forward pass, the
gradients and the running statistics over several training steps; torch's autograd of a plain
torch batch norm for the hand-written backward; numpy float64 formulas (tests/bn_references.py,
as tests_jax uses) for masks, renorm, ghost batches and momentum=None."""

import keras
import numpy as np
import pytest
import torch
from references import array, numpy_train, torch_train

import keras_bn

EPS = 1e-3


def _data(shape, seed=1, loc=2.0, scale=3.0):
    return np.random.default_rng(seed).normal(loc, scale, shape).astype("float32")


def _close(actual, expected, tolerance):
    """Equal within `tolerance` of max(1, max |expected|), elementwise."""
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), expected, rtol=0, atol=tolerance * scale
    )


def _layer(shape, axis=-1, momentum=0.9, seed=0, **kwargs):
    """A built layer with random γ and β (so that a swapped pair would show)."""
    layer = keras_bn.BatchNormalization(axis=axis, momentum=momentum, epsilon=EPS, **kwargs)
    layer.build(shape)
    rng = np.random.default_rng(seed)
    for weight in (layer.gamma, layer.beta):
        if weight is not None:
            weight.assign(rng.uniform(0.5, 1.5, weight.shape).astype("float32"))
    return layer


def _step(layer, x, cotangent, mask=None):
    """One training call: y and the gradients of Σ cotangent·y to (x, γ, β), from keras_bn's
    backward (torch autograd through the layer)."""
    x = torch.tensor(x, requires_grad=True)
    for variable in layer.trainable_variables:
        variable.value.grad = None
    y = layer(x, training=True, mask=mask)
    torch.sum(y * torch.as_tensor(cotangent)).backward()
    return array(y), array(x.grad), array(layer.gamma.value.grad), array(layer.beta.value.grad)


def _grad_fn_names(tensor):
    """The class names of every node of the graph that produced `tensor`."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


# torch.nn.BatchNorm's input is (N, C, *spatial); keras_bn sees it as it is with axis=1
# (channels_first), or with C moved last and Keras's default axis=-1 (channels_last). Odd
# sizes: a batch of 3, 5×7 maps.
TORCH_SHAPES = [(5, 4), (3, 6, 7), (3, 4, 5, 7), (2, 3, 4, 5, 3)]
TORCH_BN = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d}
TORCH_BN[5] = torch.nn.BatchNorm3d


def _to_keras(t, layout):
    """A torch-layout (N, C, ...) array in keras_bn's layout."""
    if layout == "channels_first" or t.ndim == 2:
        return t
    return np.moveaxis(t, 1, -1)


def _from_keras(t, layout):
    if layout == "channels_first" or t.ndim == 2:
        return t
    return np.moveaxis(t, -1, 1)


@pytest.mark.parametrize(
    ("shape", "layout"),
    [
        (shape, layout)
        for shape in TORCH_SHAPES
        for layout in ("channels_last", "channels_first")
        if len(shape) > 2 or layout == "channels_last"  # (N, C): both layouts are one
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v,
)
def test_training_steps_equal_torch_batch_norm(shape, layout):
    """Four SGD steps on γ and β: every step's output and gradients to x, γ and β, the running
    mean and (unbiased) variance after them, and inference, equal torch.nn.BatchNorm's within
    1e-5. Keras's momentum 0.9 is torch's 0.1 (the weight of the new batch)."""
    channels = shape[1]
    reference = TORCH_BN[len(shape)](channels, eps=EPS, momentum=0.1)
    keras_shape = _to_keras(np.empty(shape), layout).shape
    layer = _layer(keras_shape, axis=1 if layout == "channels_first" else -1, momentum=0.9)
    with torch.no_grad():
        reference.weight.copy_(layer.gamma.value)
        reference.bias.copy_(layer.beta.value)
    for step in range(4):
        x = _data(shape, seed=10 + step, loc=step - 1.0, scale=1.0 + step)
        cotangent = _data(shape, seed=20 + step, loc=0.0, scale=1.0)
        y, dx, dgamma, dbeta = _step(layer, _to_keras(x, layout), _to_keras(cotangent, layout))
        torch_x = torch.tensor(x, requires_grad=True)
        reference.zero_grad()
        torch_y = reference(torch_x)
        torch.sum(torch_y * torch.as_tensor(cotangent)).backward()
        _close(_from_keras(y, layout), array(torch_y), 1e-5)
        _close(_from_keras(dx, layout), array(torch_x.grad), 1e-5)
        _close(dgamma, array(reference.weight.grad), 1e-5)
        _close(dbeta, array(reference.bias.grad), 1e-5)
        with torch.no_grad():  # the same SGD step on both
            reference.weight -= 0.1 * reference.weight.grad
            reference.bias -= 0.1 * reference.bias.grad
        layer.gamma.assign(array(layer.gamma) - 0.1 * dgamma)
        layer.beta.assign(array(layer.beta) - 0.1 * dbeta)
        _close(array(layer.gamma), array(reference.weight), 1e-5)
        _close(array(layer.moving_mean), array(reference.running_mean), 1e-5)
        _close(array(layer.moving_variance), array(reference.running_var), 1e-5)
    x = _data(shape, seed=30)
    reference.eval()
    with torch.no_grad():
        expected = array(reference(torch.tensor(x)))
    _close(_from_keras(array(layer(_to_keras(x, layout), training=False)), layout), expected, 1e-5)


def test_keras_momentum_099_is_torch_momentum_001():
    """Keras weighs the old value (0.99), torch the new batch (0.01): the same averages."""
    shape = (6, 3, 4, 5)
    reference = torch.nn.BatchNorm2d(3, eps=EPS, momentum=0.01)
    layer = keras_bn.BatchNormalization(axis=1, momentum=0.99, epsilon=EPS)
    for step in range(5):
        x = _data(shape, seed=step, loc=3.0 * step, scale=2.0)
        layer(x, training=True)
        reference(torch.tensor(x))
    _close(array(layer.moving_mean), array(reference.running_mean), 1e-6)
    _close(array(layer.moving_variance), array(reference.running_var), 1e-6)
    assert not np.allclose(array(layer.moving_mean), 0.0)


# (input shape, axis, the sorted channel axes it means)
LAYOUTS = [
    ((16, 5), -1, [1]),
    ((4, 3, 3, 6), -1, [3]),
    ((4, 6, 3, 2), 1, [1]),
    ((4, 3, 2, 5), [1, -1], [1, 3]),
]


@pytest.mark.parametrize(("shape", "axis", "channel_axes"), LAYOUTS)
def test_backward_matches_autograd_of_plain_batch_norm(shape, axis, channel_axes):
    """The hand-written backward (a torch.autograd.Function, found in the graph) against
    autograd of the plain formula, in float64 (an independent reference, no differences)."""
    layer = _layer(shape, axis)
    x, cotangent = _data(shape, 3), _data(shape, 4, loc=0.0, scale=1.0)
    _, dx, dgamma, dbeta = _step(layer, x, cotangent)
    x64 = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    gamma = torch.tensor(array(layer.gamma), dtype=torch.float64, requires_grad=True)
    beta = torch.tensor(array(layer.beta), dtype=torch.float64, requires_grad=True)
    y = torch_train(x64, gamma, beta, channel_axes, EPS)
    torch.sum(y * torch.as_tensor(cotangent, dtype=torch.float64)).backward()
    for got, expected in zip((dx, dgamma, dbeta), (x64.grad, gamma.grad, beta.grad)):
        _close(got, array(expected), 2e-5)
    traced = layer(torch.tensor(x, requires_grad=True), training=True)
    assert "_NormalizeBackward" in _grad_fn_names(traced)


def test_train_step_is_exact_far_from_zero():
    """Mean 1e4, σ 1e-2: the shifted moments keep float32 exact (E[x²] − E[x]² would lose
    every digit); the backward's dx = γ/σ·(g − mean g − x̂·mean g·x̂) against float64."""
    shape = (64, 4)
    x = np.random.default_rng(0).normal(1e4, 1e-2, shape).astype("float32")
    layer = keras_bn.BatchNormalization(momentum=0.0, epsilon=1e-6)
    layer.build(shape)
    cotangent = _data(shape, 6, loc=0.0, scale=1.0)
    y, dx, dgamma, dbeta = _step(layer, x, cotangent)
    want_y, mean, var, m = numpy_train(x, np.ones(4), np.zeros(4), [1], 1e-6)
    assert np.max(np.abs(y - want_y)) < 3e-3  # a float32 ulp of x at 1e4 is 0.1σ
    np.testing.assert_allclose(array(layer.moving_mean), mean, rtol=1e-7)
    np.testing.assert_allclose(array(layer.moving_variance), var * m / (m - 1), rtol=1e-3)
    x_hat, g = (x - mean) / np.sqrt(var + 1e-6), cotangent.astype(np.float64)
    want_dx = (g - g.mean(0) - x_hat * (g * x_hat).mean(0)) / np.sqrt(var + 1e-6)
    _close(dx / np.max(np.abs(want_dx)), want_dx / np.max(np.abs(want_dx)), 2e-3)
    assert np.all(np.abs(dgamma - np.sum(g * x_hat, 0)) < 2e-3 * np.sum(np.abs(g), 0))
    _close(dbeta, np.sum(g, 0), 1e-5)


def test_moments_are_redone_about_the_mean_when_the_first_values_are_far():
    """The first 8 values (the shift K) 2000 away from a mean 0 of 2¹⁶ values: redone about the
    mean, the variance keeps float32's precision."""
    x = np.random.default_rng(0).normal(0.0, 1.0, (2**16, 4)).astype("float32")
    x[:8] = 2000.0
    layer = keras_bn.BatchNormalization(momentum=0.0, epsilon=1e-6)
    layer(x, training=True)
    _, mean, var, m = numpy_train(x, np.ones(4), np.zeros(4), [1], 1e-6)
    np.testing.assert_allclose(array(layer.moving_mean), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(array(layer.moving_variance), var * m / (m - 1), rtol=1e-5)


@pytest.mark.parametrize(
    ("policy", "dtype", "tolerance"),
    [("mixed_float16", torch.float16, 2e-3), ("mixed_bfloat16", torch.bfloat16, 1.6e-2)],
)
def test_mixed_precision_keeps_float32_statistics_and_gradients(policy, dtype, tolerance):
    """A 16-bit policy: 16-bit in and out, float32 weights and statistics; the moving
    statistics are those of the 16-bit values computed in float64, the output and the gradient
    autograd's of the plain formula on those values in float32, rounded to 16 bits (to within
    one 16-bit rounding: `tolerance`)."""
    keras.mixed_precision.set_global_policy(policy)
    shape = (32, 3)
    layer = keras_bn.BatchNormalization()
    x = torch.tensor(_data(shape, 1, loc=100.0, scale=50.0)).to(dtype).requires_grad_()
    values = array(x.float())  # the 16-bit values, exactly
    cotangent = _data(shape, 2, loc=0.0, scale=1.0)
    y = layer(x, training=True)
    assert y.dtype == dtype
    assert all(v.dtype == "float32" for v in layer.weights)
    torch.sum(y.float() * torch.as_tensor(cotangent)).backward()
    _, mean, var, m = numpy_train(values, np.ones(3), np.zeros(3), [1], EPS)
    np.testing.assert_allclose(array(layer.moving_mean), 0.01 * mean, rtol=1e-6)
    np.testing.assert_allclose(
        array(layer.moving_variance), 0.99 + 0.01 * var * m / (m - 1), rtol=1e-6
    )
    x32 = torch.tensor(values, requires_grad=True)
    plain = torch_train(x32, torch.ones(3), torch.zeros(3), [1], EPS)
    torch.sum(plain * torch.as_tensor(cotangent)).backward()
    assert x.grad.dtype == dtype
    _close(array(x.grad.float()), array(x32.grad), tolerance)
    _close(array(y.float()), array(plain), tolerance)


def test_float16_under_autocast_gets_float32_statistics():
    """Inside torch.autocast (float16), a float16 tensor (what an autocast convolution hands
    on) into a float32-policy layer: autocast lowers none of the layer's ops, so its output and
    statistics are float32, those of the float16 values in float64."""
    x16 = _data((16, 4), 3, loc=-50.0, scale=20.0).astype("float16")
    layer = keras_bn.BatchNormalization(momentum=0.0)
    with torch.autocast("cpu", dtype=torch.float16):
        y = layer(torch.tensor(x16), training=True)
    assert y.dtype == torch.float32
    want, mean, var, m = numpy_train(x16, np.ones(4), np.zeros(4), [1], EPS)
    np.testing.assert_allclose(array(layer.moving_mean), mean, rtol=1e-6)
    np.testing.assert_allclose(array(layer.moving_variance), var * m / (m - 1), rtol=1e-5)
    _close(array(y), want, 1e-5)


def test_static_batch_of_one_is_a_value_error():
    """As under JAX (and as torch.nn.BatchNorm raises in training); inference takes it."""
    layer = keras_bn.BatchNormalization()
    with pytest.raises(ValueError, match=r"at least 2 values per channel.*m=1"):
        layer(np.ones((1, 3), "float32"), training=True)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        torch.nn.BatchNorm1d(3)(torch.ones(1, 3))
    inference = layer(np.ones((1, 3), "float32"))
    np.testing.assert_allclose(array(inference), np.ones((1, 3)) / np.sqrt(1 + 1e-3), rtol=1e-6)


def test_fit_whose_last_batch_holds_one_sample_raises():
    """PyTorch's `fit` runs eagerly: its last batch of one is a concrete batch of one, the
    same ValueError as a direct call (TensorFlow's and JAX's traced `fit` output β there)."""
    model = keras.Sequential(
        [keras.Input((4,)), keras_bn.BatchNormalization(), keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = _data((9, 4), 4), _data((9, 1), 5)
    with pytest.raises(ValueError, match="m=1"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    history = model.fit(x[:8], y[:8], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_a_batch_of_one_under_torch_compile_outputs_beta_as_a_traced_fit():
    """Under torch.compile (dynamo; the "eager" backend, no code generation) a batch of one is
    run-time data, as in JAX's traced `fit` and TensorFlow's: the output is β, the gradients
    to x and γ are 0 (β's is the upstream), and the statistics stay; a larger batch through
    the same compiled step normalizes and updates."""
    layer = _layer((None, 3))
    beta = array(layer.beta)
    step = torch.compile(lambda x: layer(x, training=True), backend="eager")
    x = torch.tensor(_data((1, 3), 2), requires_grad=True)
    y = step(x)
    np.testing.assert_array_equal(array(y), beta[None])
    torch.sum(y * 3.0).backward()
    np.testing.assert_array_equal(array(x.grad), 0.0)
    np.testing.assert_array_equal(array(layer.gamma.value.grad), 0.0)
    np.testing.assert_array_equal(array(layer.beta.value.grad), 3.0)
    np.testing.assert_array_equal(array(layer.moving_mean), 0.0)
    np.testing.assert_array_equal(array(layer.moving_variance), 1.0)
    batch = _data((6, 3), 3)
    want, mean, _, _ = numpy_train(batch, array(layer.gamma), beta, [1], EPS)
    _close(array(step(torch.tensor(batch))), want, 1e-5)
    np.testing.assert_allclose(array(layer.moving_mean), 0.1 * mean, rtol=1e-5)


def test_channel_with_one_value_outputs_beta_and_keeps_its_statistics():
    """m_c ≤ 1 known only at run time (a mask): that channel outputs β, its statistics stay,
    its gradients to x and γ are 0; the others normalize and update. With momentum=None the
    whole batch is skipped, and not counted."""
    shape = (4, 3, 2)
    x = _data(shape, 4)
    mask = np.ones((4, 3), bool)
    mask[1:, 1] = False  # time step 1 keeps one sample
    layer = _layer(shape, axis=[1, 2])  # each (time, feature) a channel: (1, f) has m_c = 1
    beta = array(layer.beta)
    y, dx, dgamma, _ = _step(layer, x, _data(shape, 5), mask)
    np.testing.assert_array_equal(y[:, 1, :], np.broadcast_to(beta[1], (4, 2)))
    mean, variance = array(layer.moving_mean), array(layer.moving_variance)
    np.testing.assert_array_equal(mean[1], 0.0)
    np.testing.assert_array_equal(variance[1], 1.0)
    assert np.all(mean[[0, 2]] != 0.0) and np.all(variance[[0, 2]] != 1.0)
    assert np.all(dx[:, 1, :] == 0.0) and np.all(dgamma[1] == 0.0)
    assert np.all(np.isfinite(dx)) and np.any(dx != 0.0)
    cumulative = keras_bn.BatchNormalization(axis=[1, 2], momentum=None)
    cumulative(x, training=True, mask=mask)
    assert int(array(cumulative.num_batches_tracked)) == 0
    np.testing.assert_array_equal(array(cumulative.moving_mean), 0.0)
    cumulative(x, training=True)
    assert int(array(cumulative.num_batches_tracked)) == 1


def test_non_finite_batch_leaves_the_statistics_alone():
    """A NaN or inf in one channel: the output shows it, and no statistic moves (torch's own
    BatchNorm lets the NaN into running_var for ever)."""
    shape = (8, 3)
    layer = _layer(shape)
    layer(_data(shape, 1), training=True)
    before = [array(v).copy() for v in layer.non_trainable_variables]
    bad = _data(shape, 2)
    bad[3, 1] = np.nan
    y = array(layer(bad, training=True))
    assert np.isnan(y[:, 1]).all() and np.isfinite(y[:, [0, 2]]).all()
    for variable, value in zip(layer.non_trainable_variables, before):
        np.testing.assert_array_equal(array(variable), value)
    bad[3, 1] = np.inf
    layer(bad, training=True)
    for variable, value in zip(layer.non_trainable_variables, before):
        np.testing.assert_array_equal(array(variable), value)
    poisoned = torch.nn.BatchNorm1d(3)
    poisoned(torch.tensor(np.where(np.isinf(bad), np.nan, bad)))
    assert torch.isnan(poisoned.running_var[1])


def test_momentum_none_is_the_plain_average_of_the_finite_batches():
    """torch's momentum=None, whose cumulative average of the unbiased variances this equals,
    except that the NaN batch is skipped and not counted (torch's would turn NaN)."""
    shape = (6, 4)
    layer = keras_bn.BatchNormalization(momentum=None)
    reference = torch.nn.BatchNorm1d(4, momentum=None)
    batches = [_data(shape, seed, loc=seed, scale=seed) for seed in (1, 2, 3)]
    nan_batch = _data(shape, 9)
    nan_batch[0, 0] = np.nan
    for batch in (batches[0], nan_batch, batches[1], batches[2]):
        layer(batch, training=True)
    for batch in batches:
        reference(torch.tensor(batch))
    assert int(array(layer.num_batches_tracked)) == 3
    assert array(layer.num_batches_tracked).dtype == np.int64
    means = [b.astype(np.float64).mean(0) for b in batches]
    variances = [b.astype(np.float64).var(0, ddof=1) for b in batches]
    np.testing.assert_allclose(array(layer.moving_mean), np.mean(means, 0), rtol=1e-6)
    np.testing.assert_allclose(array(layer.moving_variance), np.mean(variances, 0), rtol=1e-6)
    _close(array(layer.moving_variance), array(reference.running_var), 1e-6)


def test_mask_gives_each_channel_its_own_count():
    """axis=1 on (batch, time, features) with a (batch, time) mask: Keras's reading, each time
    step a channel with its own m_c; NaN padding never reaches the statistics; the gradient is
    autograd's of the masked plain formula."""
    shape, channel_axes = (6, 4, 3), [1]
    layer = _layer(shape, axis=1)
    rng = np.random.default_rng(7)
    mask = rng.random(shape[:2]) < 0.7
    mask[:2] = True
    x = _data(shape, 8)
    x[~mask] = np.nan
    kept = np.broadcast_to(mask[..., None], shape)
    gamma, beta = array(layer.gamma), array(layer.beta)
    y, mean, var, m = numpy_train(np.where(kept, x, 0.0), gamma, beta, channel_axes, EPS, kept)
    assert len(set(m.tolist())) > 1
    got = array(layer(x, training=True, mask=mask))
    _close(got[kept], y[kept], 1e-5)
    np.testing.assert_allclose(array(layer.moving_mean), 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        array(layer.moving_variance), 0.9 + 0.1 * var * m / (m - 1), rtol=1e-5
    )

    finite = np.where(kept, x, 1.5).astype("float32")
    cotangent = _data(shape, 9, loc=0.0, scale=1.0)
    _, dx, dgamma, dbeta = _step(_layer(shape, axis=1), finite, cotangent, mask)
    x64 = torch.tensor(finite, dtype=torch.float64, requires_grad=True)
    g64 = torch.tensor(gamma, dtype=torch.float64, requires_grad=True)
    b64 = torch.tensor(beta, dtype=torch.float64, requires_grad=True)
    weight = torch.tensor(kept, dtype=torch.float64)
    plain = torch_train(x64, g64, b64, channel_axes, EPS, weight)
    torch.sum(plain * torch.as_tensor(cotangent, dtype=torch.float64)).backward()
    for got_grad, expected in zip((dx, dgamma, dbeta), (x64.grad, g64.grad, b64.grad)):
        _close(got_grad, array(expected), 2e-5)


def test_mask_over_the_non_channel_axes():
    """(batch, channels, time) with axis=1 and a (batch, time) mask; a mask fitting neither
    reading is a ValueError."""
    shape = (5, 3, 4)
    layer = _layer(shape, axis=1)
    mask = np.random.default_rng(2).random((5, 4)) < 0.6
    mask[0] = True
    x = _data(shape, 3)
    kept = np.broadcast_to(mask[:, None, :], shape)
    y, *_ = numpy_train(x, array(layer.gamma), array(layer.beta), [1], EPS, kept)
    _close(array(layer(x, training=True, mask=mask)), y, 1e-5)
    with pytest.raises(ValueError, match="fits no reading"):
        layer(x, training=True, mask=np.ones((5, 2), bool))


def test_renorm_matches_its_float64_formula():
    """y = γ·(x̂·r + d) + β with r, d from the renorm averages, clipped; the moving statistics
    as without renorm, Keras's renorm weights; r and d constants for the gradient."""
    shape, rmax, dmax = (8, 3), 1.5, 0.3
    clipping = {"rmax": rmax, "dmax": dmax}
    layer = _layer(shape, renorm=True, renorm_momentum=0.8, renorm_clipping=clipping)
    renorm_mean = np.array([0.5, -1.0, 2.0], "float32")
    renorm_stddev = np.array([1.0, 3.0, 0.5], "float32")
    layer.renorm_mean.assign(renorm_mean)
    layer.renorm_stddev.assign(renorm_stddev)
    gamma, beta = array(layer.gamma), array(layer.beta)
    x, cotangent = _data(shape, 3), _data(shape, 4, loc=0.0, scale=1.0)
    x_hat, mean, var, m = numpy_train(x, np.ones(3), np.zeros(3), [1], EPS)
    stddev = np.sqrt(var + EPS)
    r = np.clip(stddev / renorm_stddev, None, rmax)
    d = np.clip((mean - renorm_mean) / renorm_stddev, -dmax, dmax)
    assert np.any(r == rmax) and np.any(np.abs(d) == dmax)
    y, dx, dgamma, dbeta = _step(layer, x, cotangent)
    _close(y, gamma * (x_hat * r + d) + beta, 1e-5)
    variance = 0.9 + 0.1 * var * m / (m - 1)
    np.testing.assert_allclose(array(layer.moving_variance), variance, rtol=1e-6)
    np.testing.assert_allclose(array(layer.moving_stddev), np.sqrt(variance + EPS), rtol=1e-6)
    np.testing.assert_allclose(array(layer.renorm_mean), 0.8 * renorm_mean + 0.2 * mean, rtol=1e-6)
    np.testing.assert_allclose(
        array(layer.renorm_stddev), 0.8 * renorm_stddev + 0.2 * stddev, rtol=1e-6
    )
    x64 = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    g64 = torch.tensor(gamma, dtype=torch.float64, requires_grad=True)
    b64 = torch.tensor(beta, dtype=torch.float64, requires_grad=True)
    r64, d64 = torch.tensor(r), torch.tensor(d)
    plain = torch_train(x64, g64 * r64, b64 + g64 * d64, [1], EPS)
    torch.sum(plain * torch.as_tensor(cotangent, dtype=torch.float64)).backward()
    for got, expected in zip((dx, dgamma, dbeta), (x64.grad, g64.grad, b64.grad)):
        _close(got, array(expected), 2e-5)


def test_ghost_batches_normalize_each_interleaved_ghost():
    """virtual_batch_size=v: ghost g holds samples g, g+G, ...; each normalized with its own
    statistics; the moving statistics average the ghosts' (each with its m/(m−1))."""
    shape, v = (12, 2, 3), 4
    ghosts = shape[0] // v
    layer = _layer(shape, virtual_batch_size=v)
    gamma, beta = array(layer.gamma), array(layer.beta)
    x = _data(shape, 5)
    y = np.empty(shape)
    means, variances = [], []
    for g in range(ghosts):
        yg, mean, var, m = numpy_train(x[g::ghosts], gamma, beta, [2], EPS)
        y[g::ghosts] = yg
        means.append(mean)
        variances.append(var * m / (m - 1))
    _close(array(layer(x, training=True)), y, 1e-5)
    np.testing.assert_allclose(
        array(layer.moving_mean), 0.1 * np.mean(means, 0), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        array(layer.moving_variance), 0.9 + 0.1 * np.mean(variances, 0), rtol=1e-5
    )
    with pytest.raises(ValueError, match="must divide the batch size; received a batch of 10"):
        layer(x[:10], training=True)


def test_integer_input_is_a_type_error():
    with pytest.raises(TypeError, match=r"floating-point inputs.*int32"):
        keras_bn.BatchNormalization()(np.ones((4, 3), "int32"), training=True)


def test_frozen_layer_uses_its_moving_statistics():
    shape = (8, 3)
    layer = _layer(shape)
    layer.trainable = False
    x = _data(shape)
    expected = array(layer(x, training=False))
    np.testing.assert_array_equal(array(layer(x, training=True)), expected)
    np.testing.assert_array_equal(array(layer.moving_mean), 0.0)


def test_fit_trains_and_updates_the_moving_statistics():
    """`fit` (eager under PyTorch): the first BN sees the raw batches, so its moving statistics
    replay in numpy; the second (momentum=None, renorm) counts every batch; γ trains."""
    features = 4
    x, y = _data((64, features), 1), _data((64, 1), 2)
    model = keras.Sequential(
        [
            keras.Input((features,)),
            keras_bn.BatchNormalization(momentum=0.5, name="first"),
            keras.layers.Dense(3),
            keras_bn.BatchNormalization(momentum=None, renorm=True, name="second"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    mean, variance = np.zeros(features), np.ones(features)
    for batch in np.split(x.astype(np.float64), 4):
        mean = 0.5 * mean + 0.5 * batch.mean(0)
        variance = 0.5 * variance + 0.5 * batch.var(0, ddof=1)
    first, second = model.get_layer("first"), model.get_layer("second")
    np.testing.assert_allclose(array(first.moving_mean), mean, rtol=1e-5)
    np.testing.assert_allclose(array(first.moving_variance), variance, rtol=1e-5)
    assert np.all(array(first.gamma) != 1.0)
    assert int(array(second.num_batches_tracked)) == 4
    np.testing.assert_allclose(
        array(second.moving_stddev), np.sqrt(array(second.moving_variance) + 1e-3), rtol=1e-6
    )

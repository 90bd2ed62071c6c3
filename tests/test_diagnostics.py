"""keras_bn.diagnostics against gradients written out by hand in numpy for small linear models.
The gradient probes need TensorFlow's backend (their guard: test_training_backends.py), so their
tests run under it; explosion_rate, plain numpy, runs under every backend."""

import keras
import numpy as np
import pytest

import keras_bn
from helpers import assert_close
from keras_bn import diagnostics

# The gradient probes (gradient_norms_by_layer, landscape_along_gradient,
# internal_covariate_shift) run under TensorFlow only.
probes = pytest.mark.backends("tensorflow")

N, D, H = 12, 4, 3


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype("float64")
    y = rng.normal(size=(N, 1)).astype("float64")
    return x, y


def _linear(widths=(1,), seed=0):
    """Dense layers without bias or activation, float64, with random kernels."""
    model = keras.Sequential(
        [keras.Input((D,), dtype="float64")]
        + [keras.layers.Dense(w, use_bias=False, dtype="float64") for w in widths]
    )
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(size=w.shape) for w in model.get_weights()])
    return model


def _two_layer_grads(x, y, w1, w2):
    """∂/∂W of L = mean((x W1 W2 − y)²): 2/n (xW1)ᵀr and 2/n xᵀ r W2ᵀ."""
    r = x @ w1 @ w2 - y
    return 2 / N * x.T @ r @ w2.T, 2 / N * (x @ w1).T @ r


def _weights(model):
    return [w.copy() for w in model.get_weights()]


def _assert_same_weights(model, saved):
    for now, before in zip(model.get_weights(), saved, strict=True):
        np.testing.assert_array_equal(now, before)


@probes
def test_gradient_norms_by_layer_match_hand_gradients():
    x, y = _data()
    model = _linear((H, 1))
    w1, w2 = model.get_weights()
    g1, g2 = _two_layer_grads(x, y, w1, w2)
    norms = diagnostics.gradient_norms_by_layer(model, x, y, "mse")
    assert list(norms) == [layer.name for layer in model.layers]
    assert_close(list(norms.values()), [np.sum(g1**2), np.sum(g2**2)], rtol=1e-10)


@probes
def test_gradient_norms_leave_bn_moving_statistics_alone():
    x, y = _data()
    model = keras.Sequential(
        [
            keras.Input((D,)),
            keras.layers.Dense(H),
            keras_bn.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    saved = _weights(model)
    norms = diagnostics.gradient_norms_by_layer(model, x, y, "mse")
    assert len(norms) == 2 and all(v > 0 for v in norms.values())
    _assert_same_weights(model, saved)


@pytest.mark.parametrize("rate", [1.05, 1.5, 2.0])
def test_explosion_rate_recovers_known_growth(rate):
    depth = 30
    rng = np.random.default_rng(1)
    # Squared norms grow by `rate` per layer going backwards, with 5% multiplicative noise.
    norms = 7.0 * rate ** (depth - np.arange(depth)) * np.exp(rng.normal(0, 0.05, depth))
    assert abs(diagnostics.explosion_rate(norms) / rate - 1) < 0.01
    exact = {f"layer{k}": v for k, v in enumerate(3.0 * rate ** -np.arange(depth))}
    assert diagnostics.explosion_rate(exact, first=2, last=-2) == pytest.approx(rate, rel=1e-12)


def test_explosion_rate_rejects_unusable_norms():
    with pytest.raises(ValueError, match="positive finite"):
        diagnostics.explosion_rate([1.0, 0.0, 2.0])
    with pytest.raises(ValueError, match="at least 2"):
        diagnostics.explosion_rate([1.0])


@probes
def test_landscape_along_gradient_matches_hand_computation():
    x, y = _data()
    model = _linear((1,))
    (w,) = model.get_weights()
    saved = _weights(model)
    etas = np.array([0.01, 0.1, 0.3, 1.0])

    def loss_and_grad(w):
        r = x @ w - y
        return np.mean(r**2), 2 / N * x.T @ r

    loss0, g = loss_and_grad(w)
    losses = np.array([loss_and_grad(w - e * g)[0] for e in etas])
    changes = np.array([np.linalg.norm(g - loss_and_grad(w - e * g)[1]) for e in etas])
    # For a quadratic the gradient changes by η·(2/n)XᵀX·g: β-smoothness is that ratio.
    beta = np.linalg.norm(2 / N * x.T @ x @ g) / np.linalg.norm(g)

    result = diagnostics.landscape_along_gradient(model, x, y, "mse", etas)
    assert_close(result["losses"], losses, rtol=1e-10)
    assert_close(result["gradient_changes"], changes, rtol=1e-10)
    all_losses = np.append(losses, loss0)
    assert result["loss_variation"] == pytest.approx(all_losses.max() - all_losses.min(), rel=1e-10)
    assert result["gradient_predictiveness"] == pytest.approx(
        changes.max() - changes.min(), rel=1e-10
    )
    assert result["beta_smoothness"] == pytest.approx(beta, rel=1e-10)
    _assert_same_weights(model, saved)


@probes
def test_landscape_restores_weights_and_moving_statistics():
    x, y = _data()
    model = keras.Sequential(
        [
            keras.Input((D,)),
            keras.layers.Dense(H),
            keras_bn.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    saved = _weights(model)
    result = diagnostics.landscape_along_gradient(model, x, y, "mse", [0.1, 1.0])
    assert np.all(np.isfinite(result["losses"])) and result["beta_smoothness"] > 0
    _assert_same_weights(model, saved)


@probes
def test_internal_covariate_shift_matches_hand_computation():
    x, y = _data()
    model = _linear((H, 1))
    w1, w2 = model.get_weights()
    lr = 0.0625  # exact in float32, the dtype of Keras's learning-rate variable
    g1, g2 = _two_layer_grads(x, y, w1, w2)
    # Layer 2's gradient after SGD has moved layer 1 only.
    _, g2_shifted = _two_layer_grads(x, y, w1 - lr * g1, w2)
    optimizer = keras.optimizers.SGD(lr)
    saved = _weights(model)

    result = diagnostics.internal_covariate_shift(model, x, y, "mse", optimizer)
    assert result["layers"] == [layer.name for layer in model.layers]
    # The first layer has no earlier layer to move: G′ = G.
    assert result["l2_difference"][0] == pytest.approx(0.0, abs=1e-12)
    assert result["cosine"][0] == pytest.approx(1.0, rel=1e-12)
    assert result["l2_difference"][1] == pytest.approx(np.linalg.norm(g2 - g2_shifted), rel=1e-10)
    cosine = np.sum(g2 * g2_shifted) / (np.linalg.norm(g2) * np.linalg.norm(g2_shifted))
    assert result["cosine"][1] == pytest.approx(cosine, rel=1e-10)
    assert result["l2_difference"][1] > 1e-3  # the check is not vacuous
    _assert_same_weights(model, saved)
    assert int(optimizer.iterations.numpy()) == 0


@probes
def test_internal_covariate_shift_restores_stateful_optimizer():
    x, y = _data()
    model = _linear((H, H, 1))
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(model.trainable_variables)
    state = [v.numpy().copy() for v in optimizer.variables]
    saved = _weights(model)
    result = diagnostics.internal_covariate_shift(model, x, y, "mse", optimizer)
    assert result["l2_difference"].shape == (3,) and np.all(result["cosine"] <= 1 + 1e-12)
    _assert_same_weights(model, saved)
    for now, before in zip(optimizer.variables, state, strict=True):
        np.testing.assert_array_equal(now.numpy(), before)


@probes
def test_model_without_kernels_is_rejected():
    model = keras.Sequential([keras.Input((D,)), keras_bn.BatchNormalization()])
    x, y = _data()
    with pytest.raises(ValueError, match="no layer with a kernel"):
        diagnostics.gradient_norms_by_layer(model, x, y[:, :1].repeat(D, 1), "mse")

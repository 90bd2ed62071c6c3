"""The rest of keras_bn under PyTorch, each against numbers computed here in numpy float64:
`recalibrate` (Algorithm 2 over the data), `fold_batch_norms` and `convert` (the inference
formula), and `quantize_model` trained with `fit` and round-tripped through a .keras file
(check_batchnorm's findings: test_check_batchnorm.py, under every backend)."""

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from keras_bn.export import fold_batch_norms

# What test_fold_backends.py and test_qat_recalibrate.py check under every backend, here
# against torch's eager fit and calls.
pytestmark = pytest.mark.backends("torch")

L = keras.layers


def _data(shape, seed=1, loc=2.0, scale=3.0):
    return np.random.default_rng(seed).normal(loc, scale, shape).astype("float32")


def _randomise(model, seed=0):
    """Random γ, β and moving statistics on every BN, so that stale ones would show."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, (keras_bn.BatchNormalization, L.BatchNormalization)):
            shape = layer.moving_mean.shape
            layer.moving_mean.assign(rng.normal(0.0, 2.0, shape).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.2, 5.0, shape).astype("float32"))
            layer.gamma.assign(rng.uniform(0.5, 1.5, shape).astype("float32"))
            layer.beta.assign(rng.uniform(-0.5, 0.5, shape).astype("float32"))
    return model


def _pooled(batches, unbiased=True):
    """Algorithm 2 over (rows, channels) batches: Σm·μ/Σm and Σm·σ²/Σ(m − 1) (unbiased), or
    /Σm (Keras's biased convention)."""
    m = np.array([len(b) for b in batches], np.float64)
    means = np.array([b.mean(0) for b in batches])
    variances = np.array([b.var(0) for b in batches])
    divisor = m.sum() - len(batches) if unbiased else m.sum()
    return (m[:, None] * means).sum(0) / m.sum(), (m[:, None] * variances).sum(0) / divisor


def _inference(h, layer, mean, variance):
    gamma, beta = array(layer.gamma).astype(np.float64), array(layer.beta).astype(np.float64)
    return (h - mean) * gamma / np.sqrt(variance + layer.epsilon) + beta


def _dense(h, layer):
    return h @ array(layer.kernel).astype(np.float64) + array(layer.bias).astype(np.float64)


def test_recalibrate_sets_algorithm_2_over_the_data():
    """Both BN classes, a short last batch: the first BN's statistics are the raw input's,
    the second's those of its input computed with the first already set."""
    model = _randomise(
        keras.Sequential(
            [
                keras.Input((6,)),
                keras_bn.BatchNormalization(name="ours"),
                L.Dense(3, name="dense"),
                L.BatchNormalization(name="theirs"),
            ]
        )
    )
    x = _data((50, 6))
    report = keras_bn.recalibrate(model, x, batch_size=16, progress=False)
    assert report.batches == 4
    batches = [x[i : i + 16].astype(np.float64) for i in range(0, 50, 16)]
    ours, theirs = model.get_layer("ours"), model.get_layer("theirs")
    mean, variance = _pooled(batches)
    np.testing.assert_allclose(array(ours.moving_mean), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(array(ours.moving_variance), variance, rtol=1e-5)
    hidden = [
        _dense(_inference(b, ours, mean, variance), model.get_layer("dense")) for b in batches
    ]
    mean, variance = _pooled(hidden, unbiased=False)  # Keras's layer: the biased convention
    np.testing.assert_allclose(array(theirs.moving_mean), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(array(theirs.moving_variance), variance, rtol=1e-5)


def test_recalibrate_callback_sets_the_data_statistics_at_the_end_of_fit():
    """callbacks.Recalibrate in PyTorch's `fit`: after training, the BN on the raw input holds
    Algorithm 2 over the callback's data, not fit's moving averages."""
    model = keras.Sequential(
        [keras.Input((4,)), keras_bn.BatchNormalization(name="bn"), L.Dense(1)]
    )
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, data = _data((32, 4), 7), _data((40, 4), 8, loc=-1.0, scale=0.5)
    callback = keras_bn.callbacks.Recalibrate(data, batch_size=16)
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    assert callback.last_report is not None
    mean, variance = _pooled([data[i : i + 16].astype(np.float64) for i in range(0, 40, 16)])
    bn = model.get_layer("bn")
    np.testing.assert_allclose(array(bn.moving_mean), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(array(bn.moving_variance), variance, rtol=1e-5)


@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
def test_the_folded_model_computes_the_inference_formula(data_format):
    """Conv2D → BN → ReLU folded: no BN left, the outputs are the unfolded model's inference
    formula (Keras's conv, then BN in numpy)."""
    first = data_format == "channels_first"
    inputs = keras.Input((3, 5, 5) if first else (5, 5, 3))
    conv = L.Conv2D(4, 2, data_format=data_format, name="host")
    bn = keras_bn.BatchNormalization(axis=1 if first else -1, name="bn")
    model = keras.Model(inputs, L.ReLU()(bn(conv(inputs))))
    _randomise(model)
    x = _data((6, *inputs.shape[1:]), 2)
    folded, _ = fold_batch_norms(model, x)
    assert not any(isinstance(layer, keras_bn.BatchNormalization) for layer in folded.layers)
    z = array(conv(x)).astype(np.float64)
    shape = (1, 4, 1, 1) if first else (1, 1, 1, 4)
    mean, variance = array(bn.moving_mean).reshape(shape), array(bn.moving_variance).reshape(shape)
    gamma, beta = array(bn.gamma).reshape(shape), array(bn.beta).reshape(shape)
    expected = np.maximum((z - mean) * gamma / np.sqrt(variance + bn.epsilon) + beta, 0.0)
    got = array(folded.predict(x, verbose=0))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_qat_model_trains_saves_and_loads(tmp_path):
    """quantize_model, fit with FreezeBatchNorm: the weights and activation ranges move, the
    BN's statistics replay numpy's unbiased EMA of the host's outputs until the freeze, and
    a .keras round trip predicts the same."""
    inputs = keras.Input((8, 8, 3))
    h = L.Conv2D(4, 3, padding="same", name="host")(inputs)
    h = keras_bn.BatchNormalization(name="bn")(h)
    h = L.ReLU()(h)
    h = L.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, L.Dense(2)(h))
    qat = keras_bn.quantize.quantize_model(model)
    qat.compile("adam", "mse")
    x, y = _data((32, 8, 8, 3), 4, 0.0, 1.0), _data((32, 2), 5, 0.0, 1.0)
    before = [array(w).copy() for w in qat.trainable_weights]
    qat.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[keras_bn.quantize.FreezeBatchNorm(after_steps=2)],
    )
    assert any(not np.array_equal(a, array(b)) for a, b in zip(before, qat.trainable_weights))
    quantizers = [
        q
        for layer in qat.layers
        for q in layer._flatten_layers()
        if isinstance(q, keras_bn.quantize.ActivationQuantizer)
    ]
    assert quantizers and all(bool(array(q.range_initialized)) for q in quantizers)
    path = tmp_path / "qat.keras"
    qat.save(path)
    loaded = keras.saving.load_model(path)
    expected = array(qat.predict(x[:8], verbose=0))
    np.testing.assert_array_equal(array(loaded.predict(x[:8], verbose=0)), expected)
    for a, b in zip(qat.weights, loaded.weights):
        np.testing.assert_array_equal(array(a), array(b))


def test_qat_batch_norm_statistics_follow_the_batches():
    """A Dense host's QAT layer (float weights, no activation rounding) in training: its BN's
    moving statistics are the unbiased EMA of the host's outputs x·W + b (numpy), batch after
    batch, through the QAT layer's autograd moments."""
    host, bn = L.Dense(4, name="host"), keras_bn.BatchNormalization(momentum=0.5, name="bn")
    bn(host(keras.Input((5,))))
    kernel, bias = array(host.kernel).astype(np.float64), array(host.bias).astype(np.float64)
    layer = keras_bn.quantize.from_layers(host, bn, weight_bits=None, activation_bits=None)
    mean, variance = np.zeros(4), np.ones(4)
    for seed in range(3):
        x = _data((16, 5), 10 + seed)
        layer(x, training=True)
        z = x.astype(np.float64) @ kernel + bias
        mean = 0.5 * mean + 0.5 * z.mean(0)
        variance = 0.5 * variance + 0.5 * z.var(0, ddof=1)
    bn = layer.batch_norm
    np.testing.assert_allclose(array(bn.moving_mean), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(array(bn.moving_variance), variance, rtol=1e-4)


def test_qat_layer_gives_its_folded_kernel_bias_and_integers():
    """The numpy views the writers read of a QAT layer under PyTorch: the folded kernel
    W·γ/√(v + ε) and bias β + s·(b − μ) (numpy float64), and the kernel's int8 grid, each
    integer within half a step of the folded kernel over its per-channel step max|W·s|/127."""
    inputs = keras.Input((6, 6, 3))
    host, bn = L.Conv2D(4, 3, name="host"), keras_bn.BatchNormalization(name="bn")
    _randomise(keras.Model(inputs, bn(host(inputs))))
    layer = keras_bn.quantize.from_layers(host, bn, weight_bits=8, activation_bits=None)
    scale = array(bn.gamma).astype(np.float64) / np.sqrt(
        array(bn.moving_variance).astype(np.float64) + bn.epsilon
    )
    want_kernel = array(host.kernel).astype(np.float64) * scale
    want_bias = array(bn.beta) + scale * (array(host.bias) - array(bn.moving_mean))
    kernel, bias = layer.folded_weights()
    np.testing.assert_allclose(kernel, want_kernel, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(bias, want_bias, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(layer.inference_bias(), bias)  # no input grid here
    grid = layer.weight_grids()["kernel"]
    step = np.abs(want_kernel).reshape(-1, 4).max(0) / 127
    np.testing.assert_allclose(grid.scale, step, rtol=1e-6)
    assert np.abs(grid.q).max() == 127
    assert np.all(np.abs(grid.q * step - want_kernel) <= 0.5 * step * (1 + 1e-5))

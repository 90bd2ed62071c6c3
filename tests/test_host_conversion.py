"""Shared code turns backend tensors into numpy only through `keras_bn.backend.to_numpy`.

A tensor on an accelerator refuses a direct conversion: a CUDA torch tensor's `__array__` and
`numpy()` raise, and Keras's `convert_to_numpy` (what `to_numpy` and a Keras variable's own
conversion call) moves it to the CPU first. Here a torch tensor refuses both when keras_bn's
own code asks, as a CUDA tensor would, and recalibration (the one pass with its spilled
frontier and QAT settling passes, and the per-layer method), the `Recalibrate` callback and
`check_batchnorm` still run, with the same results as without the refusal."""

import sys
import warnings

import keras
import numpy as np
import pytest

import keras_bn

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.backends("torch")  # the refusing tensors are PyTorch's
L = keras.layers


def _refusing(original):
    def convert(self, *args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "keras_bn" or caller.startswith("keras_bn."):
            raise TypeError(
                f"{caller} converted a tensor to numpy directly: a CUDA tensor refuses that "
                "(simulated); use keras_bn.backend.to_numpy"
            )
        return original(self, *args, **kwargs)

    return convert


@pytest.fixture
def cuda_like(monkeypatch):
    """Torch tensors refuse np.asarray and .numpy() from keras_bn's code, as CUDA ones do."""

    def install():
        for method in ("__array__", "numpy"):
            monkeypatch.setattr(torch.Tensor, method, _refusing(getattr(torch.Tensor, method)))

    return install


def test_the_refusal_catches_a_direct_conversion(cuda_like):
    """The simulation is not vacuous: keras_bn's code converting directly is refused, and the
    conversion through to_numpy is not."""
    cuda_like()
    tensor = torch.ones(3)
    namespace = {"__name__": "keras_bn.example", "np": np}
    exec("def direct(t):\n    return np.asarray(t)\n", namespace)
    with pytest.raises(TypeError, match="refuses"):
        namespace["direct"](tensor)
    np.testing.assert_array_equal(keras_bn.backend.to_numpy(tensor), np.ones(3))


def _functional():
    inputs = keras.Input((6, 6, 3))
    h = L.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    h = keras_bn.BatchNormalization()(h)
    h = L.ReLU()(h)
    skip = keras_bn.BatchNormalization()(h)
    h = L.Conv2D(4, 3, padding="same")(h)
    h = L.Add()([h, skip])
    h = L.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras_bn.BatchNormalization()(L.Dense(3)(h)))


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = L.Dense(5)
        self.bn = keras_bn.BatchNormalization()

    def call(self, x, training=False):
        return self.bn(self.dense(x), training=training)


def _statistics(model):
    return [keras.ops.convert_to_numpy(w) for w in model.weights if "moving" in w.path]


def _both(run, cuda_like):
    """run() as it is, then with tensors that refuse np.asarray: the same statistics."""
    expected = run()
    cuda_like()
    found = run()
    assert len(found) == len(expected) > 0
    for a, b in zip(found, expected):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_one_pass_with_a_spilled_frontier(cuda_like):
    x = np.random.default_rng(0).normal(2.0, 3.0, (40, 6, 6, 3)).astype("float32")
    model = _functional()

    def run():
        keras_bn.recalibrate(model, x, batch_size=16, progress=False, max_memory=1)
        return _statistics(model)

    _both(run, cuda_like)


def test_per_layer_method_on_a_subclassed_model(cuda_like):
    x = np.random.default_rng(1).normal(1.0, 2.0, (30, 4)).astype("float32")
    model = _Subclassed()
    model(x[:2])

    def run():
        keras_bn.recalibrate(model, x, batch_size=8, progress=False)
        return _statistics(model)

    _both(run, cuda_like)


def test_qat_settling_passes(cuda_like):
    x = np.random.default_rng(2).normal(0.0, 1.0, (40, 6, 6, 3)).astype("float32")
    inputs = keras.Input((6, 6, 3))
    h = L.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    h = L.ReLU()(keras_bn.BatchNormalization()(h))
    h = L.Conv2D(4, 3, padding="same", use_bias=False)(h)
    h = L.ReLU()(keras_bn.BatchNormalization()(h))
    h = L.Dense(3)(L.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, h)
    # per tensor: each layer's further passes run it alone over its kept inputs
    qat = keras_bn.quantize.quantize_model(model, weight_bits=4, per_channel=False)
    initial = qat.get_weights()

    def run():
        qat.set_weights(initial)  # per tensor, the result depends on where the passes start
        with warnings.catch_warnings():  # whether a layer settles is not the point here
            warnings.simplefilter("ignore", keras_bn.KerasBNWarning)
            report = keras_bn.recalibrate(qat, x, batch_size=16, progress=False)
        assert max(change.passes for change in report.layers) > 1
        return _statistics(qat)

    _both(run, cuda_like)


def test_recalibrate_callback(cuda_like):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 6, 6, 3)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")

    def run():
        keras.utils.set_random_seed(0)
        model = _functional()
        model.compile("sgd", "mse")
        callback = keras_bn.callbacks.Recalibrate(x, batch_size=16, progress=False)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[callback])
        return _statistics(model)

    _both(run, cuda_like)


def test_check_batchnorm(cuda_like):
    """The stale-statistics check pools the batches' moments: the same findings, to the
    digits of their messages."""
    x = np.random.default_rng(4).normal(3.0, 2.0, (32, 6, 6, 3)).astype("float32")
    model = _functional()
    expected = [
        (f.layer, f.kind, f.message) for f in keras_bn.diagnostics.check_batchnorm(model, x)
    ]
    assert any(kind == "stale_statistics" for _, kind, _ in expected), expected
    cuda_like()
    found = [(f.layer, f.kind, f.message) for f in keras_bn.diagnostics.check_batchnorm(model, x)]
    assert found == expected

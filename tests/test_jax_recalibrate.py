"""recalibrate, callbacks.Recalibrate and diagnostics.check_batchnorm under JAX, against a numpy
float64 Algorithm 2 (each BN's input computed with every BN upstream of it already set) and
against the same calls under TensorFlow (a Python of its own)."""

import importlib.util

import keras
import numpy as np
import pytest
import tensorflow_side

import keras_bn
from helpers import mistaken_model
from keras_bn import population
from keras_bn._graph import bn_layers
from keras_bn._recalibration.batches import Batches

pytestmark = pytest.mark.backends("jax")

# --------------------------------------------------------------------------- numpy reference


class _Reached(Exception):
    """Raised by the reference forward pass at the BN whose input it collects."""

    def __init__(self, h, keep):
        super().__init__()
        self.h, self.keep = h, keep


def _dense(h, layer):
    return h @ layer.kernel.numpy().astype(np.float64) + layer.bias.numpy().astype(np.float64)


def _normalize(h, layer, mean, variance, axes):
    """Inference BN of h with these statistics, float64, over `axes` (the channel axes)."""
    shape = [h.shape[i] if i in axes else 1 for i in range(h.ndim)]
    gamma, beta = bn_layers.gamma_beta(layer)
    scale = gamma.reshape(shape) / np.sqrt(np.reshape(variance, shape) + layer.epsilon)
    return (h - np.reshape(mean, shape)) * scale + beta.reshape(shape)


def _pool(inputs, axes, unbiased):
    """Algorithm 2 over the batches' (h, keep): Σm·μ / Σm and Σm·σ² / Σ(m − 1) (unbiased) or
    / Σm (biased), per channel."""
    total = weighted_mean = weighted_variance = used = 0.0
    for h, keep in inputs:
        keep = np.broadcast_to(keep, h.shape)
        reduced = tuple(i for i in range(h.ndim) if i not in axes)
        m = keep.sum(axis=reduced)
        mean = np.where(keep, h, 0.0).sum(axis=reduced) / m
        centred = h - np.expand_dims(mean, reduced)
        variance = np.where(keep, centred**2, 0.0).sum(axis=reduced) / m
        total, used = total + m, used + 1
        weighted_mean = weighted_mean + m * mean
        weighted_variance = weighted_variance + m * variance
    return weighted_mean / total, weighted_variance / (total - used if unbiased else total)


def _reference(model, forward, order, batches):
    """{BN name: (mean, variance)}: each BN of `order` (a topological order) from its inputs
    over `batches`, computed by `forward(x, bn)` with the BNs before it already set;
    `bn(name, h, axes, keep=True)` is how `forward` applies a BN."""
    statistics = {}
    for target in order:

        def bn(name, h, axes, keep=True, target=target):
            if name == target:
                raise _Reached(h, keep)
            return _normalize(h, _layer(model, name), *statistics[name], axes)

        inputs = []
        for x in batches:
            try:
                forward(x.astype(np.float64), bn)
            except _Reached as reached:
                inputs.append((reached.h, reached.keep))
        layer = _layer(model, target)
        axes = bn_layers.channel_axes(layer, inputs[0][0].ndim)
        statistics[target] = _pool(inputs, axes, bn_layers.unbiased_variance(layer))
    return statistics


def _layer(model, name):
    for layer in model._flatten_layers(include_self=False):
        if layer.name == name:
            return layer
    raise KeyError(name)


def _assert_statistics(model, expected, rtol=1e-5):
    for name, (mean, variance) in expected.items():
        layer = _layer(model, name)
        scale = np.sqrt(variance)
        np.testing.assert_allclose(
            layer.moving_mean.numpy(), mean, rtol=0, atol=rtol * scale.max(), err_msg=name
        )
        np.testing.assert_allclose(layer.moving_variance.numpy(), variance, rtol=rtol, err_msg=name)


def _randomise(model, seed=0):
    """Random γ, β and moving statistics, so that stale upstream statistics would show."""
    rng = np.random.default_rng(seed)
    for layer in bn_layers.in_model(model):
        shape = layer.moving_mean.shape
        layer.moving_mean.assign(rng.normal(0.0, 2.0, shape).astype("float32"))
        layer.moving_variance.assign(rng.uniform(0.2, 5.0, shape).astype("float32"))
        for weight in (layer.gamma, layer.beta):
            weight.assign(rng.uniform(0.5, 1.5, shape).astype("float32"))
    return model


def _data(shape, seed=1, loc=2.0, scale=3.0):
    return np.random.default_rng(seed).normal(loc, scale, shape).astype("float32")


def _batches(x, batch_size):
    return [x[i : i + batch_size] for i in range(0, len(x), batch_size)]


# --------------------------------------------------------------------------- models


def _sequential():
    """Dense → keras_bn BN → ReLU → Dense → Keras BN → Dense."""
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, name="d1"),
            keras_bn.BatchNormalization(name="ours"),
            keras.layers.ReLU(),
            keras.layers.Dense(4, name="d2"),
            keras.layers.BatchNormalization(name="theirs"),
            keras.layers.Dense(1),
        ]
    )


def _sequential_forward(model):
    def forward(x, bn):
        h = bn("ours", _dense(x, model.get_layer("d1")), [1])
        h = np.maximum(h, 0.0)
        return bn("theirs", _dense(h, model.get_layer("d2")), [1])

    return forward


class _Block(keras.layers.Layer):
    """A custom layer holding Dense → BN: the graph walk cannot see into its call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4, name="block_dense")
        self.norm = keras_bn.BatchNormalization(name="block_bn")

    def build(self, shape):
        self.dense.build(shape)
        self.norm.build((*shape[:-1], 4))

    def call(self, x, training=None):
        return self.norm(self.dense(x), training=training)


def _functional(seed=0):
    """(batch, time, features): Dense → keras_bn BN "a" (features) → a nested Sequential
    [Dense → Keras BN "b"] and a keras_bn BN "c" over time steps (axis=1) → Add → a custom
    layer holding a BN → Dense."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5, 3))
    a = keras_bn.BatchNormalization(name="a")(keras.layers.Dense(4, name="d1")(inputs))
    nested = keras.Sequential(
        [
            keras.Input((5, 4)),
            keras.layers.Dense(4, name="d2"),
            keras.layers.BatchNormalization(name="b"),
        ],
        name="nested",
    )
    c = keras_bn.BatchNormalization(axis=1, name="c")(a)
    added = keras.layers.Add()([nested(a), c])
    outputs = keras.layers.Dense(1)(_Block(name="block")(added))
    return _randomise(keras.Model(inputs, outputs, name="functional"), seed)


def _functional_forward(model):
    block = model.get_layer("block")

    def forward(x, bn):
        a = bn("a", _dense(x, model.get_layer("d1")), [2])
        b = bn("b", _dense(a, _layer(model, "d2")), [2])
        c = bn("c", a, [1])
        return bn("block_bn", _dense(b + c, block.dense), [2])

    return forward


# --------------------------------------------------------------------------- recalibrate


def test_sequential_matches_float64_algorithm_2():
    """Both BN classes, a short last batch (each batch weighted by its count), upstream BN
    recalibrated first; a generator gives the same statistics, and so does a tf.data dataset
    where TensorFlow is installed."""
    model = _randomise(_sequential())
    x = _data((50, 6))
    expected = _reference(model, _sequential_forward(model), ["ours", "theirs"], _batches(x, 16))
    report = keras_bn.recalibrate(model, x, batch_size=16, progress=False)
    assert report.strategy == "one_pass" and report.batches == 4
    assert [(c.name, c.convention) for c in report.layers] == [
        ("ours", "unbiased"),
        ("theirs", "biased"),
    ]
    _assert_statistics(model, expected)

    data = [(batch for batch in _batches(x, 16))]
    if importlib.util.find_spec("tensorflow") is not None:  # not in make's .venv-jax
        import tensorflow as tf

        data.append(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(16))
    for batches in data:
        _randomise(model)
        keras_bn.recalibrate(model, batches, progress=False)
        _assert_statistics(model, expected)


def test_functional_nested_and_custom_layer_match_float64_and_the_per_layer_method():
    model = _functional()
    x = _data((40, 5, 3), 2)
    order = ["a", "b", "c", "block_bn"]
    expected = _reference(model, _functional_forward(model), order, _batches(x, 16))
    report = keras_bn.recalibrate(model, x, batch_size=16, progress=False)
    assert report.strategy == "one_pass"
    assert sorted(c.name for c in report.layers) == sorted(order)
    assert len(report.fallbacks) == 1 and "block/block_bn" in report.fallbacks[0]
    _assert_statistics(model, expected)

    # The per-layer method (the reference the one pass is tested against on TensorFlow).
    other = _functional()
    done = population.recalibrate_per_layer(
        other, bn_layers.in_model(other), Batches(x, None, 16), False
    )
    assert done.strategy == "per_layer"
    for layer in bn_layers.in_model(model):
        twin = _layer(other, layer.name)
        np.testing.assert_allclose(twin.moving_mean.numpy(), layer.moving_mean.numpy(), atol=1e-5)
        np.testing.assert_allclose(
            twin.moving_variance.numpy(), layer.moving_variance.numpy(), rtol=1e-5
        )


def test_a_tiny_max_memory_spills_the_frontier_and_changes_nothing():
    model = _functional()
    x = _data((40, 5, 3), 3)
    keras_bn.recalibrate(model, x, batch_size=16, progress=False)
    held = [v.numpy().copy() for layer in bn_layers.in_model(model) for v in layer.weights]
    _randomise(model)
    report = keras_bn.recalibrate(model, x, batch_size=16, progress=False, max_memory=64)
    assert report.strategy == "one_pass_spilled" and report.spilled_bytes > 0
    assert report.peak_frontier_bytes <= 64
    spilled = [v.numpy() for layer in bn_layers.in_model(model) for v in layer.weights]
    for a, b in zip(held, spilled):
        np.testing.assert_array_equal(a, b)  # the disk round trip is exact


def test_masks_give_each_channel_its_own_count():
    """Masking → Dense → keras_bn BN → Keras BN on (batch, time, features) with padded
    sequences: only the unmasked time steps enter the statistics."""
    model = keras.Sequential(
        [
            keras.Input((6, 3)),
            keras.layers.Masking(0.0),
            keras.layers.Dense(4, name="d1"),
            keras_bn.BatchNormalization(name="ours"),
            keras.layers.BatchNormalization(name="theirs"),
        ]
    )
    _randomise(model)
    x = _data((30, 6, 3), 4)
    lengths = np.random.default_rng(5).integers(2, 7, 30)
    keep = np.arange(6)[None, :] < lengths[:, None]
    x[~keep] = 0.0

    def forward(x, bn):
        kept = np.abs(x).sum(-1, keepdims=True) > 0
        h = bn("ours", _dense(x, model.get_layer("d1")), [2], kept)
        return bn("theirs", h, [2], kept)

    expected = _reference(model, forward, ["ours", "theirs"], _batches(x, 8))
    keras_bn.recalibrate(model, x, batch_size=8, progress=False)
    _assert_statistics(model, expected)


def test_nan_input_is_a_value_error_and_changes_nothing():
    model = _randomise(_sequential())
    x = _data((32, 6))
    x[20, 2] = np.nan
    before = [v.numpy().copy() for v in model.non_trainable_variables]
    with pytest.raises(ValueError, match=r"layer 'ours' would get NaN or inf statistics.*batch 1"):
        keras_bn.recalibrate(model, x, batch_size=16, progress=False)
    for variable, value in zip(model.non_trainable_variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)


# --------------------------------------------------------------------------- the callback


class _Statistics(keras.callbacks.Callback):
    """Records every BN's moving statistics around each validation run."""

    def __init__(self):
        super().__init__()
        self.at = {"test_begin": [], "test_end": []}

    def _record(self, when):
        layers = bn_layers.in_model(self.model)
        self.at[when].append([v.numpy().copy() for layer in layers for v in layer.weights[2:4]])

    def on_test_begin(self, logs=None):
        self._record("test_begin")

    def on_test_end(self, logs=None):
        self._record("test_end")


def test_recalibrate_callback_inside_jit_fit():
    """Under JAX's jit `fit`: each validation runs with recalibrated statistics, the training
    statistics come back exactly after it, and the end of fit leaves Algorithm 2's statistics
    of the final weights."""
    model = _sequential()
    model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=True)
    x, y = _data((48, 6)), _data((48, 1), 2, 0.0, 1.0)
    before, after = _Statistics(), _Statistics()
    callback = keras_bn.callbacks.Recalibrate(x, batch_size=16, before_validation=True)
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        validation_data=(x[:16], y[:16]),
        callbacks=[before, callback, after],
        verbose=0,
    )
    assert len(before.at["test_begin"]) == 2
    for saved, restored in zip(before.at["test_begin"], after.at["test_end"]):
        for a, b in zip(saved, restored):
            np.testing.assert_array_equal(a, b)  # put back exactly
    for saved, validated in zip(before.at["test_begin"], after.at["test_begin"]):
        assert not np.array_equal(saved[1], validated[1])  # recalibrated for validation
    assert callback.last_report is not None and callback.last_report.strategy == "one_pass"
    expected = _reference(model, _sequential_forward(model), ["ours", "theirs"], _batches(x, 16))
    _assert_statistics(model, expected)


# --------------------------------------------------------------------------- against TensorFlow

_TENSORFLOW_SIDE = """
import json, sys
import numpy as np
import keras
import keras_bn
from keras_bn._graph import bn_layers

assert keras.backend.backend() == "tensorflow"
folder = sys.argv[1]
x = np.load(folder + "/x.npy")
model = keras.saving.load_model(folder + "/model.keras")
findings = keras_bn.diagnostics.check_batchnorm(model, x, batch_size=4)
keras_bn.recalibrate(model, x, batch_size=8, progress=False)
statistics = {
    layer.name: [np.asarray(layer.moving_mean).tolist(), np.asarray(layer.moving_variance).tolist()]
    for layer in bn_layers.in_model(model)
}
print(json.dumps({
    "findings": [[f.layer, f.kind, f.message] for f in findings],
    "statistics": statistics,
}))
"""


@pytest.mark.slow
@pytest.mark.tensorflow_side
def test_check_batchnorm_and_recalibrate_match_tensorflow(tmp_path):
    """check_batchnorm under JAX finds the same mistakes, with the same messages, as under
    TensorFlow (the same model, saved as a .keras file), and recalibrate then sets the same
    statistics. (That it finds each mistake: test_check_batchnorm.py, under every backend.)"""
    model = mistaken_model()
    x = _data((32, 3), 6)
    model.save(tmp_path / "model.keras")
    np.save(tmp_path / "x.npy", x)
    findings = keras_bn.diagnostics.check_batchnorm(model, x, batch_size=4)
    keras_bn.recalibrate(model, x, batch_size=8, progress=False)
    tensorflow = tensorflow_side.run(_TENSORFLOW_SIDE, tmp_path, backend="tensorflow")
    assert [[f.layer, f.kind, f.message] for f in findings] == tensorflow["findings"]
    for layer in bn_layers.in_model(model):
        mean, variance = tensorflow["statistics"][layer.name]
        np.testing.assert_allclose(layer.moving_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(layer.moving_variance.numpy(), variance, rtol=1e-5)


def test_x_y_of_jax_arrays_are_whole_arrays_as_fit_takes_them():
    """`recalibrate(model, (x, y))` with jax arrays uses x alone, batched by batch_size, as with
    numpy arrays (y was pooled into the statistics as a second batch)."""
    import jax.numpy as jnp

    inputs = keras.Input((3,))
    bn = keras_bn.BatchNormalization()
    model = keras.Model(inputs, bn(inputs))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype("float32")
    y = (rng.normal(size=(40, 3)) + 100.0).astype("float32")
    keras_bn.recalibrate(model, (x, y), batch_size=16, progress=False)
    expected = [np.asarray(bn.moving_mean), np.asarray(bn.moving_variance)]
    bn.moving_mean.assign(np.full(3, 7.0))
    report = keras_bn.recalibrate(model, (jnp.asarray(x), jnp.asarray(y)), batch_size=16)
    assert report.batches == 3
    np.testing.assert_array_equal(np.asarray(bn.moving_mean), expected[0])
    np.testing.assert_array_equal(np.asarray(bn.moving_variance), expected[1])
    assert abs(float(np.mean(expected[0]))) < 1.0  # x's mean, not pooled with y's 100

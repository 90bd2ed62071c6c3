"""keras_bn.export.fold_batch_norms and keras_bn.convert under every backend: the folded model
computes what the unfolded one computes in inference, for every host kind and both BN classes;
convert keeps weights and outputs both ways; int8 readiness restores each kernel. Under JAX also:
a converted model trained by a jitted fit, and the TFLite/ONNX writers refusing JAX with what
to do."""

import importlib
import importlib.util

import keras
import numpy as np
import pytest
import tensorflow_side
from framework_references import array

import keras_bn
from keras_bn.export import ChannelBias, InferenceAffine, fold_batch_norms

L = keras.layers
BN_CLASSES = {"keras_bn": keras_bn.BatchNormalization, "keras": L.BatchNormalization}
TOLERANCE = 1e-5  # of each output's scale: float32 rounding of the folded weights


def _dense(bn):
    x = keras.Input((5,))
    h = bn(name="bn")(L.Dense(4, name="host")(x))
    return keras.Model(x, L.Dense(3, name="head")(L.ReLU()(h))), {"bn": ("backward", "host")}


def _conv(bn, data_format):
    # channels_first with a last spatial dim equal to the channel count (4): where a guessed
    # bias axis would go wrong (keras_bn/_graph/affine.py's ChannelBias).
    x = keras.Input((5, 5, 3) if data_format == "channels_last" else (3, 5, 5))
    h = L.Conv2D(4, 2, data_format=data_format, name="host")(x)
    h = bn(axis=-1 if data_format == "channels_last" else 1, name="bn")(h)
    return keras.Model(x, L.Flatten()(L.ReLU()(h))), {"bn": ("backward", "host")}


def _bn_before_conv(bn):
    """After a ReLU a BN cannot fold backward; the valid conv it feeds takes it forward."""
    x = keras.Input((6, 6, 3))
    h = L.ReLU()(L.Conv2D(4, 3, padding="same", name="first")(x))
    h = L.Conv2D(5, 3, padding="valid", name="host")(bn(name="bn")(h))
    return keras.Model(x, L.Flatten()(h)), {"bn": ("forward", "host")}


def _unfoldable(bn):
    """A BN after a ReLU, feeding a padded conv: neither fold is exact, so it stays an affine."""
    x = keras.Input((6, 6, 3))
    h = L.ReLU()(L.Conv2D(4, 3, padding="same", name="first")(x))
    h = L.Conv2D(5, 3, padding="same", name="next")(bn(name="bn")(h))
    return keras.Model(x, L.Flatten()(h)), {"bn": ("kept", "not_a_host")}


CASES = {
    "dense": _dense,
    "conv2d_channels_last": lambda bn: _conv(bn, "channels_last"),
    "conv2d_channels_first": lambda bn: _conv(bn, "channels_first"),
    "bn_before_conv": _bn_before_conv,
    "unfoldable_bn": _unfoldable,
}
# Keras 3.15's TensorFlow backend misplaces this channels_first conv's bias (last spatial size
# = filters) in the unfolded reference itself; test_fold.py checks the fold there.
CASE_PARAMS = [
    pytest.param(name, marks=pytest.mark.backends("jax", "torch"))
    if name == "conv2d_channels_first"
    else name
    for name in CASES
]


def _randomize(model, seed=0):
    """Weights far from their initial values: statistics, γ and β included (variances > 0)."""
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        if "variance" in weight.path:
            value = rng.uniform(0.5, 2.0, weight.shape)
        else:
            value = rng.normal(0.3, 0.8, weight.shape)
        weight.assign(value.astype("float32"))


def _inputs(model, seed=1, batch=8):
    return np.random.default_rng(seed).normal(0.5, 2.0, (batch, *model.input_shape[1:]))


def _assert_close(actual, expected, rtol=TOLERANCE):
    """Within `rtol` of the expected output's scale (max |expected|)."""
    actual, expected = array(actual).astype(np.float64), array(expected).astype(np.float64)
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("bn_class", BN_CLASSES)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_the_folded_model_computes_the_inference_model(case, bn_class):
    model, decisions = CASES[case](BN_CLASSES[bn_class])
    _randomize(model)
    x = _inputs(model).astype("float32")
    expected = model(x, training=False)

    folded, report = fold_batch_norms(model, x)

    found = {f.bn: (f.direction, f.host) for f in report.folded}
    found.update({k.bn: ("kept", k.kind) for k in report.kept})
    assert found == decisions
    kinds = [type(layer) for layer in folded.layers]
    assert not set(kinds) & set(BN_CLASSES.values())
    assert (InferenceAffine in kinds) == (decisions["bn"][0] == "kept")
    assert (ChannelBias in kinds) == (case == "conv2d_channels_first")
    # predict runs the folded model as fit and serving do (jitted under JAX).
    _assert_close(folded.predict(x, verbose=0), expected)
    assert report.relative_error < TOLERANCE


def test_a_folded_model_with_an_affine_and_a_channel_bias_saves_and_loads(tmp_path):
    """InferenceAffine and ChannelBias are registered: the file loads, outputs kept."""
    x = keras.Input((3, 5, 5))
    h = L.Conv2D(4, 2, data_format="channels_first")(x)
    h = keras_bn.BatchNormalization(axis=1)(h)
    h = keras_bn.BatchNormalization(axis=1)(L.ReLU()(h))
    model = keras.Model(x, h)
    _randomize(model)
    folded, report = fold_batch_norms(model)
    assert len(report.folded) == len(report.kept) == 1
    path = tmp_path / "folded.keras"
    folded.save(path)
    loaded = keras.saving.load_model(path)
    data = _inputs(model).astype("float32")
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in folded.layers]
    np.testing.assert_array_equal(
        array(loaded.predict(data, verbose=0)), array(folded.predict(data, verbose=0))
    )


class _HiddenBN(L.Layer):
    """A custom layer computing a BN out of the fold's sight; counts its constructions."""

    made = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        type(self).made += 1
        self.bn = L.BatchNormalization(name="inside")

    def build(self, shape):
        self.bn.build(shape)

    def call(self, x, training=None):
        return self.bn(x, training=training) * 2.0


def test_a_layer_called_twice_is_reported_once_and_copied_once():
    """Each BN is in the report's folded or kept list exactly once, however many nodes call
    the layer holding it; and the fold makes one copy of each layer (a custom layer's
    __init__ runs once more, not twice)."""
    xi = keras.Input((8,))
    inner = keras.Model(xi, L.BatchNormalization(name="bn")(L.Dense(8, name="host")(xi)))
    x = keras.Input((8,))
    hidden = _HiddenBN(name="hidden")
    model = keras.Model(x, L.Dense(3)(hidden(hidden(inner(inner(x))))))
    _randomize(model)
    data = _inputs(model).astype("float32")
    made = _HiddenBN.made
    folded, report = fold_batch_norms(model, data)
    assert [(f.bn, f.host, f.direction) for f in report.folded] == [
        (f"{inner.name}/bn", f"{inner.name}/host", "backward")
    ]
    assert [(k.bn, k.kind) for k in report.kept] == [("hidden/inside", "inside_layer")]
    assert _HiddenBN.made == made + 1
    _assert_close(folded.predict(data, verbose=0), model.predict(data, verbose=0))


def test_int8_readiness_measures_each_rounded_kernel_and_restores_it():
    """The measurement runs the folded model with the host's kernel rounded to int8: the error
    is non-zero (a JAX function that kept the kernel it first saw would measure 0), and the
    kernel is back, bit for bit, afterwards."""
    model, _ = _conv(keras_bn.BatchNormalization, "channels_last")
    _randomize(model)
    x = _inputs(model, batch=16).astype("float32")
    folded, report = fold_batch_norms(model, x, int8_readiness=True)
    (spread,) = report.channel_spreads
    assert spread.host == "host"
    for error in (spread.per_tensor_error, spread.per_channel_error):
        assert 0 < error < 0.05
    unmeasured, _ = fold_batch_norms(model, x)
    np.testing.assert_array_equal(
        array(folded.get_layer("host").kernel), array(unmeasured.get_layer("host").kernel)
    )


def _keras_bn_model():
    x = keras.Input((6, 6, 3))
    h = L.BatchNormalization(name="bn_input")(x)
    h = L.Conv2D(4, 3, use_bias=False)(h)
    h = L.BatchNormalization(momentum=0.9, epsilon=1e-2, center=False, name="bn_conv")(h)
    h = L.Dense(2)(L.Flatten()(L.ReLU()(h)))
    return keras.Model(x, L.BatchNormalization(axis=-1, scale=False, name="bn_head")(h))


# Under TensorFlow the two BN classes' compiled outputs differ by 2e-6, over this 1e-6
# (test_convert.py checks convert there).
@pytest.mark.backends("jax", "torch")
def test_convert_round_trip_keeps_weights_and_outputs():
    """Keras's BNs (a functional model: input, conv and head BNs, no β, no γ) to keras_bn's
    and back, then a Sequential with one BN: the same weights, bit for bit, and outputs."""
    model = _keras_bn_model()
    _randomize(model)
    x = _inputs(model).astype("float32")
    expected = model(x, training=False)

    ours = keras_bn.convert.from_keras(model)
    back = keras_bn.convert.to_keras(ours)

    for converted, bn_class in ((ours, keras_bn.BatchNormalization), (back, L.BatchNormalization)):
        bns = [layer for layer in converted.layers if "bn_" in layer.name]
        assert [type(layer) for layer in bns] == [bn_class] * 3
        for original, new in zip(model.weights, converted.weights):
            assert original.path == new.path
            np.testing.assert_array_equal(array(new), array(original))
        _assert_close(converted.predict(x, verbose=0), expected)
    assert ours.get_layer("bn_conv").epsilon == 1e-2 and ours.get_layer("bn_conv").beta is None

    model = keras.Sequential([keras.Input((5,)), L.Dense(4), L.BatchNormalization(), L.Dense(2)])
    _randomize(model)
    x = _inputs(model).astype("float32")
    ours = keras_bn.convert.from_keras(model)
    assert any(isinstance(layer, keras_bn.BatchNormalization) for layer in ours.layers)
    back = keras_bn.convert.to_keras(ours)
    expected = array(model.predict(x, verbose=0))
    for converted in (ours, back):
        np.testing.assert_array_equal(
            np.concatenate([array(w).ravel() for w in converted.weights]),
            np.concatenate([array(w).ravel() for w in model.weights]),
        )
        np.testing.assert_allclose(array(converted.predict(x, verbose=0)), expected, atol=1e-6)


@pytest.mark.backends("jax")
def test_a_converted_model_trains_under_jax():
    """from_keras's clone is a keras_bn model that `fit` (jitted) trains: its statistics move
    from Keras's, and it still folds to what it computes."""
    model = _keras_bn_model()
    ours = keras_bn.convert.from_keras(model)
    x = _inputs(model, batch=32).astype("float32")
    ours.compile(keras.optimizers.SGD(0.01), "mse")
    ours.fit(x, np.zeros((32, 2), "float32"), batch_size=16, epochs=1, verbose=0)
    moved = np.asarray(ours.get_layer("bn_conv").moving_mean.value)
    assert not np.array_equal(moved, np.asarray(model.get_layer("bn_conv").moving_mean.value))
    folded, report = fold_batch_norms(ours, x)
    _assert_close(folded.predict(x, verbose=0), ours(x, training=False))
    directions = {f.bn: f.direction for f in report.folded}
    assert directions == {"bn_input": "forward", "bn_conv": "backward", "bn_head": "backward"}


@pytest.mark.parametrize(
    ("use", "name"),
    [
        (lambda: importlib.import_module("keras_bn.export").export_tflite, "export_tflite"),
        (lambda: importlib.import_module("keras_bn.export").export_onnx, "export_onnx"),
        (lambda: importlib.import_module("keras_bn.export.tflite"), "export_tflite"),
        (lambda: importlib.import_module("keras_bn.export.onnx"), "export_onnx"),
    ],
)
@pytest.mark.backends("jax")
def test_the_file_writers_say_to_export_under_tensorflow(use, name):
    """Under JAX the writers raise ImportError: with TensorFlow installed, that they need its
    Keras backend; without it (make's .venv-jax), also what to install."""
    with pytest.raises(ImportError) as raised:
        use()
    message = str(raised.value)
    if importlib.util.find_spec("tensorflow") is not None:
        assert message.startswith(f"keras_bn.export.{name} needs the TensorFlow Keras backend")
    else:
        assert message.startswith(f"keras_bn.export.{name} needs "), message
        assert 'pip install "keras-bn[export]"' in message, message
    assert "load the .keras file under KERAS_BACKEND=tensorflow to write TFLite or ONNX" in message


@pytest.mark.backends("jax")
def test_keras_litert_export_refuses_jax(tmp_path):
    """Keras's own `model.export(format="litert")` (Keras 3.15) refuses the JAX backend before
    converting anything: the Backends page says so. If a Keras release lifts this, this test
    fails: then run the written file in LiteRT against the Keras model here instead."""
    model, _ = _conv(keras_bn.BatchNormalization, "channels_last")
    folded, _ = fold_batch_norms(model)
    path = tmp_path / "folded.tflite"
    with pytest.raises(ValueError, match=r"^LiteRT export requires TensorFlow or PyTorch backend"):
        folded.export(str(path), format="litert")
    assert not path.exists()


_TENSORFLOW_EXPORT = """
import json, sys
import numpy as np
import keras
from keras_bn.export import export_onnx, export_tflite

assert keras.backend.backend() == "tensorflow"
folder = sys.argv[1]
model = keras.saving.load_model(folder + "/trained.keras")
x, y = np.load(folder + "/x.npy"), np.load(folder + "/y.npy")
found = {"loaded_error": float(np.max(np.abs(model.predict(x, verbose=0) - y)))}
for name, export in (("tflite", export_tflite), ("onnx", export_onnx)):
    # strict (the default): a file over the tolerance raises VerificationError, written nowhere.
    report = export(model, folder + "/model." + name, probe=x)
    found[name] = {"passed": report.passed, "relative_error": report.relative_error}
folded = keras.saving.load_model(folder + "/folded.keras")
found["folded_error"] = float(np.max(np.abs(folded.predict(x, verbose=0) - y)))
print(json.dumps(found))
"""

_JAX_LOAD_FOLDED = """
import json, sys
import numpy as np
import keras_bn  # registers keras_bn's layers, a folded model's included, once Keras loads
import keras

assert keras.backend.backend() == "jax"
folder = sys.argv[1]
folded = keras.saving.load_model(folder + "/folded.keras")
y = folded.predict(np.load(folder + "/x.npy"), verbose=0)
print(json.dumps({"error": float(np.max(np.abs(y - np.load(folder + "/y.npy"))))}))
"""


@pytest.mark.slow
@pytest.mark.backends("jax")
@pytest.mark.tensorflow_side
def test_a_model_trained_under_jax_exports_verified_under_tensorflow(tmp_path):
    """Train a small CNN with keras_bn's BN under JAX and save it; a TensorFlow process loads
    the `.keras` file and writes TFLite and ONNX, each verified in its runtime (LiteRT,
    onnxruntime) against the Keras model (a failed check raises VerificationError, and the
    process fails). The model folded under JAX (with an InferenceAffine and a ChannelBias)
    loads in both backends, in fresh processes, with its outputs."""
    rng = np.random.default_rng(3)
    x = rng.normal(0.5, 2.0, (64, 3, 8, 8)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    inputs = keras.Input((3, 8, 8))
    h = L.Conv2D(6, 3, data_format="channels_first", use_bias=False)(inputs)
    h = L.ReLU()(keras_bn.BatchNormalization(axis=1)(h))
    h = keras_bn.BatchNormalization(axis=1)(h)  # after a ReLU, before a padded conv: kept
    h = L.Conv2D(4, 3, padding="same", data_format="channels_first")(h)
    h = L.GlobalAveragePooling2D(data_format="channels_first")(h)
    model = keras.Model(inputs, keras_bn.BatchNormalization()(L.Dense(3)(h)))
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    model.save(tmp_path / "trained.keras")
    folded, report = fold_batch_norms(model, x)
    assert len(report.folded) == 2 and len(report.kept) == 1
    folded.save(tmp_path / "folded.keras")
    expected = model.predict(x, verbose=0)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", expected)

    found = tensorflow_side.run(_TENSORFLOW_EXPORT, tmp_path, backend="tensorflow")
    scale = float(np.abs(expected).max())
    assert found["loaded_error"] <= 1e-5 * scale
    assert found["folded_error"] <= 1e-5 * scale
    for name in ("tflite", "onnx"):
        assert found[name]["passed"] is True, found
        assert found[name]["relative_error"] <= 1e-4
        assert (tmp_path / f"model.{name}").stat().st_size > 0
    assert tensorflow_side.run(_JAX_LOAD_FOLDED, tmp_path, backend="jax")["error"] <= 1e-5 * scale


def test_a_qat_layers_batch_norm_is_reported_as_the_qat_layers_own():
    """A QAT layer (QuantizedHostBatchNorm) folds its own BN into its fake-quantized weights:
    the fold keeps the layer as it is and reports it by the QAT layer's path, as
    "quantization_aware", not as a BN inside a custom layer; nested models alike."""
    from keras_bn.quantize import quantize_model

    x = keras.Input((6, 6, 3))
    h = keras_bn.BatchNormalization(name="bn")(L.Conv2D(4, 3, name="conv")(x))
    qat = quantize_model(keras.Model(x, L.Dense(2, name="head")(L.Flatten()(L.ReLU()(h)))))
    outer_input = keras.Input((6, 6, 3))
    outer = keras.Model(outer_input, qat(outer_input))
    data = np.random.default_rng(0).normal(size=(16, 6, 6, 3)).astype("float32")
    for model, prefix in ((qat, ""), (outer, f"{qat.name}/")):
        folded, report = fold_batch_norms(model, data)
        assert report.folded == []
        assert [(k.bn, k.kind) for k in report.kept] == [
            (f"{prefix}conv_qat", "quantization_aware")
        ]
        (reason,) = [k.reason for k in report.kept]
        assert "'conv_qat' (QuantizedHostBatchNorm) folds its own batch norm" in reason
        assert "custom layer" not in reason
        _assert_close(folded.predict(data, verbose=0), model.predict(data, verbose=0))

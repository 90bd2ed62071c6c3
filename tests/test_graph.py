"""keras_bn.export.fold_batch_norms: which BNs fold where, refusals, and the rebuilt model.

Each folded model is compared with running the original (unfolded) model on the same input.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import digits
import keras_bn
from helpers import assert_close, randomise_batch_norms
from keras_bn.export import ChannelBias, InferenceAffine, UnsupportedModelError, fold_batch_norms

pytestmark = pytest.mark.backends("tensorflow")

L = keras.layers
BNS = (keras_bn.BatchNormalization, L.BatchNormalization)


def _bn_layers(model):
    return [layer for layer in model._flatten_layers(include_self=False) if isinstance(layer, BNS)]


def _check_fold(model, x, rtol=1e-5):
    folded, report = fold_batch_norms(model, probe=x)
    assert_close(folded(x), model(x, training=False), rtol)
    assert report.relative_error <= rtol
    return folded, report


def _x(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def test_sequential_keras_bn_cnn_folds_completely():
    model = randomise_batch_norms(digits.small_cnn())
    folded, report = _check_fold(model, _x((5, 8, 8, 1)))
    names = [layer.name for layer in model.layers]  # conv, bn, relu, conv, bn, ..., dense
    assert [(f.bn, f.host, f.direction) for f in report.folded] == [
        (names[1], names[0], "backward"),
        (names[4], names[3], "backward"),
        (names[9], names[8], "backward"),
    ]
    assert report.kept == [] and _bn_layers(folded) == []
    assert isinstance(folded, keras.Sequential)
    assert len(folded.layers) == len(model.layers) - 3


def test_functional_keras_bn_every_host_kind_and_forward_fold():
    """keras.layers.BatchNormalization after each host kind; one BN folds forward."""
    inputs = keras.Input((4, 9, 9))
    # Reads the model input, so it folds forward into the conv.
    y = L.BatchNormalization(axis=1, epsilon=0.3, name="bn_in")(inputs)
    y = L.Conv2D(6, 3, data_format="channels_first", name="conv_cf")(y)
    y = L.BatchNormalization(axis=1, name="bn_cf")(y)
    y = L.Permute((2, 3, 1))(y)
    y = L.DepthwiseConv2D(3, depth_multiplier=2, padding="same", use_bias=False, name="dw")(y)
    y = keras_bn.BatchNormalization(name="bn_dw", epsilon=0.5)(y)
    y = L.ReLU()(y)
    y = L.SeparableConv2D(5, 3, padding="same", name="sep")(y)
    y = L.BatchNormalization(name="bn_sep", center=False)(y)  # no beta
    y = L.Conv2DTranspose(3, 3, strides=2, use_bias=False, name="tconv")(y)
    y = keras_bn.BatchNormalization(name="bn_tconv", scale=False)(y)  # no gamma
    y = L.Flatten()(y)
    y = L.Dense(4, name="dense")(y)
    outputs = keras_bn.BatchNormalization(name="bn_dense")(y)
    model = randomise_batch_norms(keras.Model(inputs, outputs))
    folded, report = _check_fold(model, _x((3, 4, 9, 9)))
    directions = {f.bn: (f.host, f.direction) for f in report.folded}
    assert directions == {
        "bn_in": ("conv_cf", "forward"),
        "bn_cf": ("conv_cf", "backward"),
        "bn_dw": ("dw", "backward"),
        "bn_sep": ("sep", "backward"),
        "bn_tconv": ("tconv", "backward"),
        "bn_dense": ("dense", "backward"),
    }
    assert report.kept == [] and _bn_layers(folded) == []


def test_nested_models_fold_inside_and_out():
    inner = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            L.Conv2D(4, 3, use_bias=False, name="conv"),
            keras_bn.BatchNormalization(name="bn"),
        ],
        name="inner",
    )
    inputs = keras.Input((6, 6, 2))
    y = inner(inputs)
    y = L.BatchNormalization(name="after_inner")(y)  # follows a model: folds forward
    outputs = L.Dense(3, name="head")(y)
    model = keras.Model(inputs, outputs)
    randomise_batch_norms(model)
    folded, report = _check_fold(model, _x((2, 6, 6, 2)))
    assert {(f.bn, f.host, f.direction) for f in report.folded} == {
        ("after_inner", "head", "forward"),
        ("inner/bn", "inner/conv", "backward"),
    }
    assert _bn_layers(folded) == []


def test_input_model_is_not_modified():
    model = randomise_batch_norms(digits.small_cnn())
    x = _x((4, 8, 8, 1))
    before_weights = [w.copy() for w in model.get_weights()]
    before_output = np.asarray(model(x, training=False))
    folded, _ = fold_batch_norms(model)
    folded.set_weights([w * 0 for w in folded.get_weights()])  # shares nothing with model
    for old, new in zip(before_weights, model.get_weights()):
        np.testing.assert_array_equal(old, new)
    np.testing.assert_array_equal(np.asarray(model(x, training=False)), before_output)
    assert len(_bn_layers(model)) == 3


def test_epsilon_is_read_from_each_layer():
    """A large epsilon with small variances: assuming the default 1e-3 would be far off."""
    model = keras.Sequential([keras.Input((5,)), L.Dense(4), L.BatchNormalization(epsilon=2.0)])
    model.layers[1].moving_variance.assign(np.full(4, 0.01, "float32"))
    _check_fold(model, _x((3, 5)))


def test_report_error_is_measured_on_the_probe():
    model = randomise_batch_norms(digits.small_cnn())
    probe = _x((6, 8, 8, 1), seed=3) * 5
    folded, report = fold_batch_norms(model, probe=probe)
    expected = np.asarray(model(probe, training=False), np.float64)
    output = model.layers[-1].name
    assert report.errors == {output: np.abs(np.asarray(folded(probe)) - expected).max()}
    assert report.output_scales == {output: np.abs(expected).max()}
    assert report.max_abs_error == report.errors[output]


def test_subclassed_model_gets_a_clear_error():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = L.Dense(3)
            self.bn = L.BatchNormalization()

        def call(self, x):
            return self.bn(self.dense(x))

    net = Net()
    net(np.zeros((1, 4), "float32"))
    with pytest.raises(UnsupportedModelError, match="subclassed Net: it has no layer graph"):
        fold_batch_norms(net)


# --- refusals: each BN is kept as an InferenceAffine, and the report says why --------------


def _functional(build, input_shape):
    inputs = keras.Input(input_shape)
    return randomise_batch_norms(keras.Model(inputs, build(inputs)))


def _lora_dense(inputs):
    dense = L.Dense(4, name="host")
    y = dense(inputs)
    dense.enable_lora(2)
    return L.BatchNormalization(name="bn")(y)


def _quantized_dense(inputs):
    dense = L.Dense(4, name="host")
    y = dense(inputs)
    dense.quantize("int8")
    return L.BatchNormalization(name="bn")(y)


def _shared_bn(inputs):
    bn = L.BatchNormalization(name="bn")
    return L.Add()([bn(L.Dense(4)(inputs)), bn(L.Dense(4)(inputs))])


def _shared_host(inputs):
    dense = L.Dense(4, name="host")
    y1 = L.BatchNormalization(name="bn")(dense(inputs))
    return L.Concatenate()([y1, dense(inputs * 2.0)])


REFUSALS = {
    "activation": (
        lambda x: L.BatchNormalization(name="bn")(L.Dense(4, "relu", name="host")(x)),
        "host 'host' has the non-linear activation 'relu'",
    ),
    "fan_out": (
        lambda x: (lambda h: L.Add()([L.BatchNormalization(name="bn")(h), h]))(
            L.Dense(4, name="host")(x)
        ),
        "host 'host' output also feeds other layers or a model output",
    ),
    "shared_bn": (_shared_bn, "BN layer 'bn' is shared (called 2 times)"),
    "shared_host": (_shared_host, "host 'host' is shared (called 2 times)"),
    "axis": (
        lambda x: L.BatchNormalization(axis=1, name="bn")(L.Dense(4, name="host")(x)),
        "BN axis [1] is not the channel axis 2 of host 'host'",
    ),
    "lora": (_lora_dense, "host 'host' is LoRA-enabled"),
    "quantized": (_quantized_dense, "host 'host' is quantized (int8)"),
    "no_neighbour": (
        lambda x: L.ReLU(name="relu")(L.BatchNormalization(name="bn")(x)),
        "BN layer 'bn' reads a model input directly; forward: the next layer 'relu' is a ReLU",
    ),
    "several_axes": (
        lambda x: keras_bn.BatchNormalization(axis=[1, 2], name="bn")(L.Dense(4, name="host")(x)),
        "BN layer 'bn' normalizes over several channel axes [1, 2]",
    ),
    "padded_consumer": (
        lambda x: L.Conv1D(3, 3, padding="same", name="conv")(
            L.BatchNormalization(name="bn")(L.ReLU()(x))
        ),
        "the next layer 'conv' pads its input (padding='same')",
    ),
}


# The kind of each refusal (of the backward fold, the one a reader expects first).
KINDS = {
    "activation": "activation",
    "fan_out": "fan_out",
    "shared_bn": "shared_bn",
    "shared_host": "shared_host",
    "axis": "axis",
    "lora": "lora",
    "quantized": "quantized",
    "no_neighbour": "reads_input",
    "several_axes": "several_axes",
    "padded_consumer": "not_a_host",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_fold_is_kept_as_an_exact_affine_with_its_reason(case):
    build, reason = REFUSALS[case]
    model = _functional(build, (5, 6))
    x = _x((3, 5, 6))
    folded, report = fold_batch_norms(model, probe=x)
    assert report.folded == []
    assert [k.bn for k in report.kept] == ["bn"]
    assert reason in report.kept[0].reason, report.kept[0].reason
    assert report.kept[0].kind == KINDS[case]
    assert _bn_layers(folded) == []
    assert sum(isinstance(layer, InferenceAffine) for layer in folded.layers) == 1
    assert_close(folded(x), model(x, training=False), 1e-6)


def test_refused_backward_fold_falls_back_to_forward():
    model = _functional(
        lambda x: L.Conv1D(3, 2, name="next")(
            L.BatchNormalization(name="bn")(L.Dense(4, "relu", name="host")(x))
        ),
        (5, 6),
    )
    folded, report = _check_fold(model, _x((3, 5, 6)))
    assert [(f.bn, f.host, f.direction) for f in report.folded] == [("bn", "next", "forward")]
    assert report.kept == [] and _bn_layers(folded) == []


def test_model_with_a_lambda_layer_folds():
    """Copying a Lambda from a live model needs no safe_mode override from the caller."""
    model = randomise_batch_norms(
        keras.Sequential(
            [
                keras.Input((5,)),
                L.Dense(4),
                L.BatchNormalization(),
                L.Lambda(lambda t: t * 2.0 + 1.0),
            ]
        )
    )
    folded, report = _check_fold(model, _x((3, 5)))
    assert len(report.folded) == 1 and isinstance(folded.layers[-1], L.Lambda)


def test_folded_model_with_a_kept_bn_saves_and_loads(tmp_path):
    build, _ = REFUSALS["activation"]
    model = _functional(build, (5, 6))
    folded, report = fold_batch_norms(model)
    assert len(report.kept) == 1
    folded.save(tmp_path / "folded.keras")
    loaded = keras.saving.load_model(tmp_path / "folded.keras")  # no custom_objects needed
    x = _x((2, 5, 6))
    assert isinstance(loaded.get_layer("bn"), InferenceAffine)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(folded(x)))


class _Doubler(keras.Model):
    """A subclassed model without BN: it has no graph, but it needs none to be copied."""

    def call(self, x):
        return x * 2.0


class _DenseBN(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = L.Dense(4)
        self.bn = L.BatchNormalization()

    def call(self, x):
        return self.bn(self.dense(x))


def test_nested_subclassed_model_is_copied_unless_it_hides_a_bn():
    inputs = keras.Input((5,))
    y = L.BatchNormalization(name="bn")(L.Dense(4, name="host")(inputs))
    model = randomise_batch_norms(keras.Model(inputs, _Doubler(name="doubler")(y)))
    _, report = _check_fold(model, _x((3, 5)))
    assert [f.bn for f in report.folded] == ["bn"]

    hidden = keras.Model(inputs, _DenseBN(name="block")(inputs))
    with pytest.raises(
        UnsupportedModelError, match="'block', a subclassed _DenseBN: it has no layer graph"
    ):
        fold_batch_norms(hidden)


def test_lambda_using_module_globals_folds():
    """A Lambda's function is reused as it is: re-created from its config it would lose the
    module globals it needs (here `tf`) and break the rebuilt model."""
    model = keras.Sequential(
        [
            keras.Input((3, 3)),
            keras.layers.Lambda(lambda t: tf.linalg.det(t)[:, None]),
            keras.layers.Dense(2),
            keras_bn.BatchNormalization(),
        ]
    )
    randomise_batch_norms(model)
    x = np.random.default_rng(0).normal(size=(4, 3, 3)).astype("float32")
    folded, report = fold_batch_norms(model, probe=x)
    assert len(report.folded) == 1 and not report.kept
    assert_close(folded(x), model(x, training=False), 1e-5)


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_folded_channels_first_host_adds_its_bias_on_the_channel_axis(kind, tmp_path):
    """A folded channels_first host gets its bias from a ChannelBias (an explicit axis, not
    Keras's guess from the shapes); the folded model saves and loads without custom_objects.
    A channels_last host keeps its own bias."""
    layers = [
        L.Conv2D(4, 3, data_format="channels_first", use_bias=False, name="cf"),
        L.BatchNormalization(axis=1),
        L.Permute((2, 3, 1)),
        L.Conv2D(3, 1, name="cl"),
        L.BatchNormalization(),
    ]
    if kind == "sequential":
        model = keras.Sequential([keras.Input((2, 6, 6)), *layers])
    else:
        inputs = keras.Input((2, 6, 6))
        y = inputs
        for layer in layers:
            y = layer(y)
        model = keras.Model(inputs, y)
    randomise_batch_norms(model)
    x = _x((3, 2, 6, 6))  # the cf conv's output is 4×4 with 4 filters
    folded, report = _check_fold(model, x)
    assert [f.host for f in report.folded] == ["cf", "cl"]
    biases = [layer for layer in folded.layers if isinstance(layer, ChannelBias)]
    assert [(b.name, b.channel_axis, b.channels) for b in biases] == [("cf_bias", 1, 4)]
    assert not folded.get_layer("cf").use_bias and folded.get_layer("cl").use_bias
    folded.save(tmp_path / "folded.keras")
    loaded = keras.saving.load_model(tmp_path / "folded.keras")
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(folded(x)))


@pytest.mark.parametrize(
    "bad", [{"channel_axis": 0}, {"channel_axis": True}, {"channels": 0}, {"channels": 2.0}]
)
def test_channel_bias_arguments_are_validated(bad):
    arguments = {"channel_axis": 1, "channels": 3, **bad}
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=f"received {name}={value!r}"):
        ChannelBias(**arguments)
    layer = ChannelBias(1, 3, name="b")
    assert ChannelBias.from_config(layer.get_config()).get_config() == layer.get_config()


class _BlockWithBNs(L.Layer):
    """A custom layer (not a model) computing Dense → BN, and a nested custom layer with
    another BN: the fold copies it whole."""

    def __init__(self, inner=True, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner
        self.dense = L.Dense(4)
        self.bn = keras_bn.BatchNormalization(name="hidden_bn")
        self.deeper = _BlockWithBNs(inner=False, name="deeper") if inner else None

    def call(self, x, training=None):
        y = self.bn(self.dense(x), training=training)
        return y if self.deeper is None else self.deeper(y, training=training)

    def get_config(self):
        return {**super().get_config(), "inner": self.inner}


class _ReluBN(keras_bn.BatchNormalization):
    """A BN subclass whose call is not the BN's: folding it as a BN would drop the ReLU."""

    def call(self, inputs, training=None, **kwargs):
        return keras.ops.relu(super().call(inputs, training=training, **kwargs))


def test_every_bn_is_accounted_for_bns_the_fold_cannot_see_into_are_kept():
    """A BN inside a custom layer, and a BN subclass, are kept as they are, and named in
    report.kept with the reason; the folded model still matches the original."""
    inputs = keras.Input((3,))
    y = _BlockWithBNs(name="block")(inputs)
    y = L.Dense(4, name="host")(y)
    y = _ReluBN(name="relu_bn")(y)
    y = L.Dense(2, name="host2")(y)
    outputs = L.BatchNormalization(name="plain")(y)
    model = randomise_batch_norms(keras.Model(inputs, outputs))
    folded, report = _check_fold(model, _x((5, 3)))
    assert [(f.bn, f.host) for f in report.folded] == [("plain", "host2")]
    kept = {k.bn: k for k in report.kept}
    assert set(kept) == {"block/hidden_bn", "block/deeper/hidden_bn", "relu_bn"}
    assert kept["block/hidden_bn"].kind == "inside_layer"
    assert "custom layer 'block' (_BlockWithBNs)" in kept["block/hidden_bn"].reason
    assert kept["relu_bn"].kind == "subclass"
    assert "_ReluBN" in kept["relu_bn"].reason
    assert isinstance(folded.get_layer("relu_bn"), _ReluBN)
    assert len(report.folded) + len(report.kept) == len(_bn_layers(model))


def test_bn_under_a_mask_folds_and_the_mask_still_reaches_later_layers():
    """Inference BN ignores its mask: a BN after a masking Embedding folds (it was kept as
    "has 2 inputs", counting the mask), and the pooling after it still averages only the
    unmasked steps."""
    ids = keras.Input((5,), dtype="int32")
    y = L.Embedding(10, 4, mask_zero=True)(ids)
    y = L.BatchNormalization(name="forward_bn")(y)
    y = L.Dense(4, name="host")(y)
    y = keras_bn.BatchNormalization(name="backward_bn")(y)
    model = randomise_batch_norms(keras.Model(ids, L.GlobalAveragePooling1D()(y)))
    probe = np.array([[1, 2, 0, 0, 0], [3, 0, 0, 0, 0], [4, 5, 6, 7, 9]])
    folded, report = _check_fold(model, probe)
    assert {(f.bn, f.host, f.direction) for f in report.folded} == {
        ("forward_bn", "host", "forward"),
        ("backward_bn", "host", "backward"),
    }
    assert report.kept == [] and _bn_layers(folded) == []


def test_a_kept_bn_passes_the_mask_on_to_the_layers_after_it():
    """Embedding(mask_zero) → BN (kept: it reads no host) → LSTM: the LSTM of the folded model
    must still skip the padding, or its last state differs from the original's."""
    ids = keras.Input((7,), dtype="int32")
    x = keras.layers.Embedding(20, 6, mask_zero=True)(ids)
    x = keras_bn.BatchNormalization()(x)
    y = keras.layers.LSTM(5)(x)
    model = keras.Model(ids, y)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 20, size=(16, 7)).astype("int32")
    tokens[:, 4:] = 0  # padding at the end of every sequence
    for layer in model.layers:
        if isinstance(layer, keras_bn.BatchNormalization):
            layer.moving_mean.assign(rng.normal(size=6).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, size=6).astype("float32"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folded, report = fold_batch_norms(model, tokens)
    # Keras warns when a layer that does not support masking is passed a mask.
    assert not [w for w in caught if "destroy the mask" in str(w.message)]
    assert [k.kind for k in report.kept] == ["not_a_host"]
    np.testing.assert_allclose(
        folded.predict(tokens, verbose=0), model.predict(tokens, verbose=0), atol=1e-6
    )
    assert report.relative_error < 1e-5

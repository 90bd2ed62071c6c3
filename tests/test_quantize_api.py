"""keras_bn.quantize's API: the `from_layers` factory (either BN class, weights copied, the
originals untouched, the fused activations), every argument check naming the bad value, and
the public names' Google-style docstrings (the checks of tests/test_docstrings.py, under
TensorFlow, where that module runs). Under every backend."""

import inspect
import os
import re
import tempfile

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from helpers import assert_close
from keras_bn._graph import bn_layers
from keras_bn.export import fold
from keras_bn.quantize import (
    QuantizedHost,
    QuantizedHostBatchNorm,
    fake_quant,
    from_layers,
)

L = keras.layers


def _built(host, shape, bn=None, seed=0):
    """`host` (and `bn` after it) built on `shape`, with random weights and statistics."""
    rng = np.random.default_rng(seed)
    host.build(shape)
    for weight in host.weights:
        weight.assign(rng.normal(size=weight.shape).astype("float32"))
    if bn is not None:
        bn.build(host.compute_output_shape(shape))
        channels = bn.moving_mean.shape
        bn.gamma.assign(rng.uniform(0.5, 1.5, channels).astype("float32"))
        bn.beta.assign(rng.normal(size=channels).astype("float32"))
        bn.moving_mean.assign(rng.normal(size=channels).astype("float32"))
        bn.moving_variance.assign(rng.uniform(0.5, 2.0, channels).astype("float32"))
    return host, bn


def _snapshot(*layers):
    return [[np.array(w) for w in layer.weights] for layer in layers]


@pytest.mark.parametrize("bn_class", [keras_bn.BatchNormalization, L.BatchNormalization])
def test_from_layers_copies_weights_and_keeps_the_float_inference(bn_class):
    """With fake quantization off, the QAT layer's inference is the original host → BN → ReLU's;
    the moving variance is copied as it is (either convention) and the originals keep their
    weights; with it on, `folded_weights` is the project's fold of the same layers."""
    host, bn = _built(L.Conv2D(4, 3, padding="same"), (2, 6, 6, 3), bn_class(epsilon=1e-4))
    before = _snapshot(host, bn)
    configs = [host.get_config(), bn.get_config()]
    x = np.random.default_rng(1).normal(size=(2, 6, 6, 3)).astype("float32")
    expected = np.maximum(array(bn(host(x), training=False)), 0.0)

    layer = from_layers(host, bn, L.ReLU(), weight_bits=None, activation_bits=None)
    assert isinstance(layer, QuantizedHostBatchNorm) and layer.activation == "relu"
    assert type(layer.batch_norm) is keras_bn.BatchNormalization
    assert layer.batch_norm.epsilon == 1e-4
    np.testing.assert_array_equal(layer.batch_norm.moving_variance, bn.moving_variance)
    assert_close(array(layer(x, training=False)), expected, 1e-5)
    assert layer.host is not host and layer.batch_norm is not bn

    quantized = from_layers(host, bn, "relu", weight_bits=4)
    kernel, bias = quantized.folded_weights()
    scale, shift = bn_layers.inference_affine(bn)
    want_kernel, want_bias = fold.fold_conv(array(host.kernel), array(host.bias), scale, shift)
    np.testing.assert_allclose(kernel, want_kernel, rtol=1e-6)
    np.testing.assert_allclose(bias, want_bias, rtol=1e-5, atol=1e-6)
    # Training the copies changes nothing in the originals.
    layer(x, training=True)
    layer.host.kernel.assign(layer.host.kernel * 2)
    for old, new in zip(before, _snapshot(host, bn)):
        for a, b in zip(old, new):
            np.testing.assert_array_equal(a, b)
    assert [host.get_config(), bn.get_config()] == configs


@pytest.mark.parametrize(
    "activation, name",
    [
        (L.ReLU(), "relu"),
        (L.ReLU(max_value=6), "relu6"),
        (L.Activation("relu6"), "relu6"),
        (L.Activation("linear"), None),
        ("relu6", "relu6"),
        (None, None),
    ],
)
def test_from_layers_fuses_relu_and_relu6(activation, name):
    host, bn = _built(L.Dense(3), (4, 5), keras_bn.BatchNormalization())
    assert from_layers(host, bn, activation).activation == name


@pytest.mark.parametrize(
    "activation", [L.LeakyReLU(), L.ReLU(negative_slope=0.1), L.ReLU(max_value=4), "sigmoid"]
)
def test_from_layers_refuses_other_activations(activation):
    host, bn = _built(L.Dense(3), (4, 5), keras_bn.BatchNormalization())
    with pytest.raises(ValueError, match="relu6"):
        from_layers(host, bn, activation)


def test_without_batch_norm_a_host_relu_moves_to_the_qat_layer():
    host, _ = _built(L.Dense(3, activation="relu"), (4, 5))
    layer = from_layers(host, weight_bits=None, activation_bits=None)
    assert isinstance(layer, QuantizedHost) and layer.activation == "relu"
    assert keras.activations.serialize(layer.host.activation) == "linear"
    assert host.get_config()["activation"] == "relu"  # the original keeps its own
    x = np.random.default_rng(2).normal(size=(4, 5)).astype("float32")
    assert_close(array(layer(x)), array(host(x)), 1e-6)
    with pytest.raises(ValueError, match="already applies 'relu'"):
        from_layers(host, activation="relu")


def test_from_layers_refuses_what_it_cannot_fold():
    unbuilt = L.Conv2D(2, 3)
    with pytest.raises(ValueError, match=f"'{unbuilt.name}' is not built"):
        from_layers(unbuilt)
    host, _ = _built(L.Dense(3), (4, 5))
    refused = [
        (keras_bn.BatchNormalization(renorm=True), "renorm=True"),
        (keras_bn.BatchNormalization(virtual_batch_size=2), "virtual_batch_size=2"),
        (keras_bn.BatchNormalization(momentum=None), "momentum=None"),
    ]
    if keras.backend.backend() == "tensorflow":  # Keras takes synchronized=True there alone
        refused.append((L.BatchNormalization(synchronized=True), "synchronized=True"))
    for bn, message in refused:
        bn.build((4, 3))
        with pytest.raises(ValueError, match=message):
            from_layers(host, bn)
    dense, _ = _built(L.Dense(3), (4, 3))
    with pytest.raises(ValueError, match="batch_norm must be a batch-norm layer"):
        from_layers(host, dense)


@pytest.mark.parametrize(
    "host, message",
    [
        (L.Conv2DTranspose(2, 3), "Conv2DTranspose"),
        (L.Conv2D(2, 3, activation="relu"), "activation='relu'"),
        (L.Dense(2, lora_rank=2), "LoRA"),
    ],
)
def test_unsupported_hosts_are_refused_by_name(host, message):
    with pytest.raises(ValueError, match=message):
        QuantizedHostBatchNorm(host)


def test_a_batch_norm_off_the_hosts_channel_axis_is_refused_at_build():
    layer = QuantizedHostBatchNorm(L.Conv2D(4, 3), keras_bn.BatchNormalization(axis=1))
    with pytest.raises(ValueError, match=r"axis=1.*channels on axis 3"):
        layer.build((2, 6, 6, 3))


@pytest.mark.parametrize(
    "kwargs, shown",
    [
        ({"weight_bits": 1}, "weight_bits=1"),
        ({"weight_bits": 9}, "weight_bits=9"),
        ({"weight_bits": 8.0}, "weight_bits=8.0"),
        ({"weight_bits": True}, "weight_bits=True"),
        ({"weight_bits": "8"}, "weight_bits='8'"),
        ({"activation_bits": 0}, "activation_bits=0"),
        ({"per_channel": 1}, "per_channel=1"),
        ({"quantize_output": "no"}, "quantize_output='no'"),
        ({"range_momentum": 1.0}, "range_momentum=1.0"),
        ({"range_momentum": -0.1}, "range_momentum=-0.1"),
        ({"activation": "sigmoid"}, "activation='sigmoid'"),
        ({"batch_norm": "bn"}, "str"),
        ({"weight_range": "minmax"}, "weight_range='minmax'"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_value(kwargs, shown):
    with pytest.raises(ValueError, match=shown.replace(".", r"\.")):
        QuantizedHostBatchNorm(L.Dense(3), **kwargs)


@pytest.mark.parametrize("model", [None, L.Dense(3), "model.keras"])
def test_quantize_model_takes_a_keras_model_only(model):
    with pytest.raises(
        TypeError, match=re.escape(f"takes a keras.Model; received model={model!r}.")
    ):
        keras_bn.quantize.quantize_model(model)


# keras_bn.quantize's own names are checked by tests/test_docstrings.py with the other public
# modules; the fake_quant module's functions (a public module whose functions are not in any
# __all__) are checked here, the same way.
PUBLIC = {
    f"{fake_quant.__name__}.{name}": value
    for name, value in vars(fake_quant).items()
    if not name.startswith("_")
    and inspect.isfunction(value)
    and value.__module__ == fake_quant.__name__
}


def test_the_walk_finds_the_fake_quant_functions():
    for name in ("weight_grid", "nudged_grid", "fake_quant_weights", "validate_bits"):
        assert f"keras_bn.quantize.fake_quant.{name}" in PUBLIC, name


# test_docstrings.py's checks, which read source text only, run where that module imports.
@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_fake_quant_functions_have_google_style_docstrings(name):
    from test_docstrings import (
        _entries,
        _own_doc,
        _parameters,
        _raised_directly,
        _returns_value,
        _sections,
    )

    function = PUBLIC[name]
    doc = _own_doc(function)
    assert doc and len(doc.split()) >= 5, f"{name} has no docstring"
    sections = _sections(doc)
    args = _entries(sections.get("Args", []))
    assert sorted(args) == sorted(_parameters(function)), (name, args)
    if _returns_value(function):
        assert "Returns" in sections, f"{name} has no Returns section"
    documented = {e.rsplit(".", 1)[-1] for e in _entries(sections.get("Raises", []))}
    assert _raised_directly(function) <= documented, name


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_fake_quant_functions_are_annotated(name):
    signature = inspect.signature(PUBLIC[name])
    missing = [p for p, v in signature.parameters.items() if v.annotation is v.empty]
    assert not missing and signature.return_annotation is not signature.empty, (name, missing)


def _package_callables():
    import keras_bn.quantize as package

    found = {}
    for name in package.__all__:
        value = getattr(package, name)
        if inspect.isfunction(value):
            found[name] = value
        elif inspect.isclass(value) and "__init__" in vars(value):
            found[name] = value.__init__
    return found


@pytest.mark.parametrize("name", sorted(_package_callables()))
def test_public_callables_are_annotated(name):
    """Every parameter of keras_bn.quantize's public functions and constructors has a type,
    and every function a return type."""
    function = _package_callables()[name]
    signature = inspect.signature(function)
    missing = [
        parameter
        for parameter, value in signature.parameters.items()
        if parameter not in ("self", "kwargs") and value.annotation is value.empty
    ]
    assert not missing, (name, missing)
    assert signature.return_annotation is not signature.empty, name


def test_check_batchnorm_refuses_a_qat_model_by_layer():
    """A folded BN has no input of its own to check: refused up front, naming the layer
    (`folds_batch_norm`, read by keras_bn._graph.bn_layers.refuse_folded), nested models too."""
    inner = keras.Sequential(
        [keras.Input((6,)), L.Dense(4, use_bias=False), keras_bn.BatchNormalization()]
    )
    model = keras.Sequential([keras.Input((6,)), inner])
    qat = keras_bn.quantize.quantize_model(model)
    qat.compile("sgd", "mse")
    x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
    with pytest.raises(keras_bn.UnsupportedModelError, match=r"fold their batch norms") as raised:
        keras_bn.diagnostics.check_batchnorm(qat, x)
    folded = [
        layer.name
        for layer in qat._flatten_layers()
        if isinstance(layer, keras_bn.quantize.QuantizedHostBatchNorm)
    ]
    assert folded and all(name in str(raised.value) for name in folded)


@pytest.mark.parametrize(
    "bits, given, expected",
    [(8, None, "max"), (4, None, "max"), (3, None, "learned"), (2, None, "learned")]
    + [(8, "learned", "learned"), (2, "max", "max")],
)
def test_weight_range_defaults_to_learned_below_4_bits_and_round_trips(bits, given, expected):
    """The default follows the bits (8-bit QAT keeps max|w|); the config, `.keras` files and
    the learned values round-trip."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 3))
    x = keras_bn.BatchNormalization()(L.Conv2D(4, 3, use_bias=False)(inputs))
    model = keras.Model(inputs, L.Dense(2)(L.Flatten()(L.ReLU()(x))))
    qat = keras_bn.quantize.quantize_model(model, bits, weight_range=given)
    layers = [layer for layer in qat.layers if hasattr(layer, "weight_range")]
    assert {layer.weight_range for layer in layers} == {expected}
    for layer in layers:
        assert type(layer).from_config(layer.get_config()).weight_range == expected
        assert set(layer.learned_ranges) == ({"kernel"} if expected == "learned" else set())
    if expected == "learned":
        for layer in layers:
            for variable in layer.learned_ranges.values():
                variable.assign(array(variable) * 0.75)  # not where a reset puts them
    x = np.random.default_rng(0).normal(size=(4, 6, 6, 3)).astype("float32")
    path = os.path.join(tempfile.mkdtemp(), "qat.keras")
    qat.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), qat.predict(x, verbose=0))
    for a, b in zip(qat.weights, loaded.weights):
        np.testing.assert_array_equal(array(a), array(b))

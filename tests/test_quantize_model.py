"""keras_bn.quantize.quantize_model: which layers become QAT layers and where activation
quantizers go (the TFLite int8 spec's roles), the report and its warning, the original model
left untouched, and the rewritten model's inference against the project's fold (keras_bn.export)
with the weights rounded as the QAT layers round them; channels_first at the shape where
Keras's own bias add is wrong under TensorFlow, against numpy. Under every backend; the pool
traced in a tf.function under TensorFlow alone."""

import contextlib
import re
import warnings

import keras
import numpy as np
import pytest
import quantize_reference as ref
from framework_references import array

import digits
import keras_bn
from helpers import assert_close, randomise_batch_norms
from keras_bn import KerasBNWarning
from keras_bn._errors import UnsupportedModelError
from keras_bn.export import ChannelBias, fold_batch_norms
from keras_bn.quantize import (
    ActivationQuantizer,
    KeptLayer,
    QuantizationReport,
    QuantizedAveragePooling,
    QuantizedHost,
    QuantizedHostBatchNorm,
    fake_quant,
    quantize_model,
)

BACKEND = keras.backend.backend()
# Keras 3.15 adds a channels_first bias on the output's last axis when it has as many entries
# as there are channels, under TensorFlow only: quantize_model warns there alone.
KERAS_BIAS_ADD_IS_WRONG = BACKEND == "tensorflow"

L = keras.layers
BN = keras_bn.BatchNormalization


def _branches():
    """Two inputs, two outputs: Add → ReLU, two Concatenates, Average/GlobalAveragePooling, a
    separable and a depthwise conv, Dense with ReLU and softmax; every BN foldable."""
    image = keras.Input((8, 8, 3), name="image")
    extra = keras.Input((5,), name="extra")
    a = L.Conv2D(8, 3, padding="same", use_bias=False, name="a")(image)
    a = BN(name="a_bn")(a)
    a = L.ReLU(name="a_relu")(a)
    b = L.Conv2D(8, 1, name="b")(a)
    b = L.BatchNormalization(name="b_bn")(b)
    s = L.Add(name="add")([a, b])
    s = L.ReLU(name="add_relu")(s)
    c = L.DepthwiseConv2D(3, padding="same", name="c")(s)
    c = BN(name="c_bn")(c)
    d = L.SeparableConv2D(8, 3, padding="same", name="d")(s)
    joined = L.Concatenate(name="cat")([c, d])
    pooled = L.AveragePooling2D(2, name="avg")(joined)
    gap = L.GlobalAveragePooling2D(name="gap")(pooled)
    e = L.Dense(4, activation="relu", name="e")(extra)
    h = L.Concatenate(name="cat2")([gap, e])
    probabilities = L.Dense(3, activation="softmax", name="head")(h)
    values = L.Dense(2, name="head2")(gap)
    model = keras.Model([image, extra], [probabilities, values], name="branches")
    return randomise_batch_norms(model)


def _branches_input(seed=0, n=6):
    rng = np.random.default_rng(seed)
    return [
        rng.uniform(0, 1, (n, 8, 8, 3)).astype("float32"),
        rng.normal(size=(n, 5)).astype("float32"),
    ]


def _nested():
    """A Sequential block (conv → BN → ReLU → conv → BN) inside a Functional model."""
    block = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            L.Conv2D(6, 3, padding="same", name="conv"),
            BN(name="bn"),
            L.ReLU(name="relu"),
            L.Conv2D(4, 1, name="conv2"),
            BN(name="bn2"),
        ],
        name="block",
    )
    inputs = keras.Input((8, 8, 3), name="pixels")
    x = block(inputs)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    outputs = L.Dense(2, name="head")(x)
    return randomise_batch_norms(keras.Model(inputs, outputs, name="outer"))


def _digits_cnn(norm=BN):
    model = digits.small_cnn(norm)
    model(np.zeros((1, 8, 8, 1), "float32"))
    return randomise_batch_norms(model)


def _get(model, path):
    for name in path.split("/"):
        model = model.get_layer(name)
    return model


def _hosts_of(qat, report):
    """{QAT host layer path: its host's path}: the first original mapped to each QAT layer
    that hosts a Dense or convolution (not the QuantizedAveragePooling layers)."""
    found = {}
    for original, path in report.quantized.items():
        if isinstance(_get(qat, path), (QuantizedHost, QuantizedHostBatchNorm)):
            found.setdefault(path, original)
    return found


def _fold_with_qat_weights(model, qat, report):
    """The project's fold of `model` (keras_bn.export.fold_batch_norms), checked against each
    QAT layer's `folded_weights`, then with every host's kernels rounded to the grid the QAT
    layer's weights lie on (`fake_quant.weight_grid`): what the QAT model computes before any
    activation range is set."""
    folded, fold_report = fold_batch_norms(model)
    assert not fold_report.kept
    for qat_path, host_path in _hosts_of(qat, report).items():
        layer, host = _get(qat, qat_path), _get(folded, host_path)
        kernel, bias = layer.folded_weights()
        separable = isinstance(host, (L.SeparableConv1D, L.SeparableConv2D))
        folded_kernel = host.pointwise_kernel if separable else host.kernel
        assert_close(folded_kernel, kernel, 1e-5)
        if host.bias is not None:
            assert_close(host.bias, bias, 1e-5)
        depthwise = isinstance(host, (L.DepthwiseConv1D, L.DepthwiseConv2D))
        folded_kernel.assign(_on_grid(kernel, "depthwise" if depthwise else "conv", layer))
        if separable:
            host.depthwise_kernel.assign(_on_grid(host.depthwise_kernel, "depthwise", layer))
    return folded


def _on_grid(kernel, kind, layer):
    kernel = array(kernel).astype(np.float32)
    q, scale = fake_quant.weight_grid(
        ref.channels_last_view(kernel, kind), layer.weight_bits, layer.per_channel
    )
    return (q * scale).reshape(kernel.shape).astype("float32")


def _outputs(model, x):
    return [array(t) for t in keras.tree.flatten(model(x, training=False))]


@pytest.mark.parametrize("norm", [BN, L.BatchNormalization], ids=["keras_bn", "keras"])
def test_the_digits_cnn_becomes_four_qat_layers(norm):
    """Conv–BN–ReLU ×2 and Dense–BN–ReLU are QuantizedHostBatchNorm layers, the softmax head a
    QuantizedHost followed by its softmax; only the input gets a quantizer (MaxPooling and
    Flatten keep its grid, the spec fixes softmax's); nothing is kept in float."""
    model = _digits_cnn(norm)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KerasBNWarning)  # nothing kept: no warning
        qat, report = quantize_model(model, weight_bits=6, return_report=True)
    kinds = [type(layer).__name__ for layer in qat.layers]
    assert kinds == [
        "ActivationQuantizer",
        "QuantizedHostBatchNorm",
        "QuantizedHostBatchNorm",
        "MaxPooling2D",
        "Flatten",
        "QuantizedHostBatchNorm",
        "QuantizedHost",
        "Activation",
    ]
    assert isinstance(report, QuantizationReport) and report.kept == ()
    names = [layer.name for layer in model.layers]  # conv, bn, relu, conv, bn, relu, ...
    assert report.quantized == {
        **dict.fromkeys(names[0:3], f"{names[0]}_qat"),
        **dict.fromkeys(names[3:6], f"{names[3]}_qat"),
        **dict.fromkeys(names[8:11], f"{names[8]}_qat"),
        names[11]: f"{names[11]}_qat",
    }
    (source,) = report.quantizers.values()
    assert report.quantizers == {f"{source}_quantizer": source}
    conv, _, dense, head = [layer for layer in qat.layers if hasattr(layer, "host")]
    assert conv.per_channel and not dense.per_channel and not head.per_channel  # Dense: per tensor
    assert conv.activation == "relu" and head.activation is None
    assert keras.activations.serialize(qat.layers[-1].activation) == "softmax"
    assert {layer.weight_bits for layer in (conv, dense, head)} == {6}
    assert type(conv.batch_norm) is keras_bn.BatchNormalization
    assert "weights 6 bits per channel" in str(report)
    assert f"{names[11]}_qat <- {names[11]}" in str(report)


@pytest.mark.parametrize(
    "per_channel, convolutions, dense_ranges, shown",
    [
        (True, True, False, "weights 8 bits per channel (Dense per tensor), activations"),
        ("all", True, True, "weights 8 bits per channel (Dense too), activations"),
        (False, False, False, "weights 8 bits per tensor, activations"),
    ],
)
def test_per_channel_chooses_the_weight_ranges_of_convolutions_and_dense_apart(
    per_channel, convolutions, dense_ranges, shown
):
    """True (the default): one range per output channel in convolutions, per tensor in Dense;
    "all": per channel everywhere; False: per tensor everywhere. Each QAT layer's grid has
    that shape, and the report says so."""
    model = _digits_cnn(BN)
    qat, report = quantize_model(model, per_channel=per_channel, return_report=True)
    conv, _, dense, head = [layer for layer in qat.layers if hasattr(layer, "host")]
    expected = (convolutions, dense_ranges, dense_ranges)
    assert (conv.per_channel, dense.per_channel, head.per_channel) == expected
    grids = [layer.weight_grids()["kernel"] for layer in (conv, dense, head)]
    assert [np.ndim(grid.scale) for grid in grids] == [int(flag) for flag in expected]
    assert report.per_channel == per_channel and shown in str(report)
    default = quantize_model(model)
    assert [layer.per_channel for layer in default.layers if hasattr(layer, "host")] == [
        True,
        True,
        False,
        False,
    ]


@pytest.mark.parametrize("build", [_digits_cnn, _branches, _nested], ids=lambda f: f.__name__)
def test_inference_is_the_fold_with_the_weights_rounded(build):
    """Before any training batch sets the activation ranges, the QAT model computes the
    project's fold of the original with each host's weights on the QAT layer's grid."""
    model = build()
    qat, report = quantize_model(model, weight_bits=4, return_report=True)
    x = (
        _branches_input()
        if build is _branches
        else np.random.default_rng(1)
        .uniform(0, 1, (6, 8, 8, 3 if build is _nested else 1))
        .astype("float32")
    )
    folded = _fold_with_qat_weights(model, qat, report)
    for actual, expected in zip(_outputs(qat, x), _outputs(folded, x)):
        assert_close(actual, expected, 1e-5)
    # And the weights really are rounded: 4 bits move the outputs off the float model's.
    assert max(np.abs(a - b).max() for a, b in zip(_outputs(qat, x), _outputs(model, x))) > 1e-3


def test_quantizers_follow_the_int8_spec_on_a_branching_model():
    """Own scales (inputs, Add's ReLU, Concatenate) get quantizers; a QAT layer or
    GlobalAveragePooling feeding only a Concatenate leaves its quantizer out (they share the
    Concatenate's scale), and so does the Concatenate feeding only the AveragePooling2D, which
    becomes a QuantizedAveragePooling quantizing its input itself; the softmax gets none."""
    qat, report = quantize_model(_branches(), return_report=True)
    assert report.quantizers == {
        "image_quantizer": "image",
        "extra_quantizer": "extra",
        "add_relu_quantizer": "add_relu",  # the Add's output quantizer moves after its ReLU
        "gap_quantizer": "gap",  # feeds the Concatenate and head2: a scale of its own (MEAN)
        "cat2_quantizer": "cat2",
    }
    assert report.quantized["avg"] == "avg_qat"
    assert isinstance(qat.get_layer("avg_qat"), QuantizedAveragePooling)
    quantizers = [layer.name for layer in qat.layers if isinstance(layer, ActivationQuantizer)]
    assert sorted(quantizers) == sorted(report.quantizers)
    outputs_quantized = {
        layer.name: layer.quantize_output
        for layer in qat.layers
        if isinstance(layer, (QuantizedHost, QuantizedHostBatchNorm))
    }
    assert outputs_quantized == {
        "a_qat": True,  # feeds b and the Add
        "b_qat": True,
        "c_qat": False,  # only the Concatenate reads them
        "d_qat": False,
        "e_qat": False,
        "head_qat": True,
        "head2_qat": True,
    }
    d = qat.get_layer("d_qat")  # a separable conv's intermediate tensor is still quantized
    assert d.intermediate_quantizer is not None and d.output_quantizer is None
    assert {layer.name for layer in qat.layers} >= {"add", "add_relu", "avg_qat", "gap", "cat"}
    assert report.quantized["a_relu"] == "a_qat" and report.quantized["e"] == "e_qat"
    assert qat.get_layer("e_qat").activation == "relu"  # the host's own ReLU, taken over


def test_nested_models_are_rewritten_inside():
    qat, report = quantize_model(_nested(), return_report=True)
    assert report.quantized == {
        "block/conv": "block/conv_qat",
        "block/bn": "block/conv_qat",
        "block/relu": "block/conv_qat",
        "block/conv2": "block/conv2_qat",
        "block/bn2": "block/conv2_qat",
        "head": "head_qat",
    }
    # The outer model quantizes the input; the block's output is a QAT layer's, on a grid.
    assert report.quantizers == {"pixels_quantizer": "pixels", "gap_quantizer": "gap"}
    block = qat.get_layer("block")
    assert [type(layer).__name__ for layer in block.layers] == ["QuantizedHostBatchNorm"] * 2


def _pooled(fan_out):
    """Conv → BN → ReLU → AveragePooling2D → GlobalAveragePooling → Dense; with `fan_out`, a
    strided conv reads the ReLU's output too and is added to the pool's."""
    image = keras.Input((8, 8, 3), name="image")
    a = L.Conv2D(6, 3, padding="same", name="a")(image)
    a = L.ReLU(name="a_relu")(BN(name="a_bn")(a))
    pooled = L.AveragePooling2D(2, name="avg")(a)
    if fan_out:
        pooled = L.Add(name="add")([pooled, L.Conv2D(6, 2, strides=2, name="side")(a)])
    outputs = L.Dense(3, name="head")(L.GlobalAveragePooling2D(name="gap")(pooled))
    return randomise_batch_norms(keras.Model(image, outputs, name="pooled"))


def _pool_probe(qat, fan_out):
    """(a model giving the pool's float input and its output, the quantizer whose grid both
    lie on): a QuantizedAveragePooling's own, or the quantizer the QAT layer's output moved
    to, called again after the copied pool."""
    source = qat.get_layer("a_qat").output  # not quantized inside: the grid is the pool's
    if fan_out:
        quantizer = qat.get_layer("a_qat_quantizer")
        first, after_pool = quantizer._inbound_nodes
        assert first.input_tensors[0] is source
        assert after_pool.arguments.kwargs == {"training": False, "average_of": 4}
        pooled = after_pool.outputs[0]
    else:
        layer = qat.get_layer("avg_qat")
        quantizer, pooled = layer.input_quantizer, layer.output
    return keras.Model(qat.input, [source, pooled]), quantizer


@pytest.mark.parametrize(
    "mode",
    [
        "inference",
        "training",
        pytest.param("training_graph", marks=pytest.mark.backends("tensorflow")),  # tf.function
    ],
)
@pytest.mark.parametrize("fan_out", [False, True], ids=["pool_only", "fan_out"])
def test_an_average_pool_rounds_onto_its_inputs_grid_as_int8_does(fan_out, mode):
    """The pool's output is TFLite's int8 AVERAGE_POOL_2D of its input's integers on the
    input's own grid (numpy, in integers: halves away from the int8 zero), in training (the
    grid this batch moved the range to) and at inference, whether the pool quantizes its input
    itself or shares the grid of a quantizer that other layers read. GlobalAveragePooling
    (TFLite's MEAN) keeps a scale of its own."""
    qat, report = quantize_model(_pooled(fan_out), return_report=True)
    assert report.quantizers["gap_quantizer"] == "gap"
    if fan_out:
        assert type(qat.get_layer("avg")) is L.AveragePooling2D
        assert report.quantizers["a_qat_quantizer"] == "a_qat"
    else:
        assert report.quantized["avg"] == "avg_qat" and "a_qat_quantizer" not in report.quantizers
    assert not qat.get_layer("a_qat").quantize_output
    probe, quantizer = _pool_probe(qat, fan_out)
    rng = np.random.default_rng(1)
    qat(rng.normal(size=(8, 8, 8, 3)).astype("float32"), training=True)  # sets the ranges
    x = rng.normal(size=(8, 8, 8, 3)).astype("float32")
    before = float(quantizer.range_max.numpy())
    if mode == "inference":
        source, pooled = probe(x, training=False)
    elif mode == "training":
        source, pooled = probe(x, training=True)
    else:
        import tensorflow as tf

        source, pooled = tf.function(lambda t: probe(t, training=True))(x)
    source = array(source)
    moved = float(quantizer.range_max.numpy()) != before
    assert moved == (mode != "inference")
    low, high = float(quantizer.range_min.numpy()), float(quantizer.range_max.numpy())
    scale, zero_point = ref.activation_grid(low, high, 8)
    indices = ref.activation_indices(source, low, high, 8)
    want = (ref.average_pool_int8(indices, 2) - zero_point) * scale
    # Windows holding an input within float32's reach of a rounding boundary are left out.
    near = ref.distance_to_rounding_boundary(source, low, high, 8) < 1e-3
    clear = ~near.reshape(8, 4, 2, 4, 2, 6).any(axis=(2, 4))
    assert clear.mean() > 0.9
    np.testing.assert_allclose(array(pooled)[clear], want[clear], rtol=0, atol=1e-3 * scale)
    # Halves below the int8 zero exist, where ⌊u + ½⌋ would round up and int8 rounds down.
    sums = (indices.reshape(8, 4, 2, 4, 2, 6).sum(axis=(2, 4)) - 4 * 128) % 4
    assert np.any(sums == 2)


@pytest.mark.parametrize("size", [2, 3, (2, 3)])
@pytest.mark.parametrize("fan_out", [False, True], ids=["upsampling_only", "fan_out"])
def test_a_bilinear_upsampling_rounds_onto_its_inputs_grid_as_int8_does(fan_out, size):
    """A bilinear UpSampling2D's output is TFLite's int8 RESIZE_BILINEAR of its input's
    integers on the input's own grid (numpy, in integers: 10-bit weights, halves up), whether
    it quantizes its input itself or shares the grid of a quantizer other layers read (here a
    nearest-neighbour one, which copies grid values and stays a plain copy)."""
    image = keras.Input((6, 6, 3), name="image")
    a = L.ReLU(name="a_relu")(BN(name="a_bn")(L.Conv2D(4, 3, padding="same", name="a")(image)))
    outputs = [L.UpSampling2D(size, interpolation="bilinear", name="up")(a)]
    if fan_out:
        outputs.append(L.UpSampling2D(size, name="near")(a))
    qat = quantize_model(randomise_batch_norms(keras.Model(image, outputs)))
    if fan_out:
        quantizer = qat.get_layer("a_qat_quantizer")
        assert type(qat.get_layer("up")) is type(qat.get_layer("near")) is L.UpSampling2D
        assert quantizer._inbound_nodes[-1].arguments.kwargs["halves"] == "up"
        pooled = quantizer._inbound_nodes[-1].outputs[0]
    else:
        layer = qat.get_layer("up_qat")
        assert isinstance(layer, QuantizedAveragePooling)
        quantizer, pooled = layer.input_quantizer, layer.output
    probe = keras.Model(qat.input, [qat.get_layer("a_qat").output, pooled])
    rng = np.random.default_rng(1)
    qat(rng.normal(size=(8, 6, 6, 3)).astype("float32"), training=True)  # sets the ranges
    source, upsampled = (array(t) for t in probe(rng.normal(size=(8, 6, 6, 3)), training=False))
    low, high = float(quantizer.range_min.numpy()), float(quantizer.range_max.numpy())
    scale, zero_point = ref.activation_grid(low, high, 8)
    rows, cols = (size, size) if isinstance(size, int) else size
    indices = ref.activation_indices(source, low, high, 8)
    want = (ref.resize_bilinear_int8(indices, (rows, cols)) - zero_point) * scale
    # Inputs within float32's reach of a rounding boundary may round either way.
    near_boundary = ref.distance_to_rounding_boundary(source, low, high, 8) < 1e-3
    clear = ~np.repeat(np.repeat(near_boundary.any(axis=-1), rows, 1), cols, 2)
    assert clear.mean() > 0.8
    np.testing.assert_allclose(upsampled[clear], want[clear], rtol=0, atol=1e-3 * scale)


def test_an_average_pool_then_a_bilinear_upsampling_average_on_one_grid(tmp_path):
    """AveragePooling2D, then a bilinear UpSampling2D that alone reads it: one
    QuantizedAveragePooling with two stages on one grid (a second quantizer, on a range of
    its own, would give the file two scales on the upsampling's sides, which TFLite's
    converter refuses), against numpy's int8 pool then int8 resize; the stages survive a
    .keras round trip."""
    image = keras.Input((8, 8, 3), name="image")
    a = L.ReLU(name="a_relu")(BN(name="a_bn")(L.Conv2D(4, 3, padding="same", name="a")(image)))
    pooled = L.AveragePooling2D(2, name="avg")(a)
    up = L.UpSampling2D(2, interpolation="bilinear", name="up")(pooled)
    qat, report = quantize_model(randomise_batch_norms(keras.Model(image, up)), return_report=True)
    layer = qat.get_layer("avg_qat")
    assert [type(stage) for stage in (layer.pool, *layer.then)] == [
        L.AveragePooling2D,
        L.UpSampling2D,
    ]
    assert report.quantized["avg"] == report.quantized["up"] == "avg_qat"
    rng = np.random.default_rng(3)
    qat(rng.normal(size=(8, 8, 8, 3)).astype("float32"), training=True)  # sets the range
    x = rng.normal(size=(8, 8, 8, 3)).astype("float32")
    probe = keras.Model(qat.input, [qat.get_layer("a_qat").output, qat.output])
    source, got = (array(t) for t in probe(x, training=False))
    grid = layer.input_quantizer.grid()
    low, high = (
        float(layer.input_quantizer.range_min.numpy()),
        float(layer.input_quantizer.range_max.numpy()),
    )
    indices = ref.activation_indices(source, low, high, 8)
    upsampled = ref.resize_bilinear_int8(ref.average_pool_int8(indices, 2), (2, 2))
    want = (upsampled - grid.zero_point) * grid.scale
    near = ref.distance_to_rounding_boundary(source, low, high, 8) < 1e-3
    clear = ~np.repeat(np.repeat(near.reshape(8, 4, 2, 4, 2, 4).any(axis=(2, 4, 5)), 2, 1), 2, 2)
    assert clear.mean() > 0.8
    np.testing.assert_allclose(got[clear], want[clear], rtol=0, atol=1e-3 * grid.scale)
    qat.save(tmp_path / "qat.keras")
    loaded = keras.saving.load_model(tmp_path / "qat.keras")
    np.testing.assert_array_equal(array(loaded(x, training=False)), array(qat(x, training=False)))


@pytest.mark.parametrize("fan_out", [False, True], ids=["pool_only", "fan_out"])
def test_a_saved_model_keeps_the_pools_grid(tmp_path, fan_out):
    """After a `.keras` round trip the pool still rounds onto its input's grid, in training
    too (the shared quantizer's second call keeps its arguments)."""
    qat = quantize_model(_pooled(fan_out))
    x = np.random.default_rng(2).normal(size=(8, 8, 8, 3)).astype("float32")
    qat(x, training=True)
    qat.save(tmp_path / "qat.keras")
    loaded = keras.saving.load_model(tmp_path / "qat.keras")
    np.testing.assert_array_equal(array(loaded(x, training=False)), array(qat(x, training=False)))
    probe, quantizer = _pool_probe(loaded, fan_out)
    _, pooled = probe(x * 2.0, training=True)
    low, high = float(quantizer.range_min.numpy()), float(quantizer.range_max.numpy())
    scale, zero_point = ref.activation_grid(low, high, 8)
    steps = array(pooled).astype(np.float64) / scale + zero_point
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)


@pytest.mark.slow
def test_the_original_model_is_untouched():
    """Weights and outputs bit for bit, before and after quantize_model and after training
    the copy (which does move)."""
    model = _branches()
    x = _branches_input()
    weights = [np.array(w) for w in model.weights]
    configs = [layer.get_config() for layer in model.layers]
    before = _outputs(model, x)
    qat = quantize_model(model)
    qat.compile(keras.optimizers.SGD(0.1), ["sparse_categorical_crossentropy", "mse"])
    qat_before = [np.array(w) for w in qat.weights]
    qat.fit(x, [np.zeros(6), np.ones((6, 2))], epochs=2, batch_size=3, verbose=0)
    assert any(not np.array_equal(a, np.array(b)) for a, b in zip(qat_before, qat.weights))
    for old, weight in zip(weights, model.weights):
        np.testing.assert_array_equal(old, np.array(weight), err_msg=weight.path)
    assert [layer.get_config() for layer in model.layers] == configs
    for old, new in zip(before, _outputs(model, x)):
        np.testing.assert_array_equal(old, new)
    assert not {id(w) for w in qat.weights} & {id(w) for w in model.weights}


def _with_kept_layers():
    x = keras.Input((8, 8, 3), name="x")
    a = L.Conv2D(4, 3, name="fan")(x)
    b = BN(name="fan_bn")(a)  # the conv's output also feeds the Add
    t = L.Conv2DTranspose(4, 3, padding="same", name="up")(b)
    u = BN(name="up_bn")(t)
    r = L.Conv2D(4, 1, name="rc")(u)
    r = BN(renorm=True, name="renorm_bn")(r)
    s = L.Add(name="add")([r, a])
    n = L.LayerNormalization(name="ln")(s)
    shared = L.Dense(3, name="shared")
    o1 = shared(L.GlobalAveragePooling2D(name="gap")(n))
    o2 = shared(L.GlobalMaxPooling2D(name="gmp")(n))
    return randomise_batch_norms(keras.Model(x, [o1, o2], name="kept"))


@pytest.mark.slow
def test_layers_it_cannot_quantize_stay_float_reported_and_warned():
    model = _with_kept_layers()
    with pytest.warns(KerasBNWarning, match=r"kept 6 layer\(s\) of 'kept' in float: 'fan_bn'"):
        qat, report = quantize_model(model, return_report=True)
    assert [(k.layer, k.kind) for k in report.kept] == [
        ("fan_bn", "fan_out"),
        ("up_bn", "not_a_host"),
        ("renorm_bn", "batch_norm_config"),
        ("shared", "shared_host"),
        ("up", "not_quantizable"),
        ("ln", "not_quantizable"),
    ]
    assert all(isinstance(k, KeptLayer) for k in report.kept)
    reasons = {k.layer: k.reason for k in report.kept}
    assert "also feeds other layers" in reasons["fan_bn"]
    assert "renorm=True" in reasons["renorm_bn"]
    assert "Conv2DTranspose, which has no quantization-aware form" in reasons["up"]
    assert "called 2 times" in reasons["shared"]
    # The hosts before a kept BN are still quantized, without it.
    assert isinstance(qat.get_layer("fan_qat"), QuantizedHost)
    assert isinstance(qat.get_layer("rc_qat"), QuantizedHost)
    for name in ("fan_bn", "up_bn", "renorm_bn"):
        assert type(qat.get_layer(name)) is BN
    # Every float layer's output gets a quantizer of its own (the GlobalMaxPooling keeps the
    # LayerNormalization's grid).
    assert report.quantizers == {
        "x_quantizer": "x",
        "fan_bn_quantizer": "fan_bn",
        "up_quantizer": "up",
        "up_bn_quantizer": "up_bn",
        "renorm_bn_quantizer": "renorm_bn",
        "add_quantizer": "add",
        "ln_quantizer": "ln",
        "gap_quantizer": "gap",
        "shared_quantizer": "shared",
    }
    # The float copies carry the original weights, and the model trains.
    for name in ("up", "ln", "shared", "renorm_bn"):
        for a, b in zip(model.get_layer(name).weights, qat.get_layer(name).weights):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    qat.compile(keras.optimizers.SGD(0.01), "mse")
    data = np.random.default_rng(0).normal(size=(8, 8, 8, 3)).astype("float32")
    history = qat.fit(data, [np.zeros((8, 3))] * 2, batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.parametrize(
    "activation",
    [L.ReLU(), L.ReLU(max_value=6), L.Activation("relu"), L.Activation("relu6")],
    ids=["ReLU", "ReLU6", "Activation_relu", "Activation_relu6"],
)
def test_relu_and_relu6_after_batch_norm_are_fused(activation):
    inputs = keras.Input((6, 6, 2))
    x = BN()(L.Conv2D(3, 3)(inputs))
    model = keras.Model(inputs, activation(x))
    qat, report = quantize_model(model, return_report=True)
    layer = qat.layers[2]
    assert isinstance(layer, QuantizedHostBatchNorm) and len(qat.layers) == 3
    assert layer.activation in ("relu", "relu6")
    assert report.quantized[activation.name] == layer.name


@pytest.mark.parametrize(
    "activation", [L.LeakyReLU(), L.ReLU(max_value=4.0), L.Activation("gelu")], ids=str
)
def test_other_activations_stay_float_with_a_quantizer_of_their_own(activation):
    inputs = keras.Input((6, 6, 2))
    x = BN()(L.Conv2D(3, 3)(inputs))
    model = keras.Model(inputs, activation(x))
    qat, report = quantize_model(model, return_report=True)
    assert qat.layers[2].activation is None and qat.layers[2].quantize_output
    assert type(qat.layers[3]) is type(activation)
    assert report.quantizers[f"{activation.name}_quantizer"] == activation.name


def test_a_host_without_batch_norm_takes_over_the_relu_after_it():
    inputs = keras.Input((6, 6, 2))
    outputs = L.ReLU(max_value=6.0)(L.Conv2D(3, 3, name="conv")(inputs))
    qat = quantize_model(keras.Model(inputs, outputs))
    layer = qat.get_layer("conv_qat")
    assert isinstance(layer, QuantizedHost) and layer.activation == "relu6"
    assert len(qat.layers) == 3


def test_a_frozen_batch_norm_gives_a_frozen_qat_layer():
    model = _digits_cnn()
    model.layers[1].trainable = False
    qat = quantize_model(model)
    frozen = [bool(layer.batch_norm_frozen.numpy()) for layer in qat.layers[1:3]]
    assert frozen == [True, False]
    assert not qat.layers[1].batch_norm.trainable


def test_subclassed_models_are_refused():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = L.Dense(2)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net(np.zeros((1, 3), "float32"))
    with pytest.raises(UnsupportedModelError, match=r"Cannot quantize '.*', a subclassed Net"):
        quantize_model(net)
    inputs = keras.Input((3,))
    outer = keras.Model(inputs, net(inputs))
    with pytest.raises(UnsupportedModelError, match="subclassed Net"):
        quantize_model(outer)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weight_bits": 1}, "weight_bits must be from 2 to 8; received weight_bits=1"),
        ({"weight_bits": 9}, "weight_bits=9"),
        ({"weight_bits": True}, "an int from 2 to 8; received weight_bits=True"),
        ({"weight_bits": 8.0}, "weight_bits=8.0"),
        ({"weight_bits": None}, "weight_bits=None"),
        ({"activation_bits": 0}, "activation_bits must be from 2 to 8; received activation_bits=0"),
        ({"activation_bits": False}, "activation_bits=False"),
        ({"per_channel": 1}, "per_channel=1"),
        ({"per_channel": "dense"}, "True, False or \"all\"; received per_channel='dense'"),
        ({"return_report": "yes"}, "return_report='yes'"),
        ({"range_momentum": 1.0}, r"range_momentum=1\.0"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_model(_digits_cnn(), **kwargs)


# Channels first at the shape where Keras 3.15's own bias add is wrong under TensorFlow: 4
# filters, 4×4 output (tests/test_quantize_layers.py shows Keras's own output is off there).
SHAPE = (3, 3, 6, 6)


@contextlib.contextmanager
def _bias_add_warning(name):
    """quantize_model's warning that Keras adds `name`'s channels_first bias on the wrong axis:
    given where Keras does (TensorFlow), absent elsewhere. Other warnings pass through."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield
    ours = [w for w in record if "channels_first with a bias" in str(w.message)]
    for w in record:
        if w not in ours:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if KERAS_BIAS_ADD_IS_WRONG:
        assert [w.category for w in ours] == [KerasBNWarning]
        assert re.match(f"'{name}' of '.*': channels_first with a bias", str(ours[0].message))
    else:
        assert not ours, ours


def test_channels_first_qat_layer_matches_numpy_where_keras_bias_add_is_wrong():
    rng = np.random.default_rng(5)
    inputs = keras.Input(SHAPE[1:])
    conv = L.Conv2D(4, 3, data_format="channels_first", name="conv")
    bn = BN(axis=1, epsilon=1e-3, name="bn")
    model = keras.Model(inputs, L.ReLU()(bn(conv(inputs))))
    weights = {
        "gamma": rng.uniform(0.5, 1.5, 4),
        "beta": rng.normal(size=4),
        "mean": rng.normal(size=4) * 0.2,
        "variance": rng.uniform(0.5, 2.0, 4),
        "bias": rng.normal(size=4),
    }
    s = weights["gamma"] / np.sqrt(weights["variance"] + 1e-3)
    weights["kernel"] = ref.away_from_ties(rng.normal(size=(3, 3, 3, 4)), "conv", s, 8, True)
    conv.kernel.assign(weights["kernel"].astype("float32"))
    conv.bias.assign(weights["bias"].astype("float32"))
    for name, key in (("gamma", "gamma"), ("beta", "beta"), ("moving_mean", "mean")):
        getattr(bn, name).assign(weights[key].astype("float32"))
    bn.moving_variance.assign(weights["variance"].astype("float32"))
    with _bias_add_warning("conv"):
        qat = quantize_model(model)
    x = rng.normal(size=SHAPE).astype("float32")
    spec = {"kind": "conv", "strides": (1, 1), "padding": "valid", "dilation": (1, 1)}
    expected, _, _ = ref.qat_forward(
        spec, np.moveaxis(x, 1, -1), weights, 8, True, False, 1e-3, "relu"
    )
    assert_close(array(qat(x, training=False)), np.moveaxis(expected, -1, 1), 1e-5)


def test_channels_first_float_copy_adds_its_bias_on_the_channel_axis(tmp_path):
    """A shared channels_first conv stays float; its copy's bias comes from a trainable
    ChannelBias, right where Keras's own bias add is wrong, and saved with the model."""
    rng = np.random.default_rng(6)
    conv = L.Conv2D(4, 3, data_format="channels_first", name="conv")
    first, second = keras.Input(SHAPE[1:], name="first"), keras.Input(SHAPE[1:], name="second")
    model = keras.Model([first, second], [conv(first), conv(second)])
    conv.bias.assign(rng.normal(size=4).astype("float32") + 2.0)
    with (
        _bias_add_warning("conv"),
        pytest.warns(KerasBNWarning, match="'conv' \\(shared_host\\)"),
    ):
        qat = quantize_model(model)
    bias = qat.get_layer("conv_bias")
    assert isinstance(bias, ChannelBias) and bias.trainable_weights == [bias.bias]
    x = [rng.normal(size=SHAPE).astype("float32") for _ in range(2)]
    kernel, b = array(conv.kernel).astype(np.float64), array(conv.bias).astype(np.float64)
    qat.save(tmp_path / "qat.keras")
    loaded = keras.saving.load_model(tmp_path / "qat.keras")
    assert loaded.get_layer("conv_bias").trainable_weights
    for restored, saved in zip(_outputs(loaded, x), _outputs(qat, x)):
        np.testing.assert_array_equal(restored, saved)
    for image, actual in zip(x, _outputs(qat, x)):
        expected = ref.conv(
            np.moveaxis(image, 1, -1).astype(np.float64), kernel, (1, 1), "valid", (1, 1)
        )
        assert_close(actual, np.moveaxis(expected + b, -1, 1), 1e-5)


def test_a_quantization_aware_model_is_refused():
    qat = quantize_model(_digits_cnn())
    with pytest.raises(ValueError, match=r"quantization-aware already \(layers \['input_layer"):
        quantize_model(qat)


def test_inputs_feeding_only_a_concatenate_share_its_scale():
    """Neither input gets a quantizer: the Concatenate's sets the scale both are written
    on; a stateless operation (`x * 2.0`) gets one of its own."""
    first, second = keras.Input((4,), name="first"), keras.Input((3,), name="second")
    joined = L.Concatenate(name="cat")([first, second])
    doubled = joined * 2.0
    model = keras.Model([first, second], L.Dense(2, name="head")(doubled))
    qat, report = quantize_model(model, return_report=True)
    operation = doubled._keras_history.operation
    assert report.quantizers == {
        "cat_quantizer": "cat",
        f"{operation.name}_quantizer": operation.name,
    }
    x = [np.ones((2, 4), "float32"), np.full((2, 3), 2.0, "float32")]
    folded = _fold_with_qat_weights(model, qat, report)
    assert_close(_outputs(qat, x)[0], _outputs(folded, x)[0], 1e-6)


@pytest.mark.parametrize("kind", ["add", "multiply"])
def test_a_sum_or_product_of_three_inputs_rounds_its_partial_result(kind):
    """Add or Multiply of three model inputs: ((a ∘ b) rounded) ∘ c, as the files compute it
    (two-input ops, each partial result on a grid of its own), against numpy with the ranges
    one training step set; the report names the partial result's quantizer."""
    merge = {"add": (L.Add, np.add), "multiply": (L.Multiply, np.multiply)}[kind]
    inputs = [keras.Input((6,), name=name) for name in "abc"]
    model = keras.Model(inputs, merge[0](name="merge")(inputs))
    qat, report = quantize_model(model, return_report=True)
    assert report.quantized == {"merge": "merge_qat"}
    assert report.quantizers["merge_qat/merge_1_quantizer"] == "merge"
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(32, 6)).astype("float32") for _ in range(3)]
    qat.compile("sgd", "mse")
    qat.fit(x, x[0], batch_size=32, epochs=1, verbose=0)

    def rounded(values, quantizer):
        grid = quantizer.grid()
        return ref.fake_quant_activations(values, grid.nudged_min, grid.nudged_max, grid.bits)

    a, b, c = (rounded(v, qat.get_layer(f"{n}_quantizer")) for v, n in zip(x, "abc"))
    partial = rounded(merge[1](a, b), qat.get_layer("merge_qat").get_layer("merge_1_quantizer"))
    want = rounded(merge[1](partial, c), qat.get_layer("merge_quantizer"))
    assert_close(_outputs(qat, x)[0], want, 1e-6)


def test_a_chains_layers_are_named_apart_from_the_models_own():
    """A 3-input Add named "add" beside a later Add named "add_1": every variable path of the
    QAT model is distinct (the chain's partial-result quantizer was once "add_1_quantizer",
    as the later Add's is; under PyTorch equal paths are one state_dict entry, and one
    range went missing from it)."""
    inputs = [keras.Input((4,)) for _ in range(3)]
    first = L.Add(name="add")(inputs)
    qat = quantize_model(keras.Model(inputs, L.Add(name="add_1")([first, inputs[0]])))
    paths = [variable.path for variable in qat.variables]
    # 4 state variables in each quantizer: 3 inputs, the partial result, add, add_1
    assert len(paths) == len(set(paths)) == 4 * 6, paths


def test_activity_regularized_hosts_and_batch_norms_stay_float_with_their_loss_terms():
    """A QAT layer computes the host's linear map and the BN itself, never calling them, so it
    would drop their activity regularizers' loss terms: such a host or BN stays float (with the
    BN before or after it), reported and warned, and model.losses keeps every term."""
    l2 = keras.regularizers.L2(1.0)
    inputs = keras.Input((6,), name="x")
    a = BN(activity_regularizer=l2, name="a_bn")(L.Dense(4, name="a")(inputs))
    b = BN(name="b_bn")(L.Dense(4, activity_regularizer=l2, name="b")(a))
    relu = L.ReLU(activity_regularizer=l2, name="c_relu")(L.Dense(4, name="c")(b))
    model = keras.Model(inputs, L.Dense(2, name="head")(relu), name="regularized")
    with pytest.warns(KerasBNWarning, match=r"kept 3 layer\(s\) of 'regularized' in float"):
        qat, report = quantize_model(model, return_report=True)
    assert [(k.layer, k.kind) for k in report.kept] == [
        ("a_bn", "activity_regularizer"),
        ("b_bn", "activity_regularizer"),
        ("b", "activity_regularizer"),
    ]
    reasons = {k.layer: k.reason for k in report.kept}
    assert "BN layer 'a_bn' has an activity_regularizer" in reasons["a_bn"]
    assert "its host 'b' has an activity_regularizer" in reasons["b_bn"]
    assert type(qat.get_layer("b")) is L.Dense and type(qat.get_layer("c_relu")) is L.ReLU
    assert isinstance(qat.get_layer("a_qat"), QuantizedHost)  # without its BN
    assert isinstance(qat.get_layer("c_qat"), QuantizedHost)  # without the ReLU
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    model(x, training=True)
    qat(x, training=True)
    assert len(model.losses) == len(qat.losses) == 3
    assert all(float(array(loss)) > 0 for loss in qat.losses)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_models_are_refused_naming_the_layers(policy):
    """Under a mixed policy the QAT model would cast its fake-quantized values back to 16 bits
    and compute its float layers there, which no int8 file does: refused up front."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        inputs = keras.Input((6, 6, 2), name="x")
        x = BN(name="bn")(L.Conv2D(3, 3, name="conv")(inputs))
        model = keras.Model(inputs, L.Dense(2, name="head")(L.Flatten(name="flat")(x)))
    finally:
        keras.config.set_dtype_policy(previous)
    with pytest.raises(ValueError, match=rf"float32 layers only: 'conv' \({policy}\), 'bn'") as e:
        quantize_model(model)
    assert "'head'" in str(e.value) and "set_dtype_policy('float32')" in str(e.value)


def test_a_float64_layer_is_refused_before_anything_is_copied():
    """A float64 BN: refused with the ValueError, not the InvalidArgumentError that folding it
    into a float32 QAT layer raised."""
    inputs = keras.Input((8, 8, 3))
    outputs = BN(dtype="float64", name="bn64")(L.Conv2D(4, 3, name="conv")(inputs))
    model = keras.Model(inputs, outputs, name="double")
    with pytest.raises(ValueError, match=r"'bn64' \(float64\) of 'double'"):
        quantize_model(model)


@pytest.mark.parametrize(
    ("spatial", "warned"), [(4, True), (None, True), (5, False)], ids=["equal", "dynamic", "other"]
)
def test_channels_first_hosts_with_a_bias_warn_where_keras_adds_it_on_the_wrong_axis(
    spatial, warned
):
    """Keras 3.15 adds a channels_first bias on the last axis when that axis has as many entries
    as there are channels (under TensorFlow): the QAT layer adds it on the channel axis, so the
    QAT model differs from the float one there, and quantize_model says so (a dynamic length
    may be equal). Under JAX and PyTorch Keras adds it right: no warning, no difference."""
    warned = warned and KERAS_BIAS_ADD_IS_WRONG
    size = None if spatial is None else spatial + 2
    inputs = keras.Input((3, 6, size))
    conv = L.Conv2D(4, 3, data_format="channels_first", name="conv")(inputs)
    plain = L.Conv2D(4, 3, data_format="channels_first", use_bias=False, name="plain")(inputs)
    model = keras.Model(inputs, [BN(axis=1, name="bn")(conv), plain], name="cf")
    model.get_layer("conv").bias.assign(np.array([0.0, 3.0, 6.0, 9.0], "float32"))
    if not warned:
        with warnings.catch_warnings():
            warnings.simplefilter("error", KerasBNWarning)
            qat = quantize_model(model)
    else:
        with pytest.warns(KerasBNWarning) as record:
            qat = quantize_model(model)
        ours = [str(w.message) for w in record if w.category is KerasBNWarning]
        assert len(ours) == 1
        message = ours[0]
        assert message.startswith("'conv' of 'cf': channels_first with a bias")
        assert "the float Keras model is wrong at such sizes" in message
        assert "the QAT model, which adds the bias on the channel axis" in message
    assert isinstance(qat.get_layer("conv_qat"), QuantizedHostBatchNorm)
    # The dynamic model is run at a width where it is equal.
    x = np.random.default_rng(0).normal(size=(2, 3, 6, spatial + 2 if spatial else 6))
    x = x.astype("float32")
    largest = np.abs(array(model(x)[0]) - array(qat(x, training=False)[0])).max()
    assert (largest > 1.0) == warned  # Keras's wrong add, not the weights' rounding


def test_hosts_inside_a_shared_nested_model_stay_float_as_shared_hosts_do():
    """A nested model called twice would share its QAT layers between the calls, as a shared
    host would: its hosts and BNs (in a model nested in it too) stay float, reported."""
    inner = keras.Sequential(
        [keras.Input((6, 6, 4)), L.Conv2D(4, 1, name="conv2"), BN(name="bn2")], name="inner"
    )
    block_in = keras.Input((6, 6, 4))
    x = L.ReLU(name="relu")(BN(name="bn")(L.Conv2D(4, 3, padding="same", name="conv")(block_in)))
    block = keras.Model(block_in, inner(x), name="block")
    inputs = keras.Input((6, 6, 3), name="x")
    x = L.Conv2D(4, 1, name="stem")(inputs)
    model = keras.Model(inputs, block(block(x)), name="twice")
    with pytest.warns(KerasBNWarning, match=r"kept 4 layer\(s\) of 'twice' in float"):
        qat, report = quantize_model(model, return_report=True)
    assert [(k.layer, k.kind) for k in report.kept] == [
        ("block/bn", "shared_bn"),
        ("block/conv", "shared_host"),
        ("block/inner/bn2", "shared_bn"),
        ("block/inner/conv2", "shared_host"),
    ]
    assert "inside the nested model 'block', which is called 2 times" in report.kept[3].reason
    assert isinstance(qat.get_layer("stem_qat"), QuantizedHost)
    copied = qat.get_layer("block")
    assert type(copied.get_layer("conv")) is L.Conv2D and type(copied.get_layer("bn")) is BN
    x = np.random.default_rng(0).normal(size=(2, 6, 6, 3)).astype("float32")
    assert array(qat(x, training=False)).shape == (2, 6, 6, 4)

"""keras_bn.quantize's fake quantization under PyTorch: TensorFlow's FakeQuant ops in torch
(keras_bn/backend/torch/fake_quant.py) against the TensorFlow ops themselves, bit for bit, run
by a TensorFlow Python (tests/tensorflow_side.py) on every case of this module in one process:
the ops per tensor and per channel at 2-8 bits on grids holding every rounding boundary, the
QAT weights (symmetric, narrow range, per tensor and per channel) and activations; their
gradients (TensorFlow's for the ops, torch.ao's rule of gradient 1 for every weight)."""

import json

import numpy as np
import pytest
import quantize_reference as ref
import tensorflow_side
import torch
from references import array

from keras_bn.backend.torch import fake_quant as tfq
from keras_bn.quantize import fake_quant


def _nudged(low, high, bits, narrow):
    """(scale, nudged_min) of TensorFlow's nudged grid, in numpy float32: only to place the
    test values on and around the rounding boundaries (TensorFlow's outputs are the
    reference)."""
    f = np.float32
    q_lo, q_hi = f(1 if narrow else 0), f(2**bits - 1)
    scale = f(f(high) - f(low)) / f(q_hi - q_lo)
    zero_from_min = q_lo - f(low) / scale
    zero = np.clip(np.sign(zero_from_min) * np.floor(np.abs(zero_from_min) + f(0.5)), q_lo, q_hi)
    return scale, f((q_lo - zero) * scale)


def _ranges():
    """(bits, narrow, min, max): symmetric, asymmetric, min = 0, tiny and wide ranges."""
    rng = np.random.default_rng(7)
    found = []
    for trial in range(60):
        bits = int(rng.integers(2, 9))
        narrow = bool(trial % 2)
        low = np.float32(-abs(rng.normal()) * rng.choice([1e-3, 1.0, 10.0]))
        high = np.float32(abs(rng.normal()) * rng.choice([1e-3, 1.0, 10.0]))
        if trial % 3 == 0:
            high = -low
        if trial % 7 == 0:
            low = np.float32(0.0)
        found.append((bits, narrow, low, high))
    return found


def _values(bits, narrow, low, high, rng):
    """Random values in and around the range, every grid value, every half between two grid
    values and the floats either side of each half."""
    scale, nudged_min = _nudged(low, high, bits, narrow)
    k = np.arange(-3, 2**bits + 3, dtype=np.float32)
    halves = (nudged_min + (k + 0.5) * scale).astype(np.float32)
    return np.concatenate(
        [
            rng.uniform(low * 1.2 - 0.1, high * 1.2 + 0.1, 100).astype(np.float32),
            (nudged_min + k * scale).astype(np.float32),
            halves,
            np.nextafter(halves, np.float32(np.inf)),
            np.nextafter(halves, np.float32(-np.inf)),
        ]
    )


def _sweep():
    rng = np.random.default_rng(0)
    return [
        (bits, narrow, low, high, _values(bits, narrow, low, high, rng))
        for bits, narrow, low, high in _ranges()
    ]


def _kernel(bits):
    """A Conv2D-like kernel, channels of very different scales (one all zero)."""
    rng = np.random.default_rng(bits)
    kernel = (rng.normal(size=(3, 3, 4, 24)) * rng.uniform(0.01, 3.0, 24)).astype(np.float32)
    kernel[..., 5] = 0.0
    return kernel


def _activation_case(bits):
    rng = np.random.default_rng(100 + bits)
    x = rng.normal(0.5, 2.0, size=(4, 6, 6, 3)).astype(np.float32)
    low, high = np.float32(-2.5 + 0.1 * bits), np.float32(3.0 - 0.2 * bits)
    return x, low, high


def _gradient_case(per_channel):
    rng = np.random.default_rng(2)
    x = rng.uniform(-2.0, 3.0, size=(50, 3)).astype(np.float32)
    upstream = rng.normal(size=x.shape).astype(np.float32)
    low = np.array([-1.0, -0.5, -1.5], np.float32)
    high = np.array([1.0, 2.0, 1.5], np.float32)
    if not per_channel:
        low, high = low[0], high[0]
    return x, low, high, upstream


BITS = range(2, 9)


def _cases():
    """Every TensorFlow FakeQuant call of this module: name -> (op, bits, narrow, arrays)."""
    cases = {}
    for i, (bits, narrow, low, high, x) in enumerate(_sweep()):
        cases[f"sweep{i}"] = ("per_tensor", bits, narrow, {"x": x, "min": low, "max": high})
        column = {"x": x[:, None], "min": np.array([low]), "max": np.array([high])}
        cases[f"sweep{i}_channel"] = ("per_channel", bits, narrow, column)
    for bits in BITS:
        kernel = _kernel(bits)
        per_channel = np.abs(kernel).reshape(-1, 24).max(0)
        per_channel = np.where(per_channel > 0, per_channel, np.float32(1.0))  # the zero channel
        view = kernel.reshape(-1, 24)
        cases[f"weights{bits}_channel"] = (
            "per_channel",
            bits,
            True,
            {"x": view, "min": -per_channel, "max": per_channel},
        )
        largest = np.abs(kernel).max()
        cases[f"weights{bits}_tensor"] = (
            "per_tensor",
            bits,
            True,
            {"x": kernel, "min": -largest, "max": largest},
        )
        x, low, high = _activation_case(bits)
        cases[f"activations{bits}"] = ("per_tensor", bits, False, {"x": x, "min": low, "max": high})
    for per_channel in (False, True):
        x, low, high, upstream = _gradient_case(per_channel)
        op = "per_channel" if per_channel else "per_tensor"
        arrays = {"x": x, "min": low, "max": high, "upstream": upstream}
        cases[f"gradient_{op}"] = (op, 8, False, arrays)
    return cases


# TensorFlow's side: each case's FakeQuant output (and, with an upstream, the gradients to x,
# min and max), eagerly, into outputs.npz.
_TENSORFLOW_FAKE_QUANT = """
import json, sys
import numpy as np
import tensorflow as tf

folder = sys.argv[1]
with open(folder + "/cases.json") as file:
    cases = json.load(file)
arrays = np.load(folder + "/inputs.npz")
ops = {
    "per_tensor": tf.quantization.fake_quant_with_min_max_vars,
    "per_channel": tf.quantization.fake_quant_with_min_max_vars_per_channel,
}
found = {}
for name, (op, bits, narrow) in cases.items():
    tensors = [tf.constant(arrays[name + "/" + key]) for key in ("x", "min", "max")]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        y = ops[op](*tensors, num_bits=bits, narrow_range=narrow)
        if name + "/upstream" in arrays:
            loss = tf.reduce_sum(y * arrays[name + "/upstream"])
    found[name + "/y"] = y.numpy()
    if name + "/upstream" in arrays:
        for key, gradient in zip(("x", "min", "max"), tape.gradient(loss, tensors)):
            found[name + "/d_" + key] = gradient.numpy()
np.savez(folder + "/outputs.npz", **found)
print("{}")
"""


@pytest.fixture(scope="module")
def tensorflow_fake_quant(tmp_path_factory):
    """TensorFlow's outputs (and gradients) for every case of _cases(), from one process."""
    folder = tmp_path_factory.mktemp("fake_quant")
    cases = _cases()
    with open(folder / "cases.json", "w") as file:
        json.dump({name: case[:3] for name, case in cases.items()}, file)
    np.savez(
        folder / "inputs.npz",
        **{
            f"{name}/{key}": np.asarray(value, np.float32)
            for name, (*_, arrays) in cases.items()
            for key, value in arrays.items()
        },
    )
    tensorflow_side.run(_TENSORFLOW_FAKE_QUANT, folder, backend="tensorflow")
    with np.load(folder / "outputs.npz") as outputs:
        return dict(outputs)


def _bits_equal(actual, expected):
    actual, expected = np.asarray(array(actual), np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    differ = np.nonzero(actual.view(np.int32) != expected.view(np.int32))
    assert differ[0].size == 0, (actual[differ][:5], expected[differ][:5])


@pytest.mark.tensorflow_side
def test_fake_quant_ops_equal_tensorflow_bit_for_bit(tensorflow_fake_quant):
    """60 ranges (2-8 bits, narrow or not), per tensor and as one channel, every rounding
    boundary."""
    for i, (bits, narrow, low, high, x) in enumerate(_sweep()):
        _bits_equal(
            tfq.fake_quant_with_min_max_vars(x, low, high, bits, narrow),
            tensorflow_fake_quant[f"sweep{i}/y"],
        )
        _bits_equal(
            tfq.fake_quant_with_min_max_vars_per_channel(
                x[:, None], np.array([low]), np.array([high]), bits, narrow
            ),
            tensorflow_fake_quant[f"sweep{i}_channel/y"],
        )


@pytest.mark.tensorflow_side
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
@pytest.mark.parametrize("bits", BITS)
def test_qat_weights_equal_tensorflow_bit_for_bit(bits, per_channel, tensorflow_fake_quant):
    """keras_bn.quantize.fake_quant's weight grid (±max|w|, narrow range; an all-zero channel
    gets the range 1) on a 4-D kernel, per channel along the last axis."""
    kernel = _kernel(bits)
    max_abs = fake_quant.weight_max_abs(torch.tensor(kernel), per_channel)
    largest = np.abs(kernel).reshape(-1, 24).max(0) if per_channel else np.abs(kernel).max()
    np.testing.assert_array_equal(array(max_abs), np.where(largest > 0, largest, 1.0))
    got = fake_quant.fake_quant_weights(torch.tensor(kernel), max_abs, bits)
    if per_channel:
        expected = tensorflow_fake_quant[f"weights{bits}_channel/y"].reshape(kernel.shape)
    else:
        expected = tensorflow_fake_quant[f"weights{bits}_tensor/y"]
    _bits_equal(got, expected)


@pytest.mark.tensorflow_side
@pytest.mark.parametrize("bits", BITS)
def test_qat_activations_equal_tensorflow_bit_for_bit(bits, tensorflow_fake_quant):
    x, low, high = _activation_case(bits)
    got = fake_quant.fake_quant_activations(
        torch.tensor(x), torch.tensor(low), torch.tensor(high), bits
    )
    _bits_equal(got, tensorflow_fake_quant[f"activations{bits}/y"])


@pytest.mark.tensorflow_side
@pytest.mark.parametrize("per_channel", [False, True])
def test_gradients_are_tensorflows_straight_through_rule(per_channel, tensorflow_fake_quant):
    x, low, high, upstream = _gradient_case(per_channel)
    name = "gradient_per_channel" if per_channel else "gradient_per_tensor"
    expected = [tensorflow_fake_quant[f"{name}/d_{key}"] for key in ("x", "min", "max")]
    op = (
        tfq.fake_quant_with_min_max_vars_per_channel
        if per_channel
        else tfq.fake_quant_with_min_max_vars
    )
    tensors = [torch.tensor(a, requires_grad=True) for a in (x, low, high)]
    torch.sum(op(*tensors, 8) * torch.as_tensor(upstream)).backward()
    for tensor, want in zip(tensors, expected, strict=True):
        np.testing.assert_allclose(array(tensor.grad), want, rtol=1e-6, atol=1e-6)
    inside = array(tensors[0].grad) == upstream
    assert 0 < inside.sum() < x.size  # both sides of the rule are exercised


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("bits", BITS)
def test_weight_gradient_is_one_for_every_weight_as_torch_ao_gives(bits, per_channel):
    """The weight that sets its channel's range included (tests/quantize_reference.py writes
    torch.ao's rule in numpy)."""
    rng = np.random.default_rng(bits)
    kernel = (rng.normal(size=(3, 3, 8, 300)) * rng.uniform(0.01, 3.0, 300)).astype(np.float32)
    upstream = rng.normal(size=kernel.shape).astype(np.float32)
    weights = torch.tensor(kernel, requires_grad=True)
    max_abs = fake_quant.weight_max_abs(weights, per_channel)
    torch.sum(
        fake_quant.fake_quant_weights(weights, max_abs, bits) * torch.as_tensor(upstream)
    ).backward()
    reference = ref.straight_through_weight_mask(kernel, bits, per_channel) * upstream
    assert reference.all()
    np.testing.assert_array_equal(array(weights.grad), reference.astype(np.float32))


def test_bias_rounds_half_to_even_with_a_straight_through_gradient():
    """round_bias: round(bias/step)·step, numpy's rounding (halves to even), gradient 1."""
    step = torch.tensor(0.25)
    bias = torch.tensor([0.125, 0.375, -0.125, 0.3, 1.0], requires_grad=True)
    rounded = fake_quant.round_bias(bias, step)
    np.testing.assert_array_equal(array(rounded), np.round(array(bias) / 0.25) * np.float32(0.25))
    rounded.sum().backward()
    np.testing.assert_array_equal(array(bias.grad), 1.0)


# The TensorFlow side of the QAT round trip, in a Python of its own (Keras fixes its backend).
_TF_EXPORT = """
import os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
import json, keras, numpy as np, keras_bn
from keras_bn.export import export_onnx, export_tflite
folder = sys.argv[1]
# compile=False: Keras saves a PyTorch model's optimizer as its torch subclass.
model = keras.saving.load_model(os.path.join(folder, "qat.keras"), compile=False)
x = np.load(os.path.join(folder, "x.npy"))
found = {"outputs": model.predict(x, verbose=0).tolist()}
for name, export in (("tflite", export_tflite), ("onnx", export_onnx)):
    result = export(model, os.path.join(folder, "m." + name), probe=x)
    found[name] = [bool(result.passed), result.quantization, max(
        lsb.max_lsb for errors in result.lsb_errors.values() for lsb in errors.values())]
print(json.dumps(found))
"""


@pytest.mark.slow
@pytest.mark.tensorflow_side
def test_torch_trained_qat_model_loads_and_exports_under_tensorflow(tmp_path):
    """A QAT model trained under PyTorch (FreezeBatchNorm included) and saved loads under
    TensorFlow with the same outputs, and its int8 TFLite and ONNX files verify within one
    output step."""
    import keras

    import keras_bn

    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    h = keras.layers.ReLU()(keras_bn.BatchNormalization()(h))
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    qat = keras_bn.quantize.quantize_model(model)
    qat.compile("adam", "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    freeze = keras_bn.quantize.FreezeBatchNorm(after_steps=2)
    qat.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[freeze])
    qat.save(tmp_path / "qat.keras")
    np.save(tmp_path / "x.npy", x[:8])
    expected = array(qat.predict(x[:8], verbose=0))
    found = tensorflow_side.run(_TF_EXPORT, tmp_path, backend="tensorflow")
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(found["outputs"], expected, rtol=0, atol=1e-5 * scale)
    for name in ("tflite", "onnx"):
        passed, quantization, max_lsb = found[name]
        assert passed and quantization == "int8", found[name]
        assert max_lsb <= 1.0, found[name]

"""keras_bn.quantize's fake quantization under PyTorch: TensorFlow's FakeQuant ops in torch
(keras_bn/backend/torch/fake_quant.py) against the TensorFlow ops themselves, bit for bit, run
by a TensorFlow Python (tests/tensorflow_side.py) on every case of this module in one process:
the ops per tensor and per channel at 2-8 bits on grids holding every rounding boundary, the
QAT weights (symmetric, narrow range, per tensor and per channel) and activations; their
gradients (TensorFlow's for the ops, torch.ao's rule of gradient 1 for every weight)."""

import fake_quant_cases
import numpy as np
import pytest
import quantize_reference as ref
import tensorflow_side
import torch
from references import array

from keras_bn.backend.torch import fake_quant as tfq
from keras_bn.quantize import fake_quant


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


BITS = range(2, 9)


@pytest.fixture(scope="module")
def tensorflow_fake_quant(tmp_path_factory):
    """TensorFlow's outputs (and gradients) for the shared cases and the QAT weight and
    activation cases, from one process."""
    cases = fake_quant_cases.shared_cases()
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
    return fake_quant_cases.tensorflow_outputs(cases, tmp_path_factory.mktemp("fake_quant"))


def _bits_equal(actual, expected):
    fake_quant_cases.assert_bits_equal(array(actual), expected)


@pytest.mark.tensorflow_side
def test_fake_quant_ops_equal_tensorflow_bit_for_bit(tensorflow_fake_quant):
    """60 ranges (2-8 bits, narrow or not), per tensor and as one channel, every rounding
    boundary."""
    for i, (bits, narrow, low, high, x) in enumerate(fake_quant_cases.sweep()):
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
    x, low, high, upstream = fake_quant_cases.gradient_case(per_channel)
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


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_learned_ranges_get_lsqs_gradients(bits, per_channel):
    """fake_quant_weights_learned under PyTorch: fake_quant_weights' values, and LSQ's
    gradients to the kernel and the range (tests/quantize_reference.py)."""
    kernel, max_abs, upstream = ref.learned_range_case(bits, per_channel)
    weights = torch.tensor(kernel, requires_grad=True)
    learned = torch.tensor(max_abs, requires_grad=True)
    fake = fake_quant.fake_quant_weights_learned(weights, learned, bits)
    torch.sum(fake * torch.as_tensor(upstream)).backward()
    expected_kernel, expected_range = ref.lsq_gradients(kernel, max_abs, bits, upstream)
    np.testing.assert_array_equal(array(weights.grad), expected_kernel)
    np.testing.assert_allclose(array(learned.grad), expected_range, rtol=1e-4, atol=1e-6)
    plain = fake_quant.fake_quant_weights(torch.tensor(kernel), torch.tensor(max_abs), bits)
    np.testing.assert_array_equal(array(fake), array(plain))

"""keras_bn.quantize's fake quantization under JAX and PyTorch: TensorFlow's FakeQuant ops in
jnp and torch (keras_bn/backend/jax/fake_quant.py, keras_bn/backend/torch/fake_quant.py) against
the TensorFlow ops themselves, bit for bit, run by a TensorFlow Python (tests/tensorflow_side.py)
on every case of this module in one process: the ops per tensor and per channel at 2-8 bits on
grids holding every rounding boundary, the QAT weights (symmetric, narrow range, per tensor and
per channel) and activations; their gradients (TensorFlow's for the ops, torch.ao's rule of
gradient 1 for every weight, LSQ's for learned ranges, under every backend); QAT models trained
here, then loaded and exported under TensorFlow; under JAX, a traced batch of one."""

import importlib

import fake_quant_cases
import keras
import numpy as np
import pytest
import quantize_reference as ref
import tensorflow_side
from framework_references import array

from keras_bn.quantize import fake_quant

BACKEND = keras.backend.backend()
# This backend's twin of TensorFlow's FakeQuant ops (none under TensorFlow: they are its own).
OPS = (
    importlib.import_module(f"keras_bn.backend.{BACKEND}.fake_quant")
    if BACKEND in ("jax", "torch")
    else None
)
# Compared with TensorFlow's ops: under JAX and PyTorch.
twin_of_tensorflow = pytest.mark.backends("jax", "torch")


def _last_axis_case():
    """Channels along the last axis, channel 2's range so small that most of its values clip."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 4, 5, 6)).astype(np.float32)
    high = np.abs(x).reshape(-1, 6).max(axis=0)
    high[2] = 1e-3
    return x, -high, high


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
    """TensorFlow's outputs (and gradients) for the shared cases, the last-axis case and the
    QAT weight and activation cases, from one process."""
    cases = fake_quant_cases.shared_cases()
    x, low, high = _last_axis_case()
    cases["last_axis"] = ("per_channel", 4, True, {"x": x, "min": low, "max": high})
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


def _compiled(compiled):
    """The ops per tensor and per channel, under jax.jit where `compiled`."""
    per_tensor = OPS.fake_quant_with_min_max_vars
    per_channel = OPS.fake_quant_with_min_max_vars_per_channel
    if compiled:
        import jax

        per_tensor = jax.jit(per_tensor, static_argnums=(3, 4))
        per_channel = jax.jit(per_channel, static_argnums=(3, 4))
    return per_tensor, per_channel


@twin_of_tensorflow
@pytest.mark.tensorflow_side
@pytest.mark.parametrize(
    "compiled",
    [
        # Under JAX 60 ranges, eager op by op: about 10 s.
        pytest.param(False, id="eager", marks=[pytest.mark.slow] if BACKEND == "jax" else []),
        pytest.param(True, id="jit", marks=[pytest.mark.slow, pytest.mark.backends("jax")]),
    ],
)
def test_fake_quant_ops_equal_tensorflow_bit_for_bit(compiled, tensorflow_fake_quant):
    """60 ranges (2-8 bits, narrow or not), per tensor and as one channel, every rounding
    boundary; under JAX eager and jitted."""
    per_tensor, per_channel = _compiled(compiled)
    for i, (bits, narrow, low, high, x) in enumerate(fake_quant_cases.sweep()):
        _bits_equal(per_tensor(x, low, high, bits, narrow), tensorflow_fake_quant[f"sweep{i}/y"])
        _bits_equal(
            per_channel(x[:, None], np.array([low]), np.array([high]), bits, narrow),
            tensorflow_fake_quant[f"sweep{i}_channel/y"],
        )


@twin_of_tensorflow
@pytest.mark.tensorflow_side
def test_per_channel_ranges_apply_along_the_last_axis(tensorflow_fake_quant):
    x, low, high = _last_axis_case()
    _bits_equal(
        OPS.fake_quant_with_min_max_vars_per_channel(x, low, high, 4, True),
        tensorflow_fake_quant["last_axis/y"],
    )


@twin_of_tensorflow
@pytest.mark.tensorflow_side
@pytest.mark.parametrize("per_channel", [False, True])
def test_gradients_are_tensorflows_straight_through_rule(
    per_channel, tensorflow_fake_quant, framework
):
    x, low, high, upstream = fake_quant_cases.gradient_case(per_channel)
    name = "gradient_per_channel" if per_channel else "gradient_per_tensor"
    expected = [tensorflow_fake_quant[f"{name}/d_{key}"] for key in ("x", "min", "max")]
    op = (
        OPS.fake_quant_with_min_max_vars_per_channel
        if per_channel
        else OPS.fake_quant_with_min_max_vars
    )
    actual = framework.gradients(
        lambda values, minimum, maximum: op(values, minimum, maximum, 8),
        (x, low, high),
        upstream,
        dtype="float32",
    )
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The rule itself: the upstream gradient inside the nudged range, 0 outside.
    _, _, nudged_min, nudged_max = OPS.nudge(
        framework.constant(low, "float32"), framework.constant(high, "float32"), 8, False
    )
    inside = (x >= array(nudged_min)) & (x <= array(nudged_max))
    assert 0 < inside.sum() < x.size
    np.testing.assert_array_equal(actual[0], np.where(inside, upstream, 0.0))
    inside = actual[0] == upstream
    assert 0 < inside.sum() < x.size  # both sides of the rule are exercised


@twin_of_tensorflow
@pytest.mark.tensorflow_side
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
@pytest.mark.parametrize("bits", BITS)
def test_qat_weights_equal_tensorflow_bit_for_bit(bits, per_channel, tensorflow_fake_quant):
    """keras_bn.quantize.fake_quant's weight grid (±max|w|, narrow range; an all-zero channel
    gets the range 1) on a 4-D kernel, per channel along the last axis."""
    kernel = _kernel(bits)
    max_abs = fake_quant.weight_max_abs(keras.ops.convert_to_tensor(kernel), per_channel)
    largest = np.abs(kernel).reshape(-1, 24).max(0) if per_channel else np.abs(kernel).max()
    np.testing.assert_array_equal(array(max_abs), np.where(largest > 0, largest, 1.0))
    got = fake_quant.fake_quant_weights(keras.ops.convert_to_tensor(kernel), max_abs, bits)
    if per_channel:
        expected = tensorflow_fake_quant[f"weights{bits}_channel/y"].reshape(kernel.shape)
    else:
        expected = tensorflow_fake_quant[f"weights{bits}_tensor/y"]
    _bits_equal(got, expected)


@twin_of_tensorflow
@pytest.mark.tensorflow_side
@pytest.mark.parametrize("bits", BITS)
def test_qat_activations_equal_tensorflow_bit_for_bit(bits, tensorflow_fake_quant):
    x, low, high = _activation_case(bits)
    tensor = keras.ops.convert_to_tensor
    got = fake_quant.fake_quant_activations(tensor(x), tensor(low), tensor(high), bits)
    _bits_equal(got, tensorflow_fake_quant[f"activations{bits}/y"])


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("bits", BITS)
def test_weight_gradient_is_one_for_every_weight_as_torch_ao_gives(bits, per_channel, framework):
    """The weight that sets its channel's range included: TensorFlow's kernel (which the jnp
    twin reproduces) gave it 0 wherever float32 puts the nudged maximum just below it
    (tests/quantize_reference.py writes torch.ao's rule in numpy); under JAX eager and jitted."""
    rng = np.random.default_rng(bits)
    kernel = (rng.normal(size=(3, 3, 8, 300)) * rng.uniform(0.01, 3.0, 300)).astype(np.float32)
    upstream = rng.normal(size=kernel.shape).astype(np.float32)

    def fake(weights):
        max_abs = fake_quant.weight_max_abs(weights, per_channel)
        return fake_quant.fake_quant_weights(weights, max_abs, bits)

    reference = ref.straight_through_weight_mask(kernel, bits, per_channel) * upstream
    assert reference.all()
    for jit in (False, True) if BACKEND == "jax" else (False,):
        (gradient,) = framework.gradients(fake, (kernel,), upstream, dtype="float32", jit=jit)
        np.testing.assert_array_equal(gradient, reference.astype(np.float32))


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_learned_ranges_get_lsqs_gradients(bits, per_channel, framework):
    """fake_quant_weights_learned (under JAX eager and jitted): fake_quant_weights' values, and
    LSQ's gradients to the kernel and the range (tests/quantize_reference.py)."""
    kernel, max_abs, upstream = ref.learned_range_case(bits, per_channel)

    def fake(weights, learned):
        return fake_quant.fake_quant_weights_learned(weights, learned, bits)

    expected_kernel, expected_range = ref.lsq_gradients(kernel, max_abs, bits, upstream)
    for jit in (False, True) if BACKEND == "jax" else (False,):
        to_kernel, to_range = framework.gradients(
            fake, (kernel, max_abs), upstream, dtype="float32", jit=jit
        )
        np.testing.assert_array_equal(to_kernel, expected_kernel)
        np.testing.assert_allclose(to_range, expected_range, rtol=1e-4, atol=1e-6)
    tensor = keras.ops.convert_to_tensor
    np.testing.assert_array_equal(
        array(fake_quant.fake_quant_weights_learned(tensor(kernel), tensor(max_abs), bits)),
        array(fake_quant.fake_quant_weights(tensor(kernel), tensor(max_abs), bits)),
    )


def test_bias_rounds_half_to_even_with_a_straight_through_gradient(framework):
    """round_bias: round(bias/step)·step, numpy's rounding (halves to even), gradient 1."""
    bias = np.array([0.125, 0.375, -0.125, 0.3, 1.0], np.float32)
    rounded = fake_quant.round_bias(keras.ops.convert_to_tensor(bias), np.float32(0.25))
    np.testing.assert_array_equal(array(rounded), np.round(bias / 0.25) * np.float32(0.25))
    (gradient,) = framework.gradients(
        lambda b: fake_quant.round_bias(b, np.float32(0.25)), (bias,), np.ones(5), "float32"
    )
    np.testing.assert_array_equal(gradient, 1.0)


# The TensorFlow side of the QAT round trip, in a Python of its own (Keras fixes its backend).
# argv: the folder, the formats to write, the backend that trained it.
_TF_SIDE = """
import os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
import json, keras, numpy as np, keras_bn
from keras_bn.export import export_onnx, export_tflite
folder = sys.argv[1]
# compile=False for PyTorch: Keras saves a PyTorch model's optimizer as its torch subclass.
model = keras.saving.load_model(
    os.path.join(folder, "qat.keras"), compile=sys.argv[3] != "torch"
)
x = np.load(os.path.join(folder, "x.npy"))
found = {"outputs": model.predict(x, verbose=0).tolist()}
writers = {"tflite": export_tflite, "onnx": export_onnx}
for name in filter(None, sys.argv[2].split(",")):
    export = writers[name]
    result = export(model, os.path.join(folder, "m." + name), probe=x)
    found[name] = [bool(result.passed), result.quantization, max(
        lsb.max_lsb for errors in result.lsb_errors.values() for lsb in errors.values())]
print(json.dumps(found))
"""


@pytest.mark.slow
@pytest.mark.backends("jax", "torch")
@pytest.mark.tensorflow_side
# channels_first: the host's bias goes to a ChannelBias; a last spatial axis as long as the
# channels (4) is where Keras's TensorFlow ops.add would put the bias on the wrong axis.
@pytest.mark.parametrize(
    "data_format",
    ["channels_last", pytest.param("channels_first", marks=pytest.mark.backends("jax"))],
)
def test_qat_model_trained_here_loads_and_exports_under_tensorflow(tmp_path, data_format):
    """A QAT model trained under JAX or PyTorch (FreezeBatchNorm included) and saved loads
    under TensorFlow with the same outputs, and its int8 TFLite and ONNX files verify within
    one output step."""
    import keras_bn

    first = data_format == "channels_first"
    # An integer file has no float layer, so the channels_first model (one kept in float) is
    # checked by its outputs under TensorFlow only; the export refuses it, naming the layer.
    formats = () if first else ("tflite", "onnx")
    inputs = keras.Input((3, 6, 4) if first else (8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", data_format=data_format)(inputs)
    h = keras_bn.BatchNormalization(axis=1 if first else -1)(h)
    h = keras.layers.ReLU()(h)
    if first:  # kept float (its loss term), its bias added by a ChannelBias, under JAX too
        h = keras.layers.Conv2D(
            4,
            3,
            padding="same",
            data_format=data_format,
            activity_regularizer="l2",
            # a bias far larger than a quantization step: one on the wrong axis would show
            bias_initializer=keras.initializers.RandomNormal(stddev=1.0, seed=1),
            name="kept",
        )(h)
    h = keras.layers.GlobalAveragePooling2D(data_format=data_format)(h)
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    if first:
        # No bias-axis warning under JAX (Keras's add is right there); only the float layer.
        with pytest.warns(keras_bn.KerasBNWarning, match="kept 1 layer.*'kept'"):
            qat = keras_bn.quantize.quantize_model(model)
    else:
        qat = keras_bn.quantize.quantize_model(model)
    qat.compile("adam", "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, *inputs.shape[1:])).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    before = [array(w) for w in qat.trainable_weights]
    qat.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[keras_bn.quantize.FreezeBatchNorm(after_steps=2)],
    )
    assert any(not np.array_equal(a, array(b)) for a, b in zip(before, qat.trainable_weights))
    if first:  # the bias trains in its ChannelBias, on the channel axis
        (bias,) = [w for w in qat.trainable_weights if w.path.endswith("_bias/bias")]
        assert np.ptp(array(bias)) > 0.5
    assert all(
        bool(array(q.range_initialized))
        for q in qat.layers[-1]._flatten_layers()
        if isinstance(q, keras_bn.quantize.ActivationQuantizer)
    )
    qat.save(tmp_path / "qat.keras")
    np.save(tmp_path / "x.npy", x[:8])
    expected = array(qat.predict(x[:8], verbose=0))

    found = tensorflow_side.run(
        _TF_SIDE, tmp_path, ",".join(formats), BACKEND, backend="tensorflow"
    )
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(found["outputs"], expected, rtol=0, atol=1e-5 * scale)
    for name in formats:
        passed, quantization, max_lsb = found[name]
        assert passed and quantization == "int8", found[name]
        assert max_lsb <= 1.0, found[name]  # within one output step


@pytest.mark.slow  # two fits and a jit: about 10 s
@pytest.mark.backends("jax")
def test_fit_whose_last_batch_holds_one_sample_outputs_beta_and_keeps_the_statistics():
    """TensorFlow's fit sees a batch of one as run-time data (its batch size is unknown): a
    Dense host's QAT layer outputs β and leaves the moving statistics. Under JAX every shape is
    static, which must not turn that batch into the eager call's ValueError."""
    import jax

    import keras_bn

    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras_bn.BatchNormalization()(keras.layers.Dense(4, name="host")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.ReLU()(h)))
    qat = keras_bn.quantize.quantize_model(model)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(9, 5)).astype("float32")
    y = rng.normal(size=(9, 2)).astype("float32")
    start = qat.get_weights()
    moving = {}
    for samples in (8, 9):  # one batch of 8, then the same and a batch of one
        qat.set_weights(start)
        qat.compile(keras.optimizers.SGD(0.1), "mse")
        qat.fit(x[:samples], y[:samples], batch_size=8, epochs=1, verbose=0, shuffle=False)
        bn = qat.get_layer("host_qat").batch_norm  # (the activation ranges do move)
        moving[samples] = [np.array(bn.moving_mean), np.array(bn.moving_variance)]
    for after_eight, after_nine in zip(moving[8], moving[9], strict=True):
        np.testing.assert_array_equal(after_eight, after_nine)
    host = qat.get_layer("host_qat")
    assert np.ptp(moving[9][0]) > 0  # the batch of 8 moved the mean
    # In a traced training call a batch of one outputs β (through the ReLU and the output's
    # fake quantization, within half a step of it), whatever the sample, as on TensorFlow.
    step = jax.jit(
        lambda trainable, fixed, sample: host.stateless_call(
            trainable, fixed, sample, training=True
        )[0]
    )
    state = (
        [v.value for v in host.trainable_variables],
        [v.value for v in host.non_trainable_variables],
    )
    first, other = (np.asarray(step(*state, x[i : i + 1])) for i in (8, 0))
    np.testing.assert_array_equal(first, other)
    quantizer = host.output_quantizer
    half_step = 0.5 * float(quantizer.range_max - quantizer.range_min) / 255
    beta = np.array(host.batch_norm.beta)
    np.testing.assert_allclose(first[0], np.maximum(beta, 0.0), rtol=0, atol=half_step + 1e-6)
    # An eager call with a batch of one is the caller's mistake, as on TensorFlow.
    with pytest.raises(ValueError, match="m=1"):
        host(x[8:9], training=True)

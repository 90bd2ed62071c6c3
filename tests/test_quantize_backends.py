"""keras_bn.quantize's fake quantization under JAX: TensorFlow's FakeQuant ops in jnp
(keras_bn/backend/jax/fake_quant.py) against the TensorFlow ops themselves, which a TensorFlow
Python (tests_jax/tensorflow_side.py) runs on every case of this module in one process; and QAT
models trained under JAX, then loaded and exported under TensorFlow."""

import fake_quant_cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_side

from keras_bn.backend.jax import fake_quant as jfq


def _last_axis_case():
    """Channels along the last axis, channel 2's range so small that most of its values clip."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 4, 5, 6)).astype(np.float32)
    high = np.abs(x).reshape(-1, 6).max(axis=0)
    high[2] = 1e-3
    return x, -high, high


@pytest.fixture(scope="module")
def tensorflow_fake_quant(tmp_path_factory):
    """TensorFlow's outputs (and gradients) for the shared cases and the last-axis case, from
    one process."""
    cases = fake_quant_cases.shared_cases()
    x, low, high = _last_axis_case()
    cases["last_axis"] = ("per_channel", 4, True, {"x": x, "min": low, "max": high})
    return fake_quant_cases.tensorflow_outputs(cases, tmp_path_factory.mktemp("fake_quant"))


_bits_equal = fake_quant_cases.assert_bits_equal


@pytest.mark.slow  # 60 ranges, eager op by op: about 10 s
@pytest.mark.tensorflow_side
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
def test_fake_quant_equals_tensorflow_bit_for_bit(compiled, tensorflow_fake_quant):
    per_tensor = jfq.fake_quant_with_min_max_vars
    per_channel = jfq.fake_quant_with_min_max_vars_per_channel
    if compiled:
        per_tensor = jax.jit(per_tensor, static_argnums=(3, 4))
        per_channel = jax.jit(per_channel, static_argnums=(3, 4))
    for i, (bits, narrow, low, high, x) in enumerate(fake_quant_cases.sweep()):
        _bits_equal(per_tensor(x, low, high, bits, narrow), tensorflow_fake_quant[f"sweep{i}/y"])
        column = x[:, None]
        _bits_equal(
            per_channel(column, np.array([low]), np.array([high]), bits, narrow),
            tensorflow_fake_quant[f"sweep{i}_channel/y"],
        )


@pytest.mark.tensorflow_side
def test_per_channel_ranges_apply_along_the_last_axis(tensorflow_fake_quant):
    x, low, high = _last_axis_case()
    _bits_equal(
        jfq.fake_quant_with_min_max_vars_per_channel(x, low, high, 4, True),
        tensorflow_fake_quant["last_axis/y"],
    )


@pytest.mark.tensorflow_side
@pytest.mark.parametrize("per_channel", [False, True])
def test_gradients_are_tensorflows_straight_through_rule(per_channel, tensorflow_fake_quant):
    x, low, high, upstream = fake_quant_cases.gradient_case(per_channel)
    name = "gradient_per_channel" if per_channel else "gradient_per_tensor"
    expected = [tensorflow_fake_quant[f"{name}/d_{key}"] for key in ("x", "min", "max")]
    jnp_op = (
        jfq.fake_quant_with_min_max_vars_per_channel
        if per_channel
        else jfq.fake_quant_with_min_max_vars
    )

    def jax_loss(values, minimum, maximum):
        return jnp.sum(jnp_op(values, minimum, maximum, 8) * upstream)

    actual = jax.grad(jax_loss, argnums=(0, 1, 2))(x, low, high)
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    # The rule itself: the upstream gradient inside the nudged range, 0 outside.
    _, _, nudged_min, nudged_max = jfq.nudge(jnp.asarray(low), jnp.asarray(high), 8, False)
    inside = (x >= np.asarray(nudged_min)) & (x <= np.asarray(nudged_max))
    assert 0 < inside.sum() < x.size
    np.testing.assert_array_equal(np.asarray(actual[0]), np.where(inside, upstream, 0.0))


# The TensorFlow side of the round trip, in a Python of its own (Keras fixes its backend).
_TF_SIDE = """
import os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
import json, keras, numpy as np, keras_bn
from keras_bn.export import export_onnx, export_tflite
folder = sys.argv[1]
model = keras.saving.load_model(os.path.join(folder, "qat.keras"))
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
@pytest.mark.tensorflow_side
# channels_first: the host's bias goes to a ChannelBias; a last spatial axis as long as the
# channels (4) is where Keras's TensorFlow ops.add would put the bias on the wrong axis.
@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
def test_jax_trained_qat_model_loads_and_exports_under_tensorflow(tmp_path, data_format):
    import keras

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
    before = [np.array(w) for w in qat.trainable_weights]
    qat.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[keras_bn.quantize.FreezeBatchNorm(after_steps=2)],
    )
    assert any(not np.array_equal(a, np.array(b)) for a, b in zip(before, qat.trainable_weights))
    if first:  # the bias trains in its ChannelBias, on the channel axis
        (bias,) = [w for w in qat.trainable_weights if w.path.endswith("_bias/bias")]
        assert np.ptp(np.array(bias)) > 0.5
    assert all(
        bool(q.range_initialized.numpy())
        for q in qat.layers[-1]._flatten_layers()
        if isinstance(q, keras_bn.quantize.ActivationQuantizer)
    )
    qat.save(tmp_path / "qat.keras")
    np.save(tmp_path / "x.npy", x[:8])
    expected = np.asarray(qat.predict(x[:8], verbose=0))

    found = tensorflow_side.run(_TF_SIDE, tmp_path, ",".join(formats), backend="tensorflow")
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(found["outputs"], expected, rtol=0, atol=1e-5 * scale)
    for name in formats:
        passed, quantization, max_lsb = found[name]
        assert passed and quantization == "int8", found[name]
        assert max_lsb <= 1.0, found[name]  # within one output step


@pytest.mark.slow  # two fits and a jit: about 10 s
def test_fit_whose_last_batch_holds_one_sample_outputs_beta_and_keeps_the_statistics():
    """TensorFlow's fit sees a batch of one as run-time data (its batch size is unknown): a
    Dense host's QAT layer outputs β and leaves the moving statistics. Under JAX every shape is
    static, which must not turn that batch into the eager call's ValueError."""
    import keras

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


def test_a_traced_batch_of_one_outputs_beta_with_no_gradient_to_the_kernel_or_gamma():
    """m = 1 in a traced training step (fit's last batch of one): the folded BN outputs β and
    gives x, γ and the kernel no gradient, as keras_bn.BatchNormalization does; inputs far
    from 1 make the rounding of z·σ/σ_B − γ·μ_B/σ_B (times 1/√ε) show otherwise."""
    import keras

    from keras_bn.quantize import QuantizedHostBatchNorm

    layer = QuantizedHostBatchNorm(keras.layers.Dense(4), activation_bits=None)
    layer.build((None, 5))
    rng = np.random.default_rng(4)
    for weight in layer.trainable_weights:
        weight.assign(rng.normal(size=weight.shape).astype("float32"))
    x = (rng.normal(size=(1, 5)) * 1e4).astype("float32")
    names = [w.path.split("/")[-1] for w in layer.trainable_weights]
    beta = np.array(layer.trainable_weights[names.index("beta")])
    frozen = [v.value for v in layer.non_trainable_variables]

    def loss(inputs, trainable):
        y, _ = layer.stateless_call(trainable, frozen, inputs, training=True)
        return jnp.sum(y * jnp.arange(1.0, 5.0)), y

    (_, y), (d_x, d_weights) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
        x, [v.value for v in layer.trainable_variables]
    )
    np.testing.assert_array_equal(np.asarray(y), beta[None])
    np.testing.assert_array_equal(np.asarray(d_x), 0.0)
    for name, gradient in zip(names, d_weights, strict=True):
        if name in ("kernel", "gamma"):
            np.testing.assert_array_equal(np.asarray(gradient), 0.0)
    np.testing.assert_array_equal(np.asarray(d_weights[names.index("beta")]), np.arange(1.0, 5.0))

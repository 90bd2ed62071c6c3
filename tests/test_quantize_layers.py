"""The QAT layers against independent references: the folded-BN forward pass in numpy (every
host kind, per channel and per tensor, 8/4/3/2 bits, before and after the freeze), the float
host + keras_bn BN with fake quantization off (outputs, gradients, moving statistics), γ = 0,
and the activation quantizers in the chain. Under every backend; TensorFlow's traced steps
(tf.function: its fused kernel, a run-time batch of one, a freeze after tracing) under it
alone."""

import zlib

import keras
import numpy as np
import pytest
import quantize_reference as ref
from framework_references import array

import keras_bn
from helpers import assert_close
from keras_bn.quantize import (
    ActivationQuantizer,
    QuantizedHost,
    QuantizedHostBatchNorm,
    fake_quant,
    freeze_batch_norm,
    from_layers,
    hosts,
    quantize_model,
)

BACKEND = keras.backend.backend()
# Keras 3.15 adds a channels_first bias on the output's last axis when it has as many entries
# as there are channels, under TensorFlow only (keras_bn's bias_add_may_miss_channels_first).
KERAS_BIAS_ADD_IS_WRONG = BACKEND == "tensorflow"

L = keras.layers
EPSILON = 1e-3
MOMENTUM = 0.9

# name: (host factory, input shape). Geometry that exercises strides, "same"/"valid"/"causal"
# padding, dilation, depth multipliers and channels_first.
HOSTS = {
    "conv1d": (lambda: L.Conv1D(4, 3, padding="causal", dilation_rate=2), (3, 9, 3)),
    "conv2d": (lambda: L.Conv2D(5, 3, strides=2, padding="same"), (3, 7, 7, 3)),
    "depthwise_m1": (lambda: L.DepthwiseConv2D(3, padding="valid"), (3, 6, 6, 3)),
    "depthwise_m2": (
        lambda: L.DepthwiseConv2D(3, depth_multiplier=2, padding="same"),
        (3, 5, 5, 3),
    ),
    "separable": (
        lambda: L.SeparableConv2D(4, 3, depth_multiplier=2, padding="same"),
        (3, 5, 5, 3),
    ),
    "depthwise_m2_no_bias": (
        lambda: L.DepthwiseConv2D(3, depth_multiplier=2, use_bias=False),
        (3, 5, 5, 3),
    ),
    "conv2d_no_bias": (lambda: L.Conv2D(3, 2, use_bias=False), (3, 5, 5, 2)),
    "dense": (lambda: L.Dense(5), (6, 4)),
    # A rank-5 kernel: its per-channel fake quantization runs on a 2-D view.
    "conv3d": (lambda: L.Conv3D(4, (2, 3, 2), strides=(1, 2, 1)), (3, 3, 6, 4, 2)),
    # A 4×4 output of 4 filters: where Keras 3.15's own bias add (keras.ops.add on the
    # TensorFlow backend) puts a channels_first bias on the last axis, since it has as many
    # entries as there are channels. The QAT layer adds it on the channel axis.
    "conv2d_channels_first": (lambda: L.Conv2D(4, 3, data_format="channels_first"), (3, 3, 6, 6)),
}


def _spec(host):
    kind = {L.Dense: "dense", L.DepthwiseConv2D: "depthwise", L.SeparableConv2D: "separable"}
    spec = {"kind": kind.get(type(host), "conv")}
    if spec["kind"] != "dense":
        spec.update(strides=host.strides, padding=host.padding, dilation=host.dilation_rate)
    return spec


def _channels_first(host):
    return getattr(host, "data_format", None) == "channels_first"


def _to_last(x, host):
    return np.moveaxis(x, 1, -1) if _channels_first(host) else x


def _to_host_layout(y, host):
    return np.moveaxis(y, -1, 1) if _channels_first(host) else y


def _random_weights(host, rng, bits, per_channel, zero_gamma=False):
    """Weights for the QAT layer (float64 numpy), the kernels moved off rounding boundaries."""
    folded = host.pointwise_kernel if isinstance(host, L.SeparableConv2D) else host.kernel
    channels = folded.shape[-1] * (folded.shape[-2] if isinstance(host, L.DepthwiseConv2D) else 1)
    gamma = rng.uniform(0.5, 1.5, channels) * rng.choice([-1.0, 1.0], channels)
    if zero_gamma:
        gamma[0] = 0.0
    weights = {
        "kernel": rng.normal(size=folded.shape),
        "bias": rng.normal(size=channels) * 0.3 if host.use_bias else np.zeros(channels),
        "gamma": gamma,
        "beta": rng.normal(size=channels) * 0.5,
        "mean": rng.normal(size=channels) * 0.2,
        "variance": rng.uniform(0.5, 2.0, channels),
    }
    s = gamma / np.sqrt(weights["variance"] + EPSILON)
    kind = _spec(host)["kind"]
    if bits is not None:
        weights["kernel"] = ref.away_from_ties(weights["kernel"], kind, s, bits, per_channel)
    if isinstance(host, L.SeparableConv2D):
        depthwise = rng.normal(size=host.depthwise_kernel.shape)
        if bits is not None:
            depthwise = ref.away_from_ties(depthwise, "depthwise", 1.0, bits, per_channel)
        weights["depthwise_kernel"] = depthwise
    return weights


def _assign(layer, weights):
    """Put `weights` into a built QuantizedHostBatchNorm (float32)."""
    host, bn = layer.host, layer.batch_norm
    kernel = host.pointwise_kernel if isinstance(host, L.SeparableConv2D) else host.kernel
    kernel.assign(weights["kernel"].astype("float32"))
    if "depthwise_kernel" in weights:
        host.depthwise_kernel.assign(weights["depthwise_kernel"].astype("float32"))
    if host.bias is not None:
        host.bias.assign(weights["bias"].astype("float32"))
    for name, value in (("gamma", "gamma"), ("beta", "beta")):
        getattr(bn, name).assign(weights[value].astype("float32"))
    bn.moving_mean.assign(weights["mean"].astype("float32"))
    bn.moving_variance.assign(weights["variance"].astype("float32"))


def _make(host_name, bits, per_channel, activation="relu", activation_bits=None, **options):
    """(QAT layer, the host config it copies, weights, input), all from a fixed seed."""
    factory, shape = HOSTS[host_name]
    rng = np.random.default_rng(zlib.crc32(f"{host_name} {bits} {per_channel}".encode()))
    zero_gamma = options.pop("zero_gamma", False)
    options.setdefault("weight_range", "max")  # the weights are drawn off max|W·s|'s ties
    host = factory()
    host.build(shape)
    layer = QuantizedHostBatchNorm(
        host,
        keras_bn.BatchNormalization(
            axis=1 if _channels_first(host) else -1, momentum=MOMENTUM, epsilon=EPSILON
        ),
        activation=activation,
        weight_bits=bits,
        activation_bits=activation_bits,
        per_channel=per_channel,
        **options,
    )
    layer.build(shape)
    weights = _random_weights(host, rng, bits, per_channel, zero_gamma)
    _assign(layer, weights)
    x = (rng.normal(size=shape) * 1.5 + 0.3).astype("float32")
    return layer, host, weights, x


def _reference(
    host,
    x,
    weights,
    bits,
    per_channel,
    training,
    activation="relu",
    between=None,
    input_step=None,
    ranges=None,
):
    y, mean, var = ref.qat_forward(
        _spec(host),
        _to_last(x, host),
        weights,
        bits,
        per_channel,
        training,
        EPSILON,
        activation,
        between,
        input_step,
        ranges,
    )
    return _to_host_layout(y, host), mean, var


def _moving(layer):
    return (
        np.array(layer.batch_norm.moving_mean, np.float64),
        np.array(layer.batch_norm.moving_variance, np.float64),
    )


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
@pytest.mark.parametrize("host_name", list(HOSTS))
def test_forward_matches_numpy_before_and_after_the_freeze(host_name, per_channel, bits):
    layer, host, weights, x = _make(host_name, bits, per_channel)
    # Inference: the folded BN on the fake-quantized W·s.
    expected, _, _ = _reference(host, x, weights, bits, per_channel, training=False)
    inference = array(layer(x, training=False))
    assert_close(inference, expected, 1e-5)
    # Frozen, training computes that same folded form bit for bit and moves nothing.
    before = _moving(layer)
    freeze_batch_norm(layer)
    np.testing.assert_array_equal(array(layer(x, training=True)), inference)
    for old, new in zip(before, _moving(layer)):
        np.testing.assert_array_equal(old, new)
    layer.batch_norm_frozen.assign(False)
    # Before the freeze: batch statistics of z/s, then the moving update (unbiased variance).
    expected, batch_mean, batch_var = _reference(host, x, weights, bits, per_channel, True)
    assert_close(array(layer(x, training=True)), expected, 1e-5)
    m = expected.size // weights["gamma"].size
    mean, variance = _moving(layer)
    assert_close(mean, MOMENTUM * weights["mean"] + (1 - MOMENTUM) * batch_mean, 1e-5)
    unbiased = batch_var * m / (m - 1)
    assert_close(variance, MOMENTUM * weights["variance"] + (1 - MOMENTUM) * unbiased, 1e-5)


def test_weight_grid_is_the_k_bit_grid_of_the_folded_kernel():
    """`folded_weights` and `fake_quant.weight_grid` give the integers of the reference's grid:
    |q| ≤ 2^(k−1) − 1, one scale per output channel c·M + m of a depthwise kernel with
    multiplier 2, each channel reaching the grid's end."""
    bits = 3
    layer, _, weights, _ = _make("depthwise_m2", bits, True)
    kernel, bias = layer.folded_weights()
    s = weights["gamma"] / np.sqrt(weights["variance"] + EPSILON)
    np.testing.assert_allclose(
        bias, weights["beta"] + s * (weights["bias"] - weights["mean"]), 1e-6
    )
    q, scale = fake_quant.weight_grid(ref.channels_last_view(kernel, "depthwise"), bits, True)
    view = ref.channels_last_view(weights["kernel"], "depthwise") * s
    step = ref.weight_scale(view, bits, True)
    assert q.dtype == np.int8 and q.shape == (3, 3, 1, 6)
    np.testing.assert_array_equal(q, ref.fake_quant_weights(view, bits, True) / step)
    np.testing.assert_allclose(scale, step, rtol=1e-6)
    assert (np.abs(q).reshape(-1, 6).max(axis=0) == ref.q_max(bits)).all()


def _with_bias_by_hand(host):
    """The host's map as a function: a bias-free copy of it (same kernels), then its bias added
    with keras.ops.add on the channel axis, not by Keras's own bias add, which is wrong at
    conv2d_channels_first's shape under TensorFlow (see HOSTS)."""
    bias_free = type(host).from_config({**host.get_config(), "use_bias": False})
    bias_free.build(host.get_build_config()["input_shape"])
    for weight in bias_free.weights:
        weight.assign(next(w for w in host.weights if w.name == weight.name))
    if host.bias is None:
        return bias_free, bias_free

    def forward(x):
        y = bias_free(x)
        shape = [1] * len(y.shape)
        shape[1 if _channels_first(host) else -1] = -1
        # Broadcast first: keras.ops.add's own broadcast is the one that is wrong under TF.
        return y + keras.ops.broadcast_to(keras.ops.reshape(host.bias, shape), y.shape)

    return forward, bias_free


def test_keras_adds_a_channels_first_bias_on_the_wrong_axis_at_this_shape():
    """Why the references above add the bias by hand: at conv2d_channels_first's shape Keras's
    own output is off under TensorFlow (the day this fails, Keras has fixed it and the hand-made
    bias can go), and right under JAX and PyTorch (as keras_bn assumes: no warning there)."""
    factory, shape = HOSTS["conv2d_channels_first"]
    host = factory()
    host.build(shape)
    host.bias.assign(np.arange(1.0, 5.0, dtype="float32"))
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    by_hand, _ = _with_bias_by_hand(host)
    difference = np.abs(array(host(x)) - array(by_hand(x))).max()
    if KERAS_BIAS_ADD_IS_WRONG:
        assert difference > 0.5
    else:
        assert difference < 1e-5


def _float_reference(host_name, with_relu=True):
    """A QAT layer with fake quantization off, and the float host + keras_bn BN it copies."""
    factory, shape = HOSTS[host_name]
    rng = np.random.default_rng(7)
    host = factory()
    host.build(shape)
    bn = keras_bn.BatchNormalization(
        axis=1 if _channels_first(host) else -1, momentum=MOMENTUM, epsilon=EPSILON
    )
    bn.build(host.compute_output_shape(shape))
    weights = _random_weights(host, rng, None, True, zero_gamma=True)
    weights["beta"][0] = 0.7  # after ReLU, the γ = 0 channel still passes a gradient
    for variable, value in zip(host.weights, [w for w in host.get_weights()]):
        variable.assign(rng.normal(size=value.shape).astype("float32"))
    if host.bias is not None:
        host.bias.assign(weights["bias"].astype("float32"))
    bn.gamma.assign(weights["gamma"].astype("float32"))
    bn.beta.assign(weights["beta"].astype("float32"))
    bn.moving_mean.assign(weights["mean"].astype("float32"))
    bn.moving_variance.assign(weights["variance"].astype("float32"))
    layer = from_layers(
        host, bn, "relu" if with_relu else None, weight_bits=None, activation_bits=None
    )
    x = (rng.normal(size=shape) * 1.5 + 0.3).astype("float32")
    return layer, host, bn, x


def _kernels(host):
    if isinstance(host, L.SeparableConv2D):
        return [host.depthwise_kernel, host.pointwise_kernel]
    return [host.kernel]


@pytest.mark.parametrize("host_name", list(HOSTS))
def test_without_fake_quant_training_is_float_host_then_batch_norm(host_name, framework):
    """Fake quantization off: outputs, gradients (input, kernels, γ, β) and the moving update
    equal the float host → keras_bn BN → ReLU in training mode, γ = 0 channel included (both
    differentiated by the framework's autodiff)."""
    layer, host, bn, x = _float_reference(host_name)
    upstream = np.random.default_rng(3).normal(size=layer(x).shape).astype("float32")
    qat_bn = layer.batch_norm
    y_qat, dx_qat, g_qat = framework.call_gradients(
        lambda x: layer(x, training=True),
        x,
        upstream,
        [*_kernels(layer.host), qat_bn.gamma, qat_bn.beta],
        [qat_bn.moving_mean, qat_bn.moving_variance],
    )
    reference, bias_free = _with_bias_by_hand(host)
    y_ref, dx_ref, g_ref = framework.call_gradients(
        lambda x: keras.ops.relu(bn(reference(x), training=True)),
        x,
        upstream,
        [*_kernels(bias_free), bn.gamma, bn.beta],
        [bn.moving_mean, bn.moving_variance],
    )
    g_qat, g_ref = [dx_qat, *g_qat], [dx_ref, *g_ref]
    assert_close(y_qat, y_ref, 1e-5)
    beta_0 = float(array(bn.beta)[0])
    channel_0 = np.take(array(y_qat), 0, axis=1 if _channels_first(host) else -1)
    np.testing.assert_allclose(channel_0, max(beta_0, 0.0), atol=1e-6)  # γ = 0: β, then ReLU
    for got, want in zip(g_qat, g_ref):
        assert_close(got, want, 1e-5)
    assert float(np.abs(g_ref[-2][0])) > 1e-3  # γ = 0 still has a gradient, and it matches
    assert_close(layer.batch_norm.moving_mean, bn.moving_mean, 1e-5)
    assert_close(layer.batch_norm.moving_variance, bn.moving_variance, 1e-5)
    assert not np.allclose(array(bn.moving_mean), 0.0)


@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
def test_zero_gamma_channel_outputs_beta_and_leaves_the_others_alone(per_channel, framework):
    """γ = 0 (s = 0) divides nothing by zero: that channel outputs β in training and inference,
    everything stays finite, and the other channels match the numpy reference, whose per-tensor
    range comes from W·s (the zero channel does not widen it)."""
    layer, host, weights, x = _make("conv2d", 4, per_channel, activation=None, zero_gamma=True)
    for training in (False, True):
        expected, batch_mean, _ = _reference(host, x, weights, 4, per_channel, training, None)
        y, _, grads = framework.call_gradients(
            lambda x, training=training: layer(x, training=training),
            x,
            np.ones(layer.compute_output_shape(x.shape), "float32"),
            layer.trainable_variables,
            layer.non_trainable_variables,
        )
        assert all(np.isfinite(g).all() for g in grads)
        np.testing.assert_allclose(array(y)[..., 0], weights["beta"][0], atol=1e-6)
        assert_close(array(y), expected, 1e-5)
    live = weights["gamma"] != 0
    mean, _ = _moving(layer)
    expected_mean = MOMENTUM * weights["mean"] + (1 - MOMENTUM) * batch_mean
    assert_close(mean[live], expected_mean[live], 1e-5)


@pytest.mark.parametrize("activation_bits", [8, 4])
@pytest.mark.parametrize("host_name", ["conv2d", "dense", "separable"])
def test_activation_quantizers_in_the_chain(host_name, activation_bits):
    """Output (and a separable conv's intermediate) quantized on the EMA range, first batch's
    range, then one EMA step; inference uses the stored range. Compared with the numpy grid;
    an element whose value lies within 1e-4 steps of a rounding boundary may land on either
    neighbour (float32 vs float64), and the data are such that none of the intermediate's do."""
    bits = 4
    layer, host, weights, x = _make(
        host_name, bits, True, activation="relu6", activation_bits=activation_bits
    )
    ranges = {}

    def quantize(name, values):
        lo, hi = min(values.min(), 0.0), max(values.max(), 0.0)
        if name in ranges:
            old_lo, old_hi = ranges[name]
            lo = min(0.99 * old_lo + 0.01 * values.min(), 0.0)
            hi = max(0.99 * old_hi + 0.01 * values.max(), 0.0)
        ranges[name] = (lo, hi)
        return values, lo, hi

    def intermediate(middle):
        middle, lo, hi = quantize("intermediate", middle)
        assert ref.distance_to_rounding_boundary(middle, lo, hi, activation_bits).min() > 1e-4
        return ref.fake_quant_activations(middle, lo, hi, activation_bits)

    between = intermediate if host_name == "separable" else None
    for step, batch in enumerate([x, x * 0.5 + 0.2]):
        y = array(layer(batch, training=True))
        # Back to the initial moving statistics, which the reference's W·s uses.
        layer.batch_norm.moving_mean.assign(weights["mean"].astype("float32"))
        layer.batch_norm.moving_variance.assign(weights["variance"].astype("float32"))
        pre, _, _ = _reference(host, batch, weights, bits, True, True, "relu6", between)
        _, lo, hi = quantize("output", pre)
        _assert_quantized(y, pre, lo, hi, activation_bits)
        quantizer = layer.output_quantizer
        np.testing.assert_allclose(
            [float(quantizer.range_min), float(quantizer.range_max)], [lo, hi], rtol=1e-5, atol=1e-7
        )
        assert step > 0 or lo == 0.0  # ReLU6: the range starts at 0
    lo, hi = ranges["output"]
    # A separable host's bias is added on the intermediate grid's int32 one (its other
    # hosts, called alone, know no input grid and add it in float).
    input_step = None
    if host_name == "separable":
        lo_i, hi_i = ranges["intermediate"]
        input_step, _ = ref.activation_grid(lo_i, hi_i, activation_bits)

        def between(middle):
            return ref.fake_quant_activations(middle, lo_i, hi_i, activation_bits)

    pre, _, _ = _reference(host, x, weights, bits, True, False, "relu6", between, input_step)
    _assert_quantized(array(layer(x, training=False)), pre, lo, hi, activation_bits)


def _assert_quantized(actual, pre, lo, hi, bits):
    expected = ref.fake_quant_activations(pre, lo, hi, bits)
    step, _ = ref.activation_grid(lo, hi, bits)
    near = ref.distance_to_rounding_boundary(pre, lo, hi, bits) < 1e-4
    difference = np.abs(actual - expected)
    assert (difference[~near] <= 1e-5 * max(1.0, abs(hi))).all(), difference[~near].max()
    assert (difference[near] <= step * 1.0001).all()
    assert near.mean() < 0.01


def test_quantized_host_matches_numpy():
    """No batch norm: FQ_w(W) per channel, the bias, ReLU; then the output grid."""
    rng = np.random.default_rng(11)
    host = L.Conv2D(3, 3, padding="same")
    host.build((2, 5, 5, 2))
    layer = QuantizedHost(
        host, activation="relu", weight_bits=3, activation_bits=None, weight_range="max"
    )
    layer.build((2, 5, 5, 2))
    kernel = ref.away_from_ties(rng.normal(size=(3, 3, 2, 3)), "conv", 1.0, 3, True)
    bias = rng.normal(size=3)
    layer.host.kernel.assign(kernel.astype("float32"))
    layer.host.bias.assign(bias.astype("float32"))
    x = rng.normal(size=(2, 5, 5, 2)).astype("float32")
    expected = ref.conv(
        x.astype(np.float64), ref.fake_quant_weights(kernel, 3, True), (1, 1), "same", (1, 1)
    )
    expected = np.maximum(expected + bias, 0.0)
    for training in (True, False):
        assert_close(array(layer(x, training=training)), expected, 1e-5)


def test_a_static_batch_of_one_value_per_channel_is_refused_in_training():
    layer = QuantizedHostBatchNorm(L.Dense(3), activation_bits=None)
    with pytest.raises(ValueError, match="m=1"):
        layer(np.ones((1, 4), "float32"), training=True)


@pytest.mark.backends("tensorflow")  # JAX's fit: test_quantize_backends.py
def test_a_dynamic_batch_of_one_leaves_the_moving_statistics_alone():
    """A batch size known only at run time (a tf.function's): m = 1 outputs β (x − μ_B = 0)
    and skips the update."""
    import tensorflow as tf

    layer = QuantizedHostBatchNorm(L.Dense(3), activation_bits=None)
    layer.build((None, 4))
    layer.batch_norm.beta.assign([0.5, -1.0, 2.0])
    before = _moving(layer)
    step = tf.function(
        lambda x: layer(x, training=True), input_signature=[tf.TensorSpec((None, 4))]
    )
    y = step(tf.ones((1, 4)))
    np.testing.assert_allclose(array(y), [[0.5, -1.0, 2.0]], atol=1e-5)
    for old, new in zip(before, _moving(layer)):
        np.testing.assert_array_equal(old, new)
    step(tf.ones((2, 4)) * [[1.0], [2.0]])
    assert not np.array_equal(before[0], _moving(layer)[0])


def test_a_per_channel_conv3d_trains_with_the_straight_through_gradient(framework):
    """A Conv3D QAT layer's kernel gradient, per channel, is autodiff's for the float Conv3D
    times each channel's BN scale (the fold is linear in the kernel, and the fake quantization
    passes the gradient straight through); and a quantize_model'd Conv3D model fits."""
    layer, _, weights, x = _make("conv3d", 8, True, activation=None)
    freeze_batch_norm(layer)
    upstream = np.random.default_rng(1).normal(size=layer(x).shape).astype("float32")
    _, _, (gradient,) = framework.call_gradients(
        lambda x: layer(x, training=True),
        x,
        upstream,
        [layer.host.kernel],
        layer.non_trainable_variables,
    )
    plain = L.Conv3D(4, (2, 3, 2), strides=(1, 2, 1), use_bias=False)
    plain.build(x.shape)
    _, _, (plain_gradient,) = framework.call_gradients(plain, x, upstream, [plain.kernel])
    s = weights["gamma"] / np.sqrt(weights["variance"] + EPSILON)
    assert_close(gradient, plain_gradient * s, 1e-5)
    inputs = keras.Input(HOSTS["conv3d"][1][1:])
    model = keras.Model(inputs, keras_bn.BatchNormalization()(HOSTS["conv3d"][0]()(inputs)))
    qat = quantize_model(model, per_channel=True)
    qat.compile(keras.optimizers.SGD(0.1), "mse")
    kernel = next(k for k in qat.layers if isinstance(k, QuantizedHostBatchNorm)).host.kernel
    before = array(kernel)
    history = qat.fit(x, array(model(x)) + 1.0, batch_size=3, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert not np.array_equal(before, array(kernel))


def _function_ops(concrete):
    """The op types of a traced function, its branch functions (tf.cond's) included."""
    graph_def = concrete.graph.as_graph_def()
    ops = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        ops.update(node.op for node in function.node_def)
    return ops


def test_fused_path_is_exact_far_from_zero():
    """Far from zero (|μ_B|/σ_B over 500) a training call matches the numpy reference, forward
    and moving update; under TensorFlow a channels-last 4D output goes through
    FusedBatchNormV3 before the freeze (in a tf.function), where the bare CPU kernel is off by
    more than 1e-5. z is exact here: s' = 1 (γ = σ as float32 computes it) and the integer
    input and kernel sum exactly."""
    host = L.Conv2D(3, 1, use_bias=True)
    shape = (4, 5, 5, 2)
    host.build(shape)
    layer = QuantizedHostBatchNorm(
        host,
        keras_bn.BatchNormalization(momentum=MOMENTUM, epsilon=EPSILON),
        activation=None,
        weight_bits=None,
        activation_bits=None,
    )
    layer.build(shape)
    rng = np.random.default_rng(11)
    variance = np.array([0.5, 1.0, 2.0], np.float32)
    # σ as `call` computes it
    sigma = array(keras.ops.sqrt(keras.ops.convert_to_tensor(variance) + EPSILON))
    weights = {
        "kernel": np.array([[[[1.0, 2.0, -1.0], [3.0, 1.0, 2.0]]]]),
        "bias": np.array([0.5, -0.25, 1.0]),
        "gamma": sigma.astype(np.float64),
        "beta": np.array([0.1, -0.2, 0.3]),
        "mean": np.array([0.0, 1.0, -1.0]),
        "variance": variance.astype(np.float64),
    }
    _assign(layer, weights)
    x = (4096.0 + rng.integers(-3, 4, size=shape)).astype("float32")
    if BACKEND == "tensorflow":
        import tensorflow as tf

        step = tf.function(lambda x: layer(x, training=True))
        assert "FusedBatchNormV3" in _function_ops(step.get_concrete_function(x))
    else:

        def step(x):
            return layer(x, training=True)

    expected, batch_mean, batch_var = ref.qat_forward(
        _spec(host), x, weights, None, True, True, EPSILON
    )
    assert np.abs(batch_mean).min() > 500 * np.sqrt(batch_var).max()  # far from zero
    assert_close(array(step(x)), expected, 1e-5)
    m = x.size // shape[-1]
    mean, moving_variance = _moving(layer)
    assert_close(mean, MOMENTUM * weights["mean"] + (1 - MOMENTUM) * batch_mean, 1e-5)
    unbiased = batch_var * m / (m - 1)
    assert_close(moving_variance, MOMENTUM * variance + (1 - MOMENTUM) * unbiased, 1e-5)


@pytest.mark.backends("tensorflow")  # tf.function's tracing
def test_freezing_after_tracing_switches_the_traced_step_without_retracing():
    """The freeze flag is read at run time: a step traced before freeze_batch_norm computes
    the folded form after it, bit for bit as inference, and moves nothing, on the fused path
    (conv2d) and the composite one (dense)."""
    import tensorflow as tf

    for host_name in ("conv2d", "dense"):
        layer, host, weights, x = _make(host_name, 8, True)
        x = tf.constant(x)
        step = tf.function(lambda x, layer=layer: layer(x, training=True))
        expected, _, _ = _reference(host, x, weights, 8, True, True)
        assert_close(array(step(x)), expected, 1e-5)
        freeze_batch_norm(layer)
        before = _moving(layer)
        inference = array(layer(x, training=False))
        np.testing.assert_array_equal(array(step(x)), inference)
        for old, new in zip(before, _moving(layer)):
            np.testing.assert_array_equal(old, new)
        assert step.experimental_get_tracing_count() == 1


def test_a_weight_on_a_rounding_boundary_rounds_in_weight_grids_as_in_call():
    """QAT leaves weights oscillating across rounding boundaries; one that ends on a boundary
    must round in the file (`weight_grids`) as the layer's inference rounds it. Here
    −0.2520198 is half a step of ±1.5121183's 3-bit grid (2.4999998 steps above its low
    end): TensorFlow's per-channel FakeQuant op rounds it to 0, the numpy grid to −1 step."""
    layer = QuantizedHost(
        L.Dense(1, use_bias=False),
        weight_bits=3,
        activation_bits=None,
        per_channel=True,
        weight_range="max",
    )
    layer.build((None, 2))
    layer.host.kernel.assign(np.float32([[1.5121183], [-0.2520198]]))
    used = array(layer(np.eye(2, dtype="float32"), training=False))  # the kernel it uses
    grid = layer.weight_grids()["kernel"]
    np.testing.assert_allclose(grid.values, used, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(grid.q, [[3], [0]])


@pytest.mark.parametrize("host_name", ["dense", "separable"])
def test_a_host_in_a_model_adds_its_bias_on_the_files_int32_grid(host_name):
    """In a model, a host whose input lies on a quantizer's grid adds its (folded) bias
    rounded to the multiples of Δ_in·Δ_w per output channel, as an integer file adds it: Δ_in
    the input quantizer's step (a separable host's intermediate one), Δ_w the 3-bit weight
    step. Before that quantizer has a range, the bias is the float one."""
    rng = np.random.default_rng(5)
    if host_name == "dense":
        host, shape = L.Dense(4), (6,)
        spec = {"kind": "dense"}
    else:
        host, shape = L.SeparableConv2D(4, 3, padding="same"), (5, 5, 2)
        spec = {"kind": "separable", "strides": (1, 1), "padding": "same", "dilation": (1, 1)}
    layer = QuantizedHost(
        host, weight_bits=3, activation_bits=8, per_channel=True, weight_range="max"
    )
    inputs = keras.Input(shape)
    quantizer = ActivationQuantizer(8, name="input_quantizer")
    model = keras.Model(inputs, layer(quantizer(inputs)))
    weights = {w.path.split("/")[-1]: w for w in layer.host.weights}
    for weight in weights.values():  # the same under every backend (Keras's initializers vary)
        weight.assign(rng.normal(0.0, 0.5, weight.shape).astype("float32"))
    weights["bias"].assign(rng.normal(size=4).astype("float32"))
    x = rng.normal(size=(16, *shape)).astype("float32")
    before = array(model(x, training=False))  # no ranges yet: all float
    float_bias = array(layer.host.bias).astype(np.float64)
    kernel = array(hosts.folded_kernel(layer.host)).astype(np.float64)
    view = ref.channels_last_view(kernel, "conv")
    kernels = [ref.fake_quant_weights(view, 3, True)]
    if host_name == "separable":
        depthwise = array(layer.host.depthwise_kernel).astype(np.float64)
        on_grid_view = ref.fake_quant_weights(
            ref.channels_last_view(depthwise, "depthwise"), 3, True
        )
        kernels.append(on_grid_view.reshape(depthwise.shape))
    expected_float = ref.host_output(spec, x.astype(np.float64), *kernels)
    assert_close(before, expected_float + float_bias, 1e-5)

    model(x, training=True)  # every range from this batch
    lo, hi = [float(v) for v in (quantizer.range_min, quantizer.range_max)]
    x_on_grid = ref.fake_quant_activations(x, lo, hi, 8)
    between = input_step = None
    if host_name == "dense":
        input_step, _ = ref.activation_grid(lo, hi, 8)
    else:
        middle = layer.intermediate_quantizer
        lo_i, hi_i = float(middle.range_min), float(middle.range_max)
        input_step, _ = ref.activation_grid(lo_i, hi_i, 8)

        def between(values):
            return ref.fake_quant_activations(values, lo_i, hi_i, 8)

    z = ref.host_output(spec, x_on_grid, *kernels, between=between)
    on_grid = ref.bias_on_grid(float_bias, input_step, ref.weight_scale(view, 3, True))
    # The float bias lies well off that grid: the check can fail.
    assert (
        np.abs(on_grid - float_bias).max()
        > 0.2 * input_step * ref.weight_scale(view, 3, True).min()
    )
    out = layer.output_quantizer
    lo_o, hi_o = float(out.range_min), float(out.range_max)
    pre = z + on_grid
    expected = ref.fake_quant_activations(pre, lo_o, hi_o, 8)
    near = ref.distance_to_rounding_boundary(pre, lo_o, hi_o, 8) < 1e-3
    got = array(model(x, training=False)).astype(np.float64)
    assert near.mean() < 0.01
    step_o, _ = ref.activation_grid(lo_o, hi_o, 8)
    assert np.abs(got - expected)[~near].max() <= 1e-4 * step_o
    np.testing.assert_allclose(layer.inference_bias(), on_grid, rtol=1e-6)


@pytest.mark.parametrize(("activation", "fixed_step"), [("tanh", 1 / 128), ("sigmoid", 1 / 256)])
def test_a_host_after_a_fixed_step_activation_adds_its_bias_on_that_grid(activation, fixed_step):
    """No quantizer follows a tanh or sigmoid: the int8 spec fixes its output's step, and the
    integer file adds the next host's bias in units of that step times the weights'."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = L.Dense(5, activation=activation, name="hidden")(inputs)
    model = quantize_model(
        keras.Model(inputs, L.Dense(4, name="head")(hidden)), 3, weight_range="max"
    )
    head = model.get_layer("head_qat")
    bias = np.random.default_rng(0).normal(0, 0.3, 4).astype("float32")
    head.host.bias.assign(bias)
    model(np.random.default_rng(1).normal(size=(16, 6)).astype("float32"), training=True)
    kernel = array(head.host.kernel).astype(np.float64)
    weight_step = ref.weight_scale(kernel, 3, head.per_channel)
    on_grid = ref.bias_on_grid(bias, fixed_step, weight_step)
    # The float bias lies well off that grid: the check can fail.
    assert np.abs(on_grid - bias).max() > 0.2 * fixed_step * np.min(weight_step)
    np.testing.assert_allclose(head.inference_bias(), on_grid, rtol=1e-6)


def _traced_gradients(layer, x, upstream):
    """A training call of `layer` traced with its batch size unknown (TensorFlow's
    tf.function) or traced at all (JAX's jit of stateless_call, as fit runs it), and its
    autodiff: (y, dl/dx, [dl/dw for w in trainable_weights]) of l = Σ upstream·y."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function(input_signature=[tf.TensorSpec([None, *x.shape[1:]], tf.float32)])
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(y * upstream)
            return y, tape.gradient(loss, [x, *layer.trainable_weights])

        y, (d_x, *d_weights) = step(tf.constant(x))
        return array(y), array(d_x), [array(g) for g in d_weights]
    import jax
    import jax.numpy as jnp

    frozen = [v.value for v in layer.non_trainable_variables]

    def loss(inputs, trainable):
        y, _ = layer.stateless_call(trainable, frozen, inputs, training=True)
        return jnp.sum(y * upstream), y

    (_, y), (d_x, d_weights) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
        x, [v.value for v in layer.trainable_variables]
    )
    return array(y), array(d_x), [array(g) for g in d_weights]


# Traced with a run-time batch of one (fit's last batch); PyTorch runs fit eagerly, where a
# batch of one is refused (test_a_static_batch_of_one_value_per_channel_is_refused_in_training).
@pytest.mark.backends("tensorflow", "jax")
def test_a_traced_batch_of_one_outputs_beta_with_no_gradient_to_the_kernel_or_gamma():
    """m = 1 in a traced training step (fit's last batch of one, under TensorFlow its batch
    size unknown when traced): the folded BN outputs β and gives x, γ and the kernel no
    gradient, as keras_bn's layer does; inputs far from 1 make the rounding of
    z·σ/σ_B − γ·μ_B/σ_B (times 1/√ε) show otherwise."""
    layer = QuantizedHostBatchNorm(L.Dense(4), activation_bits=None)
    layer.build((None, 5))
    rng = np.random.default_rng(4)
    for weight in layer.trainable_weights:
        weight.assign(rng.normal(size=weight.shape).astype("float32"))
    names = [w.path.split("/")[-1] for w in layer.trainable_weights]
    x = (rng.normal(size=(1, 5)) * 1e4).astype("float32")
    beta = array(layer.trainable_weights[names.index("beta")])
    y, d_x, d_weights = _traced_gradients(layer, x, np.arange(1.0, 5.0, dtype="float32"))
    np.testing.assert_array_equal(y, beta[None])
    np.testing.assert_array_equal(d_x, 0.0)
    for name, gradient in zip(names, d_weights, strict=True):
        if name in ("kernel", "gamma"):
            np.testing.assert_array_equal(gradient, 0.0)
    np.testing.assert_array_equal(d_weights[names.index("beta")], np.arange(1.0, 5.0))


@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
@pytest.mark.parametrize("host_name", ["conv2d", "depthwise_m2_no_bias", "separable", "dense"])
def test_learned_ranges_forward_matches_numpy(host_name, per_channel, bits):
    """weight_range="learned" (the default below 4 bits): the kernel rounds on the grid of the
    learned range (per channel in the host kernel's units, times |s|; per tensor in W·s's),
    weights past it clipped to ±q_max, in inference and before the freeze. The ranges are set
    to 0.6 of max|w| so that some weights are clipped, after `reset_weight_ranges` put them
    where the rounding error is least (never above max|w|)."""
    layer, host, weights, x = _make(host_name, bits, per_channel, weight_range="learned")
    ranges = {}
    layer.reset_weight_ranges()
    for name, variable in layer.learned_ranges.items():
        view = keras.ops.convert_to_numpy(layer._range_view(name))
        top = np.abs(view).reshape(-1, view.shape[-1]).max(0) if per_channel else np.abs(view).max()
        assert (array(variable) <= top * (1 + 1e-6)).all()
        ranges[name] = (0.6 * top).astype("float32")
        variable.assign(ranges[name])
    assert set(ranges) == (
        {"kernel", "depthwise_kernel"} if host_name == "separable" else {"kernel"}
    )
    grid = layer.weight_grids()["kernel"]
    s = np.abs(weights["gamma"]) / np.sqrt(weights["variance"] + EPSILON)
    expected_scale = ranges["kernel"] * (s if per_channel else 1.0) / ref.q_max(bits)
    np.testing.assert_allclose(grid.scale, expected_scale, rtol=1e-6)
    for training in (False, True):  # inference first: training moves the statistics
        expected, _, _ = _reference(host, x, weights, bits, per_channel, training, ranges=ranges)
        assert_close(array(layer(x, training=training)), expected, 1e-5)


def test_learned_ranges_get_lsq_gradients_in_a_layer(framework):
    """The kernel range is a trainable weight, and its gradient is LSQ's (the numpy
    reference's) of the loss's gradient to the rounded kernel, times |s| (the per-channel
    range is r·|s|)."""
    layer, host, weights, x = _make("conv2d", 2, True, activation=None, weight_range="learned")
    (variable,) = layer.learned_ranges.values()
    assert any(w is variable for w in layer.trainable_weights)
    shape = tuple(layer(x, training=False).shape)
    weighting = np.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape).astype("float32")
    _, _, (to_range,) = framework.call_gradients(
        lambda x: layer(x, training=False), x, weighting, [variable]
    )
    s = np.abs(weights["gamma"] / np.sqrt(weights["variance"] + EPSILON))
    folded = ref.channels_last_view(weights["kernel"], "conv") * (s * np.sign(weights["gamma"]))
    m = np.abs(array(variable).astype(np.float64)) * s
    quantized = ref.fake_quant_weights(folded, 2, True, m / ref.q_max(2)).astype("float32")
    inputs = keras.ops.convert_to_tensor(x)
    (upstream,) = framework.gradients(
        lambda kernel: host.convolution_op(inputs, kernel), (quantized,), weighting, "float32"
    )
    upstream = upstream.astype(np.float64)
    _, expected = ref.lsq_gradients(folded, m, 2, upstream)
    np.testing.assert_allclose(to_range, expected * s, rtol=1e-3, atol=1e-5)

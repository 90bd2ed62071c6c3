"""keras_bn.BatchNormalization under PyTorch against torch's own: torch.nn.BatchNorm (which
keeps the same unbiased running variance, m/(m−1)·σ²_B) for the forward pass, the gradients
and the running statistics over several training steps, 16-bit policies and autocast against
autograd of a plain torch batch norm, torch.compile. The maths every backend shares (masks,
renorm, ghost batches, momentum=None, the backward against autodiff) is test_layer_maths.py's."""

import keras
import numpy as np
import pytest
import torch
from framework_references import array, for_backend, numpy_train, torch_train

import keras_bn
from helpers import random_affine_bn

# PyTorch's own BatchNorm, autocast and torch.compile: conftest.py skips this module, unimported,
# under the other backends. The maths every backend shares is test_layer_maths.py's.
pytestmark = pytest.mark.backends("torch")

EPS = 1e-3


def _data(shape, seed=1, loc=2.0, scale=3.0):
    return np.random.default_rng(seed).normal(loc, scale, shape).astype("float32")


def _close(actual, expected, tolerance):
    """Equal within `tolerance` of max(1, max |expected|), elementwise."""
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), expected, rtol=0, atol=tolerance * scale
    )


def _step(layer, x, cotangent, mask=None):
    """One training call: y and the gradients of Σ cotangent·y to (x, γ, β), from keras_bn's
    backward (torch autograd through the layer)."""
    return for_backend("torch").train_step(layer, x, cotangent, mask)


# torch.nn.BatchNorm's input is (N, C, *spatial); keras_bn sees it as it is with axis=1
# (channels_first), or with C moved last and Keras's default axis=-1 (channels_last). Odd
# sizes: a batch of 3, 5×7 maps.
TORCH_SHAPES = [(5, 4), (3, 6, 7), (3, 4, 5, 7), (2, 3, 4, 5, 3)]
TORCH_BN = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d}
TORCH_BN[5] = torch.nn.BatchNorm3d


def _to_keras(t, layout):
    """A torch-layout (N, C, ...) array in keras_bn's layout."""
    if layout == "channels_first" or t.ndim == 2:
        return t
    return np.moveaxis(t, 1, -1)


def _from_keras(t, layout):
    if layout == "channels_first" or t.ndim == 2:
        return t
    return np.moveaxis(t, -1, 1)


@pytest.mark.parametrize(
    ("shape", "layout"),
    [
        (shape, layout)
        for shape in TORCH_SHAPES
        for layout in ("channels_last", "channels_first")
        if len(shape) > 2 or layout == "channels_last"  # (N, C): both layouts are one
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v,
)
def test_training_steps_equal_torch_batch_norm(shape, layout):
    """Four SGD steps on γ and β: every step's output and gradients to x, γ and β, the running
    mean and (unbiased) variance after them, and inference, equal torch.nn.BatchNorm's within
    1e-5. Keras's momentum 0.9 is torch's 0.1 (the weight of the new batch)."""
    channels = shape[1]
    reference = TORCH_BN[len(shape)](channels, eps=EPS, momentum=0.1)
    keras_shape = _to_keras(np.empty(shape), layout).shape
    layer = random_affine_bn(
        keras_shape, axis=1 if layout == "channels_first" else -1, momentum=0.9
    )
    with torch.no_grad():
        reference.weight.copy_(layer.gamma.value)
        reference.bias.copy_(layer.beta.value)
    for step in range(4):
        x = _data(shape, seed=10 + step, loc=step - 1.0, scale=1.0 + step)
        cotangent = _data(shape, seed=20 + step, loc=0.0, scale=1.0)
        y, dx, dgamma, dbeta = _step(layer, _to_keras(x, layout), _to_keras(cotangent, layout))
        torch_x = torch.tensor(x, requires_grad=True)
        reference.zero_grad()
        torch_y = reference(torch_x)
        torch.sum(torch_y * torch.as_tensor(cotangent)).backward()
        _close(_from_keras(y, layout), array(torch_y), 1e-5)
        _close(_from_keras(dx, layout), array(torch_x.grad), 1e-5)
        _close(dgamma, array(reference.weight.grad), 1e-5)
        _close(dbeta, array(reference.bias.grad), 1e-5)
        with torch.no_grad():  # the same SGD step on both
            reference.weight -= 0.1 * reference.weight.grad
            reference.bias -= 0.1 * reference.bias.grad
        layer.gamma.assign(array(layer.gamma) - 0.1 * dgamma)
        layer.beta.assign(array(layer.beta) - 0.1 * dbeta)
        _close(array(layer.gamma), array(reference.weight), 1e-5)
        _close(array(layer.moving_mean), array(reference.running_mean), 1e-5)
        _close(array(layer.moving_variance), array(reference.running_var), 1e-5)
    x = _data(shape, seed=30)
    reference.eval()
    with torch.no_grad():
        expected = array(reference(torch.tensor(x)))
    _close(_from_keras(array(layer(_to_keras(x, layout), training=False)), layout), expected, 1e-5)


def test_keras_momentum_099_is_torch_momentum_001():
    """Keras weighs the old value (0.99), torch the new batch (0.01): the same averages."""
    shape = (6, 3, 4, 5)
    reference = torch.nn.BatchNorm2d(3, eps=EPS, momentum=0.01)
    layer = keras_bn.BatchNormalization(axis=1, momentum=0.99, epsilon=EPS)
    for step in range(5):
        x = _data(shape, seed=step, loc=3.0 * step, scale=2.0)
        layer(x, training=True)
        reference(torch.tensor(x))
    _close(array(layer.moving_mean), array(reference.running_mean), 1e-6)
    _close(array(layer.moving_variance), array(reference.running_var), 1e-6)
    assert not np.allclose(array(layer.moving_mean), 0.0)


@pytest.mark.parametrize(
    ("policy", "dtype", "tolerance"),
    [("mixed_float16", torch.float16, 2e-3), ("mixed_bfloat16", torch.bfloat16, 1.6e-2)],
)
def test_mixed_precision_keeps_float32_statistics_and_gradients(policy, dtype, tolerance):
    """A 16-bit policy: 16-bit in and out, float32 weights and statistics; the moving
    statistics are those of the 16-bit values computed in float64, the output and the gradient
    autograd's of the plain formula on those values in float32, rounded to 16 bits (to within
    one 16-bit rounding: `tolerance`)."""
    keras.mixed_precision.set_global_policy(policy)
    shape = (32, 3)
    layer = keras_bn.BatchNormalization()
    x = torch.tensor(_data(shape, 1, loc=100.0, scale=50.0)).to(dtype).requires_grad_()
    values = array(x.float())  # the 16-bit values, exactly
    cotangent = _data(shape, 2, loc=0.0, scale=1.0)
    y = layer(x, training=True)
    assert y.dtype == dtype
    assert all(v.dtype == "float32" for v in layer.weights)
    torch.sum(y.float() * torch.as_tensor(cotangent)).backward()
    _, mean, var, m = numpy_train(values, np.ones(3), np.zeros(3), [1], EPS)
    np.testing.assert_allclose(array(layer.moving_mean), 0.01 * mean, rtol=1e-6)
    np.testing.assert_allclose(
        array(layer.moving_variance), 0.99 + 0.01 * var * m / (m - 1), rtol=1e-6
    )
    x32 = torch.tensor(values, requires_grad=True)
    plain = torch_train(x32, torch.ones(3), torch.zeros(3), [1], EPS)
    torch.sum(plain * torch.as_tensor(cotangent)).backward()
    assert x.grad.dtype == dtype
    _close(array(x.grad.float()), array(x32.grad), tolerance)
    _close(array(y.float()), array(plain), tolerance)


def test_float16_under_autocast_gets_float32_statistics():
    """Inside torch.autocast (float16), a float16 tensor (what an autocast convolution hands
    on) into a float32-policy layer: autocast lowers none of the layer's ops, so its output and
    statistics are float32, those of the float16 values in float64."""
    x16 = _data((16, 4), 3, loc=-50.0, scale=20.0).astype("float16")
    layer = keras_bn.BatchNormalization(momentum=0.0)
    with torch.autocast("cpu", dtype=torch.float16):
        y = layer(torch.tensor(x16), training=True)
    assert y.dtype == torch.float32
    want, mean, var, m = numpy_train(x16, np.ones(4), np.zeros(4), [1], EPS)
    np.testing.assert_allclose(array(layer.moving_mean), mean, rtol=1e-6)
    np.testing.assert_allclose(array(layer.moving_variance), var * m / (m - 1), rtol=1e-5)
    _close(array(y), want, 1e-5)


def test_fit_whose_last_batch_holds_one_sample_raises():
    """PyTorch's `fit` runs eagerly: its last batch of one is a concrete batch of one, the
    same ValueError as a direct call (TensorFlow's and JAX's traced `fit` output β there)."""
    model = keras.Sequential(
        [keras.Input((4,)), keras_bn.BatchNormalization(), keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = _data((9, 4), 4), _data((9, 1), 5)
    with pytest.raises(ValueError, match="m=1"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    history = model.fit(x[:8], y[:8], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_a_batch_of_one_under_torch_compile_outputs_beta_as_a_traced_fit():
    """Under torch.compile (dynamo; the "eager" backend, no code generation) a batch of one is
    run-time data, as in JAX's traced `fit` and TensorFlow's: the output is β, the gradients
    to x and γ are 0 (β's is the upstream), and the statistics stay; a larger batch through
    the same compiled step normalizes and updates."""
    layer = random_affine_bn((None, 3))
    beta = array(layer.beta)
    step = torch.compile(lambda x: layer(x, training=True), backend="eager")
    x = torch.tensor(_data((1, 3), 2), requires_grad=True)
    y = step(x)
    np.testing.assert_array_equal(array(y), beta[None])
    torch.sum(y * 3.0).backward()
    np.testing.assert_array_equal(array(x.grad), 0.0)
    np.testing.assert_array_equal(array(layer.gamma.value.grad), 0.0)
    np.testing.assert_array_equal(array(layer.beta.value.grad), 3.0)
    np.testing.assert_array_equal(array(layer.moving_mean), 0.0)
    np.testing.assert_array_equal(array(layer.moving_variance), 1.0)
    batch = _data((6, 3), 3)
    want, mean, _, _ = numpy_train(batch, array(layer.gamma), beta, [1], EPS)
    _close(array(step(torch.tensor(batch))), want, 1e-5)
    np.testing.assert_allclose(array(layer.moving_mean), 0.1 * mean, rtol=1e-5)


def test_torch_batch_norm_refuses_a_static_batch_of_one_too():
    """keras_bn's ValueError (test_layer_maths.py) matches torch.nn.BatchNorm's in training."""
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        torch.nn.BatchNorm1d(3)(torch.ones(1, 3))


def test_torch_batch_norm_lets_a_non_finite_batch_into_its_running_variance():
    """What keras_bn's skip of a non-finite batch (test_layer_maths.py) avoids: torch's own
    BatchNorm lets the NaN into running_var for ever."""
    bad = _data((8, 3), 2)
    bad[3, 1] = np.nan
    poisoned = torch.nn.BatchNorm1d(3)
    poisoned(torch.tensor(bad))
    assert torch.isnan(poisoned.running_var[1])


def test_momentum_none_equals_torch_cumulative_average_of_the_finite_batches():
    """torch's momentum=None, whose cumulative average of the unbiased variances keras_bn's
    equals, except that the NaN batch is skipped and not counted (torch's would turn NaN); the
    counter is int64, as torch's num_batches_tracked."""
    shape = (6, 4)
    layer = keras_bn.BatchNormalization(momentum=None)
    reference = torch.nn.BatchNorm1d(4, momentum=None)
    batches = [_data(shape, seed, loc=seed, scale=seed) for seed in (1, 2, 3)]
    nan_batch = _data(shape, 9)
    nan_batch[0, 0] = np.nan
    for batch in (batches[0], nan_batch, batches[1], batches[2]):
        layer(batch, training=True)
    for batch in batches:
        reference(torch.tensor(batch))
    assert array(layer.num_batches_tracked).dtype == np.int64
    _close(array(layer.moving_variance), array(reference.running_var), 1e-6)


# torch.compile: (layer arguments, input shape, whether the call gets a mask). Each kind of
# call that used to break dynamo's graph: every layout, several channel axes, ghosts, renorm,
# the cumulative average, a mask.
COMPILE_CASES = {
    "dense": ({}, (8, 5), False),
    "channels_last": ({}, (4, 5, 6, 3), False),
    "channels_first": ({"axis": 1}, (4, 3, 5, 6), False),
    "middle_axis": ({"axis": 2}, (4, 6, 3), False),
    "two_axes": ({"axis": [1, 3]}, (4, 3, 5, 2), False),
    "ghosts": ({"virtual_batch_size": 2}, (8, 5), False),
    "renorm": ({"renorm": True}, (8, 5), False),
    "cumulative": ({"momentum": None}, (8, 5), False),
    "mask": ({}, (4, 6, 5), True),
}


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_torch_compile_traces_a_call_as_one_graph_that_matches_eager(case, training):
    """Under torch.compile a call is one graph, with no break (keras_bn made 9 in a training
    call: an import, a str method, a generator, its backward's Function having `jvp`, where
    Keras's BN makes 3), and, traced with its backward by AOTAutograd ("aot_eager": no code
    generation), computes what the eager call computes: the output, the gradients to x, γ and
    β, and the moving statistics, over two calls (the second with another batch)."""
    kwargs, shape, masked = COMPILE_CASES[case]
    batches = [_data(shape, seed) for seed in (1, 2)]
    mask = (np.arange(shape[1]) < shape[1] - 2)[None].repeat(shape[0], 0) if masked else None
    cotangent = torch.tensor(_data(shape, 3, loc=0.0, scale=1.0))

    def call(layer, x):
        y = layer(x, training=training, mask=None if mask is None else torch.tensor(mask))
        return y, torch.autograd.grad(
            torch.sum(y * cotangent), [x, layer.gamma.value, layer.beta.value]
        )

    explained = random_affine_bn(shape, **kwargs)
    x = torch.tensor(batches[0], requires_grad=True)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(lambda t: explained(t, training=training))(x)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), [
        str(reason.reason).splitlines()[0] for reason in explanation.break_reasons
    ]
    eager, compiled = random_affine_bn(shape, **kwargs), random_affine_bn(shape, **kwargs)
    step = torch.compile(call, backend="aot_eager")
    for batch in batches:
        want_y, want_grads = call(eager, torch.tensor(batch, requires_grad=True))
        got_y, got_grads = step(compiled, torch.tensor(batch, requires_grad=True))
        _close(array(got_y), array(want_y), 1e-6)
        for got, want in zip(got_grads, want_grads):
            _close(array(got), array(want), 1e-5)
        for name in ("moving_mean", "moving_variance"):
            np.testing.assert_allclose(
                array(getattr(compiled, name)), array(getattr(eager, name)), rtol=1e-6
            )


@pytest.mark.slow
def test_fit_with_jit_compile_trains_the_models_dynamo_crashed_on_as_eager_fit_does():
    """`fit(jit_compile=True)` (torch.compile, inductor) of Conv2D → BN → BN(axis=1) →
    BN(axis=2) → pooling → Dense → BN(virtual_batch_size=4), which raised TorchRuntimeError
    (a shape built from channel axes that dynamo had turned into symbols after a graph
    break), ends two epochs where eager `fit` does."""
    layers = keras.layers

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 8, 3))
        h = keras_bn.BatchNormalization()(layers.Conv2D(4, 3)(inputs))
        h = layers.Reshape((36, 4))(h)
        h = keras_bn.BatchNormalization(axis=2)(keras_bn.BatchNormalization(axis=1)(h))
        h = layers.Dense(5)(layers.GlobalAveragePooling1D()(h))
        return keras.Model(inputs, keras_bn.BatchNormalization(virtual_batch_size=4)(h))

    x, y = _data((32, 8, 8, 3), 1), _data((32, 5), 2, loc=0.0, scale=1.0)
    weights = []
    for jit_compile in (False, True):
        trained = model()
        trained.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=jit_compile)
        trained.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        weights.append(trained.get_weights())
    assert len(weights[0]) == len(weights[1]) == 20
    for got, want in zip(weights[1], weights[0]):
        _close(got, want, 1e-5)


def test_torch_compile_traces_a_qat_models_training_call_as_one_graph():
    """A QAT model (digits CNN, 8-bit) in training is one graph under torch.compile: no
    break in its layers (Keras's torch `ops.min` and `ops.max` broke it, and the host's kind
    checked again at every call)."""
    import digits
    from keras_bn.quantize import quantize_model

    model = digits.small_cnn()
    x = torch.tensor(digits.load()[0][:16])
    model(x)
    qat = quantize_model(model)
    qat(x, training=True)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(lambda t: qat(t, training=True))(x)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), [
        str(reason.reason).splitlines()[0] for reason in explanation.break_reasons
    ]


def _per_tensor_qat():
    """conv → BN → ReLU → Dense, QAT at 4 bits per tensor: the weight grid depends on the
    moving variance, and the ranges move in the step."""
    from keras_bn.quantize import quantize_model

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 2))
    h = keras_bn.BatchNormalization()(keras.layers.Conv2D(3, 3)(inputs))
    h = keras.layers.Flatten()(keras.layers.ReLU()(h))
    built = keras.Model(inputs, keras.layers.Dense(2)(h))
    built(np.zeros((1, 6, 6, 2), "float32"))
    return quantize_model(built, 4, 4, per_channel=False)


def test_a_compiled_qat_train_step_takes_the_gradients_and_statistics_of_an_eager_one():
    """A QAT model's train step under torch.compile (AOTAutograd: the backward traced too)
    gives eager's loss, gradients and variables at every step, before and after batch norm
    freezes, and on a smaller last batch (a recompile, with the batch size a symbol). Its
    backward once read the moving variance after the step's own update (the
    kernel's gradient 1% off at the first step, and the weights drifting from there)."""
    from keras_bn.quantize import freeze_batch_norm

    def step(qat, x, y):
        loss = torch.mean(torch.square(qat(x, training=True) - y))
        return loss, torch.autograd.grad(loss, [v.value for v in qat.trainable_variables])

    eager, compiled = _per_tensor_qat(), _per_tensor_qat()
    compiled_step = torch.compile(step, backend="aot_eager")
    for index in range(4):
        if index == 2:
            freeze_batch_norm(eager)
            freeze_batch_norm(compiled)
        size = 5 if index == 3 else 8
        x = torch.tensor(_data((size, 6, 6, 2), index))
        y = torch.tensor(_data((size, 2), 9 + index))
        results = [step(eager, x, y), compiled_step(compiled, x, y)]
        (want_loss, want_grads), (got_loss, got_grads) = results
        _close(array(got_loss), array(want_loss), 1e-6)
        for got, want in zip(got_grads, want_grads, strict=True):
            _close(array(got), array(want), 1e-6)
        with torch.no_grad():
            for qat, (_, grads) in zip((eager, compiled), results):
                for variable, grad in zip(qat.trainable_variables, grads):
                    variable.assign(variable.value - 0.05 * grad)
        for got, want in zip(compiled.variables, eager.variables, strict=True):
            _close(array(got), array(want), 1e-6)


def _renorm_layer():
    """BN(renorm=True) with renorm averages far from the batches' (so that their update, in
    the same call, moves r and d) and a fast renorm momentum."""
    layer = random_affine_bn((8, 3), renorm=True, renorm_momentum=0.5)
    layer.renorm_mean.assign(np.array([0.5, -0.3, 1.0], "float32"))
    layer.renorm_stddev.assign(np.array([0.8, 2.0, 1.3], "float32"))
    return layer


@pytest.mark.parametrize("case", ["renorm", "qat"])
def test_under_inductor_the_backward_reads_the_variables_the_forward_read(case):
    """torch.compile's default backend (inductor, what `fit(jit_compile=True)` uses): each
    step's loss, gradients and variables are eager's, from the same variables. Its
    partitioner recomputed in the backward a read of a variable that the step then assigned
    (renorm's averages, a moving statistic, a range), and read a copy through to the
    variable, so the backward saw the update: renorm's ∂x 3e-2 off, a QAT step's gradients
    2e-2 (pytorch/pytorch#197039). The variables are copied from the eager model before each
    step: a QAT model's weights a float rounding apart round apart, and two runs diverge."""
    if case == "renorm":
        eager, compiled = _renorm_layer(), _renorm_layer()
        shapes = [(8, 3)] * 3
    else:
        eager, compiled = _per_tensor_qat(), _per_tensor_qat()
        shapes = [(8, 6, 6, 2)] * 3

    def step(model, x, y):
        out = model(x, training=True)
        loss = torch.mean(torch.square(out - y))
        return loss, torch.autograd.grad(loss, [x] + [v.value for v in model.trainable_variables])

    torch._dynamo.reset()
    compiled_step = torch.compile(step)  # inductor
    for index, shape in enumerate(shapes):
        with torch.no_grad():
            for got, want in zip(compiled.variables, eager.variables, strict=True):
                got.assign(want.value)
        x = torch.tensor(_data(shape, index), requires_grad=True)
        y = torch.tensor(_data(eager.compute_output_shape(shape), 9 + index, 0.0, 1.0))
        (want_loss, want_grads), (got_loss, got_grads) = (
            step(eager, x, y),
            compiled_step(compiled, x, y),
        )
        _close(array(got_loss), array(want_loss), 1e-5)
        for got, want in zip(got_grads, want_grads, strict=True):
            _close(array(got), array(want), 1e-5)
        for got, want in zip(compiled.variables, eager.variables, strict=True):
            _close(array(got), array(want), 1e-5)


def test_torch_export_writes_no_keras_bn_op():
    """A `torch.export` of a model with keras_bn's BN holds only PyTorch's ops, so its saved
    program loads where keras_bn is not imported (the snapshot `read` takes under
    torch.compile made it need `keras_bn::snapshot`), and computes the model's inference."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), random_affine_bn((2, 3))])
    model.layers[-1].moving_mean.assign(np.array([0.5, -1.0, 2.0], "float32"))
    x = torch.tensor(_data((2, 4)))
    program = torch.export.export(model, (x,))
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert targets and not [t for t in targets if "keras_bn" in t], targets
    _close(array(program.module()(x)), array(model(x)), 1e-6)


def _inference_layer(mean, variance, gamma=2.0, shape=(2, 4, 3, 3)):
    """A channels_first layer (F.batch_norm's axis) with the given per-channel statistics."""
    layer = keras_bn.BatchNormalization(axis=1, epsilon=1e-3)
    layer.build(shape)
    channels = shape[1]
    layer.moving_mean.assign(np.full(channels, mean, "float32"))
    layer.moving_variance.assign(np.full(channels, variance, "float32"))
    layer.gamma.assign(np.full(channels, gamma, "float32"))
    return layer


def _inference_reference(layer, x):
    """Inference from the layer's float32 weights, in float64 numpy."""
    mean, variance, gamma, beta = (
        keras.ops.convert_to_numpy(v).astype(np.float64).reshape(1, -1, 1, 1)
        for v in (layer.moving_mean, layer.moving_variance, layer.gamma, layer.beta)
    )
    return (x.astype(np.float64) - mean) * gamma / np.sqrt(variance + layer.epsilon) + beta


def test_vmap_over_the_moving_statistics_gives_each_member_its_own_inference():
    """torch.func.vmap over stacked moving statistics (an ensemble of BN states through
    `stateless_call`): each member's output is its own inference. The fold's test of the
    statistics (a Python bool) raised under vmap ("data-dependent control flow")."""
    layer = _inference_layer(0.5, 2.0)
    x = torch.randn(2, 4, 3, 3)
    trainable = [v.value for v in layer.trainable_variables]
    fixed = [v.value.detach().clone() for v in layer.non_trainable_variables]

    def infer(*statistics):
        return layer.stateless_call(trainable, list(statistics), x, training=False)[0]

    scales = (1.0, 1.1, 3e3)  # the last member's mean is far from zero
    y = torch.func.vmap(infer)(*[torch.stack([s * f for f in scales]) for s in fixed])
    for member, scale in enumerate(scales):
        layer.moving_mean.assign(keras.ops.convert_to_numpy(fixed[0]) * scale)
        layer.moving_variance.assign(keras.ops.convert_to_numpy(fixed[1]) * scale)
        want = _inference_reference(layer, x.numpy())
        np.testing.assert_allclose(y[member].detach().numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mean", [0.5, 1e3], ids=["near", "far"])
def test_forward_mode_through_inference_is_the_derivative(mean):
    """torch.func.jvp and jacfwd through an inference call: the tangent is γ/√(v + ε) per
    element, on both sides of the fold's threshold. `addcmul(out=)` raised under them."""
    layer = _inference_layer(mean, 1.0)
    x = torch.full((2, 4, 3, 3), mean + 1.0)
    slope = 2.0 / np.sqrt(1.0 + 1e-3)
    _, tangent = torch.func.jvp(lambda t: layer(t, training=False), (x,), (torch.ones_like(x),))
    np.testing.assert_allclose(tangent.detach().numpy(), slope, rtol=1e-6)
    jacobian = torch.func.jacfwd(lambda t: layer(t, training=False))(x[:1, :, :1, :1])
    np.testing.assert_allclose(
        jacobian.reshape(4, 4).detach().numpy(), np.eye(4) * slope, rtol=1e-6, atol=1e-7
    )


def test_a_jit_traced_inference_reads_the_statistics_it_is_given():
    """torch.jit.trace with statistics near zero, then statistics at 1e4 and data at 1e4:
    the traced module computes x − mean first, as eager does (within 6·2⁻²⁴ of the output's
    scale). A traced choice of the fold would be 2e5·2⁻²⁴ off."""
    layer = _inference_layer(0.01, 1e-4, gamma=1.0)
    rng = np.random.default_rng(6)

    class Inference(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = layer

        def forward(self, t):
            return self.bn(t, training=False)

    near = torch.tensor(rng.normal(0.01, 1e-2, (2, 4, 3, 3)).astype("float32"))
    traced = torch.jit.trace(Inference(), (near,), check_trace=False)
    layer.moving_mean.assign(np.full(4, 1e4, "float32"))
    far = rng.normal(1e4, 1e-2, (2, 4, 3, 3)).astype("float32")
    want = _inference_reference(layer, far)
    scale = np.max(np.abs(want))
    error = np.max(np.abs(traced(torch.tensor(far)).detach().numpy() - want)) / scale
    assert error <= 6 * 2.0**-24, error

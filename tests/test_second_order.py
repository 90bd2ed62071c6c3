"""Second-order gradients through keras_bn.BatchNormalization's hand-written backward, under
every Keras backend, against the framework's own autodiff of a plain batch norm (the
`framework` fixture's `plain_bn`): a gradient penalty pen = ‖∂l/∂x‖² (WGAN-GP, R1) and its
gradients to x, γ and β; then each framework's own higher-order tools: PyTorch's
gradgradcheck, torch.func's grad, jvp and vmap; JAX's hessian and jvp of a grad; TensorFlow's
nested tapes in graph mode and under XLA, where its fused and XLA:CPU paths run.

Float64 under TensorFlow (the composite path) and PyTorch; float32 under JAX (no x64), and on
TensorFlow's float32-only paths, with `FLOAT32_TOLERANCE`.
"""

import numpy as np
import pytest
from framework_references import array

import keras_bn

EPS = 1e-3
# Three passes (forward, backward, the backward's backward), each rounding in float32 over sums
# of at most 60 terms here, with float32's unit roundoff 2⁻²⁴ ≈ 6e-8 and the per-channel 1/σ
# factors that the second pass multiplies: measured at most 7e-7 of the result's scale (JAX,
# TensorFlow's fused and XLA:CPU paths), so 100 units of float32's epsilon (1.2e-5) of that scale.
FLOAT32_TOLERANCE = 100 * float(np.finfo(np.float32).eps)
FLOAT64_TOLERANCE = 1e-9

# (input shape, axis, mask shape or None): rank 2 and 4, channels_last and channels_first, and a
# sequence mask over (batch, time).
CASES = [
    ((6, 3), -1, None),
    ((3, 4, 3, 5), -1, None),
    ((3, 4, 3, 5), 1, None),
    ((4, 5, 3), -1, (4, 5)),
]
CASE_IDS = ["rank2", "rank4", "channels_first", "masked"]


def _close(actual, expected, tolerance):
    """Equal within `tolerance` of max(1, max |expected|), elementwise."""
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), expected, rtol=0, atol=tolerance * scale
    )


def _case(shape, axis, mask_shape, dtype, seed=0):
    """A built layer with random γ, β, and (x, u, mask, weight): the input, the loss's
    coefficients, the boolean mask and its 0/1 weight for the reference (or None)."""
    rng = np.random.default_rng(seed)
    layer = keras_bn.BatchNormalization(axis=axis, epsilon=EPS, dtype=dtype)
    layer.build(shape)
    channels = shape[axis]
    layer.gamma.assign(rng.normal(1.0, 0.5, channels).astype(dtype))
    layer.beta.assign(rng.normal(0.0, 0.5, channels).astype(dtype))
    x = rng.normal(1.0, 2.0, shape).astype(dtype)
    u = rng.normal(size=shape).astype(dtype)
    mask = weight = None
    if mask_shape is not None:
        mask = rng.random(mask_shape) > 0.3
        mask[0] = True  # every channel keeps values
        weight = mask.astype(dtype).reshape(mask_shape + (1,) * (len(shape) - len(mask_shape)))
    return layer, x, u, mask, weight


def _penalty_gradients(name, fn, x, gamma, beta, u, power):
    """∂pen/∂(x, γ, β) as numpy arrays (zeros where the penalty does not reach), with
    pen = ‖∂l/∂x‖², l = Σ u·y^power, y = fn(x, γ, β), by framework `name`'s autodiff;
    γ and β as that framework differentiates them (torch: tensors that require grad;
    TensorFlow: variables; JAX: arrays)."""
    if name == "torch":
        import torch

        x = torch.as_tensor(x).detach().clone().requires_grad_()
        loss = torch.sum(torch.as_tensor(u) * fn(x, gamma, beta) ** power)
        (dx,) = torch.autograd.grad(loss, x, create_graph=True)
        penalty = torch.sum(dx**2)
        found = torch.autograd.grad(penalty, [x, gamma, beta], allow_unused=True)
        wrt = [x, gamma, beta]
    elif name == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                loss = tf.reduce_sum(tf.constant(u) * fn(x, gamma, beta) ** power)
            penalty = tf.reduce_sum(inner.gradient(loss, x) ** 2)
        wrt = [x, gamma, beta]
        found = outer.gradient(penalty, wrt)
    else:
        import jax
        import jax.numpy as jnp

        def loss(x, gamma, beta):
            return jnp.sum(u * fn(x, gamma, beta) ** power)

        def penalty(x, gamma, beta):
            return jnp.sum(jax.grad(loss)(x, gamma, beta) ** 2)

        wrt = [jnp.asarray(x), gamma, beta]
        # Under jit: eager JAX compiles each primitive for each new shape (seconds a case).
        found = jax.jit(jax.grad(penalty, (0, 1, 2)))(*wrt)
    return [np.zeros(array(w).shape) if g is None else array(g) for g, w in zip(found, wrt)]


def _layer_function(name, layer, mask):
    """(fn, γ, β): the layer's training call as fn(x, γ, β) and the γ, β to differentiate."""
    if name == "jax":
        fixed = [v.value for v in layer.non_trainable_variables]

        def call(x, gamma, beta):
            return layer.stateless_call([gamma, beta], fixed, x, training=True, mask=mask)[0]

        return call, layer.gamma.value, layer.beta.value

    def call(x, gamma, beta):
        del gamma, beta  # the layer's own variables, which these are
        return layer(x, training=True, mask=mask)

    return call, layer.gamma.value, layer.beta.value


def _reference_function(framework, layer, shape, axis, weight, dtype):
    """(fn, γ, β): the framework's plain batch norm with a copy of the layer's γ, β."""
    gamma, beta = (array(v) for v in (layer.gamma, layer.beta))
    if framework.name == "torch":
        gamma, beta = (framework.constant(v, dtype).requires_grad_() for v in (gamma, beta))
    elif framework.name == "tensorflow":
        import tensorflow as tf

        gamma, beta = tf.Variable(gamma), tf.Variable(beta)
    else:
        gamma, beta = framework.constant(gamma, dtype), framework.constant(beta, dtype)
    channel_axes = (axis % len(shape),)

    def plain(x, gamma, beta):
        return framework.plain_bn(x, gamma, beta, channel_axes, EPS, weight)

    return plain, gamma, beta


def _dtype(framework):
    """float64 where the framework has it by default (TensorFlow, PyTorch), else float32."""
    return "float32" if framework.name == "jax" else "float64"


def _tolerance(dtype):
    return FLOAT64_TOLERANCE if dtype == "float64" else FLOAT32_TOLERANCE


@pytest.mark.parametrize("power", [1, 2], ids=["linear_loss", "quadratic_loss"])
@pytest.mark.parametrize(("shape", "axis", "mask_shape"), CASES, ids=CASE_IDS)
def test_gradient_penalty_matches_autodiff_of_the_plain_formula(
    framework, shape, axis, mask_shape, power
):
    """∂pen/∂x, ∂pen/∂γ, ∂pen/∂β of pen = ‖∂l/∂x‖² through the layer's training call equal
    autodiff of the plain formula; with the linear loss l = Σu·y, ∂l/∂x depends on x and γ
    only through the backward itself (PyTorch raised there, "element 0 of tensors does not
    require grad", before the backward was made differentiable)."""
    dtype = _dtype(framework)
    layer, x, u, mask, weight = _case(shape, axis, mask_shape, dtype)
    fn, gamma, beta = _layer_function(framework.name, layer, mask)
    got = _penalty_gradients(framework.name, fn, x, gamma, beta, u, power)
    plain, gamma, beta = _reference_function(framework, layer, shape, axis, weight, dtype)
    expected = _penalty_gradients(framework.name, plain, x, gamma, beta, u, power)
    for name, g, e in zip(("x", "gamma", "beta"), got, expected):
        assert np.all(np.isfinite(g)), name
        _close(g, e, _tolerance(dtype))


# PyTorch: the Function's own checks, and torch.func.


def _torch_inputs(shape, axis, mask_shape, seed=0):
    """(x, γ, β, channel axes, mask) for the backend's batch_norm_train, float64 tensors."""
    import torch

    rng = np.random.default_rng(seed)
    channels = shape[axis]
    x, gamma, beta = (
        torch.tensor(rng.normal(loc, scale, size), dtype=torch.float64)
        for loc, scale, size in ((1.0, 2.0, shape), (1.0, 0.5, channels), (0.0, 0.5, channels))
    )
    ops = keras_bn.backend.get()
    channel_axes = (axis % len(shape),)
    mask = None
    if mask_shape is not None:
        keep = rng.random(mask_shape) > 0.3
        keep[0] = True
        mask = ops.expand_mask(torch.as_tensor(keep), x, channel_axes)
    return x, gamma, beta, channel_axes, mask


def _torch_train(channel_axes, mask):
    """y = keras_bn's train-mode BN of (x, γ, β), through the backend's batch_norm_train."""
    ops = keras_bn.backend.get()

    def train(x, gamma, beta):
        return ops.batch_norm_train(x, gamma, beta, channel_axes, EPS, mask=mask)[0]

    return train


def _torch_plain(channel_axes, mask):
    from framework_references import torch_train

    weight = None if mask is None else array(mask)
    return lambda x, gamma, beta: torch_train(x, gamma, beta, channel_axes, EPS, weight)


@pytest.mark.backends("torch")
@pytest.mark.parametrize(("shape", "axis", "mask_shape"), CASES, ids=CASE_IDS)
def test_torch_gradcheck_and_gradgradcheck(shape, axis, mask_shape):
    """torch.autograd's numerical checks of the backward and of its backward (float64)."""
    import torch

    x, gamma, beta, channel_axes, mask = _torch_inputs(shape, axis, mask_shape)
    train = _torch_train(channel_axes, mask)
    inputs = [t.requires_grad_() for t in (x, gamma, beta)]
    assert torch.autograd.gradcheck(train, inputs)
    assert torch.autograd.gradgradcheck(train, inputs)
    # Forward mode (the Function's jvp) too.
    assert torch.autograd.gradcheck(
        train, inputs, check_forward_ad=True, check_backward_ad=False, check_undefined_grad=False
    )


@pytest.mark.backends("torch")
@pytest.mark.parametrize(("shape", "axis", "mask_shape"), CASES, ids=CASE_IDS)
def test_torch_func_grad_jvp_and_hessian_vector_products(shape, axis, mask_shape):
    """torch.func.grad of a gradient penalty, torch.func.jvp of the output, and a
    Hessian-vector product (jvp of grad) equal torch.func's own on the plain formula."""
    import torch

    x, gamma, beta, channel_axes, mask = _torch_inputs(shape, axis, mask_shape)
    u = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    found = {}
    for name, fn in (
        ("keras_bn", _torch_train(channel_axes, mask)),
        ("plain", _torch_plain(channel_axes, mask)),
    ):

        def loss(x, gamma, beta, fn=fn):
            return torch.sum(u * fn(x, gamma, beta) ** 2)

        def penalty(x, gamma, beta, loss=loss):
            return torch.sum(torch.func.grad(loss)(x, gamma, beta) ** 2)

        _, y_t = torch.func.jvp(fn, (x, gamma, beta), (u, beta, gamma))
        _, hvp = torch.func.jvp(
            torch.func.grad(loss, argnums=(0, 1)), (x, gamma, beta), (u, beta, gamma)
        )
        found[name] = [*torch.func.grad(penalty, argnums=(0, 1, 2))(x, gamma, beta), y_t, *hvp]
    for got, expected in zip(found["keras_bn"], found["plain"]):
        _close(array(got), array(expected), FLOAT64_TOLERANCE)


@pytest.mark.backends("torch")
def test_a_gradient_penalty_through_torch_compile_is_refused_as_for_keras_bn():
    """torch.compile's AOTAutograd refuses a double backward through a compiled call, with a
    clear RuntimeError, for Keras's BatchNormalization as for keras_bn's: no second derivative
    comes out, so none comes out wrong. Eager, the same penalty's gradients equal Keras BN's."""
    import keras
    import torch

    shape = (8, 5)
    layers = {
        "keras_bn": keras_bn.BatchNormalization(epsilon=EPS),
        "keras": keras.layers.BatchNormalization(epsilon=EPS),
    }
    rng = np.random.default_rng(0)
    gamma, beta = rng.normal(1.0, 0.5, 5), rng.normal(0.0, 0.5, 5)
    for layer in layers.values():
        layer.build(shape)
        layer.gamma.assign(gamma)
        layer.beta.assign(beta)
    x0 = rng.normal(1.0, 2.0, shape).astype("float32")
    u = torch.tensor(rng.normal(size=shape).astype("float32"))

    def penalty_gradients(layer, call):
        x = torch.tensor(x0, requires_grad=True)
        (grad_x,) = torch.autograd.grad(torch.sum(call(x) * u), x, create_graph=True)
        return torch.autograd.grad(torch.sum(grad_x**2), [x, layer.gamma.value])

    eager = {
        name: penalty_gradients(layer, lambda t, layer=layer: layer(t, training=True))
        for name, layer in layers.items()
    }
    for got, want in zip(eager["keras_bn"], eager["keras"]):
        _close(array(got), array(want), FLOAT32_TOLERANCE)
    for layer in layers.values():
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda t, layer=layer: layer(t, training=True), backend="aot_eager"
        )
        with pytest.raises(RuntimeError, match="does not currently support double backward"):
            penalty_gradients(layer, compiled)


@pytest.mark.backends("torch")
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_torch_func_vmap_normalizes_each_slice_as_its_own_batch(masked):
    """torch.func.vmap over the layer's maths, and per-sample gradients (vmap of grad) and
    the gradient of a vmapped loss, equal a loop over the slices."""
    import torch

    stack, channel_axes = 3, (2,)
    generator = torch.Generator().manual_seed(0)
    xs = torch.randn((stack, 6, 2, 4), dtype=torch.float64, generator=generator) * 2 + 1
    gamma, beta = torch.randn((2, 4), dtype=torch.float64, generator=generator)
    masks = [None] * stack
    if masked:
        keep = torch.rand((stack, 6, 2), generator=generator) > 0.3
        keep[:, 0] = True
        masks = torch.stack(
            [keras_bn.backend.get().expand_mask(k, xs[0], channel_axes) for k in keep]
        )
    ops = keras_bn.backend.get()

    def train(x, mask, gamma, beta):
        return ops.batch_norm_train(x, gamma, beta, channel_axes, EPS, mask=mask)

    def loss(x, mask, gamma, beta):
        return torch.sum(train(x, mask, gamma, beta)[0] ** 3)

    dims = (0, 0 if masked else None, None, None)
    mapped = torch.func.vmap(train, in_dims=dims)(xs, None if not masked else masks, gamma, beta)
    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 2)), in_dims=dims)(
        xs, None if not masked else masks, gamma, beta
    )
    loops = [
        [
            *train(xs[i], masks[i], gamma, beta),
            *torch.func.grad(loss, argnums=(0, 2))(xs[i], masks[i], gamma, beta),
        ]
        for i in range(stack)
    ]
    for got, expected in zip([*mapped, *per_sample], zip(*loops)):
        _close(array(got), array(torch.stack(expected)), FLOAT64_TOLERANCE)


# JAX: hessian and forward over reverse, through the custom_vjp.


@pytest.mark.backends("jax")
@pytest.mark.parametrize(
    ("shape", "axis", "mask_shape"), CASES[2:], ids=CASE_IDS[2:]
)  # two: a jitted hessian compiles for seconds
def test_jax_hessian_and_jvp_of_grad(framework, shape, axis, mask_shape):
    """jax.hessian of l = Σu·y² in (x, γ), and jax.jvp of its jax.grad (a Hessian-vector
    product), through the layer's stateless call, equal JAX's on the plain formula (float32).
    jax.jvp of the layer itself is JAX's TypeError: a custom_vjp has no forward mode."""
    import jax
    import jax.numpy as jnp

    layer, x, u, mask, weight = _case(shape, axis, mask_shape, "float32")
    found = []
    for fn, gamma, beta in (
        _layer_function("jax", layer, mask),
        _reference_function(framework, layer, shape, axis, weight, "float32"),
    ):

        def loss(x, gamma, beta, fn=fn):
            return jnp.sum(u * fn(x, gamma, beta) ** 2)

        @jax.jit
        def second_order(x, gamma, beta, loss=loss):
            hessian = jax.hessian(loss, (0, 1))(x, gamma, beta)
            _, hvp = jax.jvp(jax.grad(loss, (0, 1)), (x, gamma, beta), (u, beta, gamma))
            return hessian, hvp

        found.append(jax.tree.leaves(second_order(jnp.asarray(x), gamma, beta)))
    for got, expected in zip(*found):
        _close(array(got), array(expected), FLOAT32_TOLERANCE)


# TensorFlow: nested tapes in a tf.function, where the fused and XLA:CPU paths run (float32).


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("jit_compile", [False, True], ids=["tf_function", "jit_compile"])
@pytest.mark.parametrize(("shape", "axis", "mask_shape"), CASES, ids=CASE_IDS)
def test_tensorflow_gradient_penalty_in_tf_function(
    framework, shape, axis, mask_shape, jit_compile
):
    """The gradient penalty's gradients computed inside tf.function (graph mode: the fused
    kernels where the layout allows) and tf.function(jit_compile=True) (the XLA:CPU path on a
    CPU), float32, against eager autodiff of the plain formula."""
    import tensorflow as tf

    layer, x, u, mask, weight = _case(shape, axis, mask_shape, "float32")
    fn, gamma, beta = _layer_function("tensorflow", layer, mask)
    step = tf.function(lambda x: _penalty_tensors(fn, x, gamma, beta, u), jit_compile=jit_compile)
    got = step(tf.constant(x))
    plain, gamma, beta = _reference_function(framework, layer, shape, axis, weight, "float32")
    expected = _penalty_gradients("tensorflow", plain, x, gamma, beta, u, 2)
    for g, e in zip(got, expected):
        _close(array(g), e, FLOAT32_TOLERANCE)


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("jit_compile", [False, True], ids=["tf_function", "jit_compile"])
@pytest.mark.parametrize(("shape", "axis", "mask_shape"), CASES[:3], ids=CASE_IDS[:3])
def test_tensorflow_gradient_penalty_through_inference_in_tf_function(
    shape, axis, mask_shape, jit_compile
):
    """The same through an inference call (moving statistics near zero, where the fused
    kernel runs alone, inside its tf.cond), with a penalty on ∂l/∂x and ∂l/∂γ and a
    persistent outer tape: FusedBatchNormGradV3's second derivatives through that cond came
    out wrong there in a tf.function (∂pen/∂x 47% off, ∂pen/∂γ and ∂pen/∂β all but 0)."""
    import tensorflow as tf

    del mask_shape
    layer, x, u, _, _ = _case(shape, axis, None, "float32")
    rng = np.random.default_rng(1)
    channels = shape[axis]
    mean = rng.uniform(-1.0, 1.0, channels).astype("float32")
    variance = rng.uniform(0.5, 2.0, channels).astype("float32")
    layer.moving_mean.assign(mean)
    layer.moving_variance.assign(variance)
    shape_b = [channels if i == axis % len(shape) else 1 for i in range(len(shape))]

    def penalty_gradients(fn, x, gamma, beta):
        with tf.GradientTape(persistent=True) as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                loss = tf.reduce_sum(tf.constant(u) * fn(x) ** 2)
            dx, dgamma = inner.gradient(loss, [x, gamma])
            penalty = tf.reduce_sum(dx**2) + tf.reduce_sum(dgamma**2)
        return outer.gradient(penalty, [x, gamma, beta])

    def infer(x):
        return layer(x, training=False)

    step = tf.function(
        lambda x: penalty_gradients(infer, x, layer.gamma, layer.beta), jit_compile=jit_compile
    )
    got = step(tf.constant(x))
    gamma, beta = tf.Variable(array(layer.gamma)), tf.Variable(array(layer.beta))

    def plain(x):
        a = tf.reshape(gamma, shape_b) * tf.math.rsqrt(tf.reshape(variance, shape_b) + EPS)
        return (x - tf.reshape(mean, shape_b)) * a + tf.reshape(beta, shape_b)

    expected = penalty_gradients(plain, tf.constant(x), gamma, beta)
    for g, e in zip(got, expected):
        _close(array(g), array(e), FLOAT32_TOLERANCE)


def _penalty_tensors(fn, x, gamma, beta, u):
    """TensorFlow's ∂pen/∂(x, γ, β) as tensors (for a tf.function), l = Σu·y²."""
    import tensorflow as tf

    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            loss = tf.reduce_sum(tf.constant(u) * fn(x, gamma, beta) ** 2)
        penalty = tf.reduce_sum(inner.gradient(loss, x) ** 2)
    return outer.gradient(penalty, [x, gamma, beta])

"""Property-based tests (hypothesis) of keras_bn.BatchNormalization over ranks 2–5, axis
choices (negative, list, channels_first), float16/bfloat16/float32/float64, center/scale,
masks and batch sizes from 2, and of the fold; under every backend, eagerly (the gradients by
the framework's own training step, against its autodiff of a plain BN), and under TensorFlow
also under XLA (jit_compile, where the path of backend/tensorflow/xla.py runs on CPU).

Profiles live in conftest.py ("ci" by default, "thorough"). Under TensorFlow every property
runs the profile's full count. Under JAX and PyTorch each runs a tenth of it (EXAMPLES: 70 in
"ci"; the fold a thirtieth, FOLD_EXAMPLES), for CI's time: there an example costs several
times TensorFlow's (JAX runs each op eagerly and compiles a new training step for each
layer; PyTorch's eager calls cost more per op), and the layer's maths these properties reach
is the backend-neutral code TensorFlow's run already sweeps, while each backend's own kernels
are swept by test_layer_maths.py and test_training_backends.py. Under JAX float64 is left out
of the dtypes: JAX computes in float32 unless x64 is switched on for the whole process."""

import framework_references
import keras
import numpy as np
import pytest
from framework_references import array
from hypothesis import given, settings
from hypothesis import strategies as st

import keras_bn
from helpers import BACKWARD_HOSTS, assert_close, fold_input, numpy_bn_train, randomise_batch_norms
from keras_bn.export import fold_batch_norms

BACKEND = keras.backend.backend()
# The framework's training step and its autodiff of a plain BN (the fixture's, at module level:
# hypothesis runs a test's examples in one call of it).
FRAMEWORK = framework_references.for_backend(BACKEND)

EPS = 1e-3
# Mixed policies for the 16-bit dtypes: the realistic use, float32 weights.
POLICY = {
    "float16": "mixed_float16",
    "bfloat16": "mixed_bfloat16",
    "float32": "float32",
    "float64": "float64",
}
if BACKEND == "jax":  # float32 unless x64 is on (module docstring)
    del POLICY["float64"]
if BACKEND == "tensorflow":
    from keras_bn.backend.tensorflow.xla import GROUPS as XLA_GROUPS
else:  # the strategy still reaches both kinds of batch (XLA's grouped sums split 4 evenly)
    XLA_GROUPS = 4
# The profile's count under TensorFlow, a tenth under JAX and PyTorch (module docstring).
EXAMPLES = settings().max_examples // (1 if BACKEND == "tensorflow" else 10)
# Scale-relative tolerances, from each dtype's resolution (outputs are rounded to it).
FORWARD_TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5, "float64": 1e-10}
GRADIENT_TOL = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-4, "float64": 1e-9}


@st.composite
def bn_cases(draw):
    rank = draw(st.integers(2, 5))
    # backend/tensorflow/xla.py splits batches of 4, 8 and 16 into its GROUPS evenly and pads
    # the others.
    batch = draw(st.sampled_from([2, 3, 4, 5, 8, 16]))
    shape = [batch] + [draw(st.integers(1, 4)) for _ in range(rank - 1)]
    kind = draw(st.sampled_from(["last", "negative", "channels_first", "list"]))
    if kind == "last":
        axis = rank - 1
    elif kind == "negative":
        axis = draw(st.integers(-(rank - 1), -1))
    elif kind == "channels_first":
        axis = 1
    else:
        axis = sorted(draw(st.sets(st.integers(1, rank - 1), min_size=1, max_size=rank - 1)))
    channel_axes = sorted(a % rank for a in ([axis] if isinstance(axis, int) else axis))
    if len(channel_axes) == rank - 1 and shape[0] < 2:
        shape[0] = 2
    # A mask read Keras's way (over the leading axes: m_c per channel where a channel axis is
    # not last), or over the non-channel axes (only where Keras's reading does not fit).
    mask_reading = draw(st.sampled_from([None, "leading", "channels"]))
    non_channel = [d for i, d in enumerate(shape) if i not in channel_axes]
    if mask_reading == "channels" and _fits_leading(non_channel, shape):
        mask_reading = "leading"
    return {
        "shape": tuple(shape),
        "axis": axis,
        "channel_axes": channel_axes,
        "dtype": draw(st.sampled_from(sorted(POLICY))),
        "center": draw(st.booleans()),
        "scale": draw(st.booleans()),
        "mask_reading": mask_reading,
        "seed": draw(st.integers(0, 2**31)),
        "momentum": draw(st.sampled_from([0.0, 0.5, 0.9])),
    }


def _fits_leading(mask_shape, shape):
    """Whether a mask of `mask_shape` fits Keras's reading for an input of `shape`: the
    leading axes, shape[:-1], each dimension that size or 1."""
    return len(mask_shape) == len(shape) - 1 and all(
        m in (s, 1) for m, s in zip(mask_shape, shape[:-1])
    )


def _mask(case, rng):
    """(mask, the mask expanded to the input's rank as the reading means it), or Nones."""
    shape, channel_axes = case["shape"], case["channel_axes"]
    if case["mask_reading"] == "channels":
        mask = rng.uniform(size=[d for i, d in enumerate(shape) if i not in channel_axes]) > 0.4
        mask.flat[:2] = True  # at least two values survive: m ≥ 2, the same in every channel
        expanded = mask
        for a in channel_axes:
            expanded = np.expand_dims(expanded, a)
        return mask, expanded
    if case["mask_reading"] == "leading":
        mask = rng.uniform(size=shape[:-1]) > 0.4
        mask[:2] = True  # two whole samples survive: m_c ≥ 2 in every channel
        return mask, mask[..., None]
    return None, None


def _cast(values, dtype):
    """numpy float64 `values` as a tensor of `dtype` (rounded once, from float64)."""
    if BACKEND == "jax" and dtype != "float32":  # JAX would round to float32 first
        import jax.numpy as jnp
        import ml_dtypes

        return jnp.asarray(np.asarray(values).astype(getattr(ml_dtypes, dtype, dtype)))
    return keras.ops.cast(keras.ops.convert_to_tensor(values, "float64"), dtype)


def _float64(t):
    """A tensor of any float dtype as numpy float64 (exactly)."""
    dtype = keras.backend.standardize_dtype(t.dtype)
    return array(keras.ops.cast(t, "float32") if dtype != "float64" else t).astype(np.float64)


def _setup(case):
    rng = np.random.default_rng(case["seed"])
    shape = case["shape"]
    x = _cast(rng.normal(rng.uniform(-3, 3), rng.uniform(0.5, 3), shape), case["dtype"])
    mask, case["expanded_mask"] = _mask(case, rng)
    layer = keras_bn.BatchNormalization(
        axis=case["axis"],
        momentum=case["momentum"],
        center=case["center"],
        scale=case["scale"],
        dtype=POLICY[case["dtype"]],
    )
    layer.build(shape)
    weights = [rng.uniform(0.5, 1.5, w.shape).astype(w.dtype) for w in layer.weights]
    layer.set_weights(weights)
    return layer, x, mask, rng


def _params(layer, channel_axes, shape):
    pshape = [shape[a] for a in channel_axes]
    gamma = array(layer.gamma).astype(np.float64) if layer.scale else np.ones(pshape)
    beta = array(layer.beta).astype(np.float64) if layer.center else np.zeros(pshape)
    return gamma, beta


def _runner(fn, jit):
    """`fn` itself (eager), or `fn` compiled with XLA (TensorFlow's jit_compile)."""
    if not jit:
        return fn
    import tensorflow as tf

    return tf.function(fn, jit_compile=True)


# Each XLA example compiles its own function, tens of times the cost of an eager example: a
# twentieth of the profile's examples (35 per property in "ci", 350 in "thorough").
XLA_EXAMPLES = max(settings().max_examples // 20, 10)


@settings(max_examples=EXAMPLES)
@given(bn_cases())
def test_forward_and_inference_match_numpy(case):
    _check_forward_and_inference(case, jit=False)


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
@settings(max_examples=XLA_EXAMPLES)
@given(bn_cases())
def test_forward_and_inference_match_numpy_under_xla(case):
    _check_forward_and_inference(case, jit=True)


def _check_forward_and_inference(case, jit):
    layer, x, mask, _ = _setup(case)
    x64 = _float64(x)
    gamma, beta = _params(layer, case["channel_axes"], case["shape"])
    expected, _, _ = numpy_bn_train(
        x64,
        gamma,
        beta,
        case["channel_axes"],
        EPS,
        case["expanded_mask"],
    )
    paths = []

    def train(x):
        if jit:
            from keras_bn.backend.tensorflow import ops

            paths.append(ops.train_path(x, case["channel_axes"], EPS, mask=mask))
        return layer(x, training=True, mask=mask)

    y = _runner(train, jit)(x)
    if jit:  # axis 0 is always reduced here, so only a mask keeps the composite path
        assert paths == ["composite" if mask is not None else "xla_cpu"]
    assert keras.backend.standardize_dtype(y.dtype) == case["dtype"]
    assert_close(_float64(y), expected, FORWARD_TOL[case["dtype"]])

    bshape = [
        case["shape"][i] if i in case["channel_axes"] else 1 for i in range(len(case["shape"]))
    ]
    mean, var = (
        array(v).astype(np.float64).reshape(bshape)
        for v in (layer.moving_mean, layer.moving_variance)
    )
    inference = gamma.reshape(bshape) * (x64 - mean) / np.sqrt(var + EPS) + beta.reshape(bshape)
    inferred = _runner(lambda x: layer(x, training=False), jit)(x)
    assert_close(_float64(inferred), inference, FORWARD_TOL[case["dtype"]])


@settings(max_examples=EXAMPLES)
@given(bn_cases())
def test_custom_gradient_matches_autodiff_of_reference(case):
    _check_gradients(case, jit=False)


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
@settings(max_examples=XLA_EXAMPLES)
@given(bn_cases())
def test_custom_gradient_matches_autodiff_of_reference_under_xla(case):
    _check_gradients(case, jit=True)


def _layer_gradients(layer, x, mask, upstream, jit):
    """(dl/dx, dl/dγ, dl/dβ) of l = Σ y·upstream, y the layer's training call: the framework's
    training step, or under TensorFlow's XLA (jit) a GradientTape in a jit-compiled function;
    None for a γ or β the layer does not have."""
    if not jit:
        _, dx, dgamma, dbeta = FRAMEWORK.train_step(layer, x, upstream, mask)
        return dx, dgamma, dbeta
    import tensorflow as tf

    def gradients(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=mask)
            loss = tf.reduce_sum(tf.cast(y, tf.float64) * upstream)
        present = [w for w in (layer.gamma, layer.beta) if w is not None]
        found = iter(tape.gradient(loss, [x, *present]))
        return [next(found)] + [
            None if w is None else next(found) for w in (layer.gamma, layer.beta)
        ]

    return [None if g is None else _float64(g) for g in _runner(gradients, jit)(x)]


def _check_gradients(case, jit):
    layer, x, mask, rng = _setup(case)
    upstream = rng.normal(size=case["shape"])
    gamma, beta = _params(layer, case["channel_axes"], case["shape"])
    dx_got, dgamma_got, dbeta_got = _layer_gradients(layer, x, mask, upstream, jit)

    x64 = _float64(x)
    dx, dgamma, dbeta = FRAMEWORK.plain_bn_gradients(
        x64, gamma, beta, case["channel_axes"], EPS, upstream, case["expanded_mask"]
    )
    tol = GRADIENT_TOL[case["dtype"]]
    # ∂l/∂x is a difference of terms of size γ·g/σ that can cancel almost exactly (at m = 2,
    # x̂ = ±1 whatever x is), so its error is measured against those terms, not its own size.
    full_mask = case["expanded_mask"]
    x_hat, _, batch_var = numpy_bn_train(
        x64,
        np.ones_like(gamma),
        np.zeros_like(beta),
        case["channel_axes"],
        EPS,
        full_mask,
    )
    g = np.abs(upstream)
    term = np.abs(gamma).max() / np.sqrt(batch_var.min() + EPS) * g.max()
    # Likewise ∂l/∂γ = Σg·x̂ and ∂l/∂β = Σg against Σ|g|·(1 + |x̂|): the upstream g reaches the
    # layer rounded to its dtype.
    reduced = tuple(i for i in range(g.ndim) if i not in case["channel_axes"])
    sum_term = (g * (1 + np.abs(x_hat))).sum(axis=reduced).max()
    np.testing.assert_allclose(dx_got.astype(np.float64), dx, rtol=tol, atol=tol * term)
    got = ([dgamma_got] if layer.scale else []) + ([dbeta_got] if layer.center else [])
    want = ([dgamma] if layer.scale else []) + ([dbeta] if layer.center else [])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=tol, atol=tol * sum_term)


@settings(max_examples=EXAMPLES)
@given(bn_cases())
def test_moving_statistics_follow_unbiased_recurrence(case):
    _check_moving_statistics(case, jit=False)


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
@settings(max_examples=XLA_EXAMPLES)
@given(bn_cases())
def test_moving_statistics_follow_unbiased_recurrence_under_xla(case):
    _check_moving_statistics(case, jit=True)


def _check_moving_statistics(case, jit):
    layer, x, mask, rng = _setup(case)
    train = _runner(lambda x: layer(x, training=True, mask=mask), jit)
    mean = array(layer.moving_mean).astype(np.float64)
    var = array(layer.moving_variance).astype(np.float64)
    momentum = case["momentum"]
    full_mask = case["expanded_mask"]
    reduced = tuple(i for i in range(len(case["shape"])) if i not in case["channel_axes"])
    # m_c per channel (a mask over a channel axis gives each channel its own count).
    m = np.ones(case["shape"]) if full_mask is None else np.broadcast_to(full_mask, case["shape"])
    m = m.sum(axis=reduced).reshape(mean.shape)
    for step in range(2):
        batch = x if step == 0 else _cast(rng.normal(1.0, 2.0, case["shape"]), case["dtype"])
        train(batch)
        x64 = _float64(batch)
        _, batch_mean, batch_var = numpy_bn_train(
            x64, np.ones_like(mean), np.zeros_like(mean), case["channel_axes"], EPS, full_mask
        )
        mean = momentum * mean + (1 - momentum) * batch_mean
        var = momentum * var + (1 - momentum) * batch_var * m / (m - 1)
    # Statistics are float32 for every policy here except float64.
    tol = (
        1e-10
        if case["dtype"] == "float64"
        else {"float16": 2e-3, "bfloat16": 2e-2}.get(case["dtype"], 1e-5)
    )
    assert_close(layer.moving_mean, mean, tol)
    assert_close(layer.moving_variance, var, tol)


def test_strategy_covers_the_space():
    """The generator reaches every kind of case (hypothesis would silently narrow if not)."""
    seen = {"dtype": set(), "rank": set(), "kind": set(), "masked": set(), "grouped": set()}
    counts = set()  # whether a case's per-channel counts differ

    @given(bn_cases())
    def collect(case):
        seen["dtype"].add(case["dtype"])
        seen["rank"].add(len(case["shape"]))
        seen["kind"].add(type(case["axis"]).__name__ + str(case["axis"] == 1))
        seen["masked"].add(case["mask_reading"])
        if case["mask_reading"] == "leading" and case["channel_axes"] != [len(case["shape"]) - 1]:
            counts.add(True)
        seen["grouped"].add(case["shape"][0] % XLA_GROUPS == 0)

    collect()
    assert seen["dtype"] == set(POLICY)
    assert seen["rank"] == {2, 3, 4, 5}
    assert {"listFalse", "intTrue", "intFalse"} <= seen["kind"]
    assert seen["masked"] == {None, "leading", "channels"}
    assert counts == {True}  # some masks reach per-channel counts
    assert seen["grouped"] == {True, False}  # XLA's grouped sums, split evenly and padded
    keras.mixed_precision.set_global_policy("float32")


# --------------------------------------------------------------------------- folding

# Folding clones a Keras model per example, several times the cost of the cases above: a third
# of the profile's examples under TensorFlow (233 in "ci", 2,333 in "thorough"), a tenth of
# that under JAX and PyTorch (module docstring).
FOLD_EXAMPLES = max(EXAMPLES // 3, 10)


@settings(max_examples=FOLD_EXAMPLES)
@given(
    host=st.sampled_from(sorted(BACKWARD_HOSTS)),
    data_format=st.sampled_from(["channels_last", "channels_first"]),
    use_bias=st.booleans(),
    norm=st.sampled_from([keras_bn.BatchNormalization, keras.layers.BatchNormalization]),
    epsilon=st.sampled_from([1e-5, 1e-3, 0.1]),
    seed=st.integers(0, 2**31),
)
def test_folding_any_host_matches_unfolded_inference(
    host, data_format, use_bias, norm, epsilon, seed
):
    make, rank, _ = BACKWARD_HOSTS[host]
    data_format = "channels_last" if host == "Dense" else data_format
    rng = np.random.default_rng(seed)
    x = (fold_input(rank, 4, data_format, rng) if rank else rng.normal(size=(3, 4))).astype(
        "float32"
    )
    layer = make(data_format, use_bias)
    axis = 1 if data_format == "channels_first" and rank else -1
    model = keras.Sequential([keras.Input(x.shape[1:]), layer, norm(axis=axis, epsilon=epsilon)])
    layer.set_weights([rng.normal(size=w.shape).astype("float32") for w in layer.get_weights()])
    randomise_batch_norms(model, seed=seed % 1000)
    folded, report = fold_batch_norms(model, probe=x)
    assert [f.bn for f in report.folded] == [model.layers[1].name] and not report.kept
    assert not any(
        isinstance(layer, (keras_bn.BatchNormalization, keras.layers.BatchNormalization))
        for layer in folded.layers
    )
    assert_close(folded(x), model(x, training=False), 1e-5)

"""keras_bn.export.fold: each fold function against running the host layer, then BN, in numpy;
and fold_batch_norms over every host kind, data format and input size.

The reference is the real Keras host layer followed by inference BN written out in float64
numpy; the folded weights are loaded into a fresh copy of the host (with a bias) and run on the
same random data. Under every backend.
"""

import keras
import numpy as np
import pytest
from framework_references import array
from hypothesis import given, settings
from hypothesis import strategies as st

import keras_bn
from helpers import BACKWARD_HOSTS, assert_close, fold_input
from keras_bn.export import fold, fold_batch_norms

L = keras.layers
RTOL = 1e-5


def _bn_params(rng, channels):
    gamma = rng.normal(size=channels)
    beta = rng.normal(size=channels)
    mean = rng.normal(size=channels)
    var = rng.uniform(0.2, 3.0, size=channels)
    eps = 1e-3
    scale = gamma / np.sqrt(var + eps)
    return (gamma, beta, mean, var, eps), scale, beta - scale * mean


def _bn_numpy(x, params, axis):
    """Inference BN, written out independently of the backend, in float64."""
    gamma, beta, mean, var, eps = params
    shape = [1] * x.ndim
    shape[axis] = -1
    r = lambda v: v.reshape(shape)  # noqa: E731
    return (np.asarray(x, np.float64) - r(mean)) / np.sqrt(r(var) + eps) * r(gamma) + r(beta)


def _randomise(layer, rng):
    layer.set_weights([rng.normal(size=w.shape).astype("float32") for w in layer.get_weights()])


def _with_bias(layer, x):
    """A fresh copy of `layer` with use_bias=True, built on x."""
    copy = layer.__class__.from_config({**layer.get_config(), "use_bias": True})
    copy(x)
    return copy


def _built_host(make, rank, data_format, use_bias, rng):
    """(host layer with random weights, its random input x, its channel axis)."""
    host = make(data_format, use_bias)
    x = fold_input(rank, 4, data_format, rng)
    host(x)
    _randomise(host, rng)
    return host, x, _channel_axis(host)


def _channel_axis(layer):
    return 1 if getattr(layer, "data_format", "channels_last") == "channels_first" else -1


BIAS = [True, False]


def _cases(hosts):
    """(kind, data_format) for every host; Dense has no data format, so it runs once."""
    return [
        (kind, data_format)
        for kind in sorted(hosts)
        for data_format in (
            ["channels_last"] if kind == "Dense" else ["channels_last", "channels_first"]
        )
    ]


@pytest.mark.slow
@pytest.mark.parametrize("use_bias", BIAS)
@pytest.mark.parametrize("kind, data_format", _cases(BACKWARD_HOSTS))
def test_backward_fold_matches_host_then_bn(kind, data_format, use_bias):
    make, rank, fold_fn = BACKWARD_HOSTS[kind]
    rng = np.random.default_rng(0)
    host, x, axis = _built_host(make, rank, data_format, use_bias, rng)
    h = array(host(x))
    params, scale, shift = _bn_params(rng, h.shape[axis])
    expected = _bn_numpy(h, params, axis)

    weights = host.get_weights()
    bias = weights[-1] if use_bias else None
    folded = _with_bias(host, x)
    if fold_fn is fold.fold_separable:
        pointwise, new_bias = fold_fn(weights[1], bias, scale, shift)
        folded.set_weights([weights[0], pointwise, new_bias])
    else:
        kernel, new_bias = fold_fn(weights[0], bias, scale, shift)
        folded.set_weights([kernel, new_bias])
    assert_close(folded(x), expected, RTOL)


FORWARD_HOSTS = {
    "Dense": (lambda df, b: L.Dense(6, use_bias=b), 0, 1),
    "Conv1D": (lambda df, b: L.Conv1D(6, 3, data_format=df, use_bias=b), 1, 1),
    "Conv1D_groups": (lambda df, b: L.Conv1D(6, 3, groups=2, data_format=df, use_bias=b), 1, 2),
    "Conv2D": (lambda df, b: L.Conv2D(6, 3, strides=2, data_format=df, use_bias=b), 2, 1),
    "Conv2D_groups": (
        lambda df, b: L.Conv2D(6, (2, 3), groups=2, data_format=df, use_bias=b),
        2,
        2,
    ),
    "Conv3D": (lambda df, b: L.Conv3D(6, 2, data_format=df, use_bias=b), 3, 1),
    "Conv3D_groups": (lambda df, b: L.Conv3D(6, 2, groups=2, data_format=df, use_bias=b), 3, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("use_bias", BIAS)
@pytest.mark.parametrize("kind, data_format", _cases(FORWARD_HOSTS))
def test_forward_fold_matches_bn_then_host(kind, data_format, use_bias):
    make, rank, groups = FORWARD_HOSTS[kind]
    rng = np.random.default_rng(1)
    host, x, axis = _built_host(make, rank, data_format, use_bias, rng)
    params, scale, shift = _bn_params(rng, x.shape[axis])
    expected = host(_bn_numpy(x, params, axis).astype("float32"))

    weights = host.get_weights()
    kernel, new_bias = fold.fold_forward(
        weights[0], weights[1] if use_bias else None, scale, shift, groups=groups
    )
    folded = _with_bias(host, x)
    folded.set_weights([kernel, new_bias])
    assert_close(folded(x), expected, RTOL)


def test_depthwise_uses_every_scale_of_a_multiplier():
    """With M > 1, channel c·M + m gets scale[c·M + m], not scale[c] (STM's fold-script bug)."""
    kernel = np.ones((1, 1, 2, 3), "float32")
    scale = np.arange(1.0, 7.0)
    new_kernel, new_bias = fold.fold_depthwise(kernel, None, scale, np.arange(6.0))
    np.testing.assert_array_equal(new_kernel[0, 0], [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(new_bias, np.arange(6.0))


def test_bias_free_host_gains_the_bn_shift_as_bias():
    kernel, bias = fold.fold_dense(np.eye(2, dtype="float32"), None, [2.0, 3.0], [0.5, -1.0])
    np.testing.assert_array_equal(kernel, [[2, 0], [0, 3]])
    np.testing.assert_array_equal(bias, [0.5, -1.0])
    assert kernel.dtype == bias.dtype == np.float32


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: fold.fold_dense(np.ones((3, 4)), None, np.ones(5), np.ones(5)),
            "has shape (5,), but the host has 4 channels",
        ),
        (
            lambda: fold.fold_conv(np.ones((3, 3, 2, 4)), np.ones(3), np.ones(4), np.ones(4)),
            "The bias has shape (3,)",
        ),
        (
            lambda: fold.fold_dense(np.ones((3, 2)), None, [1.0, np.nan], [0.0, 0.0]),
            "scale is not finite",
        ),
        (
            lambda: fold.fold_forward(np.ones((3, 3, 2, 5)), None, np.ones(4), np.ones(4), 2),
            "groups=2 does not divide the kernel's 5 output channels",
        ),
        (
            lambda: fold.fold_forward(np.ones((3, 3, 2, 4)), None, np.ones(2), np.ones(2), 2),
            "has shape (2,), but the host has 4 channels on its input axis",
        ),
    ],
)
def test_bad_shapes_and_values_raise_naming_them(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


# --------------------------------------------------------------------------- every input size

# (rank, make(filters, data_format, use_bias), output channels for `filters` and 2 inputs).
# padding="same", stride 1: every output has the input's spatial size, which the test picks.


def _same_size(layer_class, depthwise=False):
    """make(filters, data_format, use_bias) for a kernel-2 host of `layer_class`; for a
    depthwise one, `filters` is the depth multiplier."""
    if depthwise:
        return lambda c, df, b: layer_class(
            2, depth_multiplier=c, padding="same", data_format=df, use_bias=b
        )
    return lambda c, df, b: layer_class(c, 2, padding="same", data_format=df, use_bias=b)


SIZED_HOSTS = {
    "Dense": (1, lambda c, df, b: L.Dense(c, use_bias=b), lambda c: c),
    **{
        f"{kind}{rank}D": (rank, _same_size(getattr(L, f"{kind}{rank}D")), lambda c: c)
        for kind, rank in [
            ("Conv", 1),
            ("Conv", 2),
            ("Conv", 3),
            ("SeparableConv", 1),
            ("SeparableConv", 2),
        ]
    },
    **{
        f"DepthwiseConv{rank}D": (
            rank,
            _same_size(getattr(L, f"DepthwiseConv{rank}D"), depthwise=True),
            lambda c: 2 * c,
        )
        for rank in (1, 2)
    },
    **{
        f"Conv{rank}DTranspose": (
            rank,
            _same_size(getattr(L, f"Conv{rank}DTranspose")),
            lambda c: c,
        )
        for rank in (1, 2, 3)
    },
}
IN_CHANNELS = 2


@st.composite
def sized_cases(draw):
    kind = draw(st.sampled_from(sorted(SIZED_HOSTS)))
    rank, _, out_channels = SIZED_HOSTS[kind]
    data_format = (
        "channels_last"
        if kind == "Dense"
        else draw(st.sampled_from(["channels_last", "channels_first"]))
    )
    filters = draw(st.integers(1, 4))
    spatial = draw(st.lists(st.integers(1, 7), min_size=rank, max_size=rank))
    if draw(st.booleans()):  # the size Keras's bias guess gets wrong: last dim == channels
        spatial[-1] = out_channels(filters)
    return dict(
        kind=kind,
        data_format=data_format,
        filters=filters,
        spatial=spatial,
        use_bias=draw(st.booleans()),
        dynamic=draw(st.booleans()),
        norm=draw(st.sampled_from([keras_bn.BatchNormalization, keras.layers.BatchNormalization])),
        seed=draw(st.integers(0, 2**31)),
    )


def _channels_last_twin(host, x_last):
    """The host as channels_last with the same weights (Keras kernels do not depend on the
    data format): an independent computation of the same map, with its bias on the last axis,
    where Keras's guess is right."""
    if getattr(host, "data_format", "channels_last") == "channels_last":
        return host
    twin = type(host).from_config(
        {**host.get_config(), "data_format": "channels_last", "name": host.name + "_twin"}
    )
    twin(x_last)
    twin.set_weights(host.get_weights())
    return twin


@settings(max_examples=max(settings().max_examples // 14, 20))
@given(sized_cases())
def test_fold_batch_norms_is_exact_at_every_input_size(case):
    """Folded host then BN against the channels_last twin then BN in numpy: every host kind,
    both data formats, static or dynamic (None) spatial dims, at every size, including the
    last spatial dim equal to the channel count (where Keras misplaces a channels_first
    bias: a folded host that gained a bias was off by up to 85%)."""
    rank, make, _ = SIZED_HOSTS[case["kind"]]
    first = case["data_format"] == "channels_first"
    rng = np.random.default_rng(case["seed"])
    shape = [IN_CHANNELS, *case["spatial"]] if first else [*case["spatial"], IN_CHANNELS]
    x = rng.normal(size=(3, *shape)).astype("float32")
    input_shape = [
        None if case["dynamic"] and i != (0 if first else rank) else d for i, d in enumerate(shape)
    ]
    host = make(case["filters"], case["data_format"], case["use_bias"])
    bn = case["norm"](axis=1 if first else -1, epsilon=0.01)
    model = keras.Sequential([keras.Input(input_shape), host, bn])
    host.set_weights([rng.normal(size=w.shape).astype("float32") for w in host.get_weights()])
    gamma, beta, mean = (rng.normal(size=bn.moving_mean.shape) for _ in range(3))
    variance = rng.uniform(0.2, 3.0, size=bn.moving_mean.shape)
    bn.set_weights([gamma, beta, mean, variance])

    folded, report = fold_batch_norms(model)  # default probe: 8 for every free dim
    assert len(report.folded) == 1 and not report.kept
    to_last = (0, *range(2, rank + 2), 1) if first else tuple(range(rank + 2))
    to_first = (0, rank + 1, *range(1, rank + 1)) if first else tuple(range(rank + 2))
    x_last = np.transpose(x, to_last)
    h = np.transpose(array(_channels_last_twin(host, x_last)(x_last)), to_first)
    expected = _bn_numpy(h, (gamma, beta, mean, variance, 0.01), 1 if first else -1)
    assert_close(folded(x), expected, 1e-5)

"""The TensorFlow backend's ops and statistics against independent references: numpy formulas, TF
autodiff of a plain reference written here, and finite differences."""

import numpy as np
import pytest
import tensorflow as tf

from helpers import assert_close, broadcast_shape, numpy_bn_train
from keras_bn.backend.tensorflow import ops, statistics
from tf_helpers import tf_reference_bn

pytestmark = pytest.mark.backends("tensorflow")

EPS = 1e-3

# (input shape, channel axes): 2D, NHWC, NCHW, a 3D sequence, a list axis, a 5D volume.
LAYOUTS = {
    "2d": ((12, 5), [1]),
    "nhwc": ((4, 3, 3, 5), [3]),
    "nchw": ((4, 5, 3, 3), [1]),
    "sequence": ((4, 6, 5), [2]),
    "list_axis": ((4, 3, 2, 5), [1, 3]),
    "5d": ((3, 2, 2, 2, 4), [4]),
}


def _inputs(shape, channel_axes, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.5, 2.0, size=shape).astype(dtype)
    pshape = [shape[a] for a in channel_axes]
    gamma = rng.uniform(0.5, 2.0, size=pshape).astype(dtype)
    beta = rng.normal(size=pshape).astype(dtype)
    return x, gamma, beta


def _random_mask(shape, channel_axes, seed=1, reading="channels"):
    """A 0/1 mask in expand_mask's broadcastable form: over the non-channel axes ("channels",
    the same count m in every channel), or Keras's reading, over the leading axes
    ("leading": where a channel axis is not last, each channel has its own count m_c)."""
    rng = np.random.default_rng(seed)
    if reading == "channels":
        mask = rng.uniform(size=_bshape_inverse(shape, channel_axes)) > 0.3
        mask.flat[:2] = True  # at least two elements survive
    else:
        mask = rng.uniform(size=tuple(shape[:-1]) + (1,)) > 0.5
        mask[:2] = True  # the first two samples are kept: m_c ≥ 2 in every channel
    return mask


def _bshape_inverse(shape, channel_axes):
    return [1 if i in channel_axes else shape[i] for i in range(len(shape))]


def _custom_grads(x, gamma, beta, channel_axes, upstream, mask=None):
    x, gamma, beta = map(tf.constant, (x, gamma, beta))
    with tf.GradientTape() as tape:
        tape.watch([x, gamma, beta])
        y, _, _ = ops.batch_norm_train(x, gamma, beta, channel_axes, EPS, mask)
        loss = tf.reduce_sum(y * upstream)
    return tape.gradient(loss, [x, gamma, beta])


def _autodiff_grads(x, gamma, beta, channel_axes, upstream, mask=None):
    x, gamma, beta = map(tf.constant, (x, gamma, beta))
    with tf.GradientTape() as tape:
        tape.watch([x, gamma, beta])
        loss = tf.reduce_sum(tf_reference_bn(x, gamma, beta, channel_axes, mask=mask) * upstream)
    return tape.gradient(loss, [x, gamma, beta])


MASKS = [None, "channels", "leading"]
MASK_IDS = ["nomask", "mask", "leading_mask"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("masked", MASKS, ids=MASK_IDS)
def test_forward_matches_numpy(layout, masked):
    shape, axes = LAYOUTS[layout]
    x, gamma, beta = _inputs(shape, axes)
    mask = _random_mask(shape, axes, reading=masked) if masked else None
    y, mean, var = ops.batch_norm_train(
        tf.constant(x),
        tf.constant(gamma),
        tf.constant(beta),
        axes,
        EPS,
        None if mask is None else tf.constant(mask, tf.float64),
    )
    y_ref, mean_ref, var_ref = numpy_bn_train(x, gamma, beta, axes, mask=mask)
    assert_close(y, y_ref, 1e-12)
    assert_close(mean, mean_ref, 1e-12)
    assert_close(var, var_ref, 1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("masked", MASKS, ids=MASK_IDS)
def test_custom_gradient_matches_autodiff(layout, masked):
    shape, axes = LAYOUTS[layout]
    x, gamma, beta = _inputs(shape, axes)
    upstream = np.random.default_rng(2).normal(size=shape)
    mask = _random_mask(shape, axes, reading=masked) if masked else None
    tf_mask = None if mask is None else tf.constant(mask, tf.float64)
    got = _custom_grads(x, gamma, beta, axes, upstream, tf_mask)
    want = _autodiff_grads(x, gamma, beta, axes, upstream, mask)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("masked", MASKS, ids=MASK_IDS)
def test_custom_gradient_matches_finite_differences(layout, masked):
    shape, axes = LAYOUTS[layout]
    x, gamma, beta = _inputs(shape, axes)
    mask = (
        None
        if masked is None
        else tf.constant(_random_mask(shape, axes, reading=masked), tf.float64)
    )

    def f(x, gamma, beta):
        return ops.batch_norm_train(x, gamma, beta, axes, EPS, mask)[0]

    theoretical, numerical = tf.test.compute_gradient(
        f, [tf.constant(x), tf.constant(gamma), tf.constant(beta)], delta=1e-6
    )
    for t, n in zip(theoretical, numerical):
        assert_close(t, n, 1e-5)


def test_statistics_carry_no_gradient():
    x, gamma, beta = map(tf.constant, _inputs((6, 4), [1]))
    with tf.GradientTape() as tape:
        tape.watch(x)
        _, mean, var = ops.batch_norm_train(x, gamma, beta, [1], EPS)
        loss = tf.reduce_sum(mean) + tf.reduce_sum(var)
    assert tape.gradient(loss, x) is None


def test_gradient_under_xla_matches_eager():
    shape, axes = LAYOUTS["nhwc"]
    x, gamma, beta = map(tf.constant, _inputs(shape, axes, np.float32))
    upstream = tf.constant(np.random.default_rng(3).normal(size=shape).astype(np.float32))

    def grads(x, gamma, beta):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            y, _, _ = ops.batch_norm_train(x, gamma, beta, axes, EPS)
            loss = tf.reduce_sum(y * upstream)
        return tape.gradient(loss, [x, gamma, beta])

    eager = grads(x, gamma, beta)
    compiled = tf.function(grads, jit_compile=True)(x, gamma, beta)
    for e, c in zip(eager, compiled):
        assert_close(c, e, 1e-5)


@pytest.mark.parametrize("fused,rtol", [(False, 1e-5), (None, 1e-3)], ids=["composite", "fused"])
def test_variance_is_not_single_pass(fused, rtol):
    """Mean 1e4, std 1e-2 in float32: E[x²]−E[x]² loses every digit (x² ≈ 1e8, ulp 8);
    the corrected two-pass variance keeps them (the fused CPU kernel, plain two-pass, most)."""
    rng = np.random.default_rng(4)
    x = (1e4 + 1e-2 * rng.standard_normal((4096, 3))).astype(np.float32)
    _, _, var = ops.batch_norm_train(
        tf.constant(x), tf.ones([3]), tf.zeros([3]), [1], EPS, fused=fused
    )
    exact = x.astype(np.float64).var(axis=0)
    assert_close(var, exact, rtol)
    single_pass = np.mean(x * x, axis=0) - np.mean(x, axis=0) ** 2
    assert np.abs(single_pass - exact).max() > 10 * exact.max()  # the formula we avoid


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inference_affine_matches_numpy(layout):
    shape, axes = LAYOUTS[layout]
    x, gamma, beta = _inputs(shape, axes)
    rng = np.random.default_rng(5)
    mean = rng.normal(size=gamma.shape)
    var = rng.uniform(0.5, 3.0, size=gamma.shape)
    a, b = ops.inference_affine(mean, var, gamma, beta, EPS)
    y = ops.batch_norm_inference(tf.constant(x), a, b, axes)
    bs = broadcast_shape(shape, axes)
    expected = gamma.reshape(bs) * (x - mean.reshape(bs)) / np.sqrt(var.reshape(bs) + EPS)
    assert_close(y, expected + beta.reshape(bs), 1e-12)


def test_element_count():
    x = tf.zeros([4, 3, 2, 5])
    assert statistics.element_count(x, [3]) == 24
    assert statistics.element_count(x, [1, 3]) == 8
    mask = statistics.expand_mask(tf.constant(np.arange(24).reshape(4, 3, 2) % 3 == 0), x, [3])
    np.testing.assert_array_equal(statistics.element_count(x, [3], mask), np.full([1, 1, 1, 5], 8))
    dynamic = tf.function(
        lambda t: statistics.element_count(t, [1]), input_signature=[tf.TensorSpec([None, 5])]
    )
    assert float(dynamic(tf.zeros([7, 5]))) == 7.0


def test_expand_mask_rejects_wrong_shape():
    x = tf.zeros([4, 6, 5])
    for shape in ([4, 6, 5], [4, 7], [6]):  # [6]: not aligned from the right
        with pytest.raises(ValueError, match=rf"shape \({shape[0]},.*fits no reading"):
            statistics.expand_mask(tf.ones(shape, tf.bool), x, [2])


def test_expand_mask_broadcasts_size_one_dimensions():
    x = tf.zeros([4, 6, 5])
    per_sample = np.array([[True], [False], [True], [True]])
    mask = statistics.expand_mask(tf.constant(per_sample), x, [2])
    assert mask.shape == (4, 1, 1)  # broadcastable: the count spreads the size-1 dimensions
    np.testing.assert_array_equal(mask[..., 0], per_sample)
    np.testing.assert_array_equal(statistics.element_count(x, [2], mask), np.full([1, 1, 5], 18))
    # (1, 3) does not fit Keras's reading of (2, 5, 3), (2, 5); it covers the non-channel axes.
    channels_first = statistics.expand_mask(
        tf.constant([[1.0, 0.0, 2.5]]), tf.zeros([2, 5, 3]), [1]
    )
    np.testing.assert_array_equal(channels_first, [[[1.0, 0.0, 1.0]]])
    np.testing.assert_array_equal(
        statistics.element_count(tf.zeros([2, 5, 3]), [1], channels_first), np.full([1, 5, 1], 4)
    )

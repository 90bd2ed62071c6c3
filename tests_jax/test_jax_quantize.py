"""keras_bn.quantize's fake quantization under JAX: TensorFlow's FakeQuant ops in jnp
(keras_bn/quantize/_jax_fake_quant.py) against the TensorFlow ops themselves, run eagerly in
this process (TensorFlow is a dependency; Keras's backend is JAX here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from keras_bn.quantize import _jax_fake_quant as jfq


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
    values and the floats either side of each half (the rounding boundaries)."""
    scale, _, nudged_min, _ = (np.float32(v) for v in jfq.nudge(low, high, bits, narrow))
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


def _bits_equal(actual, expected):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    differ = np.nonzero(actual.view(np.int32) != expected.view(np.int32))
    assert differ[0].size == 0, (actual[differ][:5], expected[differ][:5])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
def test_fake_quant_equals_tensorflow_bit_for_bit(compiled):
    per_tensor = jfq.fake_quant_with_min_max_vars
    per_channel = jfq.fake_quant_with_min_max_vars_per_channel
    if compiled:
        per_tensor = jax.jit(per_tensor, static_argnums=(3, 4))
        per_channel = jax.jit(per_channel, static_argnums=(3, 4))
    rng = np.random.default_rng(0)
    for bits, narrow, low, high in _ranges():
        x = _values(bits, narrow, low, high, rng)
        expected = tf.quantization.fake_quant_with_min_max_vars(
            x, low, high, num_bits=bits, narrow_range=narrow
        )
        _bits_equal(per_tensor(x, low, high, bits, narrow), expected)
        column = x[:, None]
        expected = tf.quantization.fake_quant_with_min_max_vars_per_channel(
            column, [low], [high], num_bits=bits, narrow_range=narrow
        )
        _bits_equal(per_channel(column, np.array([low]), np.array([high]), bits, narrow), expected)


def test_per_channel_ranges_apply_along_the_last_axis():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 4, 5, 6)).astype(np.float32)
    high = np.abs(x).reshape(-1, 6).max(axis=0)
    high[2] = 1e-3  # most values of channel 2 clip
    expected = tf.quantization.fake_quant_with_min_max_vars_per_channel(
        x, -high, high, num_bits=4, narrow_range=True
    )
    _bits_equal(jfq.fake_quant_with_min_max_vars_per_channel(x, -high, high, 4, True), expected)


@pytest.mark.parametrize("per_channel", [False, True])
def test_gradients_are_tensorflows_straight_through_rule(per_channel):
    rng = np.random.default_rng(2)
    x = rng.uniform(-2.0, 3.0, size=(50, 3)).astype(np.float32)
    upstream = rng.normal(size=x.shape).astype(np.float32)
    low = np.array([-1.0, -0.5, -1.5], np.float32)
    high = np.array([1.0, 2.0, 1.5], np.float32)
    if not per_channel:
        low, high = low[0], high[0]
    tf_op = (
        tf.quantization.fake_quant_with_min_max_vars_per_channel
        if per_channel
        else tf.quantization.fake_quant_with_min_max_vars
    )
    jnp_op = (
        jfq.fake_quant_with_min_max_vars_per_channel
        if per_channel
        else jfq.fake_quant_with_min_max_vars
    )
    tensors = [tf.constant(v) for v in (x, low, high)]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        loss = tf.reduce_sum(tf_op(*tensors, num_bits=8) * upstream)
    expected = tape.gradient(loss, tensors)

    def jax_loss(values, minimum, maximum):
        return jnp.sum(jnp_op(values, minimum, maximum, 8) * upstream)

    actual = jax.grad(jax_loss, argnums=(0, 1, 2))(x, low, high)
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6, atol=1e-6)
    # The rule itself: the upstream gradient inside the nudged range, 0 outside.
    _, _, nudged_min, nudged_max = jfq.nudge(jnp.asarray(low), jnp.asarray(high), 8, False)
    inside = (x >= np.asarray(nudged_min)) & (x <= np.asarray(nudged_max))
    assert 0 < inside.sum() < x.size
    np.testing.assert_array_equal(np.asarray(actual[0]), np.where(inside, upstream, 0.0))

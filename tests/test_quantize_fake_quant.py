"""The fake-quant maths (TensorFlow ops and the numpy grid the exporters read) and the
ActivationQuantizer's EMA range, against numpy written from the definitions."""

import keras
import numpy as np
import pytest
import quantize_reference as ref
import tensorflow as tf

from keras_bn.quantize import ActivationQuantizer, fake_quant

pytestmark = pytest.mark.backends("tensorflow")


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
def test_weight_grid_gives_tensorflows_integers(bits, per_channel):
    """weight_grid's q·Δ is the TF op's output (to float32 rounding), its integers are the
    definition's, |q| ≤ 2^(k−1) − 1, and each channel's (or the tensor's) extreme is ±q_max."""
    rng = np.random.default_rng(bits)
    kernel = (rng.normal(size=(3, 3, 4, 6)) * rng.uniform(0.1, 3.0, 6)).astype(np.float32)
    max_abs = fake_quant.weight_max_abs(kernel, per_channel)
    fake = np.asarray(fake_quant.fake_quant_weights(tf.constant(kernel), max_abs, bits))
    q, scale = fake_quant.weight_grid(kernel, bits, per_channel)
    assert q.dtype == np.int8
    limit = fake_quant.q_max(bits)
    assert np.abs(q).max() == limit
    if per_channel:
        assert scale.shape == (6,)
        assert (np.abs(q).reshape(-1, 6).max(axis=0) == limit).all()
    np.testing.assert_allclose(q * scale, fake, rtol=0, atol=2 * np.spacing(np.abs(kernel).max()))
    step = ref.weight_scale(kernel, bits, per_channel)
    np.testing.assert_allclose(scale, step, rtol=1e-6)
    u = kernel / step
    decided = np.abs(u - np.floor(u) - 0.5) > 1e-4  # off the rounding boundaries
    np.testing.assert_array_equal(q[decided], np.floor(u[decided] + 0.5))


def test_activation_grid_matches_the_op_and_the_definition():
    rng = np.random.default_rng(0)
    for bits in (2, 3, 4, 8):
        x = rng.normal(size=4000).astype(np.float32) * 2
        lo, hi = np.float32(-1.3), np.float32(2.9)
        fake = np.asarray(fake_quant.fake_quant_activations(tf.constant(x), lo, hi, bits))
        q, scale, zero_point = fake_quant.quantize(x, lo, hi, bits, narrow_range=False)
        np.testing.assert_allclose(q * scale, fake, atol=4 * np.spacing(np.float32(hi)))
        assert 0 <= zero_point <= 2**bits - 1 and q.min() >= -zero_point
        assert q.max() <= 2**bits - 1 - zero_point
        step, ref_zero_point = ref.activation_grid(float(lo), float(hi), bits)
        assert zero_point == ref_zero_point
        np.testing.assert_allclose(scale, step, rtol=1e-6)
        expected = ref.fake_quant_activations(x, float(lo), float(hi), bits)
        decided = ref.distance_to_rounding_boundary(x, float(lo), float(hi), bits) > 1e-4
        np.testing.assert_allclose(fake[decided], expected[decided], atol=1e-5)


def test_zero_is_on_every_grid():
    for bits in (2, 5, 8):
        out = fake_quant.fake_quant_activations(tf.zeros(3), -0.37, 1.91, bits)
        np.testing.assert_array_equal(np.asarray(out), 0.0)
        kernel = tf.constant([[0.0, 1.0], [0.3, 0.0]])
        out = fake_quant.fake_quant_weights(kernel, fake_quant.weight_max_abs(kernel, True), bits)
        assert float(out[0, 0]) == 0.0 and float(out[1, 1]) == 0.0


def test_an_all_zero_channel_quantizes_to_zero():
    kernel = np.zeros((3, 2), np.float32)
    kernel[:, 1] = [0.5, -1.0, 0.25]
    q, _ = fake_quant.weight_grid(kernel, 4, True)
    np.testing.assert_array_equal(q[:, 0], 0)
    out = fake_quant.fake_quant_weights(kernel, fake_quant.weight_max_abs(kernel, True), 4)
    np.testing.assert_array_equal(np.asarray(out)[:, 0], 0.0)


def test_weight_gradient_is_straight_through():
    kernel = tf.Variable(np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32))
    upstream = tf.constant(np.random.default_rng(2).normal(size=(4, 3)).astype(np.float32))
    with tf.GradientTape() as tape:
        out = fake_quant.fake_quant_weights(kernel, fake_quant.weight_max_abs(kernel, True), 3)
        loss = tf.reduce_sum(out * upstream)
    np.testing.assert_array_equal(np.asarray(tape.gradient(loss, kernel)), np.asarray(upstream))


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_weight_gradient_is_one_for_every_weight_as_torch_ao_gives(bits, per_channel):
    """Every weight, the one that sets its channel's range included, gets the upstream
    gradient: torch.ao's rule (every weight lies in the range). TensorFlow's op alone gave 0 to
    the range's own weight in some channels (7% at 3 bits), where float32 puts the nudged
    maximum just below it."""
    rng = np.random.default_rng(bits)
    kernel = (rng.normal(size=(3, 3, 8, 300)) * rng.uniform(0.01, 3.0, 300)).astype(np.float32)
    upstream = rng.normal(size=kernel.shape).astype(np.float32)
    variable = tf.Variable(kernel)
    with tf.GradientTape() as tape:
        max_abs = fake_quant.weight_max_abs(variable, per_channel)
        loss = tf.reduce_sum(fake_quant.fake_quant_weights(variable, max_abs, bits) * upstream)
    gradient = np.asarray(tape.gradient(loss, variable))
    reference = ref.straight_through_weight_mask(kernel, bits, per_channel) * upstream
    assert reference.all()  # every weight in range: the reference passes every gradient
    np.testing.assert_array_equal(gradient, reference.astype(np.float32))


def test_sgd_moves_the_weight_that_sets_the_range():
    """At 4 bits under SGD each channel's largest weight trains as the others do (with a zero
    gradient it stayed fixed for 100 steps)."""
    rng = np.random.default_rng(0)
    kernel = tf.Variable(rng.normal(size=(16, 64)).astype(np.float32))
    start = kernel.numpy().copy()
    target = tf.constant(rng.normal(size=(16, 64)).astype(np.float32))
    optimizer = keras.optimizers.SGD(0.01)
    for _ in range(20):
        with tf.GradientTape() as tape:
            max_abs = fake_quant.weight_max_abs(kernel, True)
            out = fake_quant.fake_quant_weights(kernel, max_abs, 4)
            loss = tf.reduce_sum(tf.square(out - target))
        optimizer.apply_gradients([(tape.gradient(loss, kernel), kernel)])
    largest = np.abs(start).argmax(0)
    moved = np.abs(kernel.numpy() - start)[largest, np.arange(64)]
    assert (moved > 0).all(), f"{int((moved == 0).sum())} channels' largest weight never moved"


@pytest.mark.parametrize("bad", [1, 9, 0, -8, 8.0, True, "8", None])
def test_bits_out_of_range_are_refused_by_name_and_value(bad):
    with pytest.raises(ValueError, match=r"bits.*2 to 8.*" + repr(bad).replace(".", r"\.")):
        fake_quant.validate_bits(bad, "bits")


def _observed(quantizer):
    return float(quantizer.range_min), float(quantizer.range_max)


def test_activation_range_is_an_ema_that_holds_zero():
    """First batch initialises; then range ← 0.9·range + 0.1·batch; 0 stays inside; the output
    is the numpy grid of the updated range."""
    rng = np.random.default_rng(4)
    quantizer = ActivationQuantizer(bits=4, momentum=0.9)
    batches = [
        rng.normal(size=(8, 5)) + 3.0,
        rng.normal(size=(8, 5)) - 1.0,
        rng.normal(size=(8, 5)),
    ]
    lo = hi = None
    for batch in batches:
        batch = batch.astype(np.float32)
        y = np.asarray(quantizer(batch, training=True))
        if lo is None:
            lo, hi = batch.min(), batch.max()
        else:
            lo, hi = 0.9 * lo + 0.1 * batch.min(), 0.9 * hi + 0.1 * batch.max()
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        np.testing.assert_allclose(_observed(quantizer), (lo, hi), rtol=1e-6, atol=1e-7)
        expected = ref.fake_quant_activations(batch, lo, hi, 4)
        decided = ref.distance_to_rounding_boundary(batch, lo, hi, 4) > 1e-4
        np.testing.assert_allclose(y[decided], expected[decided], atol=1e-5)
    assert _observed(quantizer)[0] < 0.0 < _observed(quantizer)[1]
    # Inference quantizes with the stored range and moves nothing.
    before = _observed(quantizer)
    wide = batches[0].astype(np.float32) * 5
    y = np.asarray(quantizer(wide, training=False))
    assert _observed(quantizer) == before
    expected = ref.fake_quant_activations(wide, *before, 4)
    decided = ref.distance_to_rounding_boundary(wide, *before, 4) > 1e-4
    np.testing.assert_allclose(y[decided], expected[decided], atol=1e-5)
    assert (wide > before[1] + 1).any()  # clipped to the grid's top


def test_first_all_positive_batch_starts_the_range_at_zero():
    quantizer = ActivationQuantizer()
    quantizer(np.array([[1.0, 2.0, 3.0]], np.float32), training=True)
    assert _observed(quantizer) == (0.0, 3.0)


def test_a_non_finite_batch_and_a_frozen_range_change_nothing():
    quantizer = ActivationQuantizer(bits=8)
    quantizer(np.array([[-1.0, 2.0]], np.float32), training=True)
    before = _observed(quantizer)
    y = quantizer(np.array([[np.nan, 5.0]], np.float32), training=True)
    assert _observed(quantizer) == before
    assert np.isnan(np.asarray(y)[0, 0])
    quantizer.ranges_frozen.assign(True)
    quantizer(np.array([[-7.0, 9.0]], np.float32), training=True)
    assert _observed(quantizer) == before


def test_before_any_training_batch_the_input_passes_through():
    quantizer = ActivationQuantizer(bits=2)
    x = np.array([[0.123, -4.56]], np.float32)
    np.testing.assert_array_equal(np.asarray(quantizer(x, training=False)), x)
    assert not quantizer.range_initialized.numpy()


def test_a_traced_quantizer_starts_rounding_once_a_range_is_observed_without_retracing():
    """`range_initialized` is read at run time: a step traced before any training batch passes
    x through, and rounds it (as eager inference does) once a batch has set the range."""
    quantizer = ActivationQuantizer(bits=2)
    quantizer.build(())
    x = tf.constant([[0.123, -0.456, 0.789]])
    step = tf.function(lambda x: quantizer(x, training=False))
    np.testing.assert_array_equal(np.asarray(step(x)), np.asarray(x))
    quantizer(np.array([[-1.0, 1.0]], np.float32), training=True)
    rounded = np.asarray(step(x))
    np.testing.assert_array_equal(rounded, np.asarray(quantizer(x, training=False)))
    assert not np.array_equal(rounded, np.asarray(x))
    assert step.experimental_get_tracing_count() == 1


def test_activation_gradient_passes_inside_the_range_and_stops_outside():
    quantizer = ActivationQuantizer(bits=8)
    quantizer(np.array([[-1.0, 1.0]], np.float32), training=True)
    x = tf.constant([[-5.0, -0.5, 0.25, 0.9, 5.0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = quantizer(x, training=False)
    np.testing.assert_array_equal(np.asarray(tape.gradient(y, x)), [[0.0, 1.0, 1.0, 1.0, 0.0]])


def test_in_training_the_moving_range_takes_no_gradient():
    """The range is a statistic of the batches (an EMA, as in Jacob et al. 2018): a training
    step's gradient is the straight-through one, 1 inside the updated range and 0 outside, with
    nothing flowing back through the batch's min and max into the extreme values."""
    quantizer = ActivationQuantizer(bits=8, momentum=0.5)
    quantizer(np.array([[-1.0, 1.0]], np.float32), training=True)
    x = tf.constant([[-3.0, -1.9, -0.5, 0.25, 1.9, 3.0]])  # range becomes [-2, 2]
    upstream = tf.constant([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = quantizer(x, training=True)
    gradient = tape.gradient(y, x, output_gradients=upstream)
    np.testing.assert_allclose(float(quantizer.range_min.numpy()), -2.0)
    np.testing.assert_array_equal(np.asarray(gradient), [[0.0, 2.0, 3.0, 4.0, 5.0, 0.0]])


@pytest.mark.parametrize(
    "kwargs, value",
    [
        ({"bits": 1}, "1"),
        ({"bits": 2.5}, "2.5"),
        ({"momentum": 1.0}, "1.0"),
        ({"momentum": True}, "True"),
    ],
)
def test_activation_quantizer_refuses_bad_arguments(kwargs, value):
    with pytest.raises(ValueError, match=value):
        ActivationQuantizer(**kwargs)


@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
def test_an_all_zero_channel_or_tensor_gets_a_unit_range(per_channel):
    """Its weights round to 0 whatever the range, but a step of MIN_RANGE/q_max would make a
    file's int32 bias (bias / (input scale · weight scale)) overflow: the range is 1, in the
    training op and in the grid the exporters write alike."""
    kernel = np.zeros((3, 3, 2, 3), np.float32)
    if per_channel:
        kernel[..., 0] = np.random.default_rng(0).normal(size=(3, 3, 2))
        kernel[0, 0, 0, 2] = 1e-12  # tiny but not zero: its range stays MIN_RANGE
    ranges = fake_quant.weight_max_abs(tf.constant(kernel), per_channel)
    out = np.asarray(fake_quant.fake_quant_weights(tf.constant(kernel), ranges, 8))
    max_abs = np.asarray(ranges)
    q, scale = fake_quant.weight_grid(kernel, 8, per_channel)
    if per_channel:
        np.testing.assert_array_equal(max_abs[1:], np.float32([1.0, fake_quant.MIN_RANGE]))
        np.testing.assert_array_equal(scale[1:], np.float32([1.0, fake_quant.MIN_RANGE]) / 127)
        assert max_abs[0] == np.abs(kernel[..., 0]).max()
    else:
        assert max_abs == 1.0 and scale == np.float32(1 / 127)
    np.testing.assert_array_equal(out[..., 1], 0.0)
    np.testing.assert_array_equal(q[..., 1], 0)
    np.testing.assert_allclose(q * scale, out, rtol=0, atol=1e-7)


@pytest.mark.parametrize("rank", [2, 3, 4, 5])
def test_per_channel_fake_quant_is_the_op_at_any_rank_with_a_straight_through_gradient(rank):
    """The per-channel op runs on a (-1, channels) view: bit for bit what it gives the kernel
    itself up to rank 4, a numpy reference at rank 5 (Conv3D), and the gradient passes
    straight through at every rank."""
    rng = np.random.default_rng(rank)
    shape = (2, 3, 2, 4, 5)[-rank:]
    kernel = tf.Variable((rng.normal(size=shape) * rng.uniform(0.1, 3.0, 5)).astype(np.float32))
    upstream = tf.constant(rng.normal(size=shape).astype(np.float32))
    max_abs = fake_quant.weight_max_abs(kernel, True)

    @tf.function  # as fit runs it: a graph (where a rank-5 per-channel gradient was refused)
    def forward_and_gradient():
        with tf.GradientTape() as tape:
            out = fake_quant.fake_quant_weights(kernel, max_abs, 4)
            loss = tf.reduce_sum(out * upstream)
        return out, tape.gradient(loss, kernel)

    out, gradient = forward_and_gradient()
    gradient = np.asarray(gradient)
    # Straight through for every weight, the range's own included.
    np.testing.assert_array_equal(gradient, np.asarray(upstream))
    if rank <= 4:
        direct = tf.quantization.fake_quant_with_min_max_vars_per_channel(
            kernel, -max_abs, max_abs, num_bits=4, narrow_range=True
        )
        np.testing.assert_array_equal(np.asarray(out), np.asarray(direct))
    expected = ref.fake_quant_weights(np.asarray(kernel), 4, True)
    step = ref.weight_scale(np.asarray(kernel), 4, True)
    u = np.asarray(kernel, np.float64) / step
    off_ties = np.abs(u - np.floor(u) - 0.5) > 1e-4
    np.testing.assert_allclose(np.asarray(out)[off_ties], expected[off_ties], rtol=1e-6)


def test_round_bias_is_the_nearest_multiple_exactly_with_a_straight_through_gradient():
    """round_bias gives the multiple of the step nearest the bias (per channel), an exact
    multiple in float32 (bias/step is an integer), and passes the gradient to the bias only."""
    rng = np.random.default_rng(11)
    bias = tf.Variable((rng.normal(size=64) * 3.0).astype(np.float32))
    step = tf.constant(rng.uniform(0.01, 0.5, 64).astype(np.float32))
    upstream = tf.constant(rng.normal(size=64).astype(np.float32))
    with tf.GradientTape() as tape:
        rounded = fake_quant.round_bias(bias, step)
        loss = tf.reduce_sum(rounded * upstream)
    units = np.asarray(rounded, np.float64) / np.asarray(step, np.float64)
    np.testing.assert_allclose(units, np.round(units), rtol=0, atol=1e-4)
    expected = ref.bias_on_grid(np.asarray(bias), np.asarray(step), 1.0)
    np.testing.assert_allclose(np.asarray(rounded), expected, rtol=1e-6)
    assert np.abs(expected - np.asarray(bias)).max() > 0.1 * np.asarray(step).min()
    np.testing.assert_array_equal(np.asarray(tape.gradient(loss, bias)), np.asarray(upstream))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
def test_learned_fake_quant_is_fake_quant_with_lsqs_gradients(bits, per_channel):
    """fake_quant_weights_learned: the values of fake_quant_weights on the same range bit for
    bit; the gradients LSQ's (Esser et al. 2020) from the numpy reference, to the kernel
    (0 for clipped weights) and to the range (scaled by 1/√(N·q_max)). The range is 0.6 of
    max|w|, so that some weights are clipped."""
    kernel, max_abs, upstream = ref.learned_range_case(bits, per_channel)
    kernel, max_abs = tf.Variable(kernel), tf.Variable(max_abs)
    with tf.GradientTape() as tape:
        fake = fake_quant.fake_quant_weights_learned(kernel, max_abs, bits)
        loss = tf.reduce_sum(fake * upstream)
    to_kernel, to_range = tape.gradient(loss, [kernel, max_abs])
    np.testing.assert_array_equal(
        fake, fake_quant.fake_quant_weights(kernel.value(), max_abs.value(), bits)
    )
    expected_kernel, expected_range = ref.lsq_gradients(
        kernel.numpy(), max_abs.numpy(), bits, upstream
    )
    clipped = np.abs(kernel.numpy()) > max_abs.numpy()
    assert clipped.any() and not clipped.all()
    np.testing.assert_array_equal(to_kernel, expected_kernel)
    np.testing.assert_allclose(to_range, expected_range, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 8])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
def test_mse_weight_range_is_the_least_squared_rounding_error(bits, per_channel):
    """Against an independent search 20 times finer: within 1% of its least error, never
    worse than max|w|'s; an all-zero channel gets ZERO_WEIGHT_RANGE."""
    rng = np.random.default_rng(bits)
    kernel = rng.standard_t(4, size=(3, 3, 8, 5)) * rng.uniform(0.1, 3.0, 5)
    kernel[..., 0] = 0.0 if per_channel else kernel[..., 0]
    found = fake_quant.mse_weight_range(kernel, bits, per_channel)
    flat = kernel.reshape(-1, 5) if per_channel else kernel.reshape(-1, 1)

    def error(m):
        step = np.maximum(m, 1e-12) / ref.q_max(bits)
        return ((ref.fake_quant_weights(flat, bits, True, step) - flat) ** 2).sum(axis=0)

    top = np.abs(flat).max(axis=0)
    finest = np.min([error(top * f) for f in np.linspace(0.01, 1.0, 2000)], axis=0)
    got = error(np.reshape(found, top.shape).astype(np.float64))
    live = top > 0
    assert (got[live] <= finest[live] * 1.01 + 1e-12).all(), (got, finest)
    assert (got <= error(top) + 1e-12).all()
    if per_channel:
        assert found.shape == (5,) and found[0] == 1.0
    else:
        assert found.shape == ()

"""The mask convention, everywhere a mask is read: Keras's reading (a mask of the input's rank
− 1 covers its leading axes and broadcasts over the last) wins, so the channel axis may be a
masked one and each channel c has its own count m_c; keras_bn's layer also reads a mask over
its non-channel axes where Keras's reading does not fit; any other mask is a ValueError.

The references are numpy formulas that apply Keras's rule literally (expand the mask at the
last axis, broadcast it to the input) and Keras's own layer (its gradients by the framework's
autodiff). Under every backend; TensorFlow's train-path choice, its XLA and tf.distribute under
TensorFlow only."""

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from helpers import assert_close, training_call, training_modes
from keras_bn.diagnostics import check_batchnorm
from keras_bn.population import PooledMoments

BACKEND = keras.backend.backend()
EPS = 1e-3


def _keras_rule(mask, shape):
    """Keras's reading, literally: expand_dims(mask, -1), then broadcast to the input."""
    return np.broadcast_to(np.expand_dims(np.asarray(mask, bool), -1), shape)


def _moments(x, kept, channel_axis):
    """Per channel (mean, biased variance, m_c) over the positions `kept` (x's shape), in
    float64; NaN where m_c = 0."""
    x = np.asarray(x, np.float64)
    axes = tuple(i for i in range(x.ndim) if i != channel_axis % x.ndim)
    m = kept.sum(axis=axes)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(kept, x, 0.0).sum(axis=axes) / m
        centred = x - np.expand_dims(mean, axes)
        variance = np.where(kept, centred**2, 0.0).sum(axis=axes) / m
    return mean, variance, m.astype(np.float64)


# ------------------------------------------------------- Embedding(mask_zero) → BN(axis=1)

VOCABULARY, FEATURES, BATCH, SAMPLES = 12, 6, 8, 64
PADDING_VALUE = 50.0  # the padding token's vector: leaked into the statistics, it shows


def _table():
    """The Embedding's (frozen) vectors; each time step's statistics are then the data's."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(VOCABULARY, FEATURES)) * np.linspace(0.5, 2.0, FEATURES)
    table[0] = PADDING_VALUE
    return table.astype("float32")


def _tokens(steps, seed=1, short_batch=None):
    """(SAMPLES, steps) padded token sequences; every batch of BATCH holds one full-length
    sequence (so every time step has m_c ≥ FEATURES ≥ 2), except `short_batch`, whose
    sequences all stop before the last step (m_c = 0 there)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, steps + 1, SAMPLES)
    lengths[::BATCH] = steps
    if short_batch is not None:
        rows = slice(short_batch * BATCH, (short_batch + 1) * BATCH)
        lengths[rows] = np.minimum(lengths[rows], steps - 1)
    real = np.arange(steps) < lengths[:, None]
    return np.where(real, rng.integers(1, VOCABULARY, (SAMPLES, steps)), 0).astype("int32")


def _sequence_model(bn, steps):
    """Embedding(mask_zero=True, frozen) → bn (axis=1: a channel per time step) → masked
    GlobalAveragePooling1D → Dense: the BN's input is fixed, so its statistics are exact."""
    inputs = keras.Input((steps,), dtype="int32")
    embedded = keras.layers.Embedding(
        VOCABULARY,
        FEATURES,
        mask_zero=True,
        trainable=False,
        embeddings_initializer=keras.initializers.Constant(_table()),
    )(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(bn(embedded))
    model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _batch_moments(tokens):
    """Per batch of BATCH: the BN input's per-time-step (mean, biased variance, m_c) under
    Keras's rule, padding excluded."""
    table = _table()
    out = []
    for start in range(0, len(tokens), BATCH):
        batch = tokens[start : start + BATCH]
        x = table[batch]  # (batch, steps, features)
        out.append(_moments(x, _keras_rule(batch != 0, x.shape), 1))
    return out


def _keras_bn_moving_statistics(tokens, momentum):
    """keras_bn's moving update, in numpy, after one epoch over `tokens`: per channel for a
    momentum (a channel with m_c ≤ 1 keeps its values), whole batches for momentum=None."""
    steps = tokens.shape[1]
    mean_ref, var_ref, counted = np.zeros(steps), np.ones(steps), 0
    for mean, variance, m in _batch_moments(tokens):
        enough = m >= 2
        unbiased = np.where(enough, variance * m / np.maximum(m - 1, 1), 0.0)
        if momentum is None:
            if not enough.all():
                continue
            counted += 1
            keep, update = (counted - 1) / counted, np.ones(steps, bool)
        else:
            keep, update = momentum, enough
        mean_ref = np.where(update, keep * mean_ref + (1 - keep) * np.nan_to_num(mean), mean_ref)
        var_ref = np.where(update, keep * var_ref + (1 - keep) * unbiased, var_ref)
    return mean_ref, var_ref, counted


def _pooled(tokens, unbiased):
    """Algorithm 2 per channel, over the batches that give the channel m_c ≥ 2."""
    sums = np.zeros((4, tokens.shape[1]))  # per channel: batches, Σm, Σm·μ, Σm·σ²
    for mean, variance, m in _batch_moments(tokens):
        used = m >= 2
        sums += np.where(used, [np.ones_like(m), m, m * np.nan_to_num(mean), m * variance], 0.0)
    batches, count, weighted_mean, weighted_variance = sums
    return weighted_mean / count, weighted_variance / (count - batches if unbiased else count)


@pytest.mark.parametrize("steps", [FEATURES, 9], ids=["T=D", "T!=D"])
@pytest.mark.parametrize("momentum", [0.5, None], ids=["momentum", "cumulative"])
def test_keras_bn_fit_on_embedding_mask_excludes_padding(steps, momentum):
    """Audit item 9: keras_bn's layer after `fit` holds the padding-free per-time-step
    statistics (Keras's reading of the (batch, time) mask), also where time = features (the
    mask then also fits the non-channel (batch, features) reading, which used to win and
    normalised the wrong positions). Batch 3 leaves the last step no value: that channel
    alone keeps its statistics, or (momentum=None) the whole batch is skipped, uncounted."""
    tokens = _tokens(steps, short_batch=3)
    bn = keras_bn.BatchNormalization(axis=1, momentum=momentum)
    model = _sequence_model(bn, steps)
    model.fit(tokens, np.zeros(SAMPLES), batch_size=BATCH, shuffle=False, verbose=0)
    mean, variance, counted = _keras_bn_moving_statistics(tokens, momentum)
    assert_close(bn.moving_mean, mean, 1e-5)
    assert_close(bn.moving_variance, variance, 1e-5)
    assert np.abs(array(bn.moving_mean)).max() < 0.1 * PADDING_VALUE  # no padding in it
    if momentum is None:
        assert int(array(bn.num_batches_tracked)) == counted == SAMPLES // BATCH - 1


@pytest.mark.parametrize("steps", [FEATURES, 9], ids=["T=D", "T!=D"])
def test_recalibrate_and_check_on_a_keras_bn_trained_by_fit(steps):
    """Audit item 8: on Keras's own BN(axis=1) after Embedding(mask_zero=True), recalibrate
    reads the mask as Keras does: its statistics are Keras's biased convention over the
    non-padding values (numpy), they agree with where Keras's `fit` moved the moving
    statistics, and check_batchnorm finds nothing stale in what `fit` left (it used to call
    them stale, or raise where time ≠ features)."""
    tokens = _tokens(steps)
    bn = keras.layers.BatchNormalization(axis=1, momentum=0.9)
    model = _sequence_model(bn, steps)
    model.fit(tokens, np.zeros(SAMPLES), batch_size=BATCH, epochs=20, shuffle=False, verbose=0)
    findings = check_batchnorm(model, tokens, batch_size=BATCH)
    kinds = [f.kind for f in findings if f.layer == bn.name]
    assert "stale_statistics" not in kinds and "non_finite" not in kinds, findings
    fitted_mean, fitted_variance = array(bn.moving_mean), array(bn.moving_variance)

    report = keras_bn.recalibrate(model, tokens, batch_size=BATCH, progress=False)
    mean, variance = _pooled(tokens, unbiased=False)
    assert_close(bn.moving_mean, mean, 1e-5)
    assert_close(bn.moving_variance, variance, 1e-5)
    assert report.layers[0].batches_used == SAMPLES // BATCH
    # Keras's fit moved its statistics to the same place (EMA noise aside), not to the padding.
    std = np.sqrt(variance)
    assert np.abs(fitted_mean - mean).max() < 0.1 * std.min()
    assert np.abs(np.log(fitted_variance / variance)).max() < 0.1


def test_recalibrate_keras_bn_layer_on_embedding_mask_per_channel():
    """recalibrate on keras_bn's BN(axis=1): per-channel Algorithm 2 (unbiased), a channel's
    batch used where it gives m_c ≥ 2 (the short batch is left out of the last step only);
    check_batchnorm then finds nothing stale."""
    steps = 9
    tokens = _tokens(steps, short_batch=3)
    bn = keras_bn.BatchNormalization(axis=1)
    model = _sequence_model(bn, steps)
    report = keras_bn.recalibrate(model, tokens, batch_size=BATCH, progress=False)
    mean, variance = _pooled(tokens, unbiased=True)
    assert_close(bn.moving_mean, mean, 1e-5)
    assert_close(bn.moving_variance, variance, 1e-5)
    assert report.layers[0].batches_used == SAMPLES // BATCH
    assert report.layers[0].unchanged_channels == ()
    assert "stale_statistics" not in [
        f.kind for f in check_batchnorm(model, tokens, batch_size=BATCH)
    ]


def test_recalibrate_leaves_a_channel_no_batch_reaches_and_cumulative_counts_whole_batches():
    """A time step that is padding in every sequence has no statistics: recalibrate keeps
    its values and names it. momentum=None pools whole batches only, as its training does,
    so a batch with such a channel is skipped, and with none left it is an error."""
    steps = 9
    tokens = _tokens(steps, short_batch=3)
    tokens[:, -1] = 0  # the last step is padding everywhere
    bn = keras_bn.BatchNormalization(axis=1)
    model = _sequence_model(bn, steps)
    report = keras_bn.recalibrate(model, tokens, batch_size=BATCH, progress=False)
    assert report.layers[0].unchanged_channels == (steps - 1,)
    assert "unchanged" in str(report)
    assert array(bn.moving_mean)[-1] == 0.0 and array(bn.moving_variance)[-1] == 1.0
    mean, variance = _pooled(tokens[:, :-1], unbiased=True)  # the other steps: as before
    assert_close(array(bn.moving_mean)[:-1], mean, 1e-5)
    assert_close(array(bn.moving_variance)[:-1], variance, 1e-5)

    cumulative = keras_bn.BatchNormalization(axis=1, momentum=None)
    with pytest.raises(ValueError, match="no batch of `data` gives layer"):
        keras_bn.recalibrate(_sequence_model(cumulative, steps), tokens, progress=False)
    tokens = _tokens(steps, short_batch=3)
    cumulative = keras_bn.BatchNormalization(axis=1, momentum=None)
    model = _sequence_model(cumulative, steps)
    report = keras_bn.recalibrate(model, tokens, batch_size=BATCH, progress=False)
    assert report.layers[0].batches_used == int(array(cumulative.num_batches_tracked)) == 7
    full = np.concatenate([tokens[: 3 * BATCH], tokens[4 * BATCH :]])
    mean, variance = _pooled(full, unbiased=True)
    assert_close(cumulative.moving_mean, mean, 1e-5)
    assert_close(cumulative.moving_variance, variance, 1e-5)


def test_pooled_moments_per_channel_and_whole_batches():
    """PooledMoments alone, against the formulas: per channel over the batches with m_c ≥ 2;
    with whole_batches only the batches where every channel has m_c ≥ 2."""
    batches = [  # (mean, biased variance, m_c)
        (np.array([1.0, 2.0]), np.array([4.0, 1.0]), np.array([10.0, 10.0])),
        (np.array([3.0, 9.0]), np.array([2.0, 9.0]), np.array([6.0, 1.0])),
        (np.array([5.0, 4.0]), np.array([1.0, 3.0]), np.array([4.0, 2.0])),
    ]
    per_channel, whole = PooledMoments(), PooledMoments(whole_batches=True)
    for b in batches:
        per_channel.add(*b)
        whole.add(*b)
    mean, variance = per_channel.population(unbiased=True)
    assert_close(mean, [(10 + 18 + 20) / 20, (20 + 8) / 12], 1e-12)
    assert_close(variance, [(40 + 12 + 4) / 17, (10 + 6) / 10], 1e-12)
    mean, variance = whole.population(unbiased=False)
    assert_close(mean, [(10 + 20) / 14, (20 + 8) / 12], 1e-12)
    assert_close(variance, [(40 + 4) / 14, (10 + 6) / 12], 1e-12)
    assert (per_channel.batches, whole.batches, whole.skipped) == (3, 2, 1)


# ------------------------------------------------------- keras_bn vs Keras's own layer

MOMENTUM = 0.5


def _pair(axis, shape):
    """keras_bn's and Keras's BN with the same random weights, and those weights."""
    rng = np.random.default_rng(3)
    ours = keras_bn.BatchNormalization(axis=axis, momentum=MOMENTUM)
    theirs = keras.layers.BatchNormalization(axis=axis, momentum=MOMENTUM)
    for layer in (ours, theirs):
        layer.build(shape)
    weights = [rng.uniform(0.5, 1.5, w.shape).astype("float32") for w in theirs.get_weights()]
    ours.set_weights(weights)
    theirs.set_weights(weights)
    return ours, theirs, weights


def _masked_batch(shape, seed):
    """A batch and a Keras-reading mask (shape[:-1]) that keeps ≥ 2 values in every channel
    (Keras has no m ≤ 1 guard, so parity is only defined there)."""
    rng = np.random.default_rng(seed)
    mask = rng.uniform(size=shape[:-1]) > 0.5
    mask[:2] = True
    return rng.normal(2.0, 3.0, shape).astype("float32"), mask


@pytest.mark.parametrize(
    "shape,axis",
    [((6, 5, 4), -1), ((6, 5, 4), 1), ((6, 4, 4), 1), ((6, 3, 2, 4), 1)],
    ids=["last", "axis1", "axis1-square", "axis1-rank4"],
)
@pytest.mark.parametrize(
    "mode",
    # Each backend's traced call (PyTorch's is eager).
    training_modes("graph", "xla", "jit")
    + [pytest.param("eager", marks=pytest.mark.backends("torch"), id="eager")],
)
def test_training_outputs_and_statistics_equal_keras(shape, axis, mode):
    """On masked inputs keras_bn's training mode is Keras's: the same outputs (1e-5), the
    same moving mean, and a moving variance whose batch part is Keras's times m_c/(m_c − 1),
    channel by channel (the counts differ where the channel axis is a masked one)."""
    x, mask = _masked_batch(shape, seed=4)
    ours, theirs, weights = _pair(axis, shape)
    assert_close(training_call(ours, mode)(x, mask), theirs(x, training=True, mask=mask), 1e-5)
    assert_close(ours.moving_mean, theirs.moving_mean, 1e-5)
    _, variance, m = _moments(x, _keras_rule(mask, shape), axis)
    start = weights[3].astype(np.float64)
    assert_close(theirs.moving_variance, MOMENTUM * start + (1 - MOMENTUM) * variance, 1e-5)
    unbiased = variance * m / (m - 1)
    assert_close(ours.moving_variance, MOMENTUM * start + (1 - MOMENTUM) * unbiased, 1e-5)
    if axis != -1:
        assert len(set(m)) > 1  # the case reaches per-channel counts


@pytest.mark.parametrize("axis", [-1, 1])
def test_gradients_equal_keras_autodiff(axis, framework):
    """The closed-form gradient with per-channel counts, against autodiff through Keras's
    own layer (plain ops) on the same masked batch (the framework's training step)."""
    shape = (6, 5, 4)
    x, mask = _masked_batch(shape, seed=5)
    upstream = np.random.default_rng(6).normal(size=shape).astype("float32")
    grads = [framework.train_step(layer, x, upstream, mask)[1:] for layer in _pair(axis, shape)[:2]]
    for ours, theirs in zip(*grads):
        assert_close(ours, theirs, 1e-4)


def test_ambiguous_shape_takes_keras_reading():
    """(batch, 5, 5) with axis=1 and a (batch, 5) mask fits both readings: Keras's, the
    (batch, channels) axes, wins, as Keras's own layer reads it; the non-channel reading,
    (batch, time), would give other statistics."""
    shape = (6, 5, 5)
    x, mask = _masked_batch(shape, seed=7)
    ours, theirs, weights = _pair(1, shape)
    assert_close(ours(x, training=True, mask=mask), theirs(x, training=True, mask=mask), 1e-5)
    keras_mean, _, _ = _moments(x, _keras_rule(mask, shape), 1)
    other_mean, _, _ = _moments(x, np.broadcast_to(mask[:, None, :], shape), 1)
    start = weights[2].astype(np.float64)
    assert_close(ours.moving_mean, MOMENTUM * start + (1 - MOMENTUM) * keras_mean, 1e-5)
    assert np.abs(keras_mean - other_mean).max() > 0.1


# ------------------------------------------------------- the non-channel reading, and errors


def _broadcast_errors():
    """What a backend raises for shapes that do not broadcast."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return (ValueError, tf.errors.InvalidArgumentError)
    if BACKEND == "torch":
        return (ValueError, RuntimeError)
    return (ValueError, TypeError)


_BROADCAST_ERRORS = _broadcast_errors()


class _TimeMask(keras.layers.Layer):
    """Passes (batch, channels, time) through with a (batch, time) mask: the steps whose
    values are not all 0 (what Keras's Masking would mean for channels_first data)."""

    def compute_mask(self, inputs, mask=None):
        return keras.ops.any(keras.ops.not_equal(inputs, 0.0), axis=1)

    def call(self, inputs):
        return inputs


def test_non_channel_reading_where_keras_reading_does_not_fit():
    """(batch, 3, 7) with axis=1 and a (batch, 7) mask: Keras's reading needs (batch, 3), so
    the mask covers (batch, time), for the layer, recalibrate and check_batchnorm alike."""
    rng = np.random.default_rng(8)
    x = rng.normal(1.0, 2.0, (32, 3, 7)).astype("float32")
    lengths = rng.integers(2, 8, 32)
    kept = np.broadcast_to((np.arange(7) < lengths[:, None])[:, None, :], x.shape)
    x = np.where(kept, x, 0.0).astype("float32")  # padded steps are 0 in every channel
    mean, variance, m = _moments(x, kept, 1)
    inputs = keras.Input((3, 7))
    bn = keras_bn.BatchNormalization(axis=1, momentum=0.0)
    model = keras.Model(inputs, bn(_TimeMask()(inputs)))
    y = model(x, training=True)
    assert_close(bn.moving_mean, mean, 1e-5)
    assert_close(bn.moving_variance, variance * m / (m - 1), 1e-5)
    assert_close(y, (x - mean[:, None]) / np.sqrt(variance[:, None] + EPS), 1e-5)
    keras_bn.recalibrate(model, x, batch_size=32, progress=False)
    assert_close(bn.moving_mean, mean, 1e-5)
    assert_close(bn.moving_variance, variance * m / (m - 1), 1e-5)
    assert "stale_statistics" not in [f.kind for f in check_batchnorm(model, x, batch_size=32)]
    # Keras's layer reads only Keras's way: it cannot train on this mask, nor recalibrate.
    theirs = keras.layers.BatchNormalization(axis=1)
    keras_model = keras.Model(inputs, theirs(_TimeMask()(inputs)))
    with pytest.raises(_BROADCAST_ERRORS):
        keras_model(x, training=True)
    with pytest.raises(ValueError, match=r"\(32, 7\) fits no reading.*leading axes \[32, 3\]"):
        keras_bn.recalibrate(keras_model, x, progress=False)


@pytest.mark.parametrize(
    "shape,axis,mask_shape,readings",
    [
        ((4, 6, 3), -1, (4, 5), ["[4, 6]"]),
        ((4, 3, 6), 1, (4, 4), ["[4, 3]", "[4, 6]"]),
        ((4, 3, 6), 1, (4, 3, 6), ["[4, 3]", "[4, 6]"]),
        ((4, 3, 6), 1, (6,), ["[4, 3]", "[4, 6]"]),
        ((4, 3, 2, 5), [1, 3], (4, 3), ["[4, 3, 2]", "[4, 2]"]),
    ],
)
def test_mask_that_fits_neither_reading_raises_naming_both(shape, axis, mask_shape, readings):
    layer = keras_bn.BatchNormalization(axis=axis)
    with pytest.raises(ValueError) as error:
        layer(np.zeros(shape, "float32"), training=True, mask=np.ones(mask_shape, bool))
    message = str(error.value)
    assert f"{mask_shape}".replace(",)", ")") in message.replace(",)", ")")
    for reading in readings:
        assert reading in message, message


@pytest.mark.backends("tensorflow")  # TensorFlow's fused kernel
def test_masks_never_take_the_fused_path():
    import tensorflow as tf

    from keras_bn.backend.tensorflow import ops, statistics

    x = tf.zeros([6, 5, 4])
    for axes in ([2], [1]):
        mask = statistics.expand_mask(tf.ones([6, 5], tf.bool), x, axes)
        assert ops.train_path(x, axes, EPS, mask) == "composite"


def test_ghost_batches_refuse_a_mask():
    layer = keras_bn.BatchNormalization(axis=1, virtual_batch_size=2)
    with pytest.raises(ValueError, match="does not support a mask"):
        layer(np.zeros((4, 5, 3), "float32"), training=True, mask=np.ones((4, 5), bool))


# ------------------------------------------------------- channels with m_c ≤ 1


@pytest.mark.parametrize("features,bad_rows", [(3, 0), (1, 1)], ids=["m_c=0", "m_c=1"])
@pytest.mark.parametrize("momentum", [0.5, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize(
    # "eager": the framework's training step (TensorFlow: eager, under a tape; JAX: jax.jit of
    # stateless_call; PyTorch: eager autograd).
    "mode",
    ["eager", pytest.param("xla", marks=pytest.mark.backends("tensorflow"))],
)
def test_channel_with_at_most_one_value(features, bad_rows, momentum, mode, framework):
    """A (batch, time) mask on (batch, time, features) with axis=1 that leaves time step 3
    m_c ≤ 1 values: that channel outputs β, its gradients to x and γ are 0, and it keeps its
    statistics; with a momentum the other channels update as numpy says, with
    momentum=None the whole batch is skipped and not counted (its outputs are the same)."""
    shape = (4, 5, features)
    rng = np.random.default_rng(9)
    x = rng.normal(1.0, 2.0, shape).astype("float32")
    mask = rng.uniform(size=shape[:-1]) > 0.3
    mask[:2] = True
    mask[:, 3] = False
    mask[:bad_rows, 3] = True
    layer = keras_bn.BatchNormalization(axis=1, momentum=momentum)
    layer.build(shape)
    weights = [rng.uniform(0.5, 1.5, w.shape).astype(w.dtype) for w in layer.weights]
    layer.set_weights(weights)
    upstream = rng.normal(size=shape).astype("float32")
    if mode == "eager":
        y, dx, dgamma, _ = framework.train_step(layer, x, upstream, mask)
    else:
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def step(x, mask):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True, mask=mask)
                loss = tf.reduce_sum(y * upstream)
            return [y] + tape.gradient(loss, [x, layer.gamma])

        y, dx, dgamma = (np.asarray(t) for t in step(tf.constant(x), tf.constant(mask)))
    gamma, beta, moving_mean, moving_variance = (w.astype(np.float64) for w in weights[:4])
    mean, variance, m = _moments(x, _keras_rule(mask, shape), 1)
    assert m[3] == bad_rows * features <= 1 and (np.delete(m, 3) >= 2).all()
    expected = gamma[:, None] * (x - mean[:, None]) / np.sqrt(variance[:, None] + EPS)
    expected[:, 3] = 0.0
    assert_close(y, expected + beta[:, None], 1e-5)
    assert (dx[:, 3] == 0).all() and dgamma[3] == 0 and np.abs(dx).max() > 0
    if momentum is None:
        for w, start in zip(layer.weights[2:], weights[2:]):
            np.testing.assert_array_equal(array(w), start)
        return
    ok = np.arange(5) != 3
    unbiased = variance * m / np.maximum(m - 1, 1)
    new_mean = np.where(
        ok, momentum * moving_mean + (1 - momentum) * np.nan_to_num(mean), moving_mean
    )
    new_var = np.where(ok, momentum * moving_variance + (1 - momentum) * unbiased, moving_variance)
    assert_close(layer.moving_mean, new_mean, 1e-5)
    assert_close(layer.moving_variance, new_var, 1e-5)
    assert array(layer.moving_mean)[3] == weights[2][3]


# ------------------------------------------------------- replicas


@pytest.mark.backends("tensorflow")  # tf.distribute
@pytest.mark.parametrize("synchronized", [True, False], ids=["synchronized", "per-replica"])
def test_per_channel_counts_across_replicas(synchronized):
    """Two replicas, axis=1 on (batch, time, features) with a (batch, time) mask, time step 4
    unmasked on replica 0 only. Synchronized: outputs and statistics of BN on the global
    batch (counts m_c all-reduced). Per replica: each channel's count-weighted average of
    the replicas' statistics, a replica whose channel has m_c ≤ 1 weighing 0 there."""
    import tensorflow as tf

    from tf_helpers import mirrored_strategy

    strategy = mirrored_strategy(2)
    shape = (8, 5, 3)
    rng = np.random.default_rng(10)
    x = rng.normal(1.0, 2.0, shape).astype("float32")
    mask = rng.uniform(size=shape[:-1]) > 0.4
    mask[[0, 4]] = True  # one full row per replica
    mask[4:, 4] = False  # replica 1: time step 4 all padding
    with strategy.scope():
        layer = keras_bn.BatchNormalization(axis=1, momentum=0.0, synchronized=synchronized)
        layer.build((4,) + shape[1:])
    rows = [slice(0, 4), slice(4, 8)]

    def shard(context):
        part = rows[context.replica_id_in_sync_group]
        return tf.constant(x[part]), tf.constant(mask[part])

    values = strategy.experimental_distribute_values_from_function(shard)
    y = tf.function(lambda d: strategy.run(lambda a: layer(a[0], training=True, mask=a[1]), (d,)))(
        values
    )
    y = np.concatenate(strategy.experimental_local_results(y))
    kept = _keras_rule(mask, shape)
    if synchronized:
        mean, variance, m = _moments(x, kept, 1)
        assert_close(y, (x - mean[:, None]) / np.sqrt(variance[:, None] + EPS), 1e-5)
        target_mean, target_variance = mean, variance * m / (m - 1)
    else:
        parts = [_moments(x[r], kept[r], 1) for r in rows]
        weight = np.array([np.where(p[2] >= 2, p[2], 0.0) for p in parts])
        target_mean = (weight * np.nan_to_num([p[0] for p in parts])).sum(0) / weight.sum(0)
        unbiased = [p[1] * p[2] / np.maximum(p[2] - 1, 1) for p in parts]
        target_variance = (weight * np.nan_to_num(unbiased)).sum(0) / weight.sum(0)
        assert weight[1, 4] == 0 and weight[0, 4] > 0
    for variable, target in (
        (layer.moving_mean, target_mean),
        (layer.moving_variance, target_variance),
    ):
        for copy in strategy.experimental_local_results(variable.value):
            assert_close(copy, target, 1e-5)

"""keras_bn.callbacks.Recalibrate in real `fit` runs with an EMA optimizer: the final statistics
are Algorithm 2's for the final (EMA) weights, validation sees precise statistics, and training
is untouched, on one device (every backend) and on real MirroredStrategy replicas (TensorFlow's
tf.distribute); an infinite tf.data dataset where TensorFlow is installed."""

import contextlib

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from helpers import assert_close
from keras_bn.callbacks import Recalibrate

BATCH = 32


def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.0, 2.0, size=(n, 8)).astype("float32")
    y = (np.sin(x[:, :1]) + x[:, 1:2] ** 2 / 4).astype("float32")
    return x, y


X, Y = _data(192, seed=0)
X_VAL, Y_VAL = _data(64, seed=1)


def _model(strategy=None):
    """Dense → keras_bn BN → Dense → Keras BN → Dense, with Adam(use_ema=True): a large
    learning rate and a short EMA, so the EMA weights are far from the raw ones."""
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16),
                keras_bn.BatchNormalization(momentum=0.9),
                keras.layers.ReLU(),
                keras.layers.Dense(16),
                keras.layers.BatchNormalization(momentum=0.9),
                keras.layers.ReLU(),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.9), "mse", metrics=["mae"]
        )
    return model


def _bn_layers(model):
    return [layer for layer in model.layers if "BatchNormalization" in type(layer).__name__]


def _statistics(model):
    return [
        array(v) for layer in _bn_layers(model) for v in (layer.moving_mean, layer.moving_variance)
    ]


_COPY = []  # one single-device model serves every check (its evaluate is traced once)


def _recalibrated_copy(weights):
    """A single-device model with `weights`, recalibrated by hand on X."""
    if not _COPY:
        _COPY.append(_model())
    model = _COPY[0]
    model.set_weights(weights)
    keras_bn.recalibrate(model, X, batch_size=BATCH, progress=False)
    return model


def _per_replica(model):
    """Every replica's copy of every non-trainable variable (the BN statistics), as numpy: one
    copy outside a tf.distribute strategy (and under JAX and PyTorch)."""
    if keras.backend.backend() != "tensorflow":
        return [[array(v)] for v in model.non_trainable_variables]
    strategy = model.distribute_strategy
    return [
        [c.numpy() for c in strategy.experimental_local_results(v.value)]
        for v in model.non_trainable_variables
    ]


class _Record(keras.callbacks.Callback):
    """Records the weights at on_test_begin and every replica's statistics at both ends; and
    the statistics at on_train_end."""

    def __init__(self):
        super().__init__()
        self.weights, self.begin, self.end = [], [], []
        self.train_end = None

    def on_train_end(self, logs=None):
        self.train_end = _statistics(self.model)

    def on_test_begin(self, logs=None):
        self.weights.append(self.model.get_weights())
        self.begin.append(_per_replica(self.model))

    def on_test_end(self, logs=None):
        self.end.append(_per_replica(self.model))


def _numpy_first_bn_statistics(model):
    """Algorithm 2 for the first BN (input x·W + b) in float64: batch means averaged, and the
    within-batch variances pooled with m/(m−1)."""
    kernel, bias = [w.astype(np.float64) for w in model.layers[0].get_weights()]
    h = X.astype(np.float64) @ kernel + bias
    batches = np.split(h, len(h) // BATCH)
    mean = np.mean([b.mean(axis=0) for b in batches], axis=0)
    variance = np.sum([b.var(axis=0) * len(b) for b in batches], axis=0) / (len(h) - len(batches))
    return mean, variance


def _assert_validation_saw_recalibrated_statistics(history, before, after, rel):
    """Each epoch's validation metrics are those of `evaluate` after a manual recalibrate of
    the weights the validation run began with, and every replica's training statistics are
    back at its end."""
    for epoch, weights in enumerate(before.weights):
        expected = _recalibrated_copy(weights).evaluate(X_VAL, Y_VAL, verbose=0, return_dict=True)
        for name, value in expected.items():
            assert history[f"val_{name}"][epoch] == pytest.approx(value, rel=rel)
        for a, b in zip(before.begin[epoch], after.end[epoch], strict=True):
            for replica_a, replica_b in zip(a, b, strict=True):
                np.testing.assert_array_equal(replica_a, replica_b)


def test_at_train_end_recalibrates_for_the_ema_weights():
    model = _model()
    # Callbacks run in list order: `moving` sees the statistics as they are without Recalibrate.
    moving, callback = _Record(), Recalibrate(X, batch_size=BATCH)
    model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[moving, callback])

    # Keras put the EMA weights in before on_train_end: the statistics are for those.
    fresh = _statistics(_recalibrated_copy(model.get_weights()))
    for ours, expected in zip(_statistics(model), fresh, strict=True):
        np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6)
    mean, variance = _numpy_first_bn_statistics(model)
    assert_close(model.layers[1].moving_mean, mean, 1e-5)
    assert_close(model.layers[1].moving_variance, variance, 1e-5)
    assert [c.name for c in callback.last_report.layers] == [b.name for b in _bn_layers(model)]
    # Without the callback the moving averages describe other weights.
    assert (
        max(
            np.max(np.abs(a - b) / (np.abs(b) + 1))
            for a, b in zip(moving.train_end, fresh, strict=True)
        )
        > 0.05
    )


@pytest.mark.slow
def test_before_validation_sees_recalibrated_statistics_and_leaves_training_bit_identical():
    runs = []
    for recalibrate in (False, True):
        model = _model()
        before, after = _Record(), _Record()
        callbacks = [keras.callbacks.SwapEMAWeights()]  # validate with the EMA weights
        if recalibrate:  # from a generator: read once, used at every validation run
            batches = (X[i : i + BATCH] for i in range(0, len(X), BATCH))
            callback = Recalibrate(batches, at_train_end=False, before_validation=True)
            callbacks += [before, callback, after]
        history = model.fit(
            X,
            Y,
            batch_size=BATCH,
            epochs=2,
            verbose=0,
            shuffle=True,
            validation_data=(X_VAL, Y_VAL),
            callbacks=callbacks,
        ).history
        runs.append((history, model.variables + model.optimizer.variables))
    (plain, plain_variables), (history, variables) = runs

    _assert_validation_saw_recalibrated_statistics(history, before, after, rel=1e-6)
    assert callback.last_report.batches == len(X) // BATCH
    assert abs(plain["val_loss"][-1] / history["val_loss"][-1] - 1) > 0.05
    # Training after each validation run went on exactly as without the callback.
    assert plain["loss"] == history["loss"]
    for a, b in zip(plain_variables, variables, strict=True):
        np.testing.assert_array_equal(array(a), array(b), err_msg=a.path)


@pytest.mark.slow
@pytest.mark.backends("tensorflow")  # tf.distribute.MirroredStrategy
def test_works_under_mirrored_strategy():
    from tf_helpers import mirrored_strategy

    model = _model(mirrored_strategy(2))
    before, after = _Record(), _Record()
    callbacks = [before, Recalibrate(X, batch_size=BATCH, before_validation=True), after]
    history = model.fit(
        X,
        Y,
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        validation_data=(X_VAL, Y_VAL),
        callbacks=callbacks,
    ).history
    # Metrics reduced across replicas: the same within float32 rounding.
    _assert_validation_saw_recalibrated_statistics(history, before, after, rel=1e-5)
    index = next(
        i for i, v in enumerate(model.non_trainable_variables) if v is model.layers[4].moving_mean
    )
    # Keras BN replicas differ from each other, so each must get its own statistics back.
    assert not np.array_equal(*before.begin[-1][index])

    fresh = _statistics(_recalibrated_copy(model.get_weights()))
    statistics = [
        v for layer in _bn_layers(model) for v in (layer.moving_mean, layer.moving_variance)
    ]
    for variable, expected in zip(statistics, fresh, strict=True):
        for replica in model.distribute_strategy.experimental_local_results(variable.value):
            np.testing.assert_allclose(replica.numpy(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"at_train_end": False}, "would do nothing"),
        ({"before_validation": 1}, "before_validation=1"),
        ({"progress": "yes"}, "progress='yes'"),
        ({"steps": 0}, "steps=0"),
        ({"batch_size": 0}, "batch_size=0"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Recalibrate(X, **kwargs)


@pytest.mark.requires_tensorflow  # a tf.data dataset
def test_an_infinite_dataset_needs_steps():
    import tensorflow as tf

    infinite = tf.data.Dataset.from_tensor_slices(X).batch(BATCH).repeat()
    with pytest.raises(ValueError, match="infinite"):
        Recalibrate(infinite)
    assert Recalibrate(infinite, steps=3).steps == 3


def test_frozen_bn_layers_keep_the_statistics_they_were_trained_with():
    """Fine-tuning with a frozen BN (trainable=False): it normalized with its moving statistics
    all through `fit`, and the layers after it were trained for them, so the callback leaves
    them alone, at the end and for validation. The trainable BN after it gets Algorithm 2's
    statistics of its input as the frozen BN shapes it (numpy, float64)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16),
            keras_bn.BatchNormalization(),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    frozen, trained = model.layers[1], model.layers[3]
    rng = np.random.default_rng(3)  # "pretrained" statistics, far from those of X
    frozen.moving_mean.assign(rng.normal(size=16).astype("float32"))
    frozen.moving_variance.assign(rng.uniform(0.1, 0.5, size=16).astype("float32"))
    frozen.trainable = False
    pretrained = [array(v) for v in frozen.non_trainable_variables]
    model.compile(keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.9), "mse")

    class FrozenAtValidation(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            for v, p in zip(frozen.non_trainable_variables, pretrained, strict=True):
                np.testing.assert_array_equal(array(v), p, err_msg=v.path)

    callback = Recalibrate(X, batch_size=BATCH, before_validation=True)
    model.fit(
        X,
        Y,
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        validation_data=(X_VAL, Y_VAL),
        callbacks=[callback, FrozenAtValidation()],
    )

    for v, p in zip(frozen.non_trainable_variables, pretrained, strict=True):
        np.testing.assert_array_equal(array(v), p, err_msg=v.path)
    assert [c.name for c in callback.last_report.layers] == [trained.name]
    w1, b1, gamma, beta, mean, variance, w2, b2 = [
        w.astype(np.float64) for w in model.get_weights()[:8]
    ]
    h = ((X @ w1 + b1) - mean) / np.sqrt(variance + frozen.epsilon) * gamma + beta
    batches = np.split(h @ w2 + b2, len(X) // BATCH)
    assert_close(trained.moving_mean, np.mean([b.mean(axis=0) for b in batches], axis=0), 1e-5)
    assert_close(trained.moving_variance, np.mean([b.var(axis=0) for b in batches], axis=0), 1e-5)


def test_before_validation_alone_warns_when_fit_runs_no_validation():
    """The constructor refuses a callback that would do nothing; a fit without validation data
    makes before_validation=True, at_train_end=False do nothing too, so it says so."""
    callback = Recalibrate(X, batch_size=BATCH, at_train_end=False, before_validation=True)
    with pytest.warns(keras_bn.KerasBNWarning, match="ran no validation"):
        _model().fit(
            X[:BATCH], Y[:BATCH], batch_size=BATCH, epochs=1, verbose=0, callbacks=[callback]
        )
    assert callback.last_report is None


# PyTorch's fit runs eagerly, where a training batch of one sample is the layer's ValueError
# (docs/guide/backends.md, note 5), as torch.nn.BatchNorm's is.
@pytest.mark.backends("tensorflow", "jax")
def test_a_last_batch_of_one_sample_does_not_crash_fit():
    """fit trains on BATCH + 1 samples (its last batch of one outputs β, issue 17's rule); the
    callback's recalibration at the end skips that batch too instead of raising in fit."""
    model = _model()
    callback = Recalibrate(X[: BATCH + 1], batch_size=BATCH)
    model.fit(
        X[: BATCH + 1], Y[: BATCH + 1], batch_size=BATCH, epochs=1, verbose=0, callbacks=[callback]
    )
    assert callback.last_report.batches == 2
    assert [c.batches_used for c in callback.last_report.layers] == [1, 1]

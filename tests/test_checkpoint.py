"""Checkpoint resume: 3 epochs straight equal 2 epochs, a .keras save and load, and 1 more,
for model.fit and for a custom training loop (weights, optimizer state, moving statistics)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_bn

pytestmark = pytest.mark.backends("tensorflow")

EPOCHS, BATCH = 3, 32


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, size=(128, 6, 6, 2)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 1.0).astype("int32")
    return x, y


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(4, 3, use_bias=False),
            keras_bn.BatchNormalization(momentum=0.8),
            keras.layers.ReLU(),
            keras.layers.Flatten(),
            keras.layers.Dense(8, use_bias=False),
            keras_bn.BatchNormalization(momentum=0.8),
            keras.layers.ReLU(),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def _fit(model, epochs, x, y):
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)


def _custom_loop(model, epochs, x, y):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(epochs):
        for start in range(0, len(x), BATCH):
            step(x[start : start + BATCH], y[start : start + BATCH])


@pytest.mark.slow
@pytest.mark.parametrize("train", [_fit, _custom_loop], ids=["fit", "custom_loop"])
def test_resume_from_keras_file_equals_uninterrupted_training(train, tmp_path):
    x, y = _data()
    straight = _model()
    train(straight, EPOCHS, x, y)

    first = _model()
    train(first, EPOCHS - 1, x, y)
    path = tmp_path / "checkpoint.keras"
    first.save(path)
    resumed = keras.saving.load_model(path)
    train(resumed, 1, x, y)

    names = [w.name for w in straight.weights]
    assert names == [w.name for w in resumed.weights]
    assert any("moving_variance" in n for n in names)
    for a, b, name in zip(straight.weights, resumed.weights, names):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-6, err_msg=name)
    for a, b in zip(straight.optimizer.variables, resumed.optimizer.variables):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-6)
    # Training really moved the statistics, so equality is not trivial.
    assert not np.allclose(straight.layers[1].moving_variance, 1.0)

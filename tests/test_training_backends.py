"""keras_bn.BatchNormalization in training under each backend: `model.fit` (jitted under
JAX, eager under PyTorch), `stateless_call` under jax.jit, the config, `.keras` files that
cross between JAX or PyTorch and TensorFlow, the same model trained under each (each other side
a Python of its own, tests/tensorflow_side.py), and the backend guard on everything of keras_bn
that still needs TensorFlow."""

import importlib
import importlib.util

import keras
import numpy as np
import pytest
import tensorflow_side
from framework_references import array

import keras_bn

BACKEND = keras.backend.backend()

FEATURES = 4


def _data(shape, seed=0, loc=1.0, scale=2.0):
    return np.random.default_rng(seed).normal(loc, scale, shape).astype("float32")


def test_fit_trains_and_updates_the_moving_statistics():
    """Under `fit` (jit_compile "auto": jitted under JAX, its default, eager under PyTorch) the
    first BN sees the raw input batches, so its moving statistics replay in numpy (Algorithm 2's
    m/(m−1)); the second, with momentum=None and renorm, counts every batch; γ trains."""
    x, y = _data((64, FEATURES), 1), _data((64, 1), 2)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras_bn.BatchNormalization(momentum=0.5, name="first"),
            keras.layers.Dense(3),
            keras_bn.BatchNormalization(momentum=None, renorm=True, name="second"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert BACKEND != "jax" or model.jit_compile is True
    assert np.isfinite(history.history["loss"]).all()
    mean, variance = np.zeros(FEATURES), np.ones(FEATURES)
    for batch in np.split(x.astype(np.float64), 4):
        mean = 0.5 * mean + 0.5 * batch.mean(0)
        variance = 0.5 * variance + 0.5 * batch.var(0, ddof=1)
    first, second = model.get_layer("first"), model.get_layer("second")
    np.testing.assert_allclose(array(first.moving_mean), mean, rtol=1e-5)
    np.testing.assert_allclose(array(first.moving_variance), variance, rtol=1e-5)
    assert np.all(array(first.gamma) != 1.0)  # trained through the hand-written backward
    assert int(array(second.num_batches_tracked)) == 4
    np.testing.assert_allclose(
        array(second.moving_stddev), np.sqrt(array(second.moving_variance) + 1e-3), rtol=1e-6
    )


@pytest.mark.backends("jax")  # PyTorch's eager fit raises: test_torch_layer.py
def test_fit_whose_last_batch_holds_one_sample_trains_as_on_tensorflow():
    """9 samples in batches of 8: the last batch holds one sample. On TensorFlow `fit` traces
    the batch size as unknown, so that batch is run-time data: the BN outputs β there, its
    gradients to x and γ are 0, and its statistics stay. Under JAX's traced `fit` the same
    (an eager call with a batch of one stays a ValueError)."""
    import jax

    x, y = _data((9, FEATURES), 4), _data((9, 1), 5)
    for momentum in (0.5, None):
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras_bn.BatchNormalization(momentum=momentum, name="bn"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(keras.optimizers.SGD(0.1), "mse")
        history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert np.isfinite(history.history["loss"]).all()
        bn = model.get_layer("bn")
        first = x[:8].astype(np.float64)
        if momentum is None:
            mean, variance = first.mean(0), first.var(0, ddof=1)
            assert int(array(bn.num_batches_tracked)) == 1  # the one-sample batch uncounted
        else:
            mean, variance = 0.5 * first.mean(0), 0.5 + 0.5 * first.var(0, ddof=1)
        np.testing.assert_allclose(array(bn.moving_mean), mean, rtol=1e-5)
        np.testing.assert_allclose(array(bn.moving_variance), variance, rtol=1e-5)

    layer = keras_bn.BatchNormalization()
    layer.build((1, FEATURES))
    trainable = [v.value for v in layer.trainable_variables]
    beta = np.random.default_rng(6).normal(size=FEATURES).astype("float32")
    trainable[1] = beta

    def loss(trainable, x):
        out, new = layer.stateless_call(
            trainable, [v.value for v in layer.non_trainable_variables], x, training=True
        )
        return jax.numpy.sum(out * 3.0), (out, new)

    grads, (out, new) = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(trainable, x[:1])
    np.testing.assert_array_equal(np.asarray(out), beta[None])
    np.testing.assert_array_equal(np.asarray(grads[1]), 0.0)  # to x
    np.testing.assert_array_equal(np.asarray(grads[0][0]), 0.0)  # to γ
    np.testing.assert_array_equal(np.asarray(grads[0][1]), 3.0)  # to β
    np.testing.assert_array_equal(np.asarray(new[0]), 0.0)
    np.testing.assert_array_equal(np.asarray(new[1]), 1.0)


@pytest.mark.backends("jax")
def test_stateless_call_returns_the_new_statistics_and_changes_nothing():
    import jax

    layer = keras_bn.BatchNormalization(momentum=0.8, renorm=True)
    x = _data((8, FEATURES), 3)
    layer.build(x.shape)
    trainable = [v.value for v in layer.trainable_variables]
    fixed = [v.value for v in layer.non_trainable_variables]
    before = [np.asarray(v) for v in fixed]

    @jax.jit
    def step(trainable, fixed, x):
        return layer.stateless_call(trainable, fixed, x, training=True)

    y, new = step(trainable, fixed, x)
    for variable, value in zip(layer.non_trainable_variables, before):
        np.testing.assert_array_equal(array(variable), value)  # nothing assigned
    expected = layer(x, training=True)  # the stateful call, eager
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-6, atol=1e-6)
    for variable, value in zip(layer.non_trainable_variables, new):
        np.testing.assert_allclose(np.asarray(value), array(variable), rtol=1e-6)
    assert np.any(np.asarray(new[0]) != before[0])


# The TensorFlow side of the `.keras` round trip; argv: the folder, the other backend.
_TENSORFLOW_SIDE = """
import json, sys
import numpy as np
import keras
import keras_bn

assert keras.backend.backend() == "tensorflow"
folder, other = sys.argv[1:]
x = np.load(folder + "/x.npy")
# compile=False for PyTorch: Keras saves a PyTorch model's optimizer as its torch subclass
# (keras.src.backend.torch.optimizers), which TensorFlow's Keras cannot import.
loaded = keras.saving.load_model(folder + "/" + other + ".keras", compile=other != "torch")
error = float(np.max(np.abs(loaded.predict(x, verbose=0) - np.load(folder + "/other_y.npy"))))
weights_match = all(
    np.array_equal(np.asarray(w), np.load(folder + "/other_weights.npz")[str(i)])
    for i, w in enumerate(loaded.weights)
)
model = keras.models.clone_model(loaded)
model.compile(keras.optimizers.SGD(0.05), "mse")
model.fit(x, np.load(folder + "/y.npy"), batch_size=8, epochs=2, verbose=0)
model.save(folder + "/tensorflow.keras")
np.save(folder + "/tensorflow_y.npy", model.predict(x, verbose=0))
print(json.dumps({"error": error, "weights_match": weights_match}))
"""

# The other backend's side, in a fresh process: `import keras_bn` alone registers the layer.
_OTHER_SIDE = """
import json, sys
import numpy as np
import keras_bn  # registers keras_bn's layer once Keras has loaded
import keras

assert keras.backend.backend() == sys.argv[2]
folder = sys.argv[1]
loaded = keras.saving.load_model(folder + "/tensorflow.keras")
y = keras.ops.convert_to_numpy(loaded.predict(np.load(folder + "/x.npy"), verbose=0))
print(json.dumps({"error": float(np.max(np.abs(y - np.load(folder + "/tensorflow_y.npy"))))}))
"""


@pytest.mark.backends("jax", "torch")
@pytest.mark.tensorflow_side
def test_keras_files_cross_between_this_backend_and_tensorflow(tmp_path):
    """A model trained and saved under JAX or PyTorch loads under TensorFlow with the same
    weights and outputs; one trained and saved there loads back under this backend (a fresh
    process: `import keras_bn` alone registers the layer) with the same outputs."""
    x, y = _data((32, 5, FEATURES), 4), _data((32, 5, 2), 5)
    model = keras.Sequential(
        [
            keras.Input((5, FEATURES)),
            keras_bn.BatchNormalization(momentum=None, renorm=True, name="cumulative"),
            keras.layers.Dense(3),
            keras_bn.BatchNormalization(axis=1, momentum=0.7, virtual_batch_size=4, name="ghost"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert int(array(model.get_layer("cumulative").num_batches_tracked)) == 8
    model.save(tmp_path / f"{BACKEND}.keras")
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.save(tmp_path / "other_y.npy", array(model.predict(x, verbose=0)))
    np.savez(
        tmp_path / "other_weights.npz", **{str(i): array(w) for i, w in enumerate(model.weights)}
    )
    found = tensorflow_side.run(_TENSORFLOW_SIDE, tmp_path, BACKEND, backend="tensorflow")
    assert found["weights_match"] is True
    assert found["error"] <= 1e-5
    assert tensorflow_side.run(_OTHER_SIDE, tmp_path, BACKEND, backend=BACKEND)["error"] <= 1e-5


# argv: the folder, and the backend compared with TensorFlow (JAX's comparison jit-compiles
# `fit` on both sides).
_TRAIN_BOTH = """
import sys
import numpy as np
import keras
import keras_bn

folder, compared = sys.argv[1:]
keras.utils.set_random_seed(0)
inputs = keras.Input((7, 5, 3))
h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
h = keras_bn.BatchNormalization(momentum=0.7)(h)
h = keras.layers.ReLU()(h)
h = keras.layers.Permute((3, 1, 2))(h)
clipping = {"rmax": 1.5, "rmin": 0.7, "dmax": 0.5}
h = keras_bn.BatchNormalization(axis=1, renorm=True, renorm_clipping=clipping)(h)
h = keras.layers.Dense(6)(keras.layers.Flatten()(h))
h = keras_bn.BatchNormalization(momentum=None)(h)
h = keras_bn.BatchNormalization(virtual_batch_size=5)(h)
model = keras.Model(inputs, keras.layers.Dense(2)(h))
# Kernels from numpy (each backend's initializers draw differently); the rest as built
# (zeros, ones, counters: the same on both).
rng = np.random.default_rng(2)
model.set_weights(
    [rng.normal(0.0, 0.3, w.shape) if len(w.shape) >= 2 else np.asarray(w) for w in model.weights]
)
x, y = np.load(folder + "/x.npy"), np.load(folder + "/y.npy")
model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=True if compared == "jax" else "auto")
model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
trained = model.predict(x, verbose=0)
keras_bn.recalibrate(model, x, batch_size=10, progress=False)
np.savez(
    folder + "/" + keras.backend.backend() + ".npz",
    trained=keras.ops.convert_to_numpy(trained),
    recalibrated=keras.ops.convert_to_numpy(model.predict(x, verbose=0)),
    **{str(i): keras.ops.convert_to_numpy(w) for i, w in enumerate(model.weights)},
)
print("{}")
"""


@pytest.mark.slow
@pytest.mark.backends("jax", "torch")
@pytest.mark.tensorflow_side
def test_training_under_this_backend_equals_training_under_tensorflow(tmp_path):
    """The same model, weights and batches, trained 8 steps under each backend (jit under JAX,
    a conv, a channels_first renorm BN with its clipping hit, momentum=None, ghost batches),
    then recalibrated: every weight, moving statistic and output agrees. Parameters whose
    gradient is 0 in exact arithmetic (a bias before a BN) stay within 1e-7 of 0 on both."""
    rng = np.random.default_rng(1)
    np.save(tmp_path / "x.npy", (rng.normal(size=(40, 7, 5, 3)) * 3 + 2).astype("float32"))
    np.save(tmp_path / "y.npy", rng.normal(size=(40, 2)).astype("float32"))
    for backend in ("tensorflow", BACKEND):
        tensorflow_side.run(_TRAIN_BOTH, tmp_path, BACKEND, backend=backend)
    on_tf, on_other = np.load(tmp_path / "tensorflow.npz"), np.load(tmp_path / f"{BACKEND}.npz")
    assert sorted(on_tf.files) == sorted(on_other.files)
    for key in on_tf.files:
        expected = on_tf[key].astype(np.float64)
        scale = max(float(np.abs(expected).max()), 1e-2)
        np.testing.assert_allclose(on_other[key], expected, rtol=0, atol=1e-5 * scale, err_msg=key)
    assert not np.allclose(on_tf["trained"], on_tf["recalibrated"], atol=1e-3)


# What the ImportError says works under each backend.
WHAT_WORKS = {
    "jax": "Under JAX keras_bn.BatchNormalization, recalibrate, callbacks.Recalibrate, ",
    "torch": "Under PyTorch keras_bn.BatchNormalization, recalibrate, ",
}


@pytest.mark.parametrize(
    ("use", "name"),
    [
        (
            lambda: keras_bn.diagnostics.gradient_norms_by_layer(None, None, None, "mse"),
            "keras_bn.diagnostics.gradient_norms_by_layer",
        ),
        (lambda: importlib.import_module("keras_bn.export").export_tflite, None),
        (lambda: importlib.import_module("keras_bn.export.onnx"), "keras_bn.export.export_onnx"),
    ],
)
@pytest.mark.backends("jax", "torch")
def test_everything_but_the_layer_still_needs_tensorflow(use, name):
    """The diagnostics' gradient probes and the writers raise a clear ImportError that names
    what needs TensorFlow and what works under this backend (the layer, convert and
    fold_batch_norms: test_jax_fold.py); where TensorFlow is not installed (make's .venv-jax and
    .venv-torch), the extra to install."""
    with pytest.raises(ImportError) as raised:
        use()
    message = str(raised.value)
    if importlib.util.find_spec("tensorflow") is not None:
        assert f"needs the TensorFlow Keras backend, but Keras is using '{BACKEND}'" in message
        assert WHAT_WORKS[BACKEND] in message
    else:
        assert 'pip install "keras-bn[' in message, message
    assert "KERAS_BACKEND=tensorflow" in message
    if name is not None:
        assert message.startswith(name)
    assert keras_bn.BatchNormalization.__module__ == "keras_bn.layers"  # the layer still works

"""keras_bn under PyTorch beside TensorFlow (each side a Python of its own,
tests/tensorflow_side.py): `.keras` files that cross between the two backends, and the same
model trained under each."""

import keras
import numpy as np
import pytest
import tensorflow_side
from references import array

import keras_bn

_TENSORFLOW_SIDE = """
import json, sys
import numpy as np
import keras
import keras_bn

assert keras.backend.backend() == "tensorflow"
folder = sys.argv[1]
x = np.load(folder + "/x.npy")
# compile=False: Keras saves a PyTorch model's optimizer as its torch subclass
# (keras.src.backend.torch.optimizers), which TensorFlow's Keras cannot import.
loaded = keras.saving.load_model(folder + "/torch.keras", compile=False)
torch_error = float(np.max(np.abs(loaded.predict(x, verbose=0) - np.load(folder + "/torch_y.npy"))))
weights_match = all(
    np.array_equal(np.asarray(w), np.load(folder + "/torch_weights.npz")[str(i)])
    for i, w in enumerate(loaded.weights)
)
model = keras.models.clone_model(loaded)
model.compile(keras.optimizers.SGD(0.05), "mse")
model.fit(x, np.load(folder + "/y.npy"), batch_size=8, epochs=2, verbose=0)
model.save(folder + "/tensorflow.keras")
np.save(folder + "/tensorflow_y.npy", model.predict(x, verbose=0))
print(json.dumps({"torch_error": torch_error, "weights_match": weights_match}))
"""

_TORCH_SIDE = """
import json, sys
import numpy as np
import keras_bn  # registers keras_bn's layer once Keras has loaded
import keras

assert keras.backend.backend() == "torch"
folder = sys.argv[1]
loaded = keras.saving.load_model(folder + "/tensorflow.keras")
y = keras.ops.convert_to_numpy(loaded.predict(np.load(folder + "/x.npy"), verbose=0))
print(json.dumps({"error": float(np.max(np.abs(y - np.load(folder + "/tensorflow_y.npy"))))}))
"""


def _data(shape, seed=0, loc=1.0, scale=2.0):
    return np.random.default_rng(seed).normal(loc, scale, shape).astype("float32")


@pytest.mark.tensorflow_side
def test_keras_files_cross_between_torch_and_tensorflow(tmp_path):
    """A model trained and saved under PyTorch loads under TensorFlow with the same weights and
    outputs; one trained and saved there loads back under PyTorch (a fresh process: `import
    keras_bn` alone registers the layer) with the same outputs."""
    features = 4
    x, y = _data((32, 5, features), 4), _data((32, 5, 2), 5)
    model = keras.Sequential(
        [
            keras.Input((5, features)),
            keras_bn.BatchNormalization(momentum=None, renorm=True, name="cumulative"),
            keras.layers.Dense(3),
            keras_bn.BatchNormalization(axis=1, momentum=0.7, virtual_batch_size=4, name="ghost"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert int(array(model.get_layer("cumulative").num_batches_tracked)) == 8
    model.save(tmp_path / "torch.keras")
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.save(tmp_path / "torch_y.npy", array(model.predict(x, verbose=0)))
    np.savez(
        tmp_path / "torch_weights.npz", **{str(i): array(w) for i, w in enumerate(model.weights)}
    )
    found = tensorflow_side.run(_TENSORFLOW_SIDE, tmp_path, backend="tensorflow")
    assert found["weights_match"] is True
    assert found["torch_error"] <= 1e-5
    assert tensorflow_side.run(_TORCH_SIDE, tmp_path, backend="torch")["error"] <= 1e-5


_TRAIN_BOTH = """
import sys
import numpy as np
import keras
import keras_bn

folder = sys.argv[1]
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
# Kernels from numpy (each backend's initializers draw differently); the rest as built.
rng = np.random.default_rng(2)
model.set_weights(
    [rng.normal(0.0, 0.3, w.shape) if len(w.shape) >= 2 else np.asarray(w) for w in model.weights]
)
x, y = np.load(folder + "/x.npy"), np.load(folder + "/y.npy")
model.compile(keras.optimizers.SGD(0.05), "mse")
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
@pytest.mark.tensorflow_side
def test_training_under_torch_equals_training_under_tensorflow(tmp_path):
    """The same model, weights and batches, trained 8 steps under each backend (a conv, a
    channels_first renorm BN with its clipping hit, momentum=None, ghost batches), then
    recalibrated: every weight, moving statistic and output agrees."""
    rng = np.random.default_rng(1)
    np.save(tmp_path / "x.npy", (rng.normal(size=(40, 7, 5, 3)) * 3 + 2).astype("float32"))
    np.save(tmp_path / "y.npy", rng.normal(size=(40, 2)).astype("float32"))
    for backend in ("tensorflow", "torch"):
        tensorflow_side.run(_TRAIN_BOTH, tmp_path, backend=backend)
    on_tf, on_torch = np.load(tmp_path / "tensorflow.npz"), np.load(tmp_path / "torch.npz")
    assert sorted(on_tf.files) == sorted(on_torch.files)
    for key in on_tf.files:
        expected = on_tf[key].astype(np.float64)
        scale = max(float(np.abs(expected).max()), 1e-2)
        np.testing.assert_allclose(on_torch[key], expected, rtol=0, atol=1e-5 * scale, err_msg=key)
    assert not np.allclose(on_tf["trained"], on_tf["recalibrated"], atol=1e-3)

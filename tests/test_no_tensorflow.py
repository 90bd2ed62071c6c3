"""keras_bn under JAX and PyTorch where TensorFlow is not installed: make's .venv-jax and
.venv-torch, whose runs set KERAS_BN_NO_TENSORFLOW=1 (elsewhere these tests skip: a Python with
TensorFlow proves nothing here). Each use runs in a fresh Python, so that nothing imported by
the other tests helps it: `import keras_bn` before or after `import keras`, the TFLite and ONNX
writers' ImportError; under JAX training with `fit`, `recalibrate`, `callbacks.Recalibrate`,
`check_batchnorm`, `convert`, the fold and QAT, `.keras` files loaded in another fresh process;
under PyTorch training and `recalibrate`."""

import importlib.util
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

pytestmark = [
    pytest.mark.backends("jax", "torch"),
    pytest.mark.skipif(
        os.environ.get("KERAS_BN_NO_TENSORFLOW") != "1",
        reason="KERAS_BN_NO_TENSORFLOW=1 runs these (make test's .venv-jax and .venv-torch, "
        "without TensorFlow)",
    ),
]
BACKEND = keras.backend.backend()


def _fresh(source, *args):
    """Run `source` in a fresh Python (this one) under this run's backend; the JSON of its last
    line of output."""
    result = subprocess.run(
        [sys.executable, "-c", source, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "KERAS_BACKEND": BACKEND},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_tensorflow_is_not_installed():
    assert importlib.util.find_spec("tensorflow") is None
    with pytest.raises(ModuleNotFoundError, match="tensorflow"):
        import tensorflow  # noqa: F401


_IMPORTS = """
import json, sys
import {first}
import {second}
import numpy as np

layer = keras_bn.BatchNormalization()
y = layer(np.ones((4, 3), "float32"), training=True)
print(json.dumps({{
    "backend": keras.backend.backend(),
    "output": keras.ops.convert_to_numpy(y).tolist(),
    "tensorflow_imported": "tensorflow" in sys.modules,
}}))
"""


@pytest.mark.parametrize("first", ["keras_bn", "keras"])
def test_keras_bn_and_keras_import_in_either_order(first):
    second = "keras" if first == "keras_bn" else "keras_bn"
    found = _fresh(_IMPORTS.format(first=first, second=second))
    assert found["backend"] == BACKEND
    assert found["output"] == [[0.0, 0.0, 0.0]] * 4  # constant input: x − μ = 0, β = 0
    assert found["tensorflow_imported"] is False


_TRAIN = """
import json, sys
import numpy as np
import keras_bn
import keras
from keras_bn.export import fold_batch_norms

assert keras.backend.backend() == "jax"
folder = sys.argv[1]
rng = np.random.default_rng(0)
x = rng.normal(1.0, 2.0, (64, 8, 8, 3)).astype("float32")
y = rng.normal(size=(64, 2)).astype("float32")


def build(norm):
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, use_bias=False, name="conv")(inputs)
    h = norm(name="bn")(h)
    h = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(h))
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))


found = {}
# convert: Keras's BN swapped for keras_bn's, weights kept; and back.
ours = keras_bn.convert.from_keras(build(keras.layers.BatchNormalization))
found["converted"] = type(ours.get_layer("bn")).__module__.split(".")[0]
back = keras_bn.convert.to_keras(ours)
found["converted_back"] = type(back.get_layer("bn")).__module__.split(".")[0]

# fit, with callbacks.Recalibrate at its end.
model = build(keras_bn.BatchNormalization)
model.compile(keras.optimizers.SGD(0.05), "mse")
gamma = np.array(model.get_layer("bn").gamma)
history = model.fit(
    x, y, batch_size=16, epochs=2, verbose=0,
    callbacks=[keras_bn.callbacks.Recalibrate(x, batch_size=16)],
)
found["loss_finite"] = bool(np.isfinite(history.history["loss"]).all())
found["gamma_trained"] = bool(np.any(np.array(model.get_layer("bn").gamma) != gamma))

# recalibrate: Algorithm 2 on the BN's input, 4 batches of m = 16·6·6 values a channel: the
# mean of the batch means, and m/(m−1) times the mean of the batch variances.
bn = model.get_layer("bn")
bn.moving_mean.assign(np.full(4, 5.0, "float32"))
report = keras_bn.recalibrate(model, x, batch_size=16, progress=False)
found["recalibrated"] = [change.name for change in report.layers]
h = keras.Model(model.inputs, model.get_layer("conv").output).predict(x, verbose=0)
batches = h.astype(np.float64).reshape(4, -1, 4)
m = batches.shape[1]
mean, variance = batches.mean(1).mean(0), batches.var(1).mean(0) * m / (m - 1)
found["mean_error"] = float(np.max(np.abs(np.array(bn.moving_mean) - mean)))
found["variance_error"] = float(np.max(np.abs(np.array(bn.moving_variance) / variance - 1.0)))

# check_batchnorm: statistics far from the data are found.
bn.moving_mean.assign(np.full(4, 50.0, "float32"))
findings = keras_bn.diagnostics.check_batchnorm(model, x, batch_size=16)
found["findings"] = sorted({f.kind for f in findings if f.layer == "bn"})
keras_bn.recalibrate(model, x, batch_size=16, progress=False)

# The fold: the same outputs with the BN folded into the conv.
expected = model.predict(x, verbose=0)
folded, fold_report = fold_batch_norms(model, x)
found["folded"] = len(fold_report.folded)
found["fold_error"] = float(np.max(np.abs(folded.predict(x, verbose=0) - expected)))
model.save(folder + "/model.keras")
np.save(folder + "/model_y.npy", expected)

# QAT: build, fit (the BN frozen after two steps), save.
qat = keras_bn.quantize.quantize_model(model)
qat.compile(keras.optimizers.SGD(0.01), "mse")
before = [np.array(w) for w in qat.trainable_weights]
qat.fit(
    x, y, batch_size=16, epochs=1, verbose=0,
    callbacks=[keras_bn.quantize.FreezeBatchNorm(after_steps=2)],
)
found["qat_trained"] = any(
    not np.array_equal(a, np.array(b)) for a, b in zip(before, qat.trainable_weights)
)
qat.save(folder + "/qat.keras")
np.save(folder + "/qat_y.npy", qat.predict(x[:8], verbose=0))
np.save(folder + "/x.npy", x)
found["tensorflow_imported"] = "tensorflow" in sys.modules
print(json.dumps(found))
"""

_LOAD = """
import json, sys
import numpy as np
import keras_bn  # registers keras_bn's layers, QAT's included, once Keras loads
import keras

folder = sys.argv[1]
x = np.load(folder + "/x.npy")
model = keras.saving.load_model(folder + "/model.keras")
qat = keras.saving.load_model(folder + "/qat.keras")
model_y, qat_y = model.predict(x, verbose=0), qat.predict(x[:8], verbose=0)
print(json.dumps({
    "model_error": float(np.max(np.abs(model_y - np.load(folder + "/model_y.npy")))),
    "qat_error": float(np.max(np.abs(qat_y - np.load(folder + "/qat_y.npy")))),
    "tensorflow_imported": "tensorflow" in sys.modules,
}))
"""


@pytest.mark.slow
@pytest.mark.backends("jax")
def test_train_recalibrate_fold_and_quantize_then_load_in_a_fresh_process(tmp_path):
    found = _fresh(_TRAIN, tmp_path)
    assert found["converted"] == "keras_bn" and found["converted_back"] == "keras"
    assert found["loss_finite"] and found["gamma_trained"]
    assert found["recalibrated"] == ["bn"]
    assert found["mean_error"] <= 1e-4 and found["variance_error"] <= 1e-4, found
    assert "stale_statistics" in found["findings"], found
    assert found["folded"] == 1 and found["fold_error"] <= 1e-4, found
    assert found["qat_trained"]
    assert found["tensorflow_imported"] is False
    loaded = _fresh(_LOAD, tmp_path)
    assert loaded["model_error"] <= 1e-5 and loaded["qat_error"] <= 1e-5, loaded
    assert loaded["tensorflow_imported"] is False


_WRITERS = """
import json, sys
import keras
import keras_bn
import keras_bn.export

model = keras.Sequential([keras.Input((3,)), keras_bn.BatchNormalization(), keras.layers.Dense(2)])
found = {}
for name in ("export_tflite", "export_onnx"):
    try:
        getattr(keras_bn.export, name)(model, sys.argv[1] + "/model." + name[7:])
    except ImportError as error:
        found[name] = str(error)
    except Exception as error:
        found[name] = f"not an ImportError: {type(error).__name__}: {error}"
    else:
        found[name] = "no error"
print(json.dumps(found))
"""


def test_the_file_writers_say_what_to_install_and_how_to_export(tmp_path):
    """Without TensorFlow, export_tflite and export_onnx raise ImportError: it names the extra to
    install and says to write the files from the saved .keras file under TensorFlow."""
    found = _fresh(_WRITERS, tmp_path)
    for name, message in found.items():
        assert 'pip install "keras-bn[export]"' in message, (name, message)
        assert ".keras" in message and "KERAS_BACKEND=tensorflow" in message, (name, message)
    assert not list(tmp_path.iterdir())  # nothing written


_TRAIN_TORCH = """
import json, sys
import keras_bn
import keras
import numpy as np

model = keras.Sequential([keras.Input((3,)), keras_bn.BatchNormalization(), keras.layers.Dense(1)])
model.compile("sgd", "mse")
x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
model.fit(x, x[:, :1], batch_size=8, verbose=0)
keras_bn.recalibrate(model, x, batch_size=8, progress=False)
print(json.dumps({
    "backend": keras.backend.backend(),
    "tensorflow_imported": "tensorflow" in sys.modules,
    "moving_mean": np.asarray(model.layers[0].moving_mean).tolist(),
}))
"""


@pytest.mark.backends("torch")
def test_keras_bn_trains_and_recalibrates_without_tensorflow():
    result = subprocess.run(
        [sys.executable, "-c", _TRAIN_TORCH],
        capture_output=True,
        text=True,
        env={**os.environ, "KERAS_BACKEND": "torch"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["backend"] == "torch" and not found["tensorflow_imported"]
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    np.testing.assert_allclose(found["moving_mean"], x.astype(np.float64).mean(0), atol=1e-6)

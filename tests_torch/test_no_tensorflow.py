"""keras_bn under PyTorch where TensorFlow is not installed: make's .venv-torch, which sets
KERAS_BN_NO_TENSORFLOW=1 (elsewhere these tests skip: a Python with TensorFlow proves nothing
here). A fresh Python trains a model and recalibrates it without ever importing TensorFlow."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("KERAS_BN_NO_TENSORFLOW") != "1",
    reason="KERAS_BN_NO_TENSORFLOW=1 runs these (make test-torch's .venv-torch)",
)

_TRAIN = """
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


def test_tensorflow_is_not_installed():
    assert importlib.util.find_spec("tensorflow") is None


def test_keras_bn_trains_and_recalibrates_without_tensorflow():
    result = subprocess.run(
        [sys.executable, "-c", _TRAIN],
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

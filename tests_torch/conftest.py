"""The PyTorch-backend suite: keras_bn under KERAS_BACKEND=torch.

Keras fixes its backend when first imported, so these tests run in their own pytest process
(`make test-torch`: KERAS_BACKEND=torch python -m pytest tests_torch, in .venv-torch, which has
no TensorFlow), never beside tests/ (whose conftest imports TensorFlow's Keras first). The
TensorFlow comparisons run in another Python (tests/tensorflow_side.py).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest
import torch

assert keras.backend.backend() == "torch", (
    f"tests_torch needs KERAS_BACKEND=torch, but Keras is using {keras.backend.backend()!r}: "
    f"run `KERAS_BACKEND=torch python -m pytest tests_torch` in a process of its own."
)


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Each test starts from the float32 policy, a fixed seed and float32 matmuls (no TF32 on
    a GPU: the references' tolerances are float32's)."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    keras.mixed_precision.set_global_policy("float32")

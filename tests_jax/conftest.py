"""The JAX-backend suite: keras_bn.BatchNormalization under KERAS_BACKEND=jax.

Keras fixes its backend when first imported, so these tests run in their own pytest process
(`KERAS_BACKEND=jax python -m pytest tests_jax`, a second run of `make test`), never beside
tests/ (whose conftest imports TensorFlow's Keras first).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
# Two CPU devices for keras.distribution.DataParallel (test_jax_distribution.py), added to
# any XLA_FLAGS given: XLA reads them when JAX starts, so before Keras imports it. Code that
# names no device runs on the first.
os.environ["XLA_FLAGS"] = " ".join(
    dict.fromkeys(
        [*os.environ.get("XLA_FLAGS", "").split(), "--xla_force_host_platform_device_count=2"]
    )
)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest

assert keras.backend.backend() == "jax", (
    f"tests_jax needs KERAS_BACKEND=jax, but Keras is using {keras.backend.backend()!r}: run "
    f"`KERAS_BACKEND=jax python -m pytest tests_jax` in a process of its own."
)


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Each test starts from the float32 policy and a fixed seed."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.mixed_precision.set_global_policy("float32")

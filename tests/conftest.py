"""Settings and fixtures for the whole suite: environment, logical devices, hypothesis
profiles, a clean Keras state per test. Helpers that tests import live in helpers.py
(pytest advises against importing conftest.py)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# TensorFlow turns oneDNN on by default only on CPUs with AVX-512; without it, an eager
# channels_first convolution fails ("Conv2D op currently only supports the NHWC tensor format
# on the CPU"), and the channels_first fold and export tests could not run.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import tensorflow as tf

# Four logical CPU devices, for the tf.distribute tests' real MirroredStrategy replicas. This
# must run before TensorFlow initialises its devices; ops without a device scope still run on
# /CPU:0, so the rest of the suite is unaffected.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 4)

import keras  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property-based tests: "ci" (the default) runs 700 examples per property, over 2,000 in all;
# HYPOTHESIS_PROFILE=thorough runs ten times more.
for _name, _examples in (("ci", 700), ("thorough", 7000)):
    settings.register_profile(
        _name,
        max_examples=_examples,
        deadline=None,
        derandomize=(_name == "ci"),
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Each test starts from the float32 policy and a fixed seed."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.mixed_precision.set_global_policy("float32")

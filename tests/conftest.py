import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

# Four logical CPU devices, for the tf.distribute tests' real MirroredStrategy replicas. This
# must run before TensorFlow initialises its devices; ops without a device scope still run on
# /CPU:0, so the rest of the suite is unaffected.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def assert_close(actual, expected, rtol):
    """Equal to within `rtol` of the expected tensor's scale (max |expected|).

    Scale-relative rather than elementwise, so that entries near zero (a gradient component
    that happens to vanish) do not demand absolute precision no computation can give.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Each test starts from the float32 policy and a fixed seed."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.mixed_precision.set_global_policy("float32")

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


def broadcast_shape(shape, channel_axes):
    """Shape of a per-channel array lined up with an input of `shape`."""
    return [shape[i] if i in channel_axes else 1 for i in range(len(shape))]


def numpy_bn_train(x, gamma, beta, channel_axes, eps=1e-3, mask=None):
    """Forward BN from the article's formulas; returns (y, mean, biased var) in param shape."""
    axes = tuple(i for i in range(x.ndim) if i not in channel_axes)
    bshape = broadcast_shape(x.shape, channel_axes)
    w = np.ones_like(x) if mask is None else np.broadcast_to(mask, x.shape).astype(x.dtype)
    m = w.sum(axis=axes, keepdims=True)
    mean = (w * x).sum(axis=axes, keepdims=True) / m
    var = (w * (x - mean) ** 2).sum(axis=axes, keepdims=True) / m
    y = gamma.reshape(bshape) * (x - mean) / np.sqrt(var + eps) + beta.reshape(bshape)
    pshape = gamma.shape
    return y, mean.reshape(pshape), var.reshape(pshape)

@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Each test starts from the float32 policy and a fixed seed."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.mixed_precision.set_global_policy("float32")

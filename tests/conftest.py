import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

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


def randomise_batch_norms(model, seed=0):
    """Give every BN (nested ones too) random, well-conditioned statistics and affine params.

    Freshly built BNs are the identity map, which would let a wrong fold pass unnoticed.
    """
    rng = np.random.default_rng(seed)
    for layer in model._flatten_layers(include_self=False):
        if "BatchNormalization" not in type(layer).__name__:
            continue
        n = layer.moving_mean.shape
        values = {
            "gamma": rng.uniform(0.5, 1.5, n), "beta": rng.normal(0, 0.2, n),
            "moving_mean": rng.normal(0, 0.2, n), "moving_variance": rng.uniform(0.5, 1.5, n),
        }
        for name, value in values.items():
            variable = getattr(layer, name)
            if variable is not None:
                variable.assign(value.astype("float32"))
    return model

"""Checks that import nothing of keras_bn's TensorFlow-only code: tests/test_keras_parity.py
uses them, and it runs under every backend. helpers.py re-exports them."""

import os

import keras
import numpy as np


def assert_close(actual, expected, rtol):
    """Equal to within `rtol` of the expected tensor's scale (max |expected|).

    Scale-relative rather than elementwise, so that entries near zero (a gradient component
    that happens to vanish) do not demand absolute precision no computation can give.
    """
    # keras.ops.convert_to_numpy: a PyTorch tensor that requires grad refuses np.asarray.
    actual = np.asarray(keras.ops.convert_to_numpy(actual), dtype=np.float64)
    expected = np.asarray(keras.ops.convert_to_numpy(expected), dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def docs_page(name):
    """The text of a page of the documentation site, e.g. "guide/errors.md"."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", name), encoding="utf-8") as f:
        return f.read()

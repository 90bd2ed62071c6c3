"""Keras's own BatchNormalization tests against keras_bn's layer under JAX.

tests/test_keras_parity.py's machinery, imported, not copied: the same Keras test classes (each
subclassed, every test required to construct a keras_bn layer), the same rewrites of the
intended differences, the same swap fixture and guards, collected in this JAX process. Keras's
tests that it skips under TensorFlow and runs under JAX (its `backend.backend() == "jax"`
branches) run here against keras_bn.
"""

from test_keras_parity import *  # noqa: F403  (the test classes and functions)
from test_keras_parity import _keras_bn_in_keras_tests  # noqa: F401  (the autouse swap)

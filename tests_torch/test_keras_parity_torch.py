"""Keras's own BatchNormalization tests against keras_bn's layer under PyTorch.

tests/test_keras_parity.py's machinery, imported, not copied (as tests_jax's twin of this file
does): the same Keras test classes, the same rewrites of the intended differences, the same
swap fixture and guards, collected in this PyTorch process.
"""

from test_keras_parity import *  # noqa: F403  (the test classes and functions)
from test_keras_parity import _keras_bn_in_keras_tests  # noqa: F401  (the autouse swap)

"""The array functions of keras_bn/backend/shared_maths.py that the TensorFlow backend uses
(`moved_range`), in tf (the JAX and PyTorch ones, with the same names and signatures, are
keras_bn/backend/jax/arrays.py and keras_bn/backend/torch/arrays.py)."""

import tensorflow as tf

# The tensors these functions take, for `shared_maths.arrays_of`.
ARRAY_TYPE = tf.Tensor

isfinite = tf.math.is_finite
maximum = tf.maximum
minimum = tf.minimum
stop_gradient = tf.stop_gradient
where = tf.where


def amin(x):
    """The least element."""
    return tf.reduce_min(x)


def amax(x):
    """The greatest element."""
    return tf.reduce_max(x)

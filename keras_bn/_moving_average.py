"""The guarded moving-average update that keras_bn.BatchNormalization and the QAT layers share.

A moving statistic takes a batch's value only when that value is usable: every value finite and
m ≥ 2 values per channel behind it (a variance needs two). Otherwise it keeps its value, so one
NaN batch or a batch of one sample cannot poison the average.
"""

import tensorflow as tf


def usable(values, enough):
    """Whether a moving-statistics update may be applied: every value finite and m ≥ 2
    (`enough`: True when m was checked statically, else a boolean tensor)."""
    finite = tf.reduce_all(tf.math.is_finite(tf.stack(values)))
    return finite if enough is True else enough & finite


def average_into(moving, value, momentum, usable):
    """moving ← momentum·moving + (1 − momentum)·value where `usable`, else unchanged."""
    old = tf.convert_to_tensor(moving)
    new = momentum * old + (1.0 - momentum) * value
    moving.assign(tf.where(usable, new, old))

"""The guarded moving-average update that keras_bn.BatchNormalization and the QAT layers share.

A moving statistic takes a batch's value only when that value is usable: every value finite and
m ≥ 2 values per channel behind it (a variance needs two). Otherwise it keeps its value, so one
NaN batch or a batch of one sample cannot poison the average.
"""

import tensorflow as tf


def usable(values, enough):
    """Which channels a moving-statistics update reaches: those with m ≥ 2 (`enough`: True when
    m was checked statically, else a boolean tensor, scalar or per channel), provided that
    every value of those channels is finite (a non-finite one skips the whole batch)."""
    if enough is not True:
        values = [tf.where(enough, v, tf.zeros_like(v)) for v in values]
    finite = tf.reduce_all(tf.math.is_finite(tf.stack(values)))
    return finite if enough is True else enough & finite


def average_into(moving, value, momentum, usable, weight=None):
    """moving ← momentum·moving + weight·value where `usable` (per channel, or one boolean),
    else unchanged; `weight` is 1 − momentum unless given (momentum=None's exact pair)."""
    old = tf.convert_to_tensor(moving)
    new = momentum * old + (1.0 - momentum if weight is None else weight) * value
    moving.assign(tf.where(usable, new, old))

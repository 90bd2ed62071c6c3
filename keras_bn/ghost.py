"""Ghost batches (`virtual_batch_size`, tf-keras semantics): batch statistics per ghost batch.

As in tf-keras, a batch of B = v·G samples is viewed as shape (v, G, ...) with v the virtual
batch size: ghost g holds samples g, g+G, g+2G, ... (interleaved, not contiguous), and the
statistics are taken over the v samples (and the spatial axes) of each ghost. The moving
statistics average the ghosts' means and variances, each with its own m/(m−1).
"""

import tensorflow as tf


def validate_virtual_batch_size(virtual_batch_size):
    if virtual_batch_size is None:
        return None
    if (
        isinstance(virtual_batch_size, bool)
        or not isinstance(virtual_batch_size, int)
        or virtual_batch_size <= 0
    ):
        raise ValueError(
            f"virtual_batch_size must be None or a positive int; received "
            f"virtual_batch_size={virtual_batch_size!r}."
        )
    return virtual_batch_size


def check_channel_axes(virtual_batch_size, channel_axes):
    if virtual_batch_size is not None and 0 in channel_axes:
        raise ValueError(
            f"virtual_batch_size={virtual_batch_size} splits the batch axis 0, so axis 0 cannot "
            f"be a channel axis; received channel axes {list(channel_axes)}."
        )


def ghost_count(virtual_batch_size, shape, mask):
    """G, the number of ghosts in a batch of `shape`, or None when its batch size is known only
    at run time. Raises for a mask, or a static batch size that v does not divide (shapes
    only, so that the JAX layer, keras_bn/_jax_ops.py, checks the same)."""
    if mask is not None:
        raise ValueError(
            f"virtual_batch_size={virtual_batch_size} does not support a mask: the ghost "
            f"batches would hold different numbers of values."
        )
    batch = shape[0]
    if batch is None:
        return None
    if batch % virtual_batch_size:
        raise ValueError(_divide_message(virtual_batch_size, shape).format(batch))
    return batch // virtual_batch_size


def _divide_message(virtual_batch_size, shape):
    return (
        f"virtual_batch_size={virtual_batch_size} must divide the batch size; received a batch "
        f"of {{}} (input shape {shape})."
    )


def split(x, virtual_batch_size, channel_axes, mask):
    """x as (v, G, ...) and the channel axes there: the ghost axis 1, then each original
    channel axis shifted by one. Raises when v does not divide the batch."""
    ghosts = ghost_count(virtual_batch_size, x.shape, mask)
    if ghosts is None:
        message = _divide_message(virtual_batch_size, x.shape)
        dynamic = tf.shape(x)[0]
        check = tf.debugging.Assert(
            tf.equal(dynamic % virtual_batch_size, 0),
            [message.format("a size known only at run time"), "batch size:", dynamic],
        )
        with tf.control_dependencies([check]):
            x = tf.identity(x)
        ghosts = -1
    view = tf.reshape(x, [virtual_batch_size, ghosts] + _rest(x))
    return view, [1] + [a + 1 for a in channel_axes]


def _rest(x):
    return [d if d is not None else tf.shape(x)[i + 1] for i, d in enumerate(x.shape[1:])]


def average(statistic):
    """Mean over the ghost axis of a (G, *channels) statistic."""
    return tf.reduce_mean(statistic, axis=0)

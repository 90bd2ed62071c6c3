"""Ghost batches (`virtual_batch_size`, tf-keras semantics): batch statistics per ghost batch.

As in tf-keras, a batch of B = v·G samples is viewed as shape (v, G, ...) with v the virtual
batch size: ghost g holds samples g, g+G, g+2G, ... (interleaved, not contiguous), and the
statistics are taken over the v samples (and the spatial axes) of each ghost. The moving
statistics average the ghosts' means and variances, each with its own m/(m−1).

The checks are here; each backend's `ghost_split` makes the view.
"""


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
    only, so that every backend checks the same)."""
    if mask is not None:
        raise ValueError(
            f"virtual_batch_size={virtual_batch_size} does not support a mask: the ghost "
            f"batches would hold different numbers of values."
        )
    batch = shape[0]
    if batch is None:
        return None
    if batch % virtual_batch_size:
        raise ValueError(divide_message(virtual_batch_size, shape).format(batch))
    return batch // virtual_batch_size


def divide_message(virtual_batch_size, shape):
    return (
        f"virtual_batch_size={virtual_batch_size} must divide the batch size; received a batch "
        f"of {{}} (input shape {shape})."
    )

"""Which axes a batch norm reduces, and which of them a mask covers: shapes only, so that every
backend reads axes and masks by the same rules."""


def reduction_axes(rank, channel_axes):
    """The axes a batch norm reduces over: every axis that is not a channel axis."""
    return [i for i in range(rank) if i not in channel_axes]


def mask_axes(mask_shape, x_shape, channel_axes, channel_reading=True):
    """Which axes of x a mask covers, by the backends' `expand_mask` readings:

    1. Keras's reading, which wins wherever it fits: the input's leading axes, shape
       `x.shape[:-1]`, broadcast over the last axis (`keras.layers.BatchNormalization` does
       `expand_dims(mask, -1)`). The last axis need not be a channel axis: with `axis=1` on
       (batch, time, features) a (batch, time) mask covers channel axis 1, so each channel
       (time step) has its own count m_c.
    2. Only where Keras's reading does not fit, and when `channel_reading`: the non-channel
       axes, shape x's shape without its channel axes, broadcast over the channel axes (e.g.
       (batch, time) for (batch, channels, time) with `axis=1`, when time ≠ channels).

    "Fits" means the same rank, and each dimension that size of x or 1 (a size-1 dimension
    broadcasts, as Keras's do); an unknown dimension fits. A lower rank is never aligned from
    the right, which would silently pair a per-sample mask with another axis.

    Args:
        mask_shape: the mask's shape (any sequence of ints or None).
        x_shape: the input's shape.
        channel_axes: sorted non-negative channel axes of x.
        channel_reading: whether reading 2 is allowed (keras_bn's layer); False for
            `keras.layers.BatchNormalization`, which has only Keras's reading.

    Returns:
        The covered axes of x, a list in order.

    Raises:
        ValueError: the mask fits no allowed reading; the message names each reading's shape.
    """
    mask_shape, x_shape = tuple(mask_shape), tuple(x_shape)
    rank = len(x_shape)
    readings = [list(range(rank - 1))]
    if channel_reading:
        readings.append(reduction_axes(rank, channel_axes))
    covered = next((axes for axes in readings if _fits(mask_shape, x_shape, axes)), None)
    if covered is None:
        shapes = [f"{[x_shape[i] for i in axes]} (axes {axes})" for axes in readings]
        raise ValueError(
            f"The mask's shape {mask_shape} fits no reading of a mask for the input shape "
            f"{x_shape} with channel axes {list(channel_axes)}: Keras's, the input's leading "
            f"axes {shapes[0]}"
            + (f", or the non-channel axes {shapes[1]}" if channel_reading else "")
            + "; each dimension must be that size or 1."
        )
    return covered


def _fits(mask_shape, x_shape, axes):
    """Whether a mask of `mask_shape` can cover x's `axes`: same rank, each dimension that of
    x or 1 (unknown dimensions fit)."""
    if len(mask_shape) != len(axes):
        return False
    return all(
        got is None or want is None or got in (want, 1)
        for got, want in zip(mask_shape, (x_shape[i] for i in axes))
    )

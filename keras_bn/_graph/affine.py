"""Layers a folded model may contain: InferenceAffine, what a batch norm that cannot be folded
becomes (y = scale·x + shift), and ChannelBias, the bias of a folded channels_first host.

Converters turn InferenceAffine into one Mul and one Add, and ChannelBias into one Add;
neither has a training mode or statistics.
"""

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import numpy.typing as npt

from keras_bn import backend
from keras_bn._shapes import ShapePreserving

# Before either layer can be built under a backend keras_bn does not run on.
backend.get("keras_bn.export.InferenceAffine")


class _PerChannelMap(ShapePreserving, keras.layers.Layer):
    """A map applied channel by channel: the output has the input's shape."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # An elementwise map keeps every position: a mask passes through, as it passes through
        # the BN this layer replaces (a masked LSTM after it must still see it).
        self.supports_masking = True


def _broadcast_shape(rank: int, axes: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """The shape that lines per-channel weights of `sizes` up with `axes` of a rank-`rank`
    input (1 on every other axis)."""
    shape = [1] * rank
    for axis, size in zip(axes, sizes):
        shape[axis] = size
    return shape


@keras.saving.register_keras_serializable(package="keras_bn.export")
class InferenceAffine(_PerChannelMap):
    """Per-channel y = scale·x + shift: what a batch norm that cannot be folded becomes.

    `fold_batch_norms` puts one in place of each BN it keeps, with the BN's inference map
    (scale = γ/√(Var + ε), shift = β − scale·E[x]); converters turn it into one Mul and one
    Add. It has no training mode and no statistics: `scale` and `shift` are non-trainable
    weights, computed in float32 (the output is cast to the layer's compute dtype).

    Args:
        channel_axes: the sorted, non-negative axes the scale and shift run along (the BN's
            channel axes for the input's rank).
        channels: the size of each of those axes: the shape of `scale` and `shift`.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Example::

        affine = InferenceAffine([3], [16], name="bn")   # NHWC, 16 channels
        affine.set_affine(scale, shift)
    """

    def __init__(self, channel_axes: Sequence[int], channels: Sequence[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.channel_axes = [int(a) for a in channel_axes]
        self.channels = [int(c) for c in channels]
        self.scale = self.add_weight(
            shape=self.channels, name="scale", initializer="ones", trainable=False
        )
        self.shift = self.add_weight(
            shape=self.channels, name="shift", initializer="zeros", trainable=False
        )

    # `_ignored`: e.g. `training`, passed on from the BN's call
    def call(self, inputs: Any, **_ignored: Any) -> Any:
        """scale·inputs + shift, per channel.

        Args:
            inputs: a tensor whose `channel_axes` have the sizes `channels`.
            **_ignored: call arguments of the BN it replaces (`training`, `mask`), unused.

        Returns:
            A tensor of the input's shape, in the layer's compute dtype.
        """
        x = keras.ops.cast(inputs, self.scale.dtype)
        y = backend.get().batch_norm_inference(
            x, backend.get().read(self.scale), backend.get().read(self.shift), self.channel_axes
        )
        return keras.ops.cast(y, self.compute_dtype)

    def set_affine(self, scale: npt.ArrayLike, shift: npt.ArrayLike) -> None:
        """Set the map to y = scale·x + shift.

        Args:
            scale: per-channel scale, any array with as many entries as `scale` has (it is
                reshaped to `channels`).
            shift: per-channel shift, likewise.

        Raises:
            ValueError: `scale` or `shift` does not have that many entries.
        """
        self.scale.assign(np.reshape(scale, self.channels))
        self.shift.assign(np.reshape(shift, self.channels))

    def get_config(self) -> dict[str, Any]:
        """The layer's config, for `from_config` and saving.

        Returns:
            dict: the base layer's config, `channel_axes` and `channels`.
        """
        return {
            **super().get_config(),
            "channel_axes": self.channel_axes,
            "channels": self.channels,
        }


@keras.saving.register_keras_serializable(package="keras_bn.export")
class ChannelBias(_PerChannelMap):
    """y = x + bias on one explicit channel axis: the bias of a folded channels_first host.

    Keras 3.15's TensorFlow `ops.add` guesses a bias's axis from the shapes, and puts a
    channels_first conv's bias on the last spatial axis whenever that axis has as many
    entries as there are channels. A folded host therefore has no bias of its own when it is
    channels_first; this layer adds it with a reshape that names the axis, so no guess is made.

    Args:
        channel_axis: the axis the bias runs along, a positive int (axis 0 is the batch).
        channels: the number of channels, a positive int.
        trainable_bias: whether the bias is a trainable weight (keras_bn.quantize's copy of
            a channels_first layer that keeps training); False for a folded model.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Raises:
        ValueError: `channel_axis` or `channels` is not a positive int.
    """

    def __init__(
        self, channel_axis: int, channels: int, trainable_bias: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(channel_axis, bool) or not isinstance(channel_axis, int) or channel_axis < 1:
            raise ValueError(
                f"channel_axis must be a positive int (axis 0 is the batch); received "
                f"channel_axis={channel_axis!r}."
            )
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
            raise ValueError(f"channels must be a positive int; received channels={channels!r}.")
        self.channel_axis = channel_axis
        self.channels = channels
        self.trainable_bias = bool(trainable_bias)
        self.bias = self.add_weight(
            shape=(channels,), name="bias", initializer="zeros", trainable=self.trainable_bias
        )

    def call(self, inputs: Any) -> Any:
        """inputs + bias along `channel_axis`.

        Args:
            inputs: a tensor whose `channel_axis` has `channels` entries.

        Returns:
            A tensor of the input's shape, in the layer's compute dtype.
        """
        x = keras.ops.cast(inputs, self.bias.dtype)
        shape = _broadcast_shape(len(inputs.shape), [self.channel_axis], [self.channels])
        # The backend's own add, not keras.ops.add: Keras 3.15's on TensorFlow guesses the axis.
        y = backend.get().add(x, keras.ops.reshape(self.bias, shape))
        return keras.ops.cast(y, self.compute_dtype)

    def get_config(self) -> dict[str, Any]:
        """The layer's config, for `from_config` and saving.

        Returns:
            dict: the base layer's config, `channel_axis`, `channels` and `trainable_bias`.
        """
        return {
            **super().get_config(),
            "channel_axis": self.channel_axis,
            "channels": self.channels,
            "trainable_bias": self.trainable_bias,
        }

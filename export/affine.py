"""InferenceAffine: what a batch norm that cannot be folded becomes, y = scale·x + shift.

Converters turn it into one Mul and one Add. It has no training mode and no statistics.
"""

import keras
import numpy as np

from keras_bn import ops


@keras.saving.register_keras_serializable(package="keras_bn.export")
class InferenceAffine(keras.layers.Layer):
    """Per-channel y = scale·x + shift over `channel_axes` (sorted, non-negative)."""

    def __init__(self, channel_axes, channels, **kwargs):
        super().__init__(**kwargs)
        self.channel_axes = [int(a) for a in channel_axes]
        self.channels = [int(c) for c in channels]
        self.scale = self.add_weight(shape=self.channels, name="scale", initializer="ones",
                                     trainable=False)
        self.shift = self.add_weight(shape=self.channels, name="shift", initializer="zeros",
                                     trainable=False)

    def call(self, inputs, **_ignored):  # e.g. `training`, passed on from the BN's call
        x = keras.ops.cast(inputs, self.scale.dtype)
        y = ops.batch_norm_inference(x, self.scale, self.shift, self.channel_axes)
        return keras.ops.cast(y, self.compute_dtype)

    def set_affine(self, scale, shift):
        self.scale.assign(np.reshape(scale, self.channels))
        self.shift.assign(np.reshape(shift, self.channels))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "channel_axes": self.channel_axes,
                "channels": self.channels}

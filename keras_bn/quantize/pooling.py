"""QuantizedAveragePooling: an average pool that rounds its output back onto its input's grid,
as an int8 AVERAGE_POOL_2D does.

The TFLite int8 spec requires AVERAGE_POOL_2D's input and output to have the same scale and
zero point, and its kernel rounds each average to the nearest integer of that grid. An
average of on-grid values mostly lies between two grid values, so a float pool would leave
the QAT model up to half a step away from the file after every pool, and the layers after it
can multiply that. This layer quantizes its input with its own `ActivationQuantizer` (the
producer it reads leaves its quantizer out, as for a Concatenate) and rounds the pooled output
onto the same grid, the range shared, never learned for the output.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import keras

from keras_bn.quantize import fake_quant, hosts, spec
from keras_bn.quantize.activation import ActivationQuantizer, validate_momentum


@keras.saving.register_keras_serializable(package="keras_bn.quantize")
class QuantizedAveragePooling(keras.layers.Layer):
    """An average pool between two roundings onto one grid: its input's, learned by
    `input_quantizer` (an `ActivationQuantizer`), and the pooled output's, the same grid.

    y = FQ(pool(FQ(x))), both FQ on the range `input_quantizer` holds (in training, the range
    this batch moved it to); with `then`, each further pool rounds onto that grid again, as
    consecutive int8 ops of one scale do. `quantize_model` puts one in place of each
    AveragePooling1D/2D/3D layer and bilinear UpSampling2D, and of a run of them that each
    alone read the one before.

    Args:
        pool: the pooling layer, or its `keras.layers.serialize` dict: exactly
            AveragePooling1D, AveragePooling2D, AveragePooling3D or a bilinear UpSampling2D.
            Only its config is used.
        bits: 2..8, the grid's bits.
        momentum: the input range's EMA momentum, in [0, 1).
        then: more such layers (or dicts), applied in order after `pool`.
        **kwargs: base layer arguments (`name`, `trainable`, ...).

    Raises:
        ValueError: `pool` or a layer of `then` is not one of those, or `bits` or `momentum`
            is out of range (the message names the value).
    """

    def __init__(
        self,
        pool: "keras.layers.Layer | dict",
        bits: int = 8,
        momentum: float = 0.99,
        then: "Sequence[keras.layers.Layer | dict]" = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pool, self._pool_config = _averaging(pool)
        self.bits: int = fake_quant.validate_bits(bits, "bits")
        self.momentum = validate_momentum(momentum, "momentum")
        self.input_quantizer = ActivationQuantizer(bits, momentum, name="input_quantizer")
        self.then: list[keras.layers.Layer] = []
        self._then_configs: list[dict] = []
        for layer in then:
            self.add_stage(layer)

    def add_stage(self, layer: "keras.layers.Layer | dict") -> None:
        """Average again after the pool, onto the same grid: a layer (an average pool or a
        bilinear UpSampling2D) that alone reads this one's output, as the int8 file's next
        op of the same scale does. Before the layer is built.

        Args:
            layer: the layer, or its `keras.layers.serialize` dict.

        Raises:
            ValueError: `layer` is no average pool or bilinear UpSampling2D.
        """
        stage, config = _averaging(layer)
        self.then.append(stage)
        self._then_configs.append(config)

    def _stages(self) -> list[tuple[keras.layers.Layer, int, str]]:
        return [(layer, window_size(layer), halves_of(layer)) for layer in (self.pool, *self.then)]

    def build(self, input_shape: Any) -> None:
        """Build the pools for `input_shape`, and the quantizer.

        Args:
            input_shape: the input's shape.
        """
        self.input_quantizer.build(input_shape)
        for layer, _, _ in self._stages():
            layer.build(input_shape)
            input_shape = layer.compute_output_shape(input_shape)

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """The input fake-quantized, average-pooled, and rounded onto the same grid.

        Args:
            inputs: float tensor.
            training: Python bool or None; true (and the layer trainable) moves the input's
                range, unless it is frozen.

        Returns:
            The pooled tensor, on the input's grid (the float pool while no range is set).
        """
        quantizer = self.input_quantizer
        low, high, initialized = quantizer.batch_range(inputs, training)
        x = quantizer.round_onto(inputs, low, high, initialized)
        for layer, window, halves in self._stages():
            x = quantizer.round_onto(layer(x), low, high, initialized, window, halves)
        return x

    def grid_quantizer(self) -> ActivationQuantizer:
        """The quantizer whose grid the layer's output lies on: its input's.

        Returns:
            `input_quantizer`.
        """
        return self.input_quantizer

    def export_function(self, halves_as_ops: bool = False) -> Callable[[Any], Any]:
        """The layer's inference as an exporter traces it, from the range it holds now: the
        input quantizer's `export_function` before and after the pool, so that a converter
        sees one scale on both sides of it.

        Args:
            halves_as_ops: as in `ActivationQuantizer.export_function`.

        Returns:
            A function of a float tensor.

        Raises:
            ValueError: the input quantizer has no range yet.
        """
        quantize = self.input_quantizer.export_function(halves_as_ops)

        def infer(inputs: Any) -> Any:
            x = quantize(inputs)
            for layer, window, halves in self._stages():
                x = quantize(layer(x), average_of=window, halves=halves)
            return x

        return infer

    def compute_output_shape(self, input_shape: Any) -> Any:
        """The output shape after every pool.

        Args:
            input_shape: the input's shape.

        Returns:
            The output shape.
        """
        for layer, _, _ in self._stages():
            input_shape = layer.compute_output_shape(input_shape)
        return input_shape

    def get_config(self) -> dict[str, Any]:
        """Every constructor argument, for `from_config` and saving.

        Returns:
            A dict with the base layer's config, the pool's serialized config, `bits`,
            `momentum` and the serialized layers of `then`.
        """
        return {
            **super().get_config(),
            "pool": self._pool_config,
            "bits": self.bits,
            "momentum": self.momentum,
            "then": list(self._then_configs),
        }


def _averaging(layer: "keras.layers.Layer | dict") -> tuple[keras.layers.Layer, dict]:
    """(the layer, its config) of an average pool or bilinear UpSampling2D, or its dict.

    Raises:
        ValueError: it is neither, named.
    """
    layer, config = hosts.deserialize(layer)
    if spec.role(layer) != spec.AVERAGES:
        raise ValueError(
            f"Layer '{layer.name}' ({type(layer).__name__}) is no average pool: "
            f"QuantizedAveragePooling computes exactly "
            f"{', '.join(cls.__name__ for cls in spec.AVERAGING)} and a bilinear UpSampling2D."
        )
    return layer, config


def window_size(pool: keras.layers.Layer) -> int:
    """A count n such that every output of `pool` is a sum of its input's values with weights
    in multiples of 1/n: an average pool's window size (the product of its pool_size); for a
    bilinear UpSampling2D by (s, t), 4·s·t (half-pixel centres put each source position
    (i + ½)/s − ½ on a multiple of 1/(2s), on each axis).

    Args:
        pool: an AveragePooling1D/2D/3D layer or a bilinear UpSampling2D.

    Returns:
        int.
    """
    if spec.is_bilinear_upsampling(pool):
        return 4 * math.prod(pool.size)
    return math.prod(pool.pool_size)


def halves_of(pool: keras.layers.Layer) -> str:
    """How the int8 kernel of `pool` rounds its halves (`fake_quant.HALVES`): "up" for a
    bilinear UpSampling2D (RESIZE_BILINEAR), "away" from the int8 zero for an average pool.

    Args:
        pool: an AveragePooling1D/2D/3D layer or a bilinear UpSampling2D.

    Returns:
        "up" or "away".
    """
    return "up" if spec.is_bilinear_upsampling(pool) else "away"

"""Build a QAT layer from existing layers, weights copied: the step the model rewrite takes for
each (host, batch norm, activation) it finds.

The variance convention: keras.layers.BatchNormalization stores the biased E_B[σ²_B], keras_bn
the unbiased m/(m−1)·E_B[σ²_B] (keras_bn/_graph/bn_layers.py). The QAT layer's batch norm is a
keras_bn one, and the moving variance is copied as it is, as `keras_bn.convert.from_keras`
does: the folded inference output is then exactly the original model's, and QAT's own updates
continue the average in keras_bn's unbiased convention (for the m = batch × spatial values of a
convolution the two differ by the factor m/(m−1), which QAT's moving averages soon replace).
"""

from collections.abc import Iterable
from typing import Any

import keras
import numpy as np

from keras_bn import backend
from keras_bn._graph.bn_layers import BN_TYPES
from keras_bn.quantize.layers import QuantizedHost, QuantizedHostBatchNorm


def from_layers(
    host: keras.layers.Layer,
    batch_norm: keras.layers.Layer | None = None,
    activation: "str | keras.layers.Layer | None" = None,
    *,
    weight_bits: int | None = 8,
    activation_bits: int | None = 8,
    per_channel: bool = True,
    range_momentum: float = 0.99,
    quantize_output: bool = True,
    weight_range: str | None = None,
    name: str | None = None,
) -> "QuantizedHost | QuantizedHostBatchNorm":
    """A built QAT layer computing activation(batch_norm(host(x))), with the layers' weights.

    With a batch norm it is a `QuantizedHostBatchNorm` (the host must be linear); without one,
    a `QuantizedHost`, which takes over a ReLU/ReLU6 host activation. The given layers are not
    changed: the QAT layer builds its own copies from their configs and copies their weights.

    Args:
        host: a built Dense, Conv1D/2D/3D, DepthwiseConv1D/2D or SeparableConv1D/2D layer.
        batch_norm: None, or a built keras_bn.BatchNormalization or
            keras.layers.BatchNormalization on the host's output channels.
        activation: None, "relu", "relu6", or a layer computing one of them
            (`keras.layers.ReLU()` or `ReLU(max_value=6)` with no slope or threshold, or
            `keras.layers.Activation("relu")` / `("relu6")`).
        weight_bits: 2..8, or None for float weights.
        activation_bits: 2..8, or None for no activation fake quantization.
        per_channel: per-output-channel weight ranges (True) or one per tensor.
        range_momentum: the activation ranges' EMA momentum, in [0, 1).
        quantize_output: whether the QAT layer fake-quantizes its output (see
            `QuantizedHost`).
        weight_range: "max", "learned" or None (see `QuantizedHost`); a learned range starts
            from the copied weights (`reset_weight_ranges`).
        name: the QAT layer's name; by default the host's name with "_qat".

    Returns:
        The built QuantizedHostBatchNorm or QuantizedHost.

    Raises:
        ValueError: a layer that is not built or not supported, an activation that is not
            ReLU/ReLU6, a batch norm not on the host's channel axis, or an argument out of
            range (the message names the value).
        ImportError: Keras runs on a backend the QAT layers do not support (NumPy, OpenVINO).
    """
    backend.get("keras_bn.quantize")  # see quantize_model
    for layer in (host, batch_norm):
        if layer is not None and not layer.built:
            raise ValueError(f"Layer '{layer.name}' is not built; its weights cannot be copied.")
    activation = _activation_name(activation)
    options: dict[str, Any] = dict(
        activation=activation,
        weight_bits=weight_bits,
        activation_bits=activation_bits,
        per_channel=per_channel,
        range_momentum=range_momentum,
        quantize_output=quantize_output,
        weight_range=weight_range,
        name=name or f"{host.name}_qat",
    )
    input_shape = host.get_build_config()["input_shape"]
    if batch_norm is None:
        serialized = keras.layers.serialize(host)
        lifted = _activation_name(serialized["config"].get("activation"))
        if lifted is not None:  # a host's own ReLU/ReLU6 moves to the QAT layer
            if activation is not None:
                raise ValueError(
                    f"Host '{host.name}' already applies {lifted!r}; do not give "
                    f"activation={activation!r} as well."
                )
            serialized["config"]["activation"] = "linear"
            options["activation"] = lifted
        layer = QuantizedHost(serialized, **options)
        layer.build(input_shape)
    else:
        if not isinstance(batch_norm, BN_TYPES):
            raise ValueError(
                f"batch_norm must be a batch-norm layer; received {type(batch_norm).__name__} "
                f"'{batch_norm.name}'."
            )
        layer = QuantizedHostBatchNorm(host, batch_norm, **options)
        layer.build(input_shape)
        _copy(batch_norm, layer.batch_norm, ("gamma", "beta", "moving_mean", "moving_variance"))
    layer.host.set_weights([np.array(weight) for weight in host.get_weights()])
    layer.reset_weight_ranges()  # from the copied weights (and statistics)
    return layer


def _copy(source: keras.layers.Layer, target: keras.layers.Layer, names: Iterable[str]) -> None:
    """Assign each named weight of `source` to `target`'s (copies of the values)."""
    for name in names:
        weight = getattr(source, name, None)
        if weight is None:
            continue
        getattr(target, name).assign(np.array(weight))


def fusable_activation(activation: str | keras.layers.Layer) -> str | None:
    """ "relu" or "relu6" when `activation` computes one of them, which a QAT layer can fuse;
    None for anything else (a linear activation included).

    Args:
        activation: an activation's name, or a layer: exactly `keras.layers.ReLU` (with no
            slope or threshold, and max_value None or 6) or `keras.layers.Activation`.

    Returns:
        "relu", "relu6" or None.
    """
    if isinstance(activation, str):
        return activation if activation in ("relu", "relu6") else None
    if type(activation) is keras.layers.Activation:
        return fusable_activation(keras.activations.serialize(activation.activation))
    if type(activation) is keras.layers.ReLU:
        plain = activation.negative_slope == 0 and activation.threshold == 0
        if plain and activation.max_value is None:
            return "relu"
        if plain and activation.max_value == 6:
            return "relu6"
    return None


def _activation_name(activation: Any) -> str | None:
    """None, "relu" or "relu6" for the activations a QAT layer can fuse.

    Raises:
        ValueError: any other activation (a leaky or thresholded ReLU, a ReLU capped at
            another value, another function).
    """
    if type(activation) is keras.layers.Activation:
        activation = keras.activations.serialize(activation.activation)
    if activation is None or activation == "linear":
        return None
    fused = fusable_activation(activation)
    if fused is None:
        raise ValueError(
            f"The activation must be None, 'relu', 'relu6' or a layer computing one of them; "
            f"received {activation!r}."
        )
    return fused

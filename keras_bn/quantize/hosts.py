"""The host layers a QAT layer computes, and where each one's output channel lies.

A QAT layer does not call its host: it runs the host's linear map (its convolution or matmul,
from the host's own attributes: strides, padding, dilation, data format, groups) with a kernel
it has fake-quantized, and adds the bias itself. This module says, per host kind:

- which kernel batch norm scales (the "folded" kernel): the kernel, or a separable
  convolution's pointwise kernel;
- how to view that kernel with its output channels on the last axis, the axis TensorFlow's
  per-channel FakeQuant op quantizes along: Dense (in, out) and Conv (*k, in/g, out) already
  are; a depthwise kernel (*k, C, M), whose output channel c·M + m, is viewed as
  (*k, 1, C·M) (TFLite's depthwise layout is (1, *k, C·M));
- the output's channel axis (the batch norm's axis): −1, or 1 for channels_first.

Only the exact Keras classes are accepted (a subclass may compute something else), with a
linear activation (the QAT layer applies ReLU/ReLU6 after batch norm), no LoRA and no Keras
quantization.
"""

import json
from collections.abc import Callable
from typing import Any, TypeAlias

import keras
from keras import ops

# A backend tensor or a keras.Variable: what keras.ops take and return.
Tensor: TypeAlias = Any

DENSE, CONV, DEPTHWISE, SEPARABLE = "dense", "conv", "depthwise", "separable"
KINDS = {
    keras.layers.Dense: DENSE,
    keras.layers.Conv1D: CONV,
    keras.layers.Conv2D: CONV,
    keras.layers.Conv3D: CONV,
    keras.layers.DepthwiseConv1D: DEPTHWISE,
    keras.layers.DepthwiseConv2D: DEPTHWISE,
    keras.layers.SeparableConv1D: SEPARABLE,
    keras.layers.SeparableConv2D: SEPARABLE,
}


def kind_of(host: keras.layers.Layer) -> str:
    """The host's kind: "dense", "conv", "depthwise" or "separable".

    Raises:
        ValueError: `host` is not one of the supported classes, or has a non-linear
            activation, LoRA or Keras quantization.
    """
    kind = KINDS.get(type(host))
    if kind is None:
        supported = ", ".join(cls.__name__ for cls in KINDS)
        raise ValueError(
            f"Layer '{host.name}' ({type(host).__name__}) cannot host quantization-aware "
            f"training: the host must be one of {supported} (exactly that class)."
        )
    activation = keras.activations.serialize(host.activation)
    if activation not in ("linear", None):
        raise ValueError(
            f"Layer '{host.name}' has activation={activation!r}; a QAT host must be linear "
            f"(give the activation to the QAT layer, after batch norm, instead)."
        )
    if getattr(host, "lora_rank", None) or getattr(host, "lora_enabled", False):
        raise ValueError(
            f"Layer '{host.name}' is LoRA-enabled (lora_rank={host.lora_rank}); merge the "
            f"LoRA weights into the kernel before quantization-aware training."
        )
    if getattr(host, "quantization_mode", None) is not None:
        raise ValueError(
            f"Layer '{host.name}' is already quantized by Keras "
            f"(quantization_mode={host.quantization_mode!r})."
        )
    return kind


def int8_file_refusal(host: keras.layers.Layer, input_rank: int | None) -> str | None:
    """Why no int8 file keras_bn writes can hold a QAT layer on `host`, or None.

    A dilated convolution and a Dense on an input of rank > 2 train and fake-quantize like the
    others, but the int8 TFLite converter does not keep their kernels on the 8-bit grid the
    QAT layer rounds to (its file failed verification, late, with a message naming neither);
    both writers refuse them alike, and `quantize_model` keeps them in float.

    Args:
        host: the host layer (a Dense or a convolution).
        input_rank: the rank of the input it is called on; None where unknown.

    Returns:
        The reason in words, naming the layer and the attribute, or None.
    """
    dilation = getattr(host, "dilation_rate", None)
    convolution = KINDS.get(type(host)) in (CONV, DEPTHWISE, SEPARABLE)
    if convolution and dilation is not None and any(rate != 1 for rate in tuple(dilation)):
        return (
            f"'{host.name}' ({type(host).__name__}) has dilation_rate={tuple(dilation)}, "
            f"which no int8 file of a quantization-aware model holds on its 8-bit grid; use "
            f"dilation_rate=1"
        )
    if KINDS.get(type(host)) == DENSE and input_rank is not None and input_rank > 2:
        return (
            f"'{host.name}' (Dense) reads a rank-{input_rank} input, which no int8 file of a "
            f"quantization-aware model holds on its 8-bit grid (a FULLY_CONNECTED takes "
            f"(batch, features)); Reshape the input to rank 2 before it, or Flatten it"
        )
    return None


def deserialize(
    host: keras.layers.Layer | dict[str, Any],
) -> tuple[keras.layers.Layer, dict[str, Any]]:
    """A fresh, unbuilt host layer from a layer or its `keras.layers.serialize` dict.

    Returns:
        (layer, serialized): the new layer and the dict it was built from (for get_config).
    """
    serialized = config_only(host if isinstance(host, dict) else keras.layers.serialize(host))
    return keras.layers.deserialize(serialized), serialized


def config_only(serialized: dict[str, Any]) -> dict[str, Any]:
    """A `keras.layers.serialize` dict without its build state (deserializing one with a
    "build_config" builds the layer at once, and the QAT layer builds its copies itself), in
    its JSON form (tuples as lists), so that the config is the same after a `.keras` load."""
    kept = {k: v for k, v in serialized.items() if k not in ("build_config", "compile_config")}
    return json.loads(json.dumps(kept))


def channel_axis(host: keras.layers.Layer) -> int:
    """The output's channel axis: −1, or 1 for a channels_first convolution."""
    return 1 if getattr(host, "data_format", "channels_last") == "channels_first" else -1


def _known_kind(host: keras.layers.Layer) -> str:
    """The kind of a host that `kind_of` accepted (a QAT layer's, checked when the layer was
    made): looked up, not checked again in every call, where torch.compile cannot trace
    `kind_of`'s serialization of the activation."""
    return KINDS[type(host)]


def folded_kernel(host: keras.layers.Layer) -> keras.Variable:
    """The kernel batch norm scales per output channel: the kernel, or the pointwise one."""
    return host.pointwise_kernel if _known_kind(host) == SEPARABLE else host.kernel


def output_channels(host: keras.layers.Layer) -> int:
    """How many output channels the host has (C·M for a depthwise convolution)."""
    kernel = folded_kernel(host)
    if _known_kind(host) == DEPTHWISE:
        return kernel.shape[-2] * kernel.shape[-1]
    return kernel.shape[-1]


def channels_last(kernel: Tensor, kind: str) -> Tensor:
    """`kernel` viewed with its output channels on the last axis (see the module docstring)."""
    if kind != DEPTHWISE:
        return kernel
    shape = tuple(kernel.shape)
    return ops.reshape(kernel, shape[:-2] + (1, shape[-2] * shape[-1]))


def from_channels_last(view: Tensor, kernel_shape: tuple[int, ...]) -> Tensor:
    """Undo `channels_last`: the host's kernel layout again."""
    return ops.reshape(view, tuple(kernel_shape))


def linear(
    host: keras.layers.Layer,
    inputs: Tensor,
    kernel: Tensor,
    depthwise_kernel: Tensor | None = None,
    between: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """The host's output without bias for the given kernel(s).

    Args:
        host: a built host layer (its attributes give strides, padding, etc.).
        inputs: the input tensor.
        kernel: the kernel in the host's own layout (a separable conv's pointwise kernel).
        depthwise_kernel: a separable conv's depthwise kernel.
        between: for a separable conv, a function applied to the depthwise output before
            the pointwise convolution (the intermediate tensor's fake quantization).

    Returns:
        The output tensor.
    """
    kind = _known_kind(host)
    if kind == DENSE:
        return ops.matmul(inputs, kernel)
    padding = host.padding
    if padding == "causal":  # Conv1D only: pad on the left, then a valid convolution
        left = host.dilation_rate[0] * (host.kernel_size[0] - 1)
        pads = [[0, 0], [left, 0], [0, 0]]
        if host.data_format == "channels_first":
            pads = [[0, 0], [0, 0], [left, 0]]
        inputs, padding = ops.pad(inputs, pads), "valid"
    options = dict(padding=padding, data_format=host.data_format)
    if kind == CONV:
        return ops.conv(
            inputs, kernel, strides=host.strides, dilation_rate=host.dilation_rate, **options
        )
    if kind == DEPTHWISE:
        return ops.depthwise_conv(
            inputs, kernel, strides=host.strides, dilation_rate=host.dilation_rate, **options
        )
    # Separable: a depthwise convolution, then a 1×…×1 convolution, as ops.separable_conv
    # computes, with the intermediate tensor exposed (an int8 file holds it).
    middle = ops.depthwise_conv(
        inputs, depthwise_kernel, strides=host.strides, dilation_rate=host.dilation_rate, **options
    )
    if between is not None:
        middle = between(middle)
    return ops.conv(middle, kernel, strides=1, padding="valid", data_format=host.data_format)

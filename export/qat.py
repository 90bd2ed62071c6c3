"""The export of a quantization-aware (QAT) model: what differs from a float model's, whatever
the format.

A model that holds keras_bn.quantize layers (`is_quantized`) carries its own integer
arithmetic: its batch norms are folded into fake-quantized weights already, and every
activation range is learned. Its file is therefore not calibrated and not folded: it is traced
in its *export form* (`export_model`), a copy whose QAT layers are replaced by their
`export_function`s, which compute the same inference with the ops a converter wants (8-bit
FakeQuant ops, constants, no batch-norm multiply). The weights come from `weight_op`, which
each format supplies.

The file is judged in units of each output's quantization step (an LSB, `output_steps`): an
integer runtime requantizes every layer with fixed-point arithmetic where TensorFlow rounds in
float, so a correct file differs from the Keras model by a few steps, and a wrong one by many
(`keras_bn.export.report.lsb_errors`). Its weights are read back and compared with
`fake_quant.weight_grid` of each host's folded weights (`HostWeight`), by the format.
"""

import dataclasses

import keras

from keras_bn import _models
from keras_bn._errors import UnsupportedModelError
from keras_bn.export import trace
from keras_bn.quantize import fake_quant, hosts, spec
from keras_bn.quantize.activation import ActivationQuantizer
from keras_bn.quantize.layers import QuantizedHost, QuantizedHostBatchNorm

QAT_HOSTS = (QuantizedHost, QuantizedHostBatchNorm)
QAT_LAYERS = (ActivationQuantizer, *QAT_HOSTS)
L = keras.layers


@dataclasses.dataclass(frozen=True)
class HostWeight:
    """One fake-quantized kernel of a QAT host: what its file must hold as int8.

    Attributes:
        host: the QAT layer's path ("inner/conv_qat" inside the nested model "inner").
        kernel: "kernel" (the folded kernel), or "depthwise_kernel" for a separable host's
            depthwise kernel.
        kind: the host kind (`keras_bn.quantize.hosts`): "dense", "conv", "depthwise" or
            "separable" (its "kernel" is the pointwise one).
        grid: the fake_quant.WeightGrid the layer's inference rounds to.
        tag: a unique name for the kernel in the traced graph (a valid TensorFlow op name).
    """

    host: str
    kernel: str
    kind: str
    grid: fake_quant.WeightGrid
    tag: str

    @property
    def layout_kind(self):
        """The kind whose kernel layout this kernel has: a separable host's depthwise kernel is
        a depthwise one, its "kernel" a 1×1 convolution's."""
        if self.kind == hosts.SEPARABLE:
            return hosts.DEPTHWISE if self.kernel == "depthwise_kernel" else hosts.CONV
        return self.kind


def is_quantized(model):
    """Whether `model` holds keras_bn.quantize layers (nested ones included): a QAT model.

    Args:
        model: a Keras model.

    Returns:
        bool.
    """
    return any(isinstance(layer, QAT_LAYERS) for layer in model._flatten_layers(include_self=False))


def _layers(model, prefix=""):
    """(path, layer) for every layer of a Sequential/Functional model, nested models' layers
    instead of the nested models (a subclassed nested model is a layer)."""
    for layer in model.layers:
        path = prefix + layer.name
        if isinstance(layer, keras.Model) and _models.has_layer_graph(layer):
            yield from _layers(layer, path + "/")
        else:
            yield path, layer


def check_exportable(model, format_name):
    """Refuse a QAT model that no integer file can compute, naming the layers.

    Args:
        model: a QAT model (`is_quantized`).
        format_name: "TFLite" or "ONNX", for the messages.

    Raises:
        UnsupportedModelError: a layer with weights that is not a QAT layer (a layer
            `quantize_model` kept in float, a custom layer), or a QAT layer with
            weight_bits=None or activation_bits=None (float weights or output).
        ValueError: an activation quantizer that has not seen a training batch (no range).
    """
    floating = []
    for path, layer in _layers(model):
        if isinstance(layer, QAT_LAYERS):
            continue
        if layer.weights:
            floating.append(f"'{path}' ({type(layer).__name__})")
    if floating:
        raise UnsupportedModelError(
            f"{format_name} export of the quantization-aware model '{model.name}' cannot take "
            f"its float layers with weights {', '.join(floating)}: an integer file has no float "
            f"layer. Quantize them (keras_bn.quantize.quantize_model lists the layers it keeps "
            f"in float, with the reasons), or export the float model with "
            f'quantization="int8" and representative_data.'
        )
    unquantized, unset = [], []
    for path, layer in _layers(model):
        if isinstance(layer, QAT_HOSTS):
            floats = [
                f"{n}=None" for n in ("weight_bits", "activation_bits") if getattr(layer, n) is None
            ]
            if floats:
                unquantized.append(f"'{path}' ({', '.join(floats)})")
        if isinstance(layer, QAT_LAYERS):
            for quantizer in layer._flatten_layers(include_self=True):
                if isinstance(quantizer, ActivationQuantizer) and not (
                    quantizer.built and bool(quantizer.range_initialized.numpy())
                ):
                    inner = "" if quantizer is layer else f"/{quantizer.name}"
                    unset.append(f"'{path}{inner}'")
    if unquantized:
        raise UnsupportedModelError(
            f"{format_name} export of '{model.name}' needs integer weights and activations, "
            f"but the QAT layers {', '.join(unquantized)} keep them in float."
        )
    if unset:
        raise ValueError(
            f"The activation quantizers {', '.join(unset)} of '{model.name}' have not seen a "
            f"training batch, so they have no range: the model's inference passes those tensors "
            f"through unquantized, and no integer file can compute that. Train the model (a few "
            f"QAT steps set every range) before exporting it."
        )


def host_weights(model, taken=()):
    """Every fake-quantized kernel of `model`'s QAT hosts, in model order.

    Args:
        model: a QAT model (`check_exportable` passed).
        taken: names the tags must avoid (the file's input and output names).

    Returns:
        list of HostWeight.
    """
    names = set(taken)
    found: list = []
    seen = set()
    for path, layer in _layers(model):
        if not isinstance(layer, QAT_HOSTS) or id(layer) in seen:
            continue
        seen.add(id(layer))
        for kernel, grid in layer.weight_grids().items():
            tag = _models.unique_name(f"qat_weight_{len(found)}", names)
            names.add(tag)
            found.append(HostWeight(path, kernel, layer.kind, grid, tag))
    return found


class _ExportForm(keras.layers.Layer):
    """A QAT layer's `export_function` as a layer, in its place in the traced copy."""

    def __init__(self, layer, function):
        super().__init__(name=layer.name)
        self._function = function
        self._output_shape = layer.compute_output_shape

    def call(self, inputs):
        return self._function(inputs)

    def compute_output_shape(self, input_shape):
        return self._output_shape(input_shape)


def export_model(model, weights, weight_op):
    """The export form of a QAT model: a copy whose QAT layers compute their `export_function`s
    (every other layer shared), for the converter to trace.

    Args:
        model: a QAT model (`check_exportable` passed).
        weights: `host_weights(model)`.
        weight_op: called as weight_op(HostWeight) while the copy is traced; returns the float
            tensor of that kernel in its grid's layout (see `QuantizedHost.export_function`).

    Returns:
        A keras.Model with the model's inputs and outputs.
    """
    by_layer: dict[int, str] = {}
    for path, layer in _layers(model):
        by_layer.setdefault(id(layer), path)
    tagged = {(weight.host, weight.kernel): weight for weight in weights}

    def clone(layer):
        if isinstance(layer, ActivationQuantizer):
            return _ExportForm(layer, layer.export_function())
        if isinstance(layer, QAT_HOSTS):
            path = by_layer[id(layer)]
            return _ExportForm(
                layer, layer.export_function(lambda kernel, _: weight_op(tagged[path, kernel]))
            )
        return layer

    return keras.models.clone_model(model, clone_function=clone, recursive=True)


def output_steps(model):
    """Each output's quantization step (its LSB), in the model's flat output order.

    An output's step is that of the last grid it is rounded to: the ActivationQuantizer or QAT
    layer output quantizer that produces it, through the layers that keep their input's grid
    (pooling, reshapes, dropout; `keras_bn.quantize.spec`), or the step the TFLite int8 spec
    fixes for a softmax, sigmoid, tanh or log-softmax output (1/256 for a softmax).

    Args:
        model: a QAT model whose quantizers have ranges.

    Returns:
        list of float.

    Raises:
        UnsupportedModelError: an output that no quantizer rounds (a float output, which an
            integer file cannot compute), named.
    """
    return [_step(model, tensor) for tensor in trace.output_tensors(model)]


def _step(model, tensor):
    operation, node_index, tensor_index = tensor._keras_history
    if isinstance(operation, ActivationQuantizer):
        return operation.grid().scale
    if isinstance(operation, QAT_HOSTS) and operation.output_quantizer is not None:
        return operation.output_quantizer.grid().scale
    if isinstance(operation, keras.Model) and _models.has_layer_graph(operation):
        return _step(operation, trace.output_tensors(operation)[tensor_index])
    if isinstance(operation, L.Layer) and spec.role(operation) == spec.FIXED:
        return spec.fixed_step(operation)
    node = operation._inbound_nodes[node_index]
    if (
        isinstance(operation, L.Layer)
        and spec.role(operation) == spec.PRESERVES
        and len(node.input_tensors) == 1
    ):
        return _step(model, node.input_tensors[0])
    raise UnsupportedModelError(
        f"An output of '{model.name}' comes from '{operation.name}' "
        f"({type(operation).__name__}), which no activation quantizer rounds: an integer file "
        f"cannot compute a float output. End the model with a quantized layer (quantize_model "
        f"puts an ActivationQuantizer after such outputs)."
    )

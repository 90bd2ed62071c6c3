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
each host's `weight_grids()` (`HostWeight`), by the format.
"""

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import keras

from keras_bn._errors import UnsupportedModelError
from keras_bn._graph import fold_plan, models
from keras_bn.export import trace
from keras_bn.quantize import fake_quant, grids, hosts, spec
from keras_bn.quantize.activation import ActivationQuantizer
from keras_bn.quantize.layers import QuantizedHost, QuantizedHostBatchNorm
from keras_bn.quantize.pooling import QuantizedAveragePooling

QAT_HOSTS = (QuantizedHost, QuantizedHostBatchNorm)
QAT_LAYERS = (ActivationQuantizer, QuantizedAveragePooling, *QAT_HOSTS)
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
        grid: the fake_quant.WeightGrid the layer's inference rounds to; a per-channel Dense
            kernel written as a 1×1 convolution (`host_weights(dense_as_conv=True)`) has its q
            as (1, 1, in, out).
        tag: a unique name for the kernel in the traced graph (a valid TensorFlow op name).
    """

    host: str
    kernel: str
    kind: str
    grid: fake_quant.WeightGrid
    tag: str

    @property
    def layout_kind(self) -> str:
        """The kind whose kernel layout this kernel has: a separable host's depthwise kernel is
        a depthwise one, its "kernel" a 1×1 convolution's, as is a Dense kernel written as
        one."""
        if self.kind == hosts.SEPARABLE:
            return hosts.DEPTHWISE if self.kernel == "depthwise_kernel" else hosts.CONV
        if self.kind == hosts.DENSE and self.grid.q.ndim == 4:
            return hosts.CONV
        return self.kind


def is_quantized(model: keras.Model) -> bool:
    """Whether `model` holds keras_bn.quantize layers (nested ones included): a QAT model.

    Args:
        model: a Keras model.

    Returns:
        bool.
    """
    return bool(models.layers_within(model, QAT_LAYERS))


def _layers(model: keras.Model, prefix: str = "") -> Iterator[tuple[str, keras.layers.Layer]]:
    """(path, layer) for every layer of a Sequential/Functional model, nested models' layers
    instead of the nested models (a subclassed nested model is a layer)."""
    for layer in model.layers:
        path = prefix + layer.name
        if isinstance(layer, keras.Model) and models.has_layer_graph(layer):
            yield from _layers(layer, path + "/")
        else:
            yield path, layer


def _shared_hosts(model: keras.Model, prefix: str = "", calls: int = 1) -> list[tuple[str, int]]:
    """(path, calls) of every QAT host called more than once in all, counting the calls of the
    nested models around it."""
    graph = fold_plan.Graph(models.layer_graph(model, "export"))
    found = []
    for layer in model.layers:
        total = calls * graph.calls.get(id(layer), 1)
        if isinstance(layer, keras.Model) and models.has_layer_graph(layer):
            found += _shared_hosts(layer, f"{prefix}{layer.name}/", total)
        elif isinstance(layer, QAT_HOSTS) and total > 1:
            found.append((prefix + layer.name, total))
    return found


def check_exportable(model: keras.Model, format_name: str) -> None:
    """Refuse a QAT model that no integer file can compute, naming the layers.

    Args:
        model: a QAT model (`is_quantized`).
        format_name: "TFLite" or "ONNX", for the messages.

    Raises:
        UnsupportedModelError: a layer with weights that is not a QAT layer (a layer
            `quantize_model` kept in float, a custom layer), a QAT host called more than once
            (shared, or inside a nested model that is), or a QAT layer with
            weight_bits=None or activation_bits=None (float weights or output).
        ValueError: an activation quantizer that has not seen a training batch (no range).
    """
    floating: list[str] = []
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
    shared = [f"'{path}' ({calls} calls)" for path, calls in _shared_hosts(model)]
    if shared:
        raise UnsupportedModelError(
            f"{format_name} export of '{model.name}' cannot take the QAT layers {', '.join(shared)}"
            f": each is called more than once (itself or a nested model holding it), and a file "
            f"holds one kernel per call. Give each call its own layer; quantize_model keeps "
            f"shared hosts in float."
        )
    unquantized: list[str] = []
    unset: list[str] = []
    for path, layer in _layers(model):
        if isinstance(layer, QAT_HOSTS):
            floats = [
                f"{n}=None" for n in ("weight_bits", "activation_bits") if getattr(layer, n) is None
            ]
            if floats:
                unquantized.append(f"'{path}' ({', '.join(floats)})")
        if isinstance(layer, QAT_LAYERS):
            for quantizer in models.layers_within(layer, ActivationQuantizer, include_self=True):
                if not (quantizer.built and bool(quantizer.range_initialized.numpy())):
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


def host_weights(
    model: keras.Model, taken: Iterable[str] = (), dense_as_conv: bool = False
) -> list[HostWeight]:
    """Every fake-quantized kernel of `model`'s QAT hosts, in model order.

    Args:
        model: a QAT model (`check_exportable` passed).
        taken: names the tags must avoid (the file's input and output names).
        dense_as_conv: give each per-channel Dense kernel as a 1×1 convolution's,
            (1, 1, in, out), so that the export form computes that host as one (a format
            whose matmul holds one weight scale: TFLite).

    Returns:
        list of HostWeight.
    """
    names = set(taken)
    found: list[HostWeight] = []
    seen: set[int] = set()
    for path, layer in _layers(model):
        if not isinstance(layer, QAT_HOSTS) or id(layer) in seen:
            continue
        seen.add(id(layer))
        for kernel, grid in layer.weight_grids().items():
            if dense_as_conv and layer.kind == hosts.DENSE and grid.per_channel:
                grid = grid._replace(q=grid.q.reshape((1, 1, *grid.q.shape)))
            tag = models.unique_name(f"qat_weight_{len(found)}", names)
            names.add(tag)
            found.append(HostWeight(path, kernel, layer.kind, grid, tag))
    return found


class _ExportForm(keras.layers.Layer):
    """A QAT layer's `export_function` as a layer, in its place in the traced copy."""

    def __init__(self, layer: keras.layers.Layer, function: Callable[..., Any]) -> None:
        super().__init__(name=layer.name)
        self._function = function
        self._output_shape = layer.compute_output_shape

    def call(self, inputs: Any, **options: Any) -> Any:
        return self._function(inputs, **options)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return self._output_shape(input_shape)


def export_model(
    model: keras.Model,
    weights: list[HostWeight],
    weight_op: Callable[[HostWeight], Any],
    halves_as_ops: bool = False,
) -> keras.Model:
    """The export form of a QAT model: a copy whose QAT layers compute their `export_function`s
    (every other layer shared), for the converter to trace.

    Args:
        model: a QAT model (`check_exportable` passed).
        weights: `host_weights(model)`.
        weight_op: called as weight_op(HostWeight) while the copy is traced; returns the float
            tensor of that kernel in its grid's layout (see `QuantizedHost.export_function`).
        halves_as_ops: write how an average pool's output rounds its halves as ops
            (`ActivationQuantizer.export_function`): for a format whose runtime rounds it in
            float (ONNX), not for TFLite, whose int8 AVERAGE_POOL_2D rounds them so itself.

    Returns:
        A keras.Model with the model's inputs and outputs.
    """
    by_layer: dict[int, str] = {}
    for path, layer in _layers(model):
        by_layer.setdefault(id(layer), path)
    tagged = {(weight.host, weight.kernel): weight for weight in weights}

    def clone(layer: keras.layers.Layer) -> keras.layers.Layer:
        if isinstance(layer, (ActivationQuantizer, QuantizedAveragePooling)):
            return _ExportForm(layer, layer.export_function(halves_as_ops))
        if isinstance(layer, QAT_HOSTS):
            path = by_layer[id(layer)]
            return _ExportForm(
                layer, layer.export_function(lambda kernel, _: weight_op(tagged[path, kernel]))
            )
        return layer

    return keras.models.clone_model(model, clone_function=clone, recursive=True)


def output_steps(model: keras.Model) -> list[float]:
    """Each output's quantization step (its LSB), in the model's flat output order.

    An output's step is that of the last grid it is rounded to: the ActivationQuantizer, QAT
    layer output quantizer or QuantizedAveragePooling that produces it, through the layers
    that keep their input's grid
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


def _step(model: keras.Model, tensor: keras.KerasTensor) -> float:
    operation, quantizer = grids.grid_source(tensor)
    if quantizer is not None:
        return quantizer.grid().scale
    fixed = spec.fixed_step(operation) if isinstance(operation, L.Layer) else None
    if fixed is not None:
        return fixed
    raise UnsupportedModelError(
        f"An output of '{model.name}' comes from '{operation.name}' "
        f"({type(operation).__name__}), which no activation quantizer rounds: an integer file "
        f"cannot compute a float output. End the model with a quantized layer (quantize_model "
        f"puts an ActivationQuantizer after such outputs)."
    )

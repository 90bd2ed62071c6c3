"""Which activation quantizer's grid a tensor of a QAT model lies on, read from the model's
graph of layers.

A tensor lies on the grid of the quantizer that rounded it last: the `ActivationQuantizer`,
QAT layer or `QuantizedAveragePooling` that produced it (each says which through its
`grid_quantizer()`), reached through the layers that keep their input's grid (max pooling,
reshapes, dropout: `spec.PRESERVES`) and into nested Sequential/Functional models' outputs.
The exporters read an output's step this way, and a QAT host its input's (or the step
the int8 spec fixes for a tanh, sigmoid or softmax before it): an integer file adds
the host's bias in units of that step times the weights' (`fake_quant.round_bias`).
"""

from typing import Any

import keras

from keras_bn._graph import models
from keras_bn.quantize import spec


def grid_source(tensor: keras.KerasTensor) -> tuple[keras.Operation, Any]:
    """Where the grid of a symbolic tensor of a Sequential/Functional model comes from.

    Args:
        tensor: a KerasTensor with a `_keras_history` (a model's input or a layer's output).

    Returns:
        (operation, quantizer): the operation the search ended at, and the ActivationQuantizer
        whose grid the tensor lies on, or None when that operation sets none (an input layer,
        a float layer, a softmax whose step the int8 spec fixes, a QAT layer that leaves its
        output to another layer's quantizer).
    """
    operation, node_index, tensor_index = tensor._keras_history
    quantizer_of = getattr(operation, "grid_quantizer", None)
    if quantizer_of is not None:
        return operation, quantizer_of()
    if isinstance(operation, keras.Model) and models.has_layer_graph(operation):
        return grid_source(operation.outputs[tensor_index])
    node = operation._inbound_nodes[node_index]
    if (
        isinstance(operation, keras.layers.Layer)
        and spec.role(operation) == spec.PRESERVES
        and len(node.input_tensors) == 1
    ):
        return grid_source(node.input_tensors[0])
    return operation, None


def input_grid(layer: keras.layers.Layer) -> Any:
    """The grid a one-input layer's input lies on, in the models the layer is called in.

    Args:
        layer: a layer (a QAT host).

    Returns:
        The ActivationQuantizer that sets it; or the step as a float where the int8 spec fixes
        it (the output of a tanh, sigmoid or softmax, `spec.fixed_step`), which no quantizer
        rounds; or None where there is none, or no single one: the layer was never called on
        a model's symbolic tensors (a subclassed model, a direct call), its input comes from
        outside the model it sits in (a nested model's input), or its calls read different
        grids.
    """
    found = set()
    grids = []
    for node in getattr(layer, "_inbound_nodes", []):
        if len(node.input_tensors) != 1:
            return None
        operation, grid = grid_source(node.input_tensors[0])
        if grid is None and isinstance(operation, keras.layers.Layer):
            grid = spec.fixed_step(operation)
        key = grid if isinstance(grid, float) else id(grid)
        if key not in found:
            found.add(key)
            grids.append(grid)
    return grids[0] if len(grids) == 1 else None

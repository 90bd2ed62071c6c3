"""int8 weights for the ONNX graph of a quantization-aware (QAT) model: each kernel becomes an
int8 initializer read by a DequantizeLinear (per output channel where its grid is), with no
QuantizeLinear.

tf2onnx (1.17) converts only per-tensor 8-bit FakeQuant ops, which the activations are
(export/qat.py), but no per-channel or narrow-range one, and it folds and renames constant
kernels. So the export form is traced with each kernel as an input of the function, named by
its tag (`qat.HostWeight.tag`): tf2onnx keeps input names, and writes between the input and
its Conv or MatMul only the layout changes its handlers make (TensorFlow's kernel layout to
ONNX's: Reshape, Transpose). `int8_weights` replaces each such input and its chain by the
integers in the layout the chain ends in, found by running the same chain on them, and a
DequantizeLinear on the axis the output channels end on.
"""

from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from keras_bn.export import qat
from keras_bn.quantize import fake_quant

# The nodes that only move a kernel's values: the chain between an input and its consumer.
_LAYOUT_OPS = ("Reshape", "Transpose", "Identity", "Squeeze", "Unsqueeze")
# The consumers whose input 1 is a weight.
WEIGHT_CONSUMERS = ("Conv", "MatMul", "Gemm")


def kernel_names(weight: qat.HostWeight) -> dict[str, str]:
    """The names `int8_weights` gives a kernel's initializers and its DequantizeLinear output.

    Args:
        weight: a qat.HostWeight.

    Returns:
        {"quantized", "scale", "zero_point", "dequantized"}: names.
    """
    base = f"{weight.host}/{weight.kernel}"
    return {
        "quantized": f"{base}_quantized",
        "scale": f"{base}_scale",
        "zero_point": f"{base}_zero_point",
        "dequantized": base,
    }


def int8_weights(proto: onnx.ModelProto, weights: list[qat.HostWeight]) -> None:
    """Make every kernel input of `proto` an int8 initializer and a DequantizeLinear, in place.

    Args:
        proto: the onnx.ModelProto tf2onnx wrote from the export form with each kernel an
            input named by its tag.
        weights: the qat.HostWeight list (their grids give the integers and scales).

    Raises:
        RuntimeError: a kernel input that is not there, or reaches its Conv/MatMul/Gemm
            through anything but layout changes (tf2onnx wrote the graph otherwise than this
            module expects).
    """
    graph = proto.graph
    initializers = {i.name: i for i in graph.initializer}
    removed_nodes, dequantizers = [], []
    for weight in weights:
        chain, consumer = _chain(graph, weight.tag)
        q, channel = _follow(chain, initializers, weight.grid.q, _channel_ids(weight.grid.q))
        names = kernel_names(weight)
        scale, zero_point, attributes = _scale(weight.grid, channel, q.shape)
        graph.initializer.extend(
            [
                numpy_helper.from_array(q.astype(np.int8), names["quantized"]),
                numpy_helper.from_array(scale, names["scale"]),
                numpy_helper.from_array(zero_point, names["zero_point"]),
            ]
        )
        dequantizers.append(
            helper.make_node(
                "DequantizeLinear",
                [names["quantized"], names["scale"], names["zero_point"]],
                [names["dequantized"]],
                name=f"{names['dequantized']}_dequantize",
                **attributes,
            )
        )
        consumer.input[1] = names["dequantized"]
        removed_nodes.extend(chain)
    for node in reversed(dequantizers):
        graph.node.insert(0, node)
    _remove(graph, removed_nodes, {weight.tag for weight in weights})


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    found: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            found.setdefault(name, []).append(node)
    return found


def _chain(graph: onnx.GraphProto, tag: str) -> tuple[list[onnx.NodeProto], onnx.NodeProto]:
    """(the layout nodes from input `tag` to its consumer, the consumer)."""
    if tag not in {value.name for value in graph.input}:
        raise RuntimeError(f"The ONNX graph has no kernel input {tag!r}.")
    consumers = _consumers(graph)
    chain: list[onnx.NodeProto] = []
    current = tag
    while True:
        users = consumers.get(current, [])
        if len(users) != 1:
            raise RuntimeError(
                f"The kernel {tag!r} is read by {len(users)} nodes in the ONNX graph, not one."
            )
        node = users[0]
        if node.op_type in WEIGHT_CONSUMERS and list(node.input).index(current) == 1:
            return chain, node
        if node.op_type not in _LAYOUT_OPS or node.input[0] != current:
            raise RuntimeError(
                f"The kernel {tag!r} reaches its consumer through a {node.op_type} node "
                f"('{node.name}') in the ONNX graph, which is no layout change."
            )
        chain.append(node)
        current = node.output[0]


def _channel_ids(q: np.ndarray) -> np.ndarray:
    """An array of q's shape holding each value's output channel (q's last axis)."""
    return np.broadcast_to(np.arange(q.shape[-1]), q.shape)


def _follow(
    chain: list[onnx.NodeProto], initializers: dict[str, onnx.TensorProto], *arrays: np.ndarray
) -> tuple[np.ndarray, ...]:
    """`arrays` through the chain's layout changes, as onnxruntime would compute them."""
    for node in chain:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Transpose":
            perm = attributes.get("perm")
            arrays = tuple(np.transpose(a, perm) for a in arrays)
        elif node.op_type == "Reshape":
            shape = numpy_helper.to_array(initializers[node.input[1]]).astype(int).tolist()
            if not attributes.get("allowzero", 0):  # 0 copies the input's dimension
                shape = [a if s == 0 else s for s, a in zip(shape, arrays[0].shape)] + shape[
                    len(arrays[0].shape) :
                ]
            arrays = tuple(np.reshape(a, shape) for a in arrays)
        elif node.op_type in ("Squeeze", "Unsqueeze"):
            axes = attributes.get("axes")
            if axes is None and len(node.input) > 1:
                axes = numpy_helper.to_array(initializers[node.input[1]]).astype(int).tolist()
            if node.op_type == "Squeeze":  # no axes: every dimension of size 1
                arrays = tuple(np.squeeze(a, None if axes is None else tuple(axes)) for a in arrays)
            elif axes is None:
                raise RuntimeError(f"The Unsqueeze node '{node.name}' has no axes.")
            else:
                arrays = tuple(np.expand_dims(a, tuple(axes)) for a in arrays)
    return arrays


def _scale(
    grid: fake_quant.WeightGrid, channel: np.ndarray, shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(scale, zero point, DequantizeLinear attributes) for the integers laid out as
    `channel` says (each value's output channel, in the final layout)."""
    if not grid.per_channel:
        return (
            np.asarray(grid.scale, np.float32).reshape(()),
            np.zeros((), np.int8),
            {},
        )
    for axis in range(len(shape)):
        along = np.moveaxis(channel, axis, 0).reshape(shape[axis], -1)
        if np.all(along == along[:, :1]):  # the channel depends on this axis only
            order = along[:, 0]
            scale = np.asarray(grid.scale, np.float32)[order]
            return scale, np.zeros(scale.shape, np.int8), {"axis": axis}
    raise RuntimeError(f"The output channels of a kernel of shape {shape} lie on no one axis.")


def _remove(graph: onnx.GraphProto, nodes: Iterable[onnx.NodeProto], inputs: set[str]) -> None:
    """Remove `nodes` (and what shape inference recorded of their outputs) and the graph
    inputs named in `inputs`, then any initializer nothing reads any more (a Reshape's
    shape)."""
    gone = {id(node) for node in nodes}
    outputs = {name for node in nodes for name in node.output}
    kept_info = [value for value in graph.value_info if value.name not in outputs]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    kept = [node for node in graph.node if id(node) not in gone]
    del graph.node[:]
    graph.node.extend(kept)
    kept_inputs = [value for value in graph.input if value.name not in inputs]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    read = {name for node in graph.node for name in node.input}
    read |= {value.name for value in graph.output}
    unread = [i for i in graph.initializer if i.name not in read]
    for initializer in unread:
        graph.initializer.remove(initializer)

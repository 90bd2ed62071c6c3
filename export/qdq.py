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

`float_ops` names the nodes of such a graph that an integer runtime computes in float: those
outside a DequantizeLinear → op → QuantizeLinear unit.
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
        scale, zero_point, attributes = _scale(
            weight.grid, channel, q.shape, _output_axis(consumer)
        )
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


def _output_axis(consumer: onnx.NodeProto) -> int:
    """The axis of its weight input that holds `consumer`'s output channels: a Conv's (O, I/g,
    *k) 0, a MatMul's (I, O) 1, a Gemm's 1, or 0 with transB."""
    if consumer.op_type == "Conv":
        return 0
    transposed = any(a.name == "transB" and a.i for a in consumer.attribute)
    return 0 if transposed else 1


def _scale(
    grid: fake_quant.WeightGrid, channel: np.ndarray, shape: tuple[int, ...], output_axis: int
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(scale, zero point, DequantizeLinear attributes) for the integers laid out as
    `channel` says (each value's output channel, in the final layout); `output_axis`, the
    consumer's output-channel axis, where the channels cannot tell (a single channel: every
    axis holds only it)."""
    if not grid.per_channel:
        return (
            np.asarray(grid.scale, np.float32).reshape(()),
            np.zeros((), np.int8),
            {},
        )
    axes = []
    for axis in range(len(shape)):
        along = np.moveaxis(channel, axis, 0).reshape(shape[axis], -1)
        if np.all(along == along[:, :1]):  # the channel depends on this axis only
            axes.append((axis, along[:, 0]))
    if not axes:
        raise RuntimeError(f"The output channels of a kernel of shape {shape} lie on no one axis.")
    axis, order = next(((a, o) for a, o in axes if a == output_axis), axes[0])
    scale = np.asarray(grid.scale, np.float32)[order]
    return scale, np.zeros(scale.shape, np.int8), {"axis": axis}


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


# Float-op analysis of a QDQ file. In QDQ form every op formally computes in float; an integer
# runtime computes in integers exactly the ops whose operands are dequantized values and whose
# result is quantized again (DequantizeLinear → op → QuantizeLinear), as the TFLite converter
# keeps in int8 exactly the ops whose tensors all carry a range. The same rule, read from the
# file, names the same op of the model in both formats (export/tflite.py reads its own ops);
# a Keras-level check could not, since one Keras layer (a Lambda) may write several ops of
# which only the last is rounded.
# Ops that only move values: never named, whatever they carry.
SHAPE_OPS = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
# Ops that read their input's shape alone (an upsampling's Resize sizes come from one): they
# compute on no value.
_SHAPE_READERS = frozenset({"Shape", "Size"})
# Ops whose result lies on their input's grid (values moved, selected, clamped or maxed): a
# QuantizeLinear after them quantizes the op before them too, as TFLite gives a concatenation,
# max pool or clamp its input's scale.
_GRID_KEEPING = SHAPE_OPS | {
    "Concat",
    "Split",
    "Slice",
    "Gather",
    "Pad",
    "Tile",
    "Expand",
    "MaxPool",
    "GlobalMaxPool",
    "ReduceMax",
    "ReduceMin",
    "Relu",
    "Clip",
    "Min",
    "Max",
}
# Ops whose output grid the int8 spec fixes (1/256 for a softmax, `keras_bn.quantize.spec`):
# on dequantized operands they are integer ops, as TFLite's LOGISTIC, TANH and SOFTMAX are
# (a sigmoid mid-network, a swish's x·σ(x), a squeeze-and-excitation gate), and they may end
# the model's float output unquantized, as the QAT model's own output is.
_FIXED_GRID = frozenset({"Softmax", "LogSoftmax", "Sigmoid", "Tanh"})
# The ops that compute in integers between a DequantizeLinear and a QuantizeLinear: those with
# int8 kernels in the TFLite converter's output and onnxruntime's QDQ fusions. Another op there
# (Elu, Softplus, Sin, Neg, Exp, ...) is computed in float, as TFLite's file names it.
_INTEGER_OPS = _FIXED_GRID | {
    "Conv",
    "MatMul",
    "Gemm",
    "Add",
    "Sub",
    "Mul",
    "AveragePool",
    "GlobalAveragePool",
    "ReduceMean",
    "LeakyRelu",
    "Abs",
    "Resize",
}
_FLOAT_TYPES = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.BFLOAT16,
    }
)


def float_ops(proto: onnx.ModelProto) -> list[str]:
    """The op type of every node of a QDQ file that computes in float, in graph order.

    A node computes in integers when its float operands are dequantized values or constants
    and its result reaches a QuantizeLinear through grid-keeping ops only (Concat, MaxPool,
    Relu, clamps and shape-only ops, which keep their input's grid), or the model's output
    for an op on a fixed grid (Softmax). An op on a fixed grid (Sigmoid, Tanh, Softmax,
    LogSoftmax) of dequantized operands is an integer op whose result is on that grid, as
    the TFLite converter writes it (so x·Sigmoid(x) of a swish is too). An op with no
    integer kernel (`_INTEGER_OPS`: an Elu, Softplus, Exp) computes in float wherever it is,
    and grid-keeping ops on the model's inputs alone (a Concat of two inputs) are the inputs
    as given, quantized by the QuantizeLinear after them. The export's own
    units count as one op: a Conv, MatMul or Gemm on an int8 kernel with its bias Add (the
    int32 bias of an integer kernel), and an AveragePool with the rounding of its halves
    (`halves_as_ops` in export/qat.py: Sub, Sign, Mul, Add). Every other node that reads or
    writes a float tensor is named: an op whose result another op computes on before any
    QuantizeLinear, the op that computes on it, and any op downstream of them up to the next
    QuantizeLinear. The model's float input, which a QuantizeLinear reads, and the
    DequantizeLinear of its float output are not counted; shape-only ops never are.

    Args:
        proto: the onnx.ModelProto of a QAT model's file (`int8_weights` applied).

    Returns:
        list of op types, one per float node ([] for a file an integer runtime computes).
    """
    graph = onnx.shape_inference.infer_shapes(proto).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info)}
    types.update({v.name: v.type.tensor_type.elem_type for v in graph.output})
    types.update({i.name: i.data_type for i in graph.initializer})
    producers = {name: node for node in graph.node for name in node.output}
    constants = _constants(graph)
    rounding = _pool_roundings(graph, producers, constants)
    # The value's state: on a grid (dequantized), float (unquantized and computed on, or the
    # model's input), or pending: computed from values on grids, to be quantized, with the
    # computing nodes (and non-shape grid-keeping ones) that produced it.
    on_grid: set[str] = set()
    floating_values = {value.name for value in graph.input} - constants
    # The model's inputs, and what grid-keeping ops (a Concatenate of two inputs) make of them
    # alone: a QuantizeLinear after them quantizes the inputs as given.
    as_given = set(floating_values)
    pending: dict[str, list[onnx.NodeProto]] = {}
    named: dict[int, onnx.NodeProto] = {}

    def name(*nodes: onnx.NodeProto) -> None:
        for node in nodes:
            if node.op_type not in SHAPE_OPS:
                named.setdefault(id(node), node)

    for node in graph.node:
        values = [value for value in node.input if value and value not in constants]
        if node.op_type == "QuantizeLinear" or node.output[0] in constants:
            continue  # quantizes whatever it reads; a constant computes nothing at run time
        if node.op_type in _SHAPE_READERS:
            continue
        if node.op_type == "DequantizeLinear":
            on_grid.update(node.output)
            continue
        if not any(types.get(v, onnx.TensorProto.FLOAT) in _FLOAT_TYPES for v in _io(node)):
            continue  # integer arithmetic (shapes)
        sources = [pending[v] for v in values if v in pending]
        if (
            node.op_type in _GRID_KEEPING
            and any(value in as_given for value in values)
            and all(value in as_given or value in on_grid for value in values)
        ):
            as_given.update(node.output)
            floating_values.update(node.output)
        elif any(value in floating_values for value in values):
            name(node)
            floating_values.update(node.output)
        elif node.op_type in _FIXED_GRID and not sources:
            on_grid.update(node.output)  # on the spec's fixed grid in an integer runtime
        elif node.op_type in _GRID_KEEPING:
            if sources:
                carried = [n for chain in sources for n in chain]
                pending.update({out: [*carried, node] for out in node.output})
            else:
                on_grid.update(node.output)
        elif node.op_type not in _INTEGER_OPS and id(node) not in rounding:
            for chain in sources:  # no integer kernel: it computes in float
                name(*chain)
            name(node)
            floating_values.update(node.output)
        elif not sources or id(node) in rounding or _bias_add(node, sources, producers):
            carried = [n for chain in sources for n in chain]
            pending.update({out: [*carried, node] for out in node.output})
        else:  # computes on a result no QuantizeLinear rounded
            for chain in sources:
                name(*chain)
            name(node)
            floating_values.update(node.output)
    for value in graph.output:
        chain = pending.get(value.name, [])
        computing = [n for n in chain if n.op_type not in _GRID_KEEPING]
        if chain and not (computing and computing[-1].op_type in _FIXED_GRID):
            name(*chain)  # an output no QuantizeLinear rounds
    return [node.op_type for node in graph.node if id(node) in named]


def _io(node: onnx.NodeProto) -> list[str]:
    return [value for value in (*node.input, *node.output) if value]


def _constants(graph: onnx.GraphProto) -> set[str]:
    """The values known before the graph runs: initializers, Constant nodes and what is
    computed from them alone."""
    found = {initializer.name for initializer in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" or (node.input and all(v in found for v in node.input if v)):
            found.update(node.output)
    return found


def _source(value: str, producers: dict[str, onnx.NodeProto]) -> tuple[str, onnx.NodeProto | None]:
    """(the value before any shape-only ops that led to `value`, its producer or None)."""
    node = producers.get(value)
    while node is not None and node.op_type in SHAPE_OPS:
        value = node.input[0]
        node = producers.get(value)
    return value, node


def _bias_add(
    node: onnx.NodeProto,
    sources: list[list[onnx.NodeProto]],
    producers: dict[str, onnx.NodeProto],
) -> bool:
    """Whether `node` adds a constant (the bias) to the result of a Conv, MatMul or Gemm on a
    dequantized kernel and nothing else: one integer kernel with it."""
    if node.op_type != "Add" or len(sources) != 1:
        return False
    (chain,) = sources
    computing = [n for n in chain if n.op_type not in SHAPE_OPS]
    if len(computing) != 1 or computing[0].op_type not in WEIGHT_CONSUMERS:
        return False
    kernel = producers.get(computing[0].input[1])
    return kernel is not None and kernel.op_type == "DequantizeLinear"


# The ops whose output an export rounds as TFLite's int8 kernel does: an average pool's and a
# bilinear upsampling's.
_ROUNDED_AVERAGES = frozenset({"AveragePool", "Resize"})


def _pool_roundings(
    graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto], constants: set[str]
) -> set[int]:
    """The ids of the nodes that round an AveragePool's (or a bilinear Resize's) halves as
    TFLite's int8 kernel does (`fake_quant.round_halves`): away from the int8 zero, pool +
    Sign(pool − c)·c' (Sub, Sign, Mul, Add), or up, Resize + c' (an Add), found by that
    structure (shape-only ops between them allowed)."""
    found: set[int] = set()
    for add in graph.node:
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        for pool_value, move_value in (add.input, reversed(add.input)):
            pool_value, pool = _source(pool_value, producers)
            if pool is not None and pool.op_type == "Resize" and move_value in constants:
                found.add(id(add))  # halves up: a constant added
                continue
            _, mul = _source(move_value, producers)
            if pool is None or pool.op_type not in _ROUNDED_AVERAGES or mul is None:
                continue
            if mul.op_type != "Mul" or not any(v in constants for v in mul.input):
                continue
            moved = [v for v in mul.input if v not in constants]
            if len(moved) != 1:
                continue
            _, sign = _source(moved[0], producers)
            if sign is None or sign.op_type != "Sign":
                continue
            _, sub = _source(sign.input[0], producers)
            if (
                sub is not None
                and sub.op_type == "Sub"
                and _source(sub.input[0], producers)[0] == pool_value
                and sub.input[1] in constants
            ):
                found |= {id(add), id(mul), id(sign), id(sub)}
    return found

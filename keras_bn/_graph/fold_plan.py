"""Which batch norm folds into which layer, decided from a model's graph alone: what the fold
(keras_bn.export's `fold_batch_norms`) carries out and `check_batchnorm` reports. No weight is
read, so the decisions cost no more than a walk of the graph.

The rules are shared with keras_bn.quantize's `quantize_model`, so that both rewrites fold
exactly where the other would: `Graph` (who feeds whom in a model's graph of nodes), the
decisions on a batch norm and the layer before it (`refuse_bn`, `refuse_backward`,
`refuse_host`), each a `Refusal` (a kind to branch on, and the reason in words) or None, and
`unseen_batch_norms`, the BNs a rewrite copies without seeing (BN subclasses, BNs inside
custom layers), which it must report. `plan` applies them to a model for the fold.

Each BN is folded backward into the layer that produces its input when it can be, else forward
into the layer that consumes its output, else kept, with the reason. A nested model is planned
on its own; a BN the fold cannot see into (one inside a custom layer, or a subclass of a BN
class, whose call may compute something else) is kept, so every BN of the model is decided.
"""

import dataclasses

import keras
from keras.src.ops.node import Node

from keras_bn._graph import bn_layers, models, rebuild

L = keras.layers
BN_TYPES = bn_layers.BN_TYPES  # exact types: a subclass is copied as it is, and kept
# Exact types, not isinstance: a subclass may change what `call` computes.
CONV = (L.Conv1D, L.Conv2D, L.Conv3D)
DEPTHWISE = (L.DepthwiseConv1D, L.DepthwiseConv2D)
SEPARABLE = (L.SeparableConv1D, L.SeparableConv2D)
TRANSPOSE = (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose)
BACKWARD_HOSTS = (L.Dense, *CONV, *DEPTHWISE, *SEPARABLE, *TRANSPOSE)
FORWARD_HOSTS = (L.Dense, *CONV)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a fold cannot happen: `kind` is what the decisions branch on, `message` is only
    for the report."""

    kind: str
    message: str


class Graph:
    """Who feeds whom in a Functional graph, for the fold decisions.

    Args:
        graph: a Functional model (`models.layer_graph` of a Sequential or Functional one).
    """

    def __init__(self, graph):
        self.nodes = [
            node
            for depth in sorted(graph._nodes_by_depth, reverse=True)
            for node in graph._nodes_by_depth[depth]
            if node.operation is not None and not node.is_input
        ]
        self.outputs = {id(t) for t in graph.outputs}
        self.consumers: dict = {}
        self.calls: dict = {}
        for node in self.nodes:
            self.calls[id(node.operation)] = self.calls.get(id(node.operation), 0) + 1
            for tensor in node.input_tensors:
                self.consumers.setdefault(id(tensor), []).append(node)

    def producer(self, node):
        """The operation whose output is the node's single input, or None for a model input."""
        history = getattr(node.input_tensors[0], "_keras_history", None)
        operation = history.operation if history else None
        return None if isinstance(operation, L.InputLayer) else operation

    def fan_out(self, tensor):
        """How many nodes read `tensor`, plus one if it is a model output."""
        return len(self.consumers.get(id(tensor), [])) + (id(tensor) in self.outputs)

    def shared(self, layer):
        """Whether `layer` is called at more than one node."""
        return self.calls.get(id(layer), 0) > 1


def refuse_bn(bn, node, graph):
    """Why this BN cannot fold in any direction, or None."""
    if graph.shared(bn):
        return Refusal(
            "shared_bn", f"BN layer '{bn.name}' is shared (called {graph.calls[id(bn)]} times)"
        )
    # Only the tensors passed positionally: a mask (a keyword tensor) is ignored by inference BN.
    inputs = keras.tree.flatten(node.arguments.args)
    if len(inputs) != 1:
        return Refusal("several_inputs", f"BN layer '{bn.name}' has {len(inputs)} inputs")
    if len(bn_axes(bn, node)) != 1:
        return Refusal(
            "several_axes",
            f"BN layer '{bn.name}' normalizes over several channel axes {bn_axes(bn, node)}",
        )
    return None


def refuse_backward(bn, node, host, graph, host_types, hosts_taken="a Dense or convolution"):
    """Why the BN cannot fold into the layer that feeds it, or None.

    Args:
        bn: the BN layer.
        node: its node.
        host: the operation that produces its input (`Graph.producer`), None for a model input.
        graph: the `Graph`.
        host_types: the exact classes the BN can fold into.
        hosts_taken: those classes in words, for the message.
    """
    if host is None:
        return Refusal("reads_input", f"BN layer '{bn.name}' reads a model input directly")
    if type(host) not in host_types:
        return Refusal(
            "not_a_host",
            f"BN layer '{bn.name}' follows '{host.name}', a "
            f"{type(host).__name__}, which is not {hosts_taken}",
        )
    refusal = refuse_host(host, graph)
    if refusal:
        return refusal
    if activation_name(host) != "linear":
        return Refusal(
            "activation",
            f"host '{host.name}' has the non-linear activation "
            f"'{activation_name(host)}' between its linear part and "
            f"the BN",
        )
    if graph.fan_out(node.input_tensors[0]) > 1:
        return Refusal(
            "fan_out", f"host '{host.name}' output also feeds other layers or a model output"
        )
    rank = len(node.input_tensors[0].shape)
    if bn_axes(bn, node) != [channel_axis(host, rank)]:
        return Refusal(
            "axis",
            f"BN axis {bn_axes(bn, node)} is not the channel axis "
            f"{channel_axis(host, rank)} of host '{host.name}'",
        )
    return None


def refuse_host(layer, graph):
    """Why `layer` cannot take a fold whatever the BN (shared, LoRA, quantized), or None."""
    if graph.shared(layer):
        return Refusal(
            "shared_host", f"host '{layer.name}' is shared (called {graph.calls[id(layer)]} times)"
        )
    if getattr(layer, "lora_enabled", False):
        return Refusal("lora", f"host '{layer.name}' is LoRA-enabled")
    if getattr(layer, "quantization_mode", None):
        return Refusal("quantized", f"host '{layer.name}' is quantized ({layer.quantization_mode})")
    return None


def activation_name(layer):
    """The serialized name of a layer's own activation ("linear" when it has none)."""
    return keras.activations.serialize(layer.activation) if layer.activation else "linear"


def channel_axis(layer, rank):
    """The output channel axis of `layer` for an output of `rank`."""
    return 1 if channels_first(layer) else rank - 1


def bn_axes(bn, node):
    """The BN's channel axes for the input of `node`."""
    return bn_layers.channel_axes(bn, len(node.input_tensors[0].shape))


def channels_first(layer):
    """Whether `layer` has data_format="channels_first"."""
    return getattr(layer, "data_format", None) == "channels_first"


def unseen_batch_norms(layer, prefix, reader="the fold"):
    """(path, reason, kind) for each BN that `layer`, copied as it is, computes out of sight.

    Args:
        layer: a layer the rewrite copies as it is (not an exact BN class).
        prefix: the path of the model holding it ("" or "inner/").
        reader: who cannot see into it, for the reason ("the fold").

    Returns:
        A list: `layer` itself if it subclasses a BN class (kind "subclass") or folds its BN
        into its own weights (a QAT layer: kind "quantization_aware"), else every BN inside it
        (kind "inside_layer"; a QAT layer inside it "quantization_aware"), with its path. A
        QAT layer's BN is part of it, not a BN of its own: it is named by the QAT layer.
    """
    if bn_layers.is_batch_norm(layer):  # not an exact BN type (those were handled)
        base = "keras_bn" if isinstance(layer, bn_layers.KERAS_BN_BN) else "keras.layers"
        return [
            (
                prefix + layer.name,
                (
                    f"BN layer '{layer.name}' is a {type(layer).__name__}, a subclass of "
                    f"{base}.BatchNormalization whose call may compute something else; it is "
                    f"kept as it is"
                ),
                "subclass",
            )
        ]
    if bn_layers.folds_batch_norm(layer):
        return [_quantization_aware(prefix + layer.name, layer)]
    return [
        (
            _quantization_aware(f"{prefix}{layer.name}/{path}", bn)
            if bn_layers.folds_batch_norm(bn)
            else (
                f"{prefix}{layer.name}/{path}",
                (
                    f"BN layer '{bn.name}' is inside custom layer '{layer.name}' "
                    f"({type(layer).__name__}), whose call {reader} cannot see into; it is "
                    f"kept as it is"
                ),
                "inside_layer",
            )
        )
        for path, bn in bn_layers.batch_norms_inside(layer)
    ]


def _quantization_aware(path, layer):
    """The (path, reason, kind) of a QAT layer, which folds its own BN."""
    return (
        path,
        (
            f"quantization-aware layer '{layer.name}' ({type(layer).__name__}) folds its own "
            f"batch norm into its fake-quantized weights, as its inference computes; it is "
            f"kept as it is"
        ),
        "quantization_aware",
    )


@dataclasses.dataclass(frozen=True)
class FoldedBN:
    """A batch norm that `fold_batch_norms` folded into a neighbouring layer.

    Attributes:
        bn: the BN layer's path ("inner/bn" for a BN in the nested model "inner").
        host: the path of the Dense/Conv layer that took it.
        direction: "backward" (host → BN: the BN scaled the host's output channels) or
            "forward" (BN → host: the BN scaled the next layer's input channels).
    """

    bn: str
    host: str
    direction: str


@dataclasses.dataclass(frozen=True)
class KeptBN:
    """A batch norm that `fold_batch_norms` did not fold.

    It becomes an InferenceAffine layer, except a BN inside a custom layer, a BN subclass or a
    QAT layer's BN (folded by the QAT layer itself), which stay as they are.

    Attributes:
        bn: the BN layer's path ("inner/bn" for a BN in the nested model "inner"; for a BN
            inside a custom layer, "layer/…/name").
        reason: why neither fold applies, in words (the backward reason, then the forward
            one).
        kind: the backward refusal, a short code to branch on: "shared_bn", "several_inputs",
            "several_axes", "reads_input", "not_a_host", "shared_host", "lora", "quantized",
            "activation", "fan_out", "axis", "inside_layer" (a BN inside a custom layer),
            "subclass" (a subclass of a BN class, whose call may add to the normalization) or
            "quantization_aware" (a QAT layer, which folds its BN itself: `bn` is its path).
    """

    bn: str
    reason: str
    kind: str = ""


@dataclasses.dataclass
class Plan:
    """The fold's decisions for one Sequential or Functional model.

    Attributes:
        prefix: the model's path ("" or "inner/").
        graph: the model's Functional graph (`models.layer_graph`).
        info: who feeds whom in it (`Graph`).
        backward: (BN, host) per backward fold, in the graph's order.
        forward: (BN, its node, consumer) per forward fold.
        kept: the BNs of this graph that neither fold takes.
        inner: the plan of each nested model that holds a graph or a BN, by id(layer).
        unseen: the BNs each other layer computes out of sight, by id(layer).
        copies: the fold's unbuilt copy of each other layer, by id(layer), made from its
            config (a folded host's with the bias it will need): made here, so that a layer
            whose config does not round-trip refuses the model before anything is folded.
    """

    prefix: str
    graph: keras.Model
    info: Graph
    backward: list[tuple[keras.layers.Layer, keras.layers.Layer]]
    forward: list[tuple[keras.layers.Layer, Node, keras.layers.Layer]]
    kept: list[KeptBN]
    inner: dict[int, "Plan"]
    unseen: dict[int, list[KeptBN]]
    copies: dict[int, keras.layers.Layer]

    def decisions(self) -> tuple[list[FoldedBN], list[KeptBN]]:
        """(folded, kept) over the model and its nested models, in the order the fold's
        report lists them."""
        path = self.prefix
        folded = [
            FoldedBN(path + bn.name, path + host.name, "backward") for bn, host in self.backward
        ]
        folded += [
            FoldedBN(path + bn.name, path + host.name, "forward") for bn, _, host in self.forward
        ]
        kept = list(self.kept)
        seen: set[int] = set()  # a layer called at several nodes is reported once
        for node in self.info.nodes:
            layer = node.operation
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            if id(layer) in self.inner:
                inner_folded, inner_kept = self.inner[id(layer)].decisions()
                folded += inner_folded
                kept += inner_kept
            kept += self.unseen.get(id(layer), [])
        return folded, kept


def plan(model: keras.Model, prefix: str = "") -> Plan:
    """The fold's decisions for `model` (a Sequential or Functional model).

    Args:
        model: the model.
        prefix: its path ("" or "inner/"), for the kept BNs' paths.

    Returns:
        A `Plan`.

    Raises:
        UnsupportedModelError: the model, or a nested one holding a BN, has no layer graph, or
            a layer the fold would copy has a config that does not round-trip.
    """
    graph = models.layer_graph(model, "fold batch norms in")
    info = Graph(graph)
    backward: list[tuple[keras.layers.Layer, keras.layers.Layer]] = []
    pending: list[tuple[Node, Refusal]] = []
    for node in info.nodes:  # backward folds first: a forward one is the fallback
        bn = node.operation
        if type(bn) not in BN_TYPES:
            continue
        refusal = refuse_bn(bn, node, info)
        if refusal is None:
            host = info.producer(node)
            refusal = refuse_backward(bn, node, host, info, BACKWARD_HOSTS)
            if refusal is None:
                backward.append((bn, host))
                continue
        pending.append((node, refusal))

    forward: list[tuple[keras.layers.Layer, Node, keras.layers.Layer]] = []
    kept: list[KeptBN] = []
    for node, backward_refusal in pending:
        bn = node.operation
        target = _forward_target(bn, node, info, backward_refusal)
        if isinstance(target, Refusal):
            if all(k.bn != prefix + bn.name for k in kept):  # a shared BN is reported once
                kept.append(KeptBN(prefix + bn.name, target.message, target.kind))
        else:
            forward.append((bn, node, target))

    folded = {id(bn) for bn, _ in backward} | {id(bn) for bn, _, _ in forward}
    hosts = {id(host) for _, host in backward} | {id(host) for _, _, host in forward}
    inner: dict[int, Plan] = {}
    unseen: dict[int, list[KeptBN]] = {}
    copies: dict[int, keras.layers.Layer] = {}
    for node in info.nodes:
        layer = node.operation
        if id(layer) in inner or id(layer) in copies or id(layer) in folded:
            continue
        if isinstance(layer, keras.Model) and (models.has_layer_graph(layer) or contains_bn(layer)):
            inner[id(layer)] = plan(layer, prefix + layer.name + "/")
        elif isinstance(layer, L.Layer) and type(layer) not in BN_TYPES:
            copies[id(layer)] = rebuild.copy_layer(
                layer, use_bias=_folded_host_bias(layer) if id(layer) in hosts else None
            )
            unseen[id(layer)] = [KeptBN(*entry) for entry in unseen_batch_norms(layer, prefix)]
    return Plan(prefix, graph, info, backward, forward, kept, inner, unseen, copies)


def _folded_host_bias(host: keras.layers.Layer) -> bool:
    """A folded host's use_bias: its own bias, or, channels_first, none (the fold adds a
    ChannelBias after it: see `rebuild.copy_layer`)."""
    return not channels_first(host)


def contains_bn(model: keras.Model) -> bool:
    """Whether any layer inside `model` is a batch norm."""
    return any(
        bn_layers.is_batch_norm(layer) for layer in model._flatten_layers(include_self=False)
    )


def _forward_target(
    bn: keras.layers.Layer, node: Node, info: Graph, backward_refusal: Refusal
) -> keras.layers.Layer | Refusal:
    """The consumer when the BN folds into the one layer it feeds, else the refusal.

    The refusal's message keeps the backward reason first: it is the fold one would expect.
    """
    if backward_refusal.kind == "shared_bn":
        return backward_refusal
    output = node.outputs[0]
    consumers = info.consumers.get(id(output), [])
    if info.fan_out(output) != 1 or not consumers:
        why: str | None = "its output feeds several layers or a model output"
    elif type(consumers[0].operation) not in FORWARD_HOSTS:
        consumer = consumers[0].operation
        why = (
            f"the next layer '{consumer.name}' is a {type(consumer).__name__}, not a Dense "
            f"or Conv1D/2D/3D"
        )
    else:
        consumer = consumers[0].operation
        rank = len(output.shape)
        refusal = refuse_host(consumer, info)
        why = refusal.message if refusal else None
        if why is None and getattr(consumer, "padding", "valid") != "valid":
            why = (
                f"the next layer '{consumer.name}' pads its input (padding="
                f"'{consumer.padding}'), so a forward fold would not be exact"
            )
        if why is None and bn_axes(bn, node) != [channel_axis(consumer, rank)]:
            why = f"BN axis {bn_axes(bn, node)} is not the input channel axis of '{consumer.name}'"
        if why is None:
            return consumer
    return Refusal(backward_refusal.kind, f"{backward_refusal.message}; forward: {why}")

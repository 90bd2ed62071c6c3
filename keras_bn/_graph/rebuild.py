"""What the two model rewrites share: keras_bn.export's fold (`fold_batch_norms`) and
keras_bn.quantize's `quantize_model`.

- `Graph`: who feeds whom in a Sequential or Functional model's graph of nodes;
- the decisions on a batch norm and the layer before it (`refuse_bn`, `refuse_backward`,
  `refuse_host`), each a `Refusal` (a kind to branch on, and the reason in words) or None, so
  that both rewrites fold exactly where the other would;
- `unseen_batch_norms`: the BNs a rewrite copies without seeing (BN subclasses, BNs inside
  custom layers), which it must report;
- `copy_layer` and `rebuild`: a copy of the model with some operations replaced, some dropped
  and layers inserted after others.

Keras has no public API for walking a model's graph; this reads the same internals that
keras.models.clone_model uses (`_nodes_by_depth`, `_run_through_graph`, Sequential's
`_functional`), which is one reason pyproject.toml bounds the Keras version.
"""

import dataclasses

import keras
from keras.src.saving.serialization_lib import SafeModeScope

from keras_bn._graph import bn_layers, models

L = keras.layers


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
        A list: `layer` itself if it subclasses a BN class (kind "subclass"), else every BN
        inside it (kind "inside_layer"), with its path.
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
    return [
        (
            f"{prefix}{layer.name}/{path}",
            (
                f"BN layer '{bn.name}' is inside custom layer '{layer.name}' "
                f"({type(layer).__name__}), whose call {reader} cannot see into; it is kept as "
                f"it is"
            ),
            "inside_layer",
        )
        for path, bn in bn_layers.batch_norms_inside(layer)
    ]


def copy_layer(layer, use_bias=None):
    """An unbuilt copy of a layer, from its config; `use_bias` overrides the config's.

    A folded host has a bias: its own (use_bias=True), or, when it is channels_first, a
    ChannelBias after it (use_bias=False). Keras's own bias add guesses the axis from the
    shapes (keras.ops.add on the TensorFlow backend) and gets a channels_first output wrong
    whenever its last dim equals its channel count.

    Raises:
        UnsupportedModelError: the layer's config does not round-trip.
    """
    if type(layer) is L.Lambda:
        # From its config a Lambda's function would be re-created from bytecode, without the
        # module globals it uses (e.g. `tf`); the live function object is what it computes.
        return L.Lambda(
            layer.function,
            output_shape=layer._output_shape,
            mask=layer.mask,
            arguments=layer.arguments,
            name=layer.name,
            dtype=layer.dtype_policy,
        )
    config = models.config_of(layer)
    if use_bias is not None:
        config["use_bias"] = use_bias
    # The config comes from a live layer, not from a file: a Lambda's function is already
    # loaded in this process, so safe mode (which guards files) has nothing to guard here.
    with SafeModeScope(False):
        return models.from_config(layer, config)


def rebuild(model, graph, copies, dropped=(), after=None, input_layers=None):
    """A new model with `model`'s structure, computed by other operations.

    Args:
        model: the Sequential or Functional model.
        graph: its Functional graph (`models.layer_graph(model, ...)`).
        copies: {id(operation): what computes it in the new model}, for every operation of
            the graph that is not dropped (a stateless operation may map to itself).
        dropped: ids of the operations that become the identity (their first input passes
            through).
        after: {id(operation): one list of layers per flattened output of the operation}:
            layers applied in order to that output, at every call of the operation.
        input_layers: one list of layers per flattened model input, applied to it first.

    Returns:
        The new model (unbuilt layers are built by the calls; weights are the caller's job).
    """
    after = after or {}
    if isinstance(model, keras.Sequential):
        layers = list(input_layers[0]) if input_layers else []
        for layer in model.layers:
            if id(layer) not in dropped:
                layers.append(copies[id(layer)])
                for extra in after.get(id(layer), []):
                    layers.extend(extra)
        return keras.Sequential(
            [keras.Input(batch_shape=model.inputs[0].shape, dtype=model.inputs[0].dtype), *layers],
            name=model.name,
        )
    inputs = [
        keras.Input(batch_shape=x.shape, dtype=x.dtype, name=x._keras_history.operation.name)
        for x in graph.inputs
    ]
    fed = [_apply(x, layers) for x, layers in zip(inputs, input_layers or [[]] * len(inputs))]

    def operation_fn(operation):
        if id(operation) in dropped:
            return lambda x, *args, **kwargs: x
        copy = copies[id(operation)]
        if id(operation) not in after:
            return copy

        def run(*args, **kwargs):
            outputs = copy(*args, **kwargs)
            flat = keras.tree.flatten(outputs)
            flat = [_apply(x, layers) for x, layers in zip(flat, after[id(operation)])]
            return keras.tree.pack_sequence_as(outputs, flat)

        return run

    outputs = graph._run_through_graph(fed, operation_fn=operation_fn)
    inputs = keras.tree.pack_sequence_as(graph._inputs_struct, inputs)
    return keras.Model(inputs, outputs, name=model.name)


def _apply(tensor, layers):
    for layer in layers:
        tensor = layer(tensor)
    return tensor

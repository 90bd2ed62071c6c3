"""The layer rebuild the two model rewrites share, keras_bn.export's fold
(`fold_batch_norms`) and keras_bn.quantize's `quantize_model`: `copy_layer` and `rebuild`, a
copy of the model with some operations replaced, some dropped and layers inserted after
others. Where a BN folds is decided in keras_bn/_graph/fold_plan.py.

Keras has no public API for walking a model's graph; this reads the same internals that
keras.models.clone_model uses (`_nodes_by_depth`, `_run_through_graph`, Sequential's
`_functional`), which is one reason pyproject.toml bounds the Keras version.
"""

import keras
from keras.src.saving.serialization_lib import SafeModeScope

from keras_bn._graph import models

L = keras.layers


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

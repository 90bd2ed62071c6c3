"""fold_batch_norms: rebuild a Keras model without its BNs, folded into their neighbours.

Which BN folds where is keras_bn/_graph/fold_plan.py's decision (each BN backward into the
layer that produces its input when it can be, else forward into the layer that consumes its
output, else kept, with the reason); the maths is `keras_bn.export.fold`'s; this module
carries the plan out. Sequential and Functional models are rebuilt through their graph of
nodes; nested models are folded on their own first and used as opaque layers of the outer
graph. A kept BN becomes an `InferenceAffine` layer; one the fold cannot see into (inside a
custom layer, or a subclass of a BN class) is copied as it is. The input model is only read:
every layer of the result is a copy.
"""

from typing import TypeAlias

import keras
import numpy as np
from keras.src.ops.node import Node

from keras_bn._graph import bn_layers, fold_plan, models, rebuild
from keras_bn._graph.affine import ChannelBias, InferenceAffine
from keras_bn.export import defaults, fold, readiness, report, trace
from keras_bn.export.report import ChannelSpread, FoldReport

L = keras.layers
BN_TYPES = bn_layers.BN_TYPES  # exact types: a subclass is copied as it is, and kept
FoldedBN, KeptBN = fold_plan.FoldedBN, fold_plan.KeptBN  # the report's entries
# A host's kernels (a separable conv's depthwise, then pointwise) and bias (None without one);
# and the folded ones of every host, by id(original host) (a fold always gives a bias).
_HostWeights: TypeAlias = tuple[list[np.ndarray], np.ndarray | None]
_Weights: TypeAlias = dict[int, tuple[list[np.ndarray], np.ndarray]]

CONV, DEPTHWISE = fold_plan.CONV, fold_plan.DEPTHWISE
SEPARABLE, TRANSPOSE = fold_plan.SEPARABLE, fold_plan.TRANSPOSE
# The maths of a backward fold into each host the plan takes (fold_plan.BACKWARD_HOSTS).
BACKWARD_FOLDS = {L.Dense: fold.fold_dense}
BACKWARD_FOLDS.update({t: fold.fold_conv for t in CONV})
BACKWARD_FOLDS.update({t: fold.fold_depthwise for t in DEPTHWISE})
BACKWARD_FOLDS.update({t: fold.fold_separable for t in SEPARABLE})
BACKWARD_FOLDS.update({t: fold.fold_conv_transpose for t in TRANSPOSE})
# Where each host's output channels lie in its (folded) kernel; the rest have them last.
OUTPUT_LAYOUTS = {t: fold.DEPTHWISE for t in DEPTHWISE}
OUTPUT_LAYOUTS.update({t: fold.TRANSPOSE for t in TRANSPOSE})


def fold_batch_norms(
    model: keras.Model,
    probe: trace.ModelInput | None = None,
    int8_readiness: bool = False,
    allow_unverified: bool = False,
) -> tuple[keras.Model, FoldReport]:
    """Fold every batch norm of `model` into a neighbouring Dense/Conv layer.

    Args:
        model: a built Sequential or Functional Keras model (nested models, several inputs
            and outputs allowed).
        probe: optional input on which the folded model is compared with the original, in
            any structure `model.predict` takes (an array, a list of arrays in input order,
            or a dict keyed by input name: a dict for a model that takes a dict), with
            outputs that differ between samples; seeded random data when None.
        int8_readiness: also measure each folded host's int8 readiness: run the folded model
            on (up to 64 samples of) the probe with that host's kernel alone rounded to int8,
            per tensor and per output channel, and judge the outputs against the unrounded
            ones as an int8 file's are (export/readiness.py). One forward pass per host and
            mode: on ResNet50 about 19 times the fold's own time, hence off by default;
            `export_tflite(..., quantization="int8")` turns it on.
        allow_unverified: accept a model whose own outputs are the same for every sample of
            a varied probe (untrained, dead): the comparison then only says the folded model
            gives that output too. False refuses it (ValueError).

    Returns:
        (folded_model, FoldReport). BNs that cannot be folded are kept as InferenceAffine
        layers (BNs inside custom layers and BN subclasses: as they are) and listed in
        `report.kept` with the reason, so every BN is in `report.folded` or `report.kept`;
        `report.errors` has the error of each output, `report.worst_channels` its channel
        furthest from the original (relative to that channel's own scale), whose relative
        error is `report.relative_errors`; `report.channel_spreads` has each
        folded host's channel spreads and, with int8_readiness=True, its measured rounding
        errors (`report.int8_risks`: those over `INT8_READINESS_TOLERANCE`; None when not
        measured).

    Raises:
        UnsupportedModelError: the model (or a nested one holding a BN) is subclassed or an
            unbuilt Sequential, or a layer's config does not round-trip; a TypeError and a
            ValueError.
        ValueError: `probe` does not fit the model's inputs (a list for a dict of several
            inputs, say) or an output is the same for all its samples (unless the samples
            differ and allow_unverified is True), a BN to be folded
            has a non-finite inference scale or shift (NaN or inf statistics or weights), or
            int8_readiness is not a bool.

    Example::

        folded, report = fold_batch_norms(model, x_val[:64])
        for kept in report.kept:
            print(kept.bn, kept.kind, kept.reason)
        assert report.relative_error < 1e-5
    """
    if not isinstance(int8_readiness, bool):
        raise ValueError(
            f"int8_readiness must be True or False; received int8_readiness={int8_readiness!r}."
        )
    decided = fold_plan.plan(model)
    folded_model, hosts = _fold_model(model, decided)
    folded, kept = decided.decisions()
    sig = trace.signature(model)
    inputs = trace.random_feed(sig) if probe is None else trace.feed(sig, probe)
    expected = trace.outputs(model, sig, inputs)
    report.check_varies(expected, inputs.what, inputs, allow_unverified)
    actual = trace.outputs(folded_model, sig, inputs)
    errors, scales, channels = report.compare(
        expected, {"folded": actual}, defaults.FLOAT32_SCALE_TOLERANCE
    )
    folded_errors = {name: by_setting["folded"] for name, by_setting in errors.items()}
    if int8_readiness:
        spreads = readiness.measure(folded_model, sig, inputs, hosts)
    else:
        spreads = [host.spread for host in hosts]
    return folded_model, FoldReport(folded, kept, folded_errors, scales, spreads, channels)


def _fold_model(
    model: keras.Model, decided: fold_plan.Plan
) -> tuple[keras.Model, list[readiness.Host]]:
    """(new model, readiness.Host list) for one Sequential/Functional model, folded as
    `decided` says."""
    prefix, graph, info = decided.prefix, decided.graph, decided.info
    weights: _Weights = {}  # folded (kernels, bias) of each host, by id(original host)
    dropped: set[int] = set()  # ids of the BNs that were folded away
    # by id: every host, and those that took a forward fold
    hosts: dict[int, keras.layers.Layer] = {}
    forward_hosts: set[int] = set()
    for bn, host in decided.backward:  # backward folds first: they need the original kernels
        _fold_backward(bn, host, weights)
        hosts[id(host)] = host
        dropped.add(id(bn))
    for bn, _, consumer in decided.forward:
        _fold_forward(bn, consumer, weights)
        hosts[id(consumer)] = consumer
        forward_hosts.add(id(consumer))
        dropped.add(id(bn))

    copies: dict[int, keras.Operation] = {}
    refolded: set[int] = set()
    inner_models: list[list[readiness.Host]] = []
    # ChannelBias after each folded channels_first host, by id(original host)
    biases: dict[int, ChannelBias] = {}
    for node in info.nodes:
        layer = node.operation
        if id(layer) in copies or id(layer) in dropped:
            continue
        if id(layer) in decided.inner:
            copies[id(layer)], inner_hosts = _fold_model(layer, decided.inner[id(layer)])
            refolded.add(id(layer))
            inner_models.append(inner_hosts)
        elif type(layer) in BN_TYPES:
            copies[id(layer)] = _affine_copy(layer, node)
        elif not isinstance(layer, L.Layer):  # a stateless op such as `x * 2.0`: reusable
            copies[id(layer)] = layer
        else:  # made by the plan; its hidden BNs, if any, are in the plan's kept list
            copies[id(layer)] = decided.copies[id(layer)]
        if id(layer) in weights and fold_plan.channels_first(layer):
            biases[id(layer)] = ChannelBias(
                1,
                len(weights[id(layer)][1]),
                name=models.unique_name(
                    f"{layer.name}_bias", {other.name for other in model.layers}
                ),
                dtype=layer.dtype_policy,
            )

    after = {key: [[bias]] for key, bias in biases.items()}
    new_model = rebuild.rebuild(model, graph, copies, dropped, after)
    _copy_weights(info.nodes, copies, biases, weights, refolded)
    measured = [
        _host(prefix, hosts[key], copies[key], weights[key], key in forward_hosts)
        for key in weights
    ]
    return new_model, measured + [h for inner in inner_models for h in inner]


def _host_weights(host: keras.layers.Layer, weights: _Weights) -> _HostWeights:
    """The host's (kernel, bias) as folded so far: a layer may take a fold in each direction."""
    if id(host) in weights:
        return weights[id(host)]
    values = host.get_weights()
    kernel_index = 1 if type(host) in SEPARABLE else 0
    bias = values[-1] if host.use_bias else None
    return values[: kernel_index + 1], bias


def _fold_backward(bn: keras.layers.Layer, host: keras.layers.Layer, weights: _Weights) -> None:
    kernels, bias = _host_weights(host, weights)
    kernel, bias = BACKWARD_FOLDS[type(host)](kernels[-1], bias, *bn_layers.inference_affine(bn))
    weights[id(host)] = (kernels[:-1] + [kernel], bias)


def _fold_forward(bn: keras.layers.Layer, consumer: keras.layers.Layer, weights: _Weights) -> None:
    kernels, bias = _host_weights(consumer, weights)
    scale, shift = bn_layers.inference_affine(bn)
    kernel, bias = fold.fold_forward(
        kernels[-1], bias, scale, shift, groups=getattr(consumer, "groups", 1)
    )
    weights[id(consumer)] = (kernels[:-1] + [kernel], bias)


def _host(
    prefix: str,
    host: keras.layers.Layer,
    copy: keras.layers.Layer,
    folded_weights: tuple[list[np.ndarray], np.ndarray],
    forward: bool,
) -> readiness.Host:
    """The readiness.Host of a folded host: the ChannelSpread of its folded kernel (a
    SeparableConv's pointwise kernel, the last of its kernels) and the copy's variable that
    holds that kernel."""
    kernels, _ = folded_weights
    kernel = kernels[-1]
    layout = OUTPUT_LAYOUTS.get(type(host), fold.LAST)
    output_spread = fold.channel_spread(fold.output_channel_ranges(kernel, layout))
    input_spread = None
    if forward:
        input_ranges = fold.input_channel_ranges(kernel, getattr(host, "groups", 1))
        input_spread = fold.channel_spread(input_ranges)
    spread = ChannelSpread(prefix + host.name, type(host).__name__, output_spread, input_spread)
    # The copy's weights are its kernels, then its bias if it has one (`_copy_weights`).
    return readiness.Host(spread, copy.weights[len(kernels) - 1], layout)


def _affine_copy(bn: keras.layers.Layer, node: Node) -> InferenceAffine:
    axes = fold_plan.bn_axes(bn, node)
    return InferenceAffine(axes, bn.moving_mean.shape, name=bn.name, dtype=bn.dtype_policy)


def _copy_weights(
    nodes: list[Node],
    copies: dict[int, keras.Operation],
    biases: dict[int, ChannelBias],
    weights: _Weights,
    refolded: set[int],
) -> None:
    """Load the copies: folded weights for hosts, the affine for kept BNs, else the originals."""
    done: set[int] = set()
    for node in nodes:
        layer = node.operation
        if id(layer) in done or id(layer) not in copies or copies[id(layer)] is layer:
            continue
        if id(layer) in refolded:
            continue  # a nested model folded on its own, weights and all
        done.add(id(layer))
        copy = copies[id(layer)]
        if isinstance(copy, InferenceAffine):
            copy.set_affine(*bn_layers.inference_affine(layer))
        elif id(layer) in biases:
            kernels, bias = weights[id(layer)]
            copy.set_weights(kernels)
            biases[id(layer)].bias.assign(bias)
        elif id(layer) in weights:
            kernels, bias = weights[id(layer)]
            copy.set_weights(kernels + [bias])
        else:
            copy.set_weights(layer.get_weights())

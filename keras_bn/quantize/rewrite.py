"""quantize_model: a copy of a Keras model for quantization-aware training, weights copied.

Each Dense/convolution host followed by a batch norm (and optionally ReLU/ReLU6) becomes one
`QuantizedHostBatchNorm`, where export's fold would fold the BN backward: the same decisions,
from keras_bn/_graph/fold_plan.py. A host without such a BN becomes a `QuantizedHost` (with its own
ReLU/ReLU6, or a following ReLU/ReLU6 layer, fused; any other activation of its own follows it
as a float Activation layer). Activation quantizers go where the TFLite int8 spec gives a
tensor a scale of its own (`keras_bn.quantize.spec`): the model's float inputs, the QAT layers'
outputs (inside them), Add/Subtract/Multiply, GlobalAveragePooling and other operations' outputs;
not where the spec makes the output share its input's scale (max pooling, reshapes) or fixes it
(softmax). An average pool, whose int8 kernel rounds onto its input's grid, becomes a
`QuantizedAveragePooling` that quantizes its input and rounds its output onto that grid, or,
where the input's quantizer has other readers, is followed by that quantizer again. Everything
else is copied in float, and every layer with weights that stays float is reported, with the
reason.

Sequential and Functional models are walked through their graph of nodes; a nested one is
rewritten on its own, its inputs taken as quantized where the outer model quantizes them. The
input model is only read: every layer of the result is a copy.
"""

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import keras
from keras.src.ops.node import Node

from keras_bn import backend
from keras_bn._errors import KerasBNWarning
from keras_bn._graph import bn_layers, fold_plan, models, rebuild
from keras_bn._graph.affine import ChannelBias
from keras_bn.quantize import fake_quant, hosts, spec
from keras_bn.quantize.activation import ActivationQuantizer, validate_momentum
from keras_bn.quantize.factory import from_layers, fusable_activation
from keras_bn.quantize.layers import QuantizedHost, QuantizedHostBatchNorm, batch_norm_refusal
from keras_bn.quantize.pooling import QuantizedAveragePooling, halves_of, window_size
from keras_bn.quantize.report import KeptLayer, QuantizationReport

L = keras.layers
_HOSTS_TAKEN = (
    "a layer a QAT layer can fold it into (exactly Dense, Conv1D/2D/3D, DepthwiseConv1D/2D or "
    "SeparableConv1D/2D)"
)
# The layers whose bias Keras 3.15 adds with keras.ops.add, which on the TensorFlow backend puts
# a channels_first bias on the last axis whenever that axis has as many entries as there are
# channels; their float copies add it with a ChannelBias instead.
_BIAS_ADDING = (*hosts.KINDS, L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose)
_QAT_LAYERS = (ActivationQuantizer, QuantizedHost, QuantizedHostBatchNorm, QuantizedAveragePooling)
# per_channel="all": one weight range per output channel of every host, Dense included.
EVERY_HOST = "all"


def quantize_model(
    model: keras.Model,
    weight_bits: int = 8,
    activation_bits: int = 8,
    per_channel: "bool | str" = True,
    *,
    range_momentum: float = 0.99,
    weight_range: str | None = None,
    return_report: bool = False,
) -> "keras.Model | tuple[keras.Model, QuantizationReport]":
    """A copy of `model` for quantization-aware training, with batch norm folded into the QAT
    layers; `model` itself is left untouched.

    In the copy:

    - each Dense, Conv1D/2D/3D, DepthwiseConv1D/2D or SeparableConv1D/2D followed by a
      keras_bn or Keras BatchNormalization, and optionally by a ReLU/ReLU6
      (`keras.layers.ReLU()`, `ReLU(max_value=6)`, `Activation("relu")`, `("relu6")`), is
      one `QuantizedHostBatchNorm`, wherever `keras_bn.export.fold_batch_norms` would fold
      that BN backward (the host's output feeds only the BN, neither is shared, the BN's axis
      is the host's channel axis, no activation in between, no LoRA or Keras quantization)
      and the BN is one the QAT layer can train (no renorm, virtual_batch_size,
      synchronized=True or momentum=None); a host or BN with an activity_regularizer stays
      float (a QAT layer would drop its loss term);
    - every other such host is a `QuantizedHost`, which takes over the host's own
      ReLU/ReLU6 or a ReLU/ReLU6 layer after it; any other activation of the host's own
      follows it as a float `Activation` layer;
    - an `ActivationQuantizer` fake-quantizes each float model input and the outputs that
      the TFLite int8 spec gives a scale of their own (Add, Subtract, Multiply,
      GlobalAveragePooling, Concatenate, a ReLU after an Add, a layer kept in float, ...);
      none follows a layer whose output keeps its input's scale (MaxPooling, Flatten,
      Reshape, padding, Dropout, ...) or whose scale the spec fixes (softmax, sigmoid, tanh);
      a layer feeding only a Concatenate (directly or through layers that keep its scale,
      such as Dropout; a model input directly only) leaves its own out, so both share the
      Concatenate's scale (see
      `keras_bn.quantize.spec`); an (unshared) Add or Multiply of
      three or more inputs is a nested model `<name>_qat` of two-input ones, left to right,
      with a quantizer after each partial result, as both files compute it;
    - each AveragePooling1D/2D/3D rounds its output onto its input's grid, as TFLite's int8
      AVERAGE_POOL_2D does (halves away from the int8 zero), and so does a bilinear
      UpSampling2D, as RESIZE_BILINEAR does (halves up): a layer that only it reads
      (directly or through Dropout, padding and the like) leaves its quantizer out, and the
      pool becomes a `QuantizedAveragePooling`, which quantizes its input and rounds its
      output onto that one grid; where other layers read the input too, its quantizer (one in
      the model: a QAT layer's moves out of it) is called again after the copied pool, at
      inference, so the output shares that range. A pool whose input's grid is set elsewhere
      (by a nested model, or fixed by the spec) or that is shared requantizes its input,
      which TFLite's converter refuses before an AVERAGE_POOL_2D (ONNX takes it);
    - every other layer is a float copy with the original's weights. A layer with weights
      that stays float (a BN that cannot be folded, a shared host or one inside a nested model
      called more than once, a transposed convolution, a custom layer, ...) is listed in the
      report's `kept` with the reason, and a `keras_bn.KerasBNWarning` names them. A
      channels_first layer with a bias where Keras adds it on the wrong axis gets a
      `KerasBNWarning` too (the QAT model adds it on the channel axis).

    A BN that is frozen (trainable=False) gives a QAT layer frozen to its moving statistics.
    The copy is not compiled. Its activation ranges start unset: until a training batch sets
    them the activation quantizers pass their input through. Train it with `fit` and the
    `FreezeBatchNorm` callback.

    Args:
        model: a built Sequential or Functional Keras model (nested ones, several inputs and
            outputs allowed).
        weight_bits: 2..8, the weights' bits.
        activation_bits: 2..8, the activations' bits.
        per_channel: one weight range per output channel of each convolution and one per
            tensor for Dense (True), one per output channel of every host, Dense included
            ("all"), or one per tensor everywhere (False). Both files hold per-channel Dense
            weights (TFLite as a 1×1 CONV_2D: its FULLY_CONNECTED takes one weight scale). On
            the digits CNN, Dense per channel was no better than per tensor over 10 seeds
            (benchmarks/results/bench_qat_dense_per_channel.json), so True keeps Dense per
            tensor; "all" makes `recalibrate` exact in one pass for Dense hosts too.
        range_momentum: the activation ranges' EMA momentum, in [0, 1).
        weight_range: how each weight range is set: "max" (max|w| at every step), "learned"
            (a trainable range, Esser et al. 2020's LSQ, starting where the rounding error of
            the copied weights is least), or None: "learned" at 3 bits or fewer, where max|w|
            leaves most weights on 0 or one level, else "max".
        return_report: also return the `QuantizationReport`.

    Returns:
        The new model; with `return_report=True`, `(model, QuantizationReport)`.

    Raises:
        TypeError: `model` is not a keras.Model (the message names it).
        ValueError: `weight_bits` or `activation_bits` is not an int from 2 to 8 (bools
            included), `return_report` is not a bool, `range_momentum` is
            not in [0, 1), or `weight_range` is not None, "max" or "learned" (the message
            names the value), `per_channel` is not True, False or "all"; `model` holds QAT
            layers already; or
            a layer computes or keeps weights in a float type other than float32 (a
            mixed_float16 or mixed_bfloat16 policy, float64), named with its policy.
        UnsupportedModelError: the model, or a nested one holding a host or BN, is subclassed
            (it has no layer graph) or an unbuilt Sequential, or a layer's config does not
            round-trip.
        ImportError: Keras runs on another backend than TensorFlow, JAX or PyTorch.

    Example::

        qat, report = keras_bn.quantize.quantize_model(model, return_report=True)
        qat.compile(keras.optimizers.Adam(1e-4), loss, metrics=["accuracy"])
        qat.fit(x, y, epochs=3, callbacks=[keras_bn.quantize.FreezeBatchNorm(500)])
    """
    backend.get("keras_bn.quantize.quantize_model")
    if not isinstance(model, keras.Model):
        raise TypeError(f"quantize_model takes a keras.Model; received model={model!r}.")
    if not isinstance(return_report, bool):
        raise ValueError(
            f"return_report must be True or False; received return_report={return_report!r}."
        )
    if not (isinstance(per_channel, bool) or per_channel == EVERY_HOST):
        raise ValueError(
            f'per_channel must be True, False or "{EVERY_HOST}"; received '
            f"per_channel={per_channel!r}."
        )
    quantized = [layer.name for layer in models.layers_within(model, _QAT_LAYERS)]
    if quantized:
        raise ValueError(
            f"'{model.name}' is quantization-aware already (layers {quantized}); "
            f"quantize_model takes the float model."
        )
    _refuse_float_dtypes(model)
    settings = _Settings(
        fake_quant.validate_bits(weight_bits, "weight_bits"),
        fake_quant.validate_bits(activation_bits, "activation_bits"),
        per_channel,
        validate_momentum(range_momentum, "range_momentum"),
        fake_quant.validate_weight_range(weight_range, weight_bits),
    )
    findings = _Findings()
    new_model, _ = _ModelRewrite(settings, findings, model, prefix="").run(None)
    report = QuantizationReport(
        quantized=findings.quantized,
        quantizers=findings.quantizers,
        kept=tuple(findings.kept),
        weight_bits=settings.weight_bits,
        activation_bits=settings.activation_bits,
        per_channel=per_channel,
    )
    if report.kept:
        kept = ", ".join(f"'{k.layer}' ({k.kind})" for k in report.kept)
        warnings.warn(
            KerasBNWarning(
                f"quantize_model kept {len(report.kept)} layer(s) of '{model.name}' in float: "
                f"{kept}. quantize_model(..., return_report=True) gives each one's reason."
            ),
            stacklevel=2,
        )
    if findings.wrong_bias_add:
        named = ", ".join(f"'{path}'" for path in findings.wrong_bias_add)
        warnings.warn(
            KerasBNWarning(
                f"{named} of '{model.name}': channels_first with a bias, at an output whose last "
                f"(spatial) axis has as many entries as there are channels, or may have (its "
                f"length is unknown). There Keras 3.15 on TensorFlow adds the bias on that last "
                f"axis: the float Keras model is wrong at such sizes, and the QAT model, which "
                f"adds the bias on the channel axis, computes the correct bias add and differs "
                f"from it."
            ),
            stacklevel=2,
        )
    return (new_model, report) if return_report else new_model


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The quantization arguments every QAT layer and quantizer of the rewrite gets."""

    weight_bits: int
    activation_bits: int
    per_channel: "bool | str"
    range_momentum: float
    weight_range: str


@dataclasses.dataclass
class _Findings:
    """What the report lists, gathered over the model and its nested models."""

    quantized: dict[str, str] = dataclasses.field(default_factory=dict)
    quantizers: dict[str, str] = dataclasses.field(default_factory=dict)
    kept: list[KeptLayer] = dataclasses.field(default_factory=list)
    # channels_first layers whose Keras bias add is wrong
    wrong_bias_add: list[str] = dataclasses.field(default_factory=list)


class _ModelRewrite:
    """The rewrite of one Sequential or Functional model (a nested one gets its own)."""

    def __init__(
        self,
        settings: _Settings,
        findings: _Findings,
        model: keras.Model,
        prefix: str,
        shared_in: str | None = None,
    ) -> None:
        self.settings = settings
        self.findings = findings
        self.model = model
        self.prefix = prefix
        # Why every host and BN here is shared, when this nested model (or one around it) is
        # called more than once: they stay float, as a shared host does.
        self.shared_in = shared_in
        self.graph = models.layer_graph(model, "quantize")
        self.info = fold_plan.Graph(self.graph)
        self.names = {operation.name for operation in self.graph.operations}
        # id(operation) → what computes it in the new model
        self.copies: dict[int, keras.Operation] = {}
        self.dropped: set[int] = set()  # ids of the BNs and activations a QAT layer computes
        # id(operation) → one list of layers (or calls) per flattened output
        self.after: dict[int, list[list[Callable[..., Any]]]] = {}
        # id(host) → (QAT layer, the Activation split off or None, whether a quantizer in the
        # model rounds its output, for an average pool to share)
        self.qat: dict[int, tuple[keras.layers.Layer, keras.layers.Layer | None, bool]] = {}
        # id(layer) → (layer, copy, ChannelBias or None)
        self.float_copies: dict[
            int, tuple[keras.layers.Layer, keras.layers.Layer, ChannelBias | None]
        ] = {}
        self.on_grid: dict[int, bool] = {}  # id(tensor) → whether it lies on a quantization grid
        # id(tensor) → the ActivationQuantizer of this model whose grid it lies on, if any
        self.grid_source: dict[int, ActivationQuantizer] = {}
        # id(average pool) → the quantizer it shares, or None
        self.pool_grids: dict[int, ActivationQuantizer | None] = {}
        # id(tensor) → the QuantizedAveragePooling that computes it
        self.pooled_by: dict[int, QuantizedAveragePooling] = {}
        # id(operation) → per output, on a grid as copied
        self.outputs_on_grid: dict[int, list[bool]] = {}
        self.kept_ids: set[int] = set()

    def run(self, inputs_on_grid: list[bool] | None) -> tuple[keras.Model, list[bool]]:
        """(the new model, whether each flattened output lies on a grid).

        Args:
            inputs_on_grid: None for the outer model (its float inputs get quantizers), else
                whether each flattened input lies on a grid already.
        """
        self._quantize_hosts(self._paired_batch_norms())
        input_layers = self._place_input_quantizers(inputs_on_grid)
        for node in self.info.nodes:
            self._visit(node)
        new_model = rebuild.rebuild(
            self.model, self.graph, self.copies, self.dropped, self.after, input_layers
        )
        for layer, copy, bias in self.float_copies.values():
            if bias is None:
                copy.set_weights(layer.get_weights())
                continue
            values = {weight.name: weight for weight in layer.weights}
            for weight in copy.weights:
                weight.assign(values[weight.name])
            bias.bias.assign(layer.bias)
        return new_model, [self.on_grid[id(t)] for t in self.graph.outputs]

    # The decisions.

    def _paired_batch_norms(self) -> dict[int, Node]:
        """{id(host): the node of the BN folded into it}; the other exact BNs are kept."""
        pairs: dict[int, Node] = {}
        for node in self.info.nodes:
            bn = node.operation
            if type(bn) not in bn_layers.BN_TYPES:
                continue
            host = self.info.producer(node)
            if self.shared_in is not None:
                self._keep(
                    bn, f"BN layer '{bn.name}' {self.shared_in}; it stays a float BN", "shared_bn"
                )
                continue
            refusal = fold_plan.refuse_bn(bn, node, self.info) or fold_plan.refuse_backward(
                bn, node, host, self.info, hosts.KINDS, _HOSTS_TAKEN
            )
            config_refusal = batch_norm_refusal(bn)
            if refusal is None and config_refusal:
                refusal = fold_plan.Refusal("batch_norm_config", config_refusal)
            if refusal is None:
                refusal = _activity_refusal(bn, "BN layer") or _activity_refusal(host, "its host")
            if refusal is None:
                pairs[id(host)] = node
            else:
                self._keep(bn, f"{refusal.message}; it stays a float BN", refusal.kind)
        return pairs

    def _quantize_hosts(self, pairs: dict[int, Node]) -> None:
        """A QAT layer for every host that can have one."""
        for node in self.info.nodes:
            host = node.operation
            if type(host) not in hosts.KINDS or id(host) in self.qat or id(host) in self.kept_ids:
                continue
            refusal = fold_plan.refuse_host(host, self.info) or _activity_refusal(host, "host")
            no_file = hosts.int8_file_refusal(host, len(node.input_tensors[0].shape))
            if refusal is None and no_file:
                refusal = fold_plan.Refusal("no_int8_file", no_file)
            if self.shared_in is not None:
                refusal = fold_plan.Refusal("shared_host", f"host '{host.name}' {self.shared_in}")
            bn_node = pairs.get(id(host))
            if refusal:
                self._keep(host, f"{refusal.message}; it stays float", refusal.kind)
                if bn_node is not None:  # paired before the host was refused: float with it
                    self._keep(
                        bn_node.operation,
                        f"BN layer '{bn_node.operation.name}' follows host '{host.name}', which "
                        f"stays float ({refusal.message}); it stays a float BN",
                        refusal.kind,
                    )
                continue
            bn = bn_node.operation if bn_node else None
            tail = bn_node or node  # the node whose output the QAT layer's output replaces
            own = fold_plan.activation_name(host)
            activation = split = None
            if own == "linear":  # (a host paired with a BN always is)
                activation_node = self._fusable_consumer(tail)
                if activation_node is not None:
                    activation, tail = activation_node.operation, activation_node
            source = host
            if bn is None and own not in ("linear", "relu", "relu6"):
                source = _linear_copy(host)
                label = own if isinstance(own, str) else "activation"
                split = L.Activation(host.activation, name=self._unique(f"{host.name}_{label}"))
            quantize_output = split is not None or not self._deferred(tail.outputs[0], host)
            # An average pool that reads the output (among other layers) shares its grid, so a
            # quantizer in the model computes it, not one inside the QAT layer.
            pooled = (
                split is None and quantize_output and self._reaches_average_pool(tail.outputs[0])
            )
            layer = from_layers(
                source,
                bn,
                activation,
                weight_bits=self.settings.weight_bits,
                activation_bits=self.settings.activation_bits,
                per_channel=self.settings.per_channel == EVERY_HOST
                or (self.settings.per_channel is True and type(host) is not L.Dense),
                range_momentum=self.settings.range_momentum,
                quantize_output=quantize_output and not pooled,
                weight_range=self.settings.weight_range,
                name=self._unique(f"{host.name}_qat"),
            )
            if bn is not None and not bn.trainable and isinstance(layer, QuantizedHostBatchNorm):
                layer.batch_norm_frozen.assign(True)  # a frozen BN: its inference statistics
            self.qat[id(host)] = (layer, split, pooled)
            self.copies[id(host)] = layer
            for original in (host, bn, activation):
                if original is not None:
                    self.findings.quantized[self.prefix + original.name] = self.prefix + layer.name
                    if original is not host:
                        self.dropped.add(id(original))

    def _fusable_consumer(self, node: Node) -> Node | None:
        """The node of a ReLU/ReLU6 layer that alone reads `node`'s output, or None."""
        output = node.outputs[0]
        consumers = self.info.consumers.get(id(output), [])
        if self.info.fan_out(output) != 1 or not consumers:
            return None
        layer = consumers[0].operation
        if self.info.shared(layer) or fusable_activation(layer) is None:
            return None
        if layer.activity_regularizer is not None:  # its loss term needs the layer called
            return None
        return consumers[0]

    def _deferred(self, tensor: keras.KerasTensor, producer: keras.Operation | None) -> bool:
        """Whether the output `tensor` of `producer` (None for a model input) leaves its
        quantization to the one operation that reads it: a Concatenate-like operation, whose
        inputs and output share a scale, an average pool, which quantizes its input itself, or
        a ReLU/ReLU6 that TFLite fuses into an Add/Subtract/Multiply."""
        if (producer is not None and self.info.shared(producer)) or id(tensor) in self.info.outputs:
            return False
        consumers = self.info.consumers.get(id(tensor), [])
        if len(consumers) != 1:
            return False
        consumer = consumers[0].operation
        if self.info.shared(consumer) or id(consumer) in self.dropped:
            return False
        if spec.role(consumer) == spec.SHARES or self._read_only_by(tensor, spec.AVERAGES):
            return True
        # A computed output through scale-keeping layers too (a model input keeps its own
        # quantizer there: ONNX cannot write that path in integers).
        if producer is not None and self._read_only_by(tensor, spec.SHARES):
            return True
        return type(producer) in spec.RELU_FUSING and fusable_activation(consumer) is not None

    def _read_only_by(self, tensor: keras.KerasTensor, role: str) -> bool:
        """Whether one operation of `role` (spec.SHARES: a Concatenate-like one; spec.AVERAGES:
        an average pool) alone reads `tensor`, directly or through ops that keep their input's
        grid (a Dropout, a ZeroPadding, ...), each the only reader of the one before, none
        shared and none a model output."""
        consumers = self.info.consumers.get(id(tensor), [])
        if id(tensor) in self.info.outputs or len(consumers) != 1:
            return False
        node = consumers[0]
        if self.info.shared(node.operation) or id(node.operation) in self.dropped:
            return False
        found = spec.role(node.operation)
        return found == role or (
            found == spec.PRESERVES
            and len(node.input_tensors) == len(node.outputs) == 1
            and self._read_only_by(node.outputs[0], role)
        )

    def _reaches_average_pool(self, tensor: keras.KerasTensor) -> bool:
        """Whether an average pool reads `tensor`, directly or through ops that keep their
        input's grid."""
        for node in self.info.consumers.get(id(tensor), []):
            role = spec.role(node.operation)
            if role == spec.AVERAGES or (
                role == spec.PRESERVES
                and len(node.input_tensors) == 1
                and any(self._reaches_average_pool(t) for t in node.outputs)
            ):
                return True
        return False

    # The activation quantizers, in graph order.

    def _place_input_quantizers(
        self, inputs_on_grid: list[bool] | None
    ) -> list[list[ActivationQuantizer]]:
        input_layers = []
        for index, tensor in enumerate(self.graph.inputs):
            layers: list[ActivationQuantizer] = []
            if inputs_on_grid is not None:
                self.on_grid[id(tensor)] = inputs_on_grid[index]
            elif not _is_float(tensor):
                self.on_grid[id(tensor)] = True  # not an activation: nothing to quantize
            elif self._deferred(tensor, None):
                self.on_grid[id(tensor)] = False
            else:
                layers.append(self._quantizer(tensor._keras_history.operation.name))
                self.on_grid[id(tensor)] = True
                self.grid_source[id(tensor)] = layers[-1]
            input_layers.append(layers)
        return input_layers

    def _visit(self, node: Node) -> None:
        """Copy the node's operation (at its first call) and decide which of its outputs get
        quantizers."""
        operation = node.operation
        self._check_bias_add(operation, node)
        if id(operation) in self.dropped:  # computed by the QAT layer before it
            self._inherit_grid(node)
            return
        if id(operation) in self.qat:
            layer, split, pooled = self.qat[id(operation)]
            self.on_grid[id(node.outputs[0])] = layer.quantize_output
            if split is not None or pooled:
                self._after_qat_layer(node, layer, split)
            return
        if spec.role(operation) == spec.AVERAGES:
            self._visit_average_pool(node)
            return
        inputs_on_grid = all(self.on_grid.get(id(t), True) for t in node.input_tensors)
        if id(operation) not in self.outputs_on_grid:  # its first call
            inner = None
            if self._chained(node):
                self._copy_chain(node)
            else:
                inner = self._copy(
                    operation, [self.on_grid.get(id(t), True) for t in node.input_tensors]
                )
            self.outputs_on_grid[id(operation)] = inner or [False] * len(node.outputs)
            after = [
                self._output_layers(operation, tensor, on_grid, inputs_on_grid)
                for tensor, on_grid in zip(node.outputs, self.outputs_on_grid[id(operation)])
            ]
            if any(after):
                self.after[id(operation)] = after
        after = self.after.get(id(operation), [[]] * len(node.outputs))
        for index, (tensor, layers) in enumerate(zip(node.outputs, after)):
            quantizers = [layer for layer in layers if isinstance(layer, ActivationQuantizer)]
            self.on_grid[id(tensor)] = (
                bool(quantizers)
                or self.outputs_on_grid[id(operation)][index]
                or self._grid_without_quantizer(operation, tensor, inputs_on_grid)
            )
            if quantizers:
                self.grid_source[id(tensor)] = quantizers[-1]
            elif spec.role(operation) == spec.PRESERVES and self.on_grid[id(tensor)]:
                self._inherit_grid(node)

    def _inherit_grid(self, node: Node) -> None:
        """The node's output keeps its (first) input's grid."""
        source = node.input_tensors[0]
        self.on_grid[id(node.outputs[0])] = self.on_grid[id(source)]
        if id(source) in self.grid_source:
            self.grid_source[id(node.outputs[0])] = self.grid_source[id(source)]

    def _check_bias_add(self, operation: keras.Operation, node: Node) -> None:
        """Note a channels_first layer with a bias whose output's last (spatial) axis may have
        as many entries as there are channels: there Keras 3.15 adds the bias on that axis, so
        the float model is wrong where the QAT model (its QAT layer or float copy with a
        ChannelBias) adds it on the channel axis. Under JAX Keras's add broadcasts as numpy
        does, so the float model is right and there is nothing to note."""
        if not (
            backend.get().bias_add_may_miss_channels_first()
            and type(operation) in _BIAS_ADDING
            and fold_plan.channels_first(operation)
            and operation.use_bias
        ):
            return
        shape = node.outputs[0].shape
        if shape[-1] is None or shape[-1] == shape[1]:
            path = self.prefix + operation.name
            if path not in self.findings.wrong_bias_add:
                self.findings.wrong_bias_add.append(path)

    def _after_qat_layer(
        self, node: Node, layer: keras.layers.Layer, split: keras.layers.Layer | None
    ) -> None:
        """The layers after a QAT layer whose host's own activation was split off, or whose
        output an average pool shares: the Activation, and the quantizer of the result (none
        where the spec fixes its scale). The result always lies on a grid."""
        layers: list[keras.layers.Layer] = [] if split is None else [split]
        if split is None or spec.role(split) == spec.OWN:
            layers.append(self._quantizer((split or layer).name))
            self.grid_source[id(node.outputs[0])] = layers[-1]
        self.after[id(node.operation)] = [layers]
        self.on_grid[id(node.outputs[0])] = True

    def _visit_average_pool(self, node: Node) -> None:
        """An average pool rounds its output onto its input's grid. Where that grid is a
        quantizer's of this model (the input's producer has other readers), the pool is copied
        and that quantizer called again after it, at inference; otherwise the pool becomes a
        QuantizedAveragePooling, which quantizes its input itself (its producer left its
        quantizer out) and rounds its output onto that grid. A pool that alone reads a
        QuantizedAveragePooling's output becomes its next stage, on the same grid."""
        pool, (tensor,) = node.operation, node.input_tensors
        before = self.pooled_by.get(id(tensor))
        if before is not None and id(pool) not in self.copies and self._alone_reads(pool, tensor):
            # The QuantizedAveragePooling before it averages again, on its own grid: a pool
            # that quantized its input anew would give the file two scales on one op's sides.
            before.add_stage(pool)
            self.dropped.add(id(pool))
            self.pool_grids[id(pool)] = None
            self.pooled_by[id(node.outputs[0])] = before
            self.on_grid[id(node.outputs[0])] = True
            self.findings.quantized[self.prefix + pool.name] = self.prefix + before.name
            return
        if id(pool) not in self.copies:  # its first call
            source = self.grid_source.get(id(tensor)) if self.on_grid.get(id(tensor)) else None
            functional = not isinstance(self.model, keras.Sequential)
            if source is not None and functional and not self.info.shared(pool):
                self.copies[id(pool)] = rebuild.copy_layer(pool)
                # The quantizer called again (`__call__` spelt out for mypy's partial, which
                # cannot see a Keras layer's); `halves` only where it is not the default, so
                # that the call's saved arguments stay those of files saved before it existed.
                rounding: dict[str, Any] = {"average_of": window_size(pool)}
                if halves_of(pool) != "away":
                    rounding["halves"] = halves_of(pool)
                self.after[id(pool)] = [
                    [functools.partial(source.__call__, training=False, **rounding)]
                ]
            else:
                source = None
                layer = QuantizedAveragePooling(
                    pool,
                    self.settings.activation_bits,
                    self.settings.range_momentum,
                    name=self._unique(f"{pool.name}_qat"),
                )
                self.copies[id(pool)] = layer
                self.findings.quantized[self.prefix + pool.name] = self.prefix + layer.name
                self.pooled_by[id(node.outputs[0])] = layer
            self.pool_grids[id(pool)] = source
        self.on_grid[id(node.outputs[0])] = True
        shared = self.pool_grids[id(pool)]
        if shared is not None:
            self.grid_source[id(node.outputs[0])] = shared

    def _alone_reads(self, pool: keras.Operation, tensor: keras.KerasTensor) -> bool:
        """Whether `pool`, called once, is the only reader of `tensor`, no model output."""
        return (
            not self.info.shared(pool)
            and self.info.fan_out(tensor) == 1
            and id(tensor) not in self.info.outputs
        )

    def _output_layers(
        self,
        operation: keras.Operation,
        tensor: keras.KerasTensor,
        on_grid: bool,
        inputs_on_grid: bool,
    ) -> list[keras.layers.Layer]:
        """The layers after one output: its ChannelBias (a copy's), then its quantizer if it
        needs one."""
        layers: list[keras.layers.Layer] = []
        copied = self.float_copies.get(id(operation))
        if copied is not None and copied[2] is not None:
            layers.append(copied[2])
        needs = not (
            on_grid
            or self._grid_without_quantizer(operation, tensor, inputs_on_grid)
            or self._deferred(tensor, operation)
        )
        if needs:
            layers.append(self._quantizer(operation.name))
        return layers

    def _grid_without_quantizer(
        self, operation: keras.Operation, tensor: keras.KerasTensor, inputs_on_grid: bool
    ) -> bool:
        """Whether this output needs no quantizer: not a float tensor, a spec-fixed scale, or
        its input's grid kept."""
        if not _is_float(tensor):
            return True
        role = spec.role(operation)
        return role == spec.FIXED or (role == spec.PRESERVES and inputs_on_grid)

    def _quantizer(self, source: str) -> ActivationQuantizer:
        name = self._unique(f"{source}_quantizer")
        self.findings.quantizers[self.prefix + name] = self.prefix + source
        return ActivationQuantizer(
            self.settings.activation_bits, self.settings.range_momentum, name=name
        )

    # An Add or Multiply of three or more inputs.

    def _chained(self, node: Node) -> bool:
        """Whether the node is an unshared Add or Multiply of three or more inputs, which
        TFLite's converter (and tf2onnx) write as a chain of two-input ADDs (MULs): each
        partial result is a tensor of the file and needs a scale of its own."""
        operation = node.operation
        return (
            type(operation) in spec.CHAINED
            and len(node.input_tensors) > 2
            and not self.info.shared(operation)
        )

    def _copy_chain(self, node: Node) -> None:
        """Copy a chained Add or Multiply as a nested model of two-input ones, left to right
        as Keras computes it, with an ActivationQuantizer after each partial result; the
        last result's quantizer (or a fused ReLU's) follows the nested model as any Add's.
        Its layers' names are unique in the outer model too: a variable's path is its
        layer's name, and two equal paths are one entry of a torch state_dict."""
        operation = node.operation
        name = self._unique(f"{operation.name}_qat")
        inputs = [
            keras.Input(batch_shape=t.shape, dtype=t.dtype, name=f"{name}_input_{index}")
            for index, t in enumerate(node.input_tensors)
        ]
        result = inputs[0]
        for index, tensor in enumerate(inputs[1:], start=1):
            if index > 1:
                quantizer = ActivationQuantizer(
                    self.settings.activation_bits,
                    self.settings.range_momentum,
                    name=self._unique(f"{operation.name}_{index - 1}_quantizer"),
                )
                self.findings.quantizers[f"{self.prefix}{name}/{quantizer.name}"] = (
                    f"{self.prefix}{operation.name}"
                )
                result = quantizer(result)
            step = type(operation)(
                name=self._unique(f"{operation.name}_{index}"), dtype=operation.dtype_policy
            )
            result = step([result, tensor])
        self.copies[id(operation)] = keras.Model(inputs, result, name=name)
        self.findings.quantized[self.prefix + operation.name] = self.prefix + name

    # The float copies.

    def _copy(self, operation: keras.Operation, inputs_on_grid: list[bool]) -> list[bool] | None:
        """Copy `operation`, or rewrite it if it is a nested model; for a nested model, whether
        each of its flattened outputs lies on a grid (None otherwise).

        Raises:
            UnsupportedModelError: a nested subclassed model holds a host or a BN.
        """
        if not isinstance(operation, L.Layer):  # a stateless op such as `x * 2.0`: reusable
            self.copies[id(operation)] = operation
            return None
        if isinstance(operation, keras.Model) and models.has_layer_graph(operation):
            shared_in = self.shared_in
            if shared_in is None and self.info.shared(operation):
                shared_in = (
                    f"is inside the nested model '{self.prefix}{operation.name}', which is "
                    f"called {self.info.calls[id(operation)]} times (its QAT layers would be "
                    f"shared, which no exported file can hold)"
                )
            inner = _ModelRewrite(
                self.settings,
                self.findings,
                operation,
                f"{self.prefix}{operation.name}/",
                shared_in,
            )
            self.copies[id(operation)], outputs_on_grid = inner.run(inputs_on_grid)
            return outputs_on_grid
        if isinstance(operation, keras.Model) and _holds_hosts(operation):
            models.layer_graph(operation, "quantize")  # subclassed: raises, naming it
        self._keep_float(operation)
        bias = None
        if (
            type(operation) in _BIAS_ADDING
            and fold_plan.channels_first(operation)
            and operation.use_bias
        ):
            copy = rebuild.copy_layer(operation, use_bias=False)
            bias = ChannelBias(
                1,
                int(operation.bias.shape[0]),
                trainable_bias=operation.trainable,
                name=self._unique(f"{operation.name}_bias"),
                dtype=operation.dtype_policy,
            )
        else:
            copy = rebuild.copy_layer(operation)
        self.copies[id(operation)] = copy
        self.float_copies[id(operation)] = (operation, copy, bias)
        return None

    def _keep_float(self, layer: keras.layers.Layer) -> None:
        """Report a float copy's weights, and the BNs it computes out of sight."""
        unseen = fold_plan.unseen_batch_norms(layer, self.prefix, reader="quantize_model")
        for path, reason, kind in unseen:
            itself = path == self.prefix + layer.name  # a BN subclass
            self._keep_path(id(layer) if itself else None, path, reason, kind)
        if layer.weights and id(layer) not in self.kept_ids:
            self._keep(
                layer,
                (
                    f"'{layer.name}' is a {type(layer).__name__}, which has no "
                    f"quantization-aware form; it stays float"
                ),
                "not_quantizable",
            )

    def _keep(self, layer: keras.layers.Layer, reason: str, kind: str) -> None:
        self._keep_path(id(layer), self.prefix + layer.name, reason, kind)

    def _keep_path(self, key: int | None, path: str, reason: str, kind: str) -> None:
        if key is not None:
            if key in self.kept_ids:
                return
            self.kept_ids.add(key)
        self.findings.kept.append(KeptLayer(path, reason, kind))

    def _unique(self, name: str) -> str:
        name = models.unique_name(name, self.names)
        self.names.add(name)
        return name


def _activity_refusal(layer: keras.layers.Layer, role: str) -> fold_plan.Refusal | None:
    """Why a QAT layer cannot compute `layer` (a host or a BN): it has an activity regularizer,
    whose loss term only the layer's own call adds (a QAT layer computes the host's linear map
    and the BN itself); None without one. `role` names the layer in the message ("host")."""
    if layer.activity_regularizer is None:
        return None
    return fold_plan.Refusal(
        "activity_regularizer",
        f"{role} '{layer.name}' has an activity_regularizer, whose loss term (in model.losses) "
        f"a QAT layer would drop",
    )


def _refuse_float_dtypes(model: keras.Model) -> None:
    """Refuse a model whose layers compute or keep weights in a float type other than float32,
    before anything is copied.

    The QAT layers and an int8 file compute in float32: under a mixed policy (float16 or
    bfloat16) the fake-quantized values are cast back to the lower precision and the float
    layers between them compute in it, so the QAT model is not what its exported file
    computes; a float64 batch norm cannot be folded into a float32 QAT layer.

    Raises:
        ValueError: naming each such layer and its dtype policy.
    """
    other = [
        f"'{layer.name}' ({layer.dtype_policy.name})"
        for layer in model._flatten_layers(include_self=False)
        if not isinstance(layer, L.InputLayer)
        and any(
            _is_float_dtype(dtype) and dtype != "float32"
            for dtype in (layer.dtype_policy.compute_dtype, layer.dtype_policy.variable_dtype)
        )
    ]
    if other:
        raise ValueError(
            f"quantize_model takes float32 layers only: {', '.join(other)} of '{model.name}' "
            f"compute or keep weights in another float type: the QAT model would round in it "
            f"where its exported int8 file does not, and differ from the file unseen. Build the "
            f"float model under the float32 policy (keras.config.set_dtype_policy('float32')) "
            f"and copy its weights into it, then call quantize_model."
        )


def _linear_copy(host: keras.layers.Layer) -> keras.layers.Layer:
    """A built copy of `host` with a linear activation, its weights copied."""
    config = models.config_of(host)
    config["activation"] = "linear"
    copy = models.from_config(host, config)
    copy.build(host.get_build_config()["input_shape"])
    copy.set_weights(host.get_weights())
    return copy


def _holds_hosts(layer: keras.layers.Layer) -> bool:
    """Whether a layer computes a host or a BN inside its own code."""
    return any(
        type(inner) in hosts.KINDS or bn_layers.is_batch_norm(inner)
        for inner in layer._flatten_layers(include_self=False)
    )


def _is_float(tensor: keras.KerasTensor) -> bool:
    return _is_float_dtype(tensor.dtype)


def _is_float_dtype(dtype: object) -> bool:
    """Whether `dtype` is a floating-point type (bfloat16 included)."""
    return keras.backend.standardize_dtype(dtype).startswith(("float", "bfloat"))

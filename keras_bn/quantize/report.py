"""QuantizationReport: what `quantize_model` turned into QAT layers, where it put activation
quantizers, and what it left in float and why."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class KeptLayer:
    """A layer that `quantize_model` left in float, as `keras_bn.export.KeptBN` does for the fold.

    Attributes:
        layer: the layer's path ("inner/conv" for a layer of the nested model "inner"; for a
            BN inside a custom layer, "layer/…/name").
        reason: why it is not quantized, in words.
        kind: a short code to branch on. For a batch norm, the fold's refusal ("shared_bn",
            "several_inputs", "several_axes", "reads_input", "not_a_host", "shared_host",
            "lora", "quantized", "activation", "fan_out", "axis", "inside_layer",
            "subclass") or "batch_norm_config" (renorm, virtual_batch_size,
            synchronized=True or momentum=None, which the folded QAT layer cannot train) or
            "activity_regularizer" (the BN's or its host's, whose loss term a QAT layer would
            drop); for a host (Dense or convolution), "shared_host", "lora", "quantized",
            "activity_regularizer" or "no_int8_file" (a dilated convolution, a Dense on an
            input of rank > 2: `hosts.int8_file_refusal`); for any
            other layer with weights, "not_quantizable" (no QAT form: a transposed
            convolution, a normalization other than BN, an embedding, a custom layer, ...).
    """

    layer: str
    reason: str
    kind: str


@dataclasses.dataclass(frozen=True)
class QuantizationReport:
    """What `quantize_model` did to a model.

    `str()` of it is a summary: the QAT layers with the layers each one took over, the
    activation quantizers, and the layers kept in float with the reasons.

    Attributes:
        quantized: {original layer path: QAT layer path}: every host, batch norm and fused
            ReLU/ReLU6 that a QAT layer now computes (a host and its BN map to the same QAT
            layer), and every average pool that became a QuantizedAveragePooling.
        quantizers: {ActivationQuantizer path: the path of the model input or layer whose
            output it fake-quantizes}, for the quantizers outside the QAT layers (one that an
            average pool's output shares rounds that output too).
        kept: tuple of `KeptLayer`, the layers with weights that stay float (batch norms that
            could not be folded included), in model order.
        weight_bits: the weights' bits.
        activation_bits: the activations' bits.
        per_channel: `quantize_model`'s per_channel: True (one weight range per output
            channel of each convolution, one per tensor for Dense), "all" (per channel for
            every host) or False (one per tensor).
    """

    quantized: dict
    quantizers: dict
    kept: tuple
    weight_bits: int
    activation_bits: int
    per_channel: "bool | str"

    def __str__(self) -> str:
        grouped: dict[str, list[str]] = {}
        for original, qat in self.quantized.items():
            grouped.setdefault(qat, []).append(original)
        lines = [
            f"quantize_model: {len(grouped)} QAT layer(s), {len(self.quantizers)} activation "
            f"quantizer(s), {len(self.kept)} layer(s) kept in float "
            f"(weights {self.weight_bits} bits"
            f"{_GRANULARITY[self.per_channel]}, activations "
            f"{self.activation_bits} bits).",
        ]
        lines += [f"  {qat} <- {', '.join(originals)}" for qat, originals in grouped.items()]
        lines += [f"  {name} quantizes {source}" for name, source in self.quantizers.items()]
        lines += [f"  kept {k.layer} ({k.kind}): {k.reason}" for k in self.kept]
        return "\n".join(lines)


_GRANULARITY = {
    True: " per channel (Dense per tensor)",
    "all": " per channel (Dense too)",
    False: " per tensor",
}

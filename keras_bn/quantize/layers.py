"""The QAT layers: a host (Dense or a convolution) with fake-quantized weights, with or without
the batch norm that follows it folded in.

`QuantizedHostBatchNorm` computes host → BN (→ ReLU/ReLU6) as one layer whose weights are
fake-quantized *after* the fold, so training sees the weights an int8 file will hold
(Krishnamoorthi, "Quantizing deep convolutional networks for efficient inference: A
whitepaper", 2018, section 3.2; Jacob et al., "Quantization and Training of Neural Networks for
Efficient Integer-Arithmetic-Only Inference", 2018). With σ = √(v + ε) from the moving variance
v and s = γ/σ per output channel:

    z = host(x, FQ_w(W·s))                                   (no bias)
    training, before the freeze:
        μ_B, σ²_B = biased two-pass moments of z/s,  σ_B = √(σ²_B + ε)
        y = γ·(z/s' − μ_B)/σ_B + β                           (BN in training of z/s')
    after the freeze, and at inference:
        y = z + R(β + s·(b − μ))                             (the folded BN, b the host bias)
    then ReLU/ReLU6, then the output's fake quantization.

R rounds the folded bias to the multiples of Δ_in·Δ_w (per output channel), the int32 grid an
integer file adds it on, with a straight-through gradient (`fake_quant.round_bias`): Δ_w is
the channel's weight step and Δ_in the step of the grid the layer's input lies on in its model
(`keras_bn.quantize.grids`), once that has a range. With 8-bit weights the float bias lies
within a few hundredths of an output step of the file's, but below that Δ_w is coarse, and the
file's bias differs from a float one by up to ~0.4 output steps: enough to move 3–13% of a
layer's outputs one step, and after a few layers the logits by several. R is the identity
where the weights are float or the input's grid is unknown (a direct call, a nested model's
input). A `QuantizedHost` adds R(b) the same way.

Before the freeze the layer therefore trains like batch-statistics BN (the host bias cancels),
with BN's full gradient through the batch moments (as PyTorch's
`torch.ao.nn.intrinsic.qat.ConvBn2d` has) and straight-through for the rounding: the backend's
`batch_norm_train` of z/s', forward and backward, as keras_bn.BatchNormalization computes it
(under TensorFlow outside XLA FusedBatchNormV3 where the layout allows, re-centred far from
zero; elsewhere sums about a shift, exact far from zero), never the folded form z·σ/σ_B +
(β − γ·μ_B/σ_B), whose two terms cancel to (|μ_B|/σ_B)·2⁻²⁴ of the output's scale. The moving
statistics follow keras_bn.BatchNormalization: μ ← momentum·μ + (1 − momentum)·(μ_B + b) and
v ← momentum·v + (1 − momentum)·m/(m − 1)·σ²_B, skipped for a non-finite batch or m ≤ 1, by
the BN's own `update_moving_statistics` (so under a tf.distribute strategy every replica takes
the replicas' count-weighted averages, as the layer's do). The mean is that of the host's
output with its bias, so that the folded form's b − μ is BN's.
A batch that gives m = 1 at run time (`fit`'s last batch of one) outputs β before the freeze,
with no gradient to x, γ or the kernel, as keras_bn.BatchNormalization does.

The weight range m of FQ_w is max|W·s| per channel or per tensor, or, below 4 bits by default,
learned (`weight_range`; Esser et al., "Learned Step Size Quantization", ICLR 2020): per
channel m_c = r_c·|s'_c| with r_c trained in the host kernel's units, so that s' still cancels
in each channel's grid; per tensor one trained m for W·s'.

γ = 0 makes s = 0, so z/s would divide 0 by 0. Such a channel's output is β whatever its
kernel, but its γ still needs the gradient Σg·x̂. So the kernel is scaled by
s' = γ'/σ with γ' = 1 where γ = 0 (s' = s elsewhere), z/s' normalizes, and z is multiplied by
s/s', which is exactly 1 where γ ≠ 0 and 0 where γ = 0. Per-tensor weight ranges are taken from
W·s itself, so a γ = 0 channel never widens the other channels' grid.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from keras_bn import backend
from keras_bn._graph import bn_layers, models
from keras_bn._graph.bn_layers import KERAS_BN, KERAS_BN_BN
from keras_bn.backend.constants import MIN_RANGE
from keras_bn.quantize import fake_quant, grids, hosts
from keras_bn.quantize.activation import ActivationQuantizer, scalar_state, validate_momentum

ACTIVATIONS = ("relu", "relu6")


class _QuantizedHostLayer(keras.layers.Layer):
    """What both QAT layers share: the host, its weights' fake quantization, the activation and
    the activation quantizers."""

    output_quantizer: ActivationQuantizer | None
    intermediate_quantizer: ActivationQuantizer | None

    def __init__(
        self,
        host: "keras.layers.Layer | dict",
        activation: str | None = None,
        weight_bits: int | None = 8,
        activation_bits: int | None = 8,
        per_channel: bool = True,
        range_momentum: float = 0.99,
        quantize_output: bool = True,
        weight_range: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.host, self._host_config = hosts.deserialize(host)
        self.kind = hosts.kind_of(self.host)
        self.activation = validate_activation(activation)
        self.weight_bits = fake_quant.validate_bits(weight_bits, "weight_bits", allow_none=True)
        self.activation_bits = fake_quant.validate_bits(
            activation_bits, "activation_bits", allow_none=True
        )
        if not isinstance(per_channel, bool):
            raise ValueError(
                f"per_channel must be True or False; received per_channel={per_channel!r}."
            )
        self.per_channel = per_channel
        self.range_momentum = validate_momentum(range_momentum, "range_momentum")
        if not isinstance(quantize_output, bool):
            raise ValueError(
                f"quantize_output must be True or False; received "
                f"quantize_output={quantize_output!r}."
            )
        self.quantize_output = quantize_output
        self.weight_range = fake_quant.validate_weight_range(weight_range, self.weight_bits)
        # The learned ranges, by kernel name ("kernel", and a separable host's
        # "depthwise_kernel"), created by build.
        self.learned_ranges: dict[str, Any] = {}
        self.output_quantizer = self.intermediate_quantizer = None
        bits = self.activation_bits
        if bits is not None:
            if quantize_output:
                self.output_quantizer = ActivationQuantizer(
                    bits, self.range_momentum, name="output_quantizer"
                )
            if self.kind == hosts.SEPARABLE:  # the depthwise output is a tensor of the file
                self.intermediate_quantizer = ActivationQuantizer(
                    bits, self.range_momentum, name="intermediate_quantizer"
                )

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        """Build the host for `input_shape`, then the quantizers (and the batch norm).

        Args:
            input_shape: the input's shape.
        """
        self.host.build(input_shape)
        for quantizer in (self.output_quantizer, self.intermediate_quantizer):
            if quantizer is not None:
                quantizer.build(())
        if self.weight_range == "learned" and self.weight_bits is not None:
            names = ["kernel"] + (["depthwise_kernel"] if self.kind == hosts.SEPARABLE else [])
            for name in names:
                channels = int(ops.shape(self._channels_last(name))[-1])
                self.learned_ranges[name] = self.add_weight(
                    name=f"{name}_range",
                    shape=(channels,) if self.per_channel else (),
                    initializer="ones",
                    trainable=True,
                )

    def _channels_last(self, name: str) -> Any:
        """The host's kernel `name` ("kernel": the folded one, or "depthwise_kernel") viewed
        with its output channels last (float32)."""
        if name == "depthwise_kernel":
            return hosts.channels_last(
                ops.cast(self.host.depthwise_kernel, "float32"), hosts.DEPTHWISE
            )
        return self._kernel_view()

    def _range_view(self, name: str) -> Any:
        """The channels-last kernel in the units of the learned range `name`."""
        return self._channels_last(name)

    def _start_weight_ranges(self) -> None:
        """Learned ranges at max|w| of the kernel as built (cheap: `from_layers` resets them
        from the weights it copies, `reset_weight_ranges`)."""
        for name, variable in self.learned_ranges.items():
            view = self._range_view(name)
            variable.assign(fake_quant.weight_max_abs(view, self.per_channel))

    def reset_weight_ranges(self) -> None:
        """Start each learned weight range where the squared rounding error of the weights
        as they are now is least (`fake_quant.mse_weight_range`); nothing for "max" ranges.

        `from_layers` and `quantize_model` call it once they have copied the weights; call it
        after setting a kernel, or the batch norm's statistics, yourself.
        """
        bits = self.weight_bits
        for name, variable in self.learned_ranges.items():
            assert bits is not None  # build makes learned ranges only for rounded weights
            view = ops.convert_to_numpy(self._range_view(name))
            variable.assign(fake_quant.mse_weight_range(view, bits, self.per_channel))

    def _weight_range(self, name: str, view: Any, scale: Any = None) -> Any:
        """The range m of the kernel `name`'s grid, `view` the channels-last kernel `call`
        rounds: max|view| ("max", no gradient), or the learned range (with its gradient), per
        channel in the host kernel's units times |scale| (batch norm's, no gradient)."""
        variable = self.learned_ranges.get(name)
        if variable is None:
            return fake_quant.weight_max_abs(view, self.per_channel)
        learned = ops.maximum(ops.abs(ops.convert_to_tensor(variable)), MIN_RANGE)
        if scale is not None and self.per_channel:
            learned = learned * ops.stop_gradient(ops.abs(scale))
        return learned

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        """The host's output shape.

        Args:
            input_shape: the input's shape.

        Returns:
            The output shape.
        """
        return self.host.compute_output_shape(input_shape)

    def _channel_axes(self, outputs: Any) -> list[int]:
        return [hosts.channel_axis(self.host) % len(outputs.shape)]

    def _kernel_view(self) -> Any:
        """The folded kernel with its output channels on the last axis (float32)."""
        kernel = ops.cast(hosts.folded_kernel(self.host), "float32")
        return hosts.channels_last(kernel, self.kind)

    def _fake_quant(self, view: Any, max_abs: Any) -> Any:
        """FQ_w of a channels-last kernel view (unchanged with weight_bits=None)."""
        if self.weight_bits is None:
            return view
        if self.weight_range == "learned":
            return fake_quant.fake_quant_weights_learned(view, max_abs, self.weight_bits)
        return fake_quant.fake_quant_weights(view, max_abs, self.weight_bits)

    def _quantized_depthwise(self) -> tuple[Any, Any]:
        """A separable host's depthwise kernel viewed channels last and fake-quantized, and its
        weight range."""
        view = self._channels_last("depthwise_kernel")
        max_abs = self._weight_range("depthwise_kernel", view)
        return self._fake_quant(view, max_abs), max_abs

    def _quantized_kernel(self) -> tuple[Any, Any, Any | None]:
        """The folded kernel viewed channels last and fake-quantized as `call` rounds it, its
        weight range, and the per-channel factor inference multiplies the host's output by
        (None for 1)."""
        raise NotImplementedError

    def _linear(self, inputs: Any, view: Any, training: bool | None) -> Any:
        """The host's map without bias, with the fake-quantized channels-last kernel `view`."""
        kernel = hosts.from_channels_last(view, hosts.folded_kernel(self.host).shape)
        depthwise = None
        between: Callable[[Any], Any] | None = None
        if self.kind == hosts.SEPARABLE:
            depthwise_view, _ = self._quantized_depthwise()
            depthwise = hosts.from_channels_last(depthwise_view, self.host.depthwise_kernel.shape)
            quantizer = self.intermediate_quantizer
            if quantizer is not None:
                # (`__call__` spelt out: mypy's partial cannot see a Keras layer's, whose base
                # class has no types)
                between = functools.partial(quantizer.__call__, training=training)
        return hosts.linear(self.host, inputs, kernel, depthwise, between)

    def grid_quantizer(self) -> ActivationQuantizer | None:
        """The quantizer whose grid the layer's output lies on.

        Returns:
            `output_quantizer`: None where the layer leaves its output to another layer's
            quantizer, or has activation_bits=None.
        """
        return self.output_quantizer

    def _bias_on_grid(self, bias: Any, max_abs: Any) -> Any:
        """`bias` as an integer file adds it: rounded to its int32 grid, the input's step times
        the weights' (`fake_quant.round_bias`), once the input's grid has a range.

        The input's grid is the intermediate quantizer's for a separable host, else the one
        its input lies on in its model (`grids.input_grid`: a quantizer's, or the step the
        int8 spec fixes after a tanh, sigmoid or softmax). Left in float where the weights
        are float, or that grid is unknown (no model graph around the layer, or its input
        comes from outside it): no integer file computes the layer then, or the exporter's
        verification measures the rest.
        """
        if self.weight_bits is None:
            return bias
        grid = (
            self.intermediate_quantizer if self.kind == hosts.SEPARABLE else grids.input_grid(self)
        )
        weight_step = fake_quant.weight_step(max_abs, self.weight_bits)
        if isinstance(grid, float):
            return fake_quant.round_bias(bias, grid * weight_step)
        if grid is None or not grid.built:
            return bias
        input_step, initialized = grid.step()
        return ops.where(initialized, fake_quant.round_bias(bias, input_step * weight_step), bias)

    def inference_bias(self) -> np.ndarray:
        """The bias the layer's inference adds, as the integer file adds it.

        Returns:
            float32 numpy vector: `folded_weights()`'s bias, rounded to the multiples of the
            input's step times the weights' step per output channel where the layer knows its
            input's grid (see `call`), else that bias itself.
        """
        _, max_abs, _ = self._quantized_kernel()
        _, bias = self.folded_weights()
        return ops.convert_to_numpy(self._bias_on_grid(ops.convert_to_tensor(bias), max_abs))

    def _host_bias(self) -> Any:
        """The host's bias as float32 (zeros without one)."""
        if self.host.bias is None:
            return ops.zeros([hosts.output_channels(self.host)], "float32")
        return ops.cast(self.host.bias, "float32")

    def _activate(self, outputs: Any) -> Any:
        """ReLU/ReLU6 if fused."""
        if self.activation == "relu":
            return ops.relu(outputs)
        if self.activation == "relu6":
            return ops.relu6(outputs)
        return outputs

    def _finish(self, outputs: Any, training: bool | None) -> Any:
        """ReLU/ReLU6 if fused, then the output's fake quantization."""
        outputs = self._activate(outputs)
        if self.output_quantizer is not None:
            outputs = self.output_quantizer(outputs, training=training)
        return ops.cast(outputs, self.compute_dtype)

    def weight_grids(self) -> dict[str, fake_quant.WeightGrid]:
        """The integers and scales of the weights the layer's inference rounds to, by name.

        Returns:
            {"kernel": fake_quant.WeightGrid of the folded kernel (`folded_weights`) viewed
            with its output channels last (a depthwise kernel (*k, C, M) as (*k, 1, C·M))},
            and for a separable host also "depthwise_kernel" (its depthwise kernel, which
            batch norm does not scale, viewed the same way). The integers are read from the
            kernels `call` computes, through the same TensorFlow ops: a weight that training
            left on a rounding boundary (QAT weights oscillate across one) rounds as the
            layer rounds it, which `fake_quant.weight_grid`'s numpy need not (TensorFlow's
            per-channel FakeQuant kernel rounds some such halves the other way). A channel
            that inference multiplies by 0 (γ = 0) holds zeros.

        Raises:
            ValueError: the layer has weight_bits=None (float weights: no integers).
        """
        if self.weight_bits is None:
            raise ValueError(
                f"Layer '{self.name}' has weight_bits=None: its weights are float, so no "
                f"integer file can hold them."
            )
        kernel, max_abs, factor = self._quantized_kernel()
        found = {"kernel": self._grid(kernel, max_abs, factor)}
        if self.kind == hosts.SEPARABLE:
            found["depthwise_kernel"] = self._grid(*self._quantized_depthwise(), None)
        return found

    def _grid(self, quantized: Any, max_abs: Any, factor: Any | None) -> fake_quant.WeightGrid:
        """The WeightGrid of a fake-quantized channels-last kernel: its steps from the range
        as the op nudges it, its integers by dividing by them (each value is an integer
        times its step, to float32 rounding), times `factor` per channel."""
        bits = self.weight_bits
        assert bits is not None  # weight_grids refuses float weights
        # ops.convert_to_numpy, not np.asarray: a PyTorch tensor may require grad.
        largest = ops.convert_to_numpy(max_abs).astype(np.float32)
        scale, _, _, _ = fake_quant.nudged_grid(-largest, largest, bits, narrow_range=True)
        q = np.round(ops.convert_to_numpy(quantized).astype(np.float64) / scale)
        if factor is not None:
            q = q * ops.convert_to_numpy(factor)
        return fake_quant.WeightGrid(q.astype(np.int8), scale, bits)

    def export_function(self, weight_op: Callable[[str, Any], Any]) -> Callable[[Any], Any]:
        """The layer's inference as an exporter traces it, from the values it holds now.

        It computes what `call(x, training=False)` computes, as the ops an integer file
        holds: the host's linear map with the kernels `weight_op` gives, the folded bias
        added (for a QuantizedHostBatchNorm, β + s·(b − μ): nothing of batch norm is left to
        multiply), ReLU/ReLU6, and the activation quantizers' `export_function`s. The
        weights, bias and ranges are read once, here, and become constants of the function.

        Args:
            weight_op: called as weight_op(name, grid) for each entry of `weight_grids()`
                while the function is traced; returns the float tensor to use for that kernel,
                in the grid's layout (channels last), whose values are `grid.values` (a
                constant, the values under a FakeQuant op a converter reads, or an input of
                the traced function). A Dense kernel may come as (1, 1, in, out): the host is
                then computed as a 1×1 convolution of each input row.

        Returns:
            A function of the input tensor (float32 out); it adds `inference_bias()`.

        Raises:
            ValueError: weight_bits or activation_bits is None (a float part, which no
                integer file can compute), or an activation quantizer has no range yet.
        """
        if self.activation_bits is None:
            raise ValueError(
                f"Layer '{self.name}' has activation_bits=None: its output is float, so no "
                f"integer file can compute it."
            )
        weight_grids = self.weight_grids()
        bias = self.inference_bias()
        shapes = {"kernel": tuple(hosts.folded_kernel(self.host).shape)}
        if self.kind == hosts.SEPARABLE:
            shapes["depthwise_kernel"] = tuple(self.host.depthwise_kernel.shape)
        output = between = None
        if self.output_quantizer is not None:
            output = self.output_quantizer.export_function()
        if self.intermediate_quantizer is not None:
            between = self.intermediate_quantizer.export_function()

        def finish(outputs: Any) -> Any:
            axes = self._channel_axes(outputs)
            outputs = self._activate(outputs + backend.get().per_channel(bias, outputs, axes))
            return outputs if output is None else output(outputs)

        def infer(inputs: Any) -> Any:
            inputs = ops.cast(inputs, "float32")
            kernels = {name: weight_op(name, grid) for name, grid in weight_grids.items()}
            kernel = kernels["kernel"]
            if self.kind == hosts.DENSE and len(kernel.shape) == 4:
                # Each row a 1×1 image, up to the output quantizer: the converter then fuses
                # the bias and activation into the CONV_2D, whose output it quantizes.
                rows = ops.reshape(inputs, (-1, 1, 1, kernel.shape[-2]))
                outputs = finish(ops.conv(rows, kernel, padding="valid"))
                return ops.reshape(outputs, (-1, *inputs.shape[1:-1], kernel.shape[-1]))
            outputs = hosts.linear(
                self.host,
                inputs,
                hosts.from_channels_last(kernel, shapes["kernel"]),
                hosts.from_channels_last(kernels["depthwise_kernel"], shapes["depthwise_kernel"])
                if "depthwise_kernel" in kernels
                else None,
                between,
            )
            return finish(outputs)

        return infer

    def get_config(self) -> dict[str, Any]:
        """Every constructor argument, for `from_config` and saving.

        Returns:
            A dict with the base layer's config, the host's serialized config and the
            quantization arguments.
        """
        return {
            **super().get_config(),
            "host": self._host_config,
            "activation": self.activation,
            "weight_bits": self.weight_bits,
            "activation_bits": self.activation_bits,
            "per_channel": self.per_channel,
            "range_momentum": self.range_momentum,
            "quantize_output": self.quantize_output,
            "weight_range": self.weight_range,
        }


@keras.saving.register_keras_serializable(package="keras_bn.quantize")
class QuantizedHost(_QuantizedHostLayer):
    """A host layer (Dense or a convolution) with fake-quantized weights and output, no BN.

    y = FQ_a(act(host(x, FQ_w(W)) + b)): for hosts no batch norm follows (a classifier's last
    Dense, for instance).

    Args:
        host: the host layer, or its `keras.layers.serialize` dict: exactly Dense, Conv1D,
            Conv2D, Conv3D, DepthwiseConv1D, DepthwiseConv2D, SeparableConv1D or
            SeparableConv2D, with a linear activation. Only its config is used; the QAT layer
            builds its own copy (use `keras_bn.quantize.from_layers` to copy weights).
        activation: None, "relu" or "relu6", applied before the output's fake quantization.
        weight_bits: 2..8, or None for float weights (no weight fake quantization).
        activation_bits: 2..8, or None for no activation fake quantization.
        per_channel: one weight range per output channel (True) or one per tensor.
        range_momentum: the activation ranges' EMA momentum, in [0, 1).
        weight_range: "max" (m = max|w| at every step, no gradient), "learned" (m a trainable
            weight, `kernel_range`, and a separable host's `depthwise_kernel_range`, trained
            with LSQ's gradient, `fake_quant.fake_quant_weights_learned`; built at max|w|,
            and started where the rounding error is least by `reset_weight_ranges`, which
            `from_layers` and `quantize_model` call), or None: "learned" at
            weight_bits ≤ 3, else "max". A per-channel learned range is in the units of the
            host's kernel, so batch norm's scale cancels in each channel's grid as with "max".
        quantize_output: whether the layer fake-quantizes its output (with activation_bits);
            False where another layer quantizes it instead, on a scale shared with other
            tensors (`quantize_model` does this for a layer feeding only a Concatenate, whose
            inputs and output share one scale in an int8 file, and for one an average pool
            reads, which rounds its output onto its input's grid).
        **kwargs: base layer arguments (`name`, `trainable`, ...).

    Raises:
        ValueError: an unsupported or non-linear host, or an argument out of range (the
            message names the value).
    """

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """act(host(x, FQ_w(W)) + b), fake-quantized.

        Args:
            inputs: float tensor, the host's input.
            training: Python bool or None; true (and trainable) moves the activation ranges.

        Returns:
            The output tensor.
        """
        view, max_abs, _ = self._quantized_kernel()
        outputs = self._linear(ops.cast(inputs, "float32"), view, training)
        bias = self._bias_on_grid(self._host_bias(), max_abs)
        outputs = outputs + backend.get().per_channel(bias, outputs, self._channel_axes(outputs))
        return self._finish(outputs, training)

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        """Build the host and the quantizers, and start any learned weight range.

        Args:
            input_shape: the input's shape.
        """
        super().build(input_shape)
        self._start_weight_ranges()

    def _quantized_kernel(self) -> tuple[Any, Any, Any | None]:
        view = self._kernel_view()
        max_abs = self._weight_range("kernel", view)
        return self._fake_quant(view, max_abs), max_abs, None

    def folded_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """The float kernel and bias an int8 file quantizes: the host's own.

        Returns:
            (kernel, bias) as float32 numpy arrays, the kernel in the host's layout (for a
            separable host, the pointwise kernel), the bias zeros when the host has none.
        """
        return (
            ops.convert_to_numpy(hosts.folded_kernel(self.host)).astype(np.float32),
            ops.convert_to_numpy(self._host_bias()),
        )


@keras.saving.register_keras_serializable(package="keras_bn.quantize")
class QuantizedHostBatchNorm(_QuantizedHostLayer):
    """Host → batch norm (→ ReLU/ReLU6) as one QAT layer, the BN folded into the weights that
    are fake-quantized; see the module docstring for the maths.

    Its class attribute `folds_batch_norm` tells the tools that measure every BN's input
    (`recalibrate`, `check_batchnorm`) that it holds a BN they cannot measure
    (`keras_bn._graph.bn_layers.refuse_folded`).

    The batch norm's weights (γ, β, moving mean and variance) live in `batch_norm`, a
    keras_bn.BatchNormalization that is never called: its config gives momentum, epsilon,
    center, scale, initializers, regularizers and constraints, and its moving variance is the
    unbiased estimate. The non-trainable bool weight `batch_norm_frozen` switches the layer to
    the folded form (moving statistics, no update) in training too; set it with
    `keras_bn.quantize.freeze_batch_norm` or the `FreezeBatchNorm` callback. Inference
    (`training=False`, or the layer not trainable) always uses the folded form, which is what
    an int8 file computes.

    Args:
        host: the host layer, or its `keras.layers.serialize` dict (see `QuantizedHost`).
        batch_norm: None (a default keras_bn.BatchNormalization on the host's channel axis),
            a keras_bn or keras.layers BatchNormalization, or its serialized dict. Only its
            config is used; Keras's is translated to keras_bn's.
        activation: None, "relu" or "relu6", applied after batch norm.
        weight_bits: 2..8, or None for float weights (no weight fake quantization).
        activation_bits: 2..8, or None for no activation fake quantization.
        per_channel: one weight range per output channel (True) or one per tensor.
        range_momentum: the activation ranges' EMA momentum, in [0, 1).
        weight_range: "max" (m = max|w| at every step, no gradient), "learned" (m a trainable
            weight, `kernel_range`, and a separable host's `depthwise_kernel_range`, trained
            with LSQ's gradient, `fake_quant.fake_quant_weights_learned`; built at max|w|,
            and started where the rounding error is least by `reset_weight_ranges`, which
            `from_layers` and `quantize_model` call), or None: "learned" at
            weight_bits ≤ 3, else "max". A per-channel learned range is in the units of the
            host's kernel, so batch norm's scale cancels in each channel's grid as with "max".
        quantize_output: whether the layer fake-quantizes its output (with activation_bits);
            False where another layer quantizes it instead, on a scale shared with other
            tensors (`quantize_model` does this for a layer feeding only a Concatenate, whose
            inputs and output share one scale in an int8 file, and for one an average pool
            reads, which rounds its output onto its input's grid).
        **kwargs: base layer arguments (`name`, `trainable`, ...).

    Raises:
        ValueError: an unsupported or non-linear host; a batch norm that is not one of the two
            classes, or uses renorm, virtual_batch_size, synchronized=True or momentum=None
            (which the fold cannot train); when built, a batch-norm axis other than the
            host's channel axis; in training, a static batch with m ≤ 1 values per channel;
            or an argument out of range (the message names the value).
    """

    folds_batch_norm = True

    def __init__(
        self,
        host: "keras.layers.Layer | dict",
        batch_norm: "keras.layers.Layer | dict | None" = None,
        activation: str | None = None,
        weight_bits: int | None = 8,
        activation_bits: int | None = 8,
        per_channel: bool = True,
        range_momentum: float = 0.99,
        quantize_output: bool = True,
        weight_range: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            host,
            activation,
            weight_bits,
            activation_bits,
            per_channel,
            range_momentum,
            quantize_output,
            weight_range,
            **kwargs,
        )
        self.batch_norm = _keras_bn_copy(batch_norm, hosts.channel_axis(self.host))
        self.batch_norm_frozen: Any = None  # a bool variable, created by build

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        """Build the host, the batch norm on the host's output and the freeze flag.

        Args:
            input_shape: the input's shape.

        Raises:
            ValueError: the batch norm's axis is not the host's channel axis.
        """
        super().build(input_shape)
        output_shape = self.host.compute_output_shape(input_shape)
        self.batch_norm.build(output_shape)
        expected = [hosts.channel_axis(self.host) % len(output_shape)]
        if list(self.batch_norm._channel_axes) != expected:
            raise ValueError(
                f"The batch norm '{self.batch_norm.name}' has axis={self.batch_norm.axis}, "
                f"but host '{self.host.name}' puts its channels on axis {expected[0]} of its "
                f"output (shape {tuple(output_shape)}): the fold needs them to agree."
            )
        self.batch_norm_frozen = scalar_state(self, "batch_norm_frozen", "bool")
        self._start_weight_ranges()

    def _bn_parameters(self) -> tuple[Any, Any, Any, Any, Any]:
        """γ, β, μ, v and the host bias as float32 vectors (γ = 1, β = 0 when absent)."""
        bn = self.batch_norm
        mean = backend.get().read(bn.moving_mean)
        gamma = ops.ones_like(mean) if bn.gamma is None else backend.get().read(bn.gamma)
        beta = ops.zeros_like(mean) if bn.beta is None else backend.get().read(bn.beta)
        return gamma, beta, mean, backend.get().read(bn.moving_variance), self._host_bias()

    def _range_view(self, name: str) -> Any:
        """The channels-last kernel in the units of the learned range `name`: per channel the
        host's own (s' cancels in each channel's grid), per tensor the folded W·s that `call`
        rounds."""
        view = self._channels_last(name)
        if name != "kernel" or self.per_channel:
            return view
        gamma, _, _, variance, _ = self._bn_parameters()
        return view * (gamma / ops.sqrt(variance + self.batch_norm.epsilon))

    def _scaled_kernel(self, gamma: Any, sigma: Any) -> tuple[Any, Any, Any, Any]:
        """(s, s', the kernel view scaled by s', its weight range); see the module docstring."""
        scale = gamma / sigma
        safe_scale = ops.where(gamma == 0.0, 1.0 / sigma, scale)
        view = self._kernel_view()
        if self.learned_ranges:
            max_abs = self._weight_range("kernel", view, safe_scale)
            return scale, safe_scale, view * safe_scale, max_abs
        # Per channel, a γ = 0 channel's own range (from s') is the one its rounding needs;
        # per tensor, the range is W·s's, which that channel (0 there) does not widen.
        ranged = view * safe_scale if self.per_channel else view * scale
        return (
            scale,
            safe_scale,
            view * safe_scale,
            fake_quant.weight_max_abs(ranged, self.per_channel),
        )

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """The folded host → BN → activation, fake-quantized.

        Args:
            inputs: float tensor, the host's input.
            training: Python bool or None; true (and trainable) normalizes with the batch's
                statistics (until frozen), updates the moving ones and moves the activation
                ranges.

        Returns:
            The output tensor.

        Raises:
            ValueError: in training, a static batch with m ≤ 1 values per channel.
        """
        linear = self._folded_linear(inputs, training)
        gamma, beta, mean, bias = linear.gamma, linear.beta, linear.mean, linear.bias
        scale, safe_scale, max_abs = linear.scale, linear.safe_scale, linear.max_abs
        z, axes, per_channel = linear.z, linear.axes, linear.per_channel
        ratio = scale / safe_scale  # exactly 1 where γ ≠ 0, 0 where γ = 0
        # The folded BN, its bias on the file's int32 grid (after `_linear`: a separable
        # host's intermediate range is this step's then).
        multiplier = ratio
        offset = self._bias_on_grid(beta + scale * (bias - mean), max_abs)
        if not (training and self.trainable):
            return self._finish(z * per_channel(multiplier) + per_channel(offset), training)
        frozen = backend.get().read(self.batch_norm_frozen)
        epsilon = self.batch_norm.epsilon

        # Before the freeze y = γ·(z/s' − μ_B)/σ_B + β is BN in training of z/s': the
        # backend's `batch_norm_train` computes it, forward and backward, as the layer does
        # (under TensorFlow FusedBatchNormV3 where the layout allows, re-centred where its
        # one-pass variance would lose accuracy; elsewhere sums about a shift K and
        # ((z/s' − K) − Δμ)·γ/σ_B + β). Never z·σ/σ_B + (β − γ·μ_B/σ_B): its two terms cancel
        # far from zero, to (|μ_B|/σ_B)·2⁻²⁴ of the output's scale (2e-4 at |μ_B|/σ_B ≈ 2600).
        # The backend's cond keeps the flag a run-time switch in a traced step (an eager one
        # takes its branch: an eager lax.cond compiles both again at every call), and the
        # frozen branch computes inference's folded form. Both read the offset through one
        # where, so that a variable only one branch needs (the host bias) still gets a zero
        # gradient, not None, in eager mode.
        shift = ops.where(frozen, offset, beta)
        single = _run_time_single_value(z, axes)
        if single is not None:
            # m = 1 (fit's last batch of one): BN's output is β, and x, γ and the kernel get
            # no gradient, as in keras_bn.BatchNormalization (γ = 0 there too).
            gamma = ops.where(single, 0.0, gamma)

        def folded() -> tuple[Any, Any, Any]:
            unused = ops.zeros_like(mean)  # the update is skipped when frozen
            return z * per_channel(multiplier) + per_channel(shift), unused, unused

        def batch_norm() -> tuple[Any, Any, Any]:
            y, batch_mean, batch_variance = backend.get().batch_norm_train(
                linear.normalized(), gamma, shift, axes, epsilon
            )
            return y, ops.reshape(batch_mean, [-1]), ops.reshape(batch_variance, [-1])

        outputs, batch_mean, batch_variance = backend.get().cond(frozen, folded, batch_norm)
        self._update_moving_statistics(z, axes, batch_mean + bias, batch_variance, frozen)
        return self._finish(outputs, training)

    def batch_norm_moments(self, inputs: Any) -> tuple[Any, Any, Any]:
        """(mean, biased variance, m) per channel of what the batch norm normalizes in
        training, for `recalibrate`: z/s' with the kernel rounded as it is now, its mean with
        the host bias (the moving mean's convention, see `call`). A separable host's
        intermediate tensor is quantized as at inference (its range does not move).

        Args:
            inputs: float tensor, the host's input.

        Returns:
            Three float32 tensors of the moving statistics' shape.
        """
        linear = self._folded_linear(inputs, False)
        mean, variance, count = bn_layers.batch_moments(self.batch_norm, linear.normalized(), None)
        return mean + ops.reshape(linear.bias, ops.shape(mean)), variance, count

    def _folded_kernel(self) -> tuple[Any, Any, Any, Any, Any, Any, Any, Any]:
        """(γ, β, μ, host bias, s, s', the fake-quantized kernel view W·s', its weight range):
        what `call` and `batch_norm_moments` fold and round, from the weights now."""
        gamma, beta, mean, variance, bias = self._bn_parameters()
        sigma = ops.sqrt(variance + self.batch_norm.epsilon)
        scale, safe_scale, view, max_abs = self._scaled_kernel(gamma, sigma)
        return gamma, beta, mean, bias, scale, safe_scale, self._fake_quant(view, max_abs), max_abs

    def _folded_linear(self, inputs: Any, training: bool | None) -> "_FoldedLinear":
        """The host's output z with the folded, fake-quantized kernel, for `call` (`training`
        as given) and `batch_norm_moments` (False: a separable host's intermediate range
        does not move)."""
        gamma, beta, mean, bias, scale, safe_scale, kernel, max_abs = self._folded_kernel()
        z = self._linear(ops.cast(inputs, "float32"), kernel, training)
        axes = self._channel_axes(z)
        return _FoldedLinear(gamma, beta, mean, bias, scale, safe_scale, max_abs, z, axes)

    def _quantized_kernel(self) -> tuple[Any, Any, Any | None]:
        _, _, _, _, scale, safe_scale, kernel, max_abs = self._folded_kernel()
        return kernel, max_abs, scale / safe_scale

    def _update_moving_statistics(
        self, z: Any, axes: list[int], mean: Any, variance: Any, frozen: Any
    ) -> None:
        """The batch norm's own update (`keras_bn.BatchNormalization.update_moving_statistics`),
        skipped for a frozen layer; `fit`'s traced last batch of one leaves it alone."""
        count = backend.get().element_count(z, axes)
        if isinstance(count, int) and count < 2:
            if backend.get().batch_size_traced(z, axes):
                return  # run-time data under JAX's fit, as in TensorFlow's (unknown batch size)
            raise ValueError(
                f"Layer '{self.name}' in training mode needs at least 2 values per channel "
                f"to estimate a batch variance, but this batch gives m={count} (output "
                f"shape {z.shape}). Use a larger batch, or call it with training=False."
            )
        self.batch_norm.update_moving_statistics(mean, variance, count, skip=frozen)

    def folded_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """The float kernel and bias an int8 file quantizes: W·s and β + s·(b − μ).

        Computed with the same float32 ops as `call`; `weight_grids` gives the integers the
        layer's inference rounds the kernel to, and `inference_bias` the bias it adds.

        Returns:
            (kernel, bias) as float32 numpy arrays, the kernel in the host's layout (for a
            separable host, the pointwise kernel).
        """
        gamma, beta, mean, variance, bias = self._bn_parameters()
        scale = gamma / ops.sqrt(variance + self.batch_norm.epsilon)
        kernel = hosts.from_channels_last(
            self._kernel_view() * scale, hosts.folded_kernel(self.host).shape
        )
        return ops.convert_to_numpy(kernel), ops.convert_to_numpy(beta + scale * (bias - mean))

    def get_config(self) -> dict[str, Any]:
        """Every constructor argument, for `from_config` and saving.

        Returns:
            A dict with the base layer's config, the host's and the batch norm's serialized
            configs and the quantization arguments.
        """
        return {
            **super().get_config(),
            "batch_norm": hosts.config_only(keras.layers.serialize(self.batch_norm)),
        }


class _FoldedLinear(NamedTuple):
    """A QAT layer's host output z (`QuantizedHostBatchNorm._folded_linear`), its channel
    axes, and the parameters it was computed with (see `_folded_kernel`)."""

    gamma: Any
    beta: Any
    mean: Any
    bias: Any
    scale: Any
    safe_scale: Any
    max_abs: Any
    z: Any
    axes: list[int]

    def per_channel(self, t: Any) -> Any:
        """`t`, a per-channel vector, shaped to broadcast against z."""
        return backend.get().per_channel(t, self.z, self.axes)

    def normalized(self) -> Any:
        """z/s', what the batch norm normalizes in training, as a product with the per-channel
        reciprocal: a full-tensor division, forward and in its gradient, costs several times a
        multiplication on CPU."""
        return self.z * self.per_channel(1.0 / self.safe_scale)


def _run_time_single_value(z: Any, axes: list[int]) -> Any:
    """None where z's shape fixes m ≥ 2 values per channel (or m ≤ 1, which the moving
    statistics' update refuses), else whether this batch gives m ≤ 1 at run time: a bool
    tensor on TensorFlow (an unknown batch size), True under JAX for a traced batch of one
    (as TensorFlow's `fit` would see it)."""
    count = backend.get().element_count(z, axes)
    if not isinstance(count, int):
        return count <= 1.0
    return True if count < 2 and backend.get().batch_size_traced(z, axes) else None


def validate_activation(activation: str | None) -> str | None:
    """None ("linear" is taken as None), "relu" or "relu6".

    Raises:
        ValueError: anything else; the message names it.
    """
    if activation in (None, "linear"):
        return None
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be None, 'relu' or 'relu6'; received activation={activation!r}."
        )
    return activation


def _keras_bn_copy(
    batch_norm: keras.layers.Layer | dict[str, Any] | None, axis: int
) -> keras.layers.Layer:
    """A fresh, unbuilt keras_bn.BatchNormalization with `batch_norm`'s config (None: defaults
    on `axis`); Keras's BN config is translated (its biased moving variance is then read as the
    unbiased one, as keras_bn.convert does)."""
    if batch_norm is None:
        return KERAS_BN_BN(axis=axis, name="batch_norm")
    if isinstance(batch_norm, dict):
        return _keras_bn_copy(keras.layers.deserialize(hosts.config_only(batch_norm)), axis)
    if type(batch_norm) not in (KERAS_BN, KERAS_BN_BN):
        raise ValueError(
            f"batch_norm must be a keras_bn.BatchNormalization or a "
            f"keras.layers.BatchNormalization (exactly); received {type(batch_norm).__name__} "
            f"'{getattr(batch_norm, 'name', batch_norm)}'."
        )
    config = batch_norm.get_config()
    if type(batch_norm) is KERAS_BN:
        config = models.translate_config(config, KERAS_BN, KERAS_BN_BN)
    copy = KERAS_BN_BN.from_config(config)
    refusal = batch_norm_refusal(copy)
    if refusal:
        raise ValueError(refusal)
    return copy


def batch_norm_refusal(batch_norm: keras.layers.Layer) -> str | None:
    """Why the folded QAT layer cannot train `batch_norm` (either BN class), or None.

    Args:
        batch_norm: a keras_bn or keras.layers BatchNormalization.

    Returns:
        None, or the reason in words, naming the layer and the argument: renorm, a
        virtual_batch_size or synchronized=True (the layer normalizes each batch as a whole, on
        one replica), or momentum=None (it keeps exponential moving averages).
    """
    for name in ("renorm", "virtual_batch_size", "synchronized"):
        value = getattr(batch_norm, name, None)
        if value:
            return (
                f"Batch norm '{batch_norm.name}' has {name}={value!r}, which the folded QAT "
                f"layer cannot train (it normalizes each batch as a whole, on one replica)."
            )
    if batch_norm.momentum is None:
        return (
            f"Batch norm '{batch_norm.name}' has momentum=None (a cumulative average); the "
            f"folded QAT layer keeps exponential moving averages: give a momentum in [0, 1)."
        )
    return None

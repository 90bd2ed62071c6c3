"""ActivationQuantizer: per-tensor asymmetric fake quantization over an EMA range."""

from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from keras_bn import backend
from keras_bn._shapes import ShapePreserving
from keras_bn.quantize import fake_quant


@keras.saving.register_keras_serializable(package="keras_bn.quantize")
class ActivationQuantizer(ShapePreserving, keras.layers.Layer):
    """Fake-quantizes a tensor to `bits` bits over a range learned from the training batches.

    The range [range_min, range_max] is an exponential moving average of each training
    batch's min and max (as in Jacob et al. 2018, section 3.1), initialised from the first
    batch, and always holds 0 (range_min ≤ 0 ≤ range_max) so that zero padding is exact::

        range_min ← momentum·range_min + (1 − momentum)·min(x)     (then min(·, 0))
        range_max ← momentum·range_max + (1 − momentum)·max(x)     (then max(·, 0))

    In training the updated range quantizes the batch; at inference (`training=False`, or the
    layer not trainable) the stored one does. A batch whose min or max is not finite leaves the
    range unchanged. Once `ranges_frozen` is set (`keras_bn.quantize.freeze_ranges`, or the
    `FreezeBatchNorm` callback) the range no longer moves. Until a training batch has been
    seen (`range_initialized` false) the layer passes its input through unchanged: there is no
    range to quantize to yet.

    The state is four non-trainable weights, saved with the model: `range_min`, `range_max`
    (float32 scalars), `range_initialized` and `ranges_frozen` (bool scalars).

    Use it on a model's input and on the outputs of Add, Concatenate and global pooling
    layers; the QAT layers hold their own for their outputs. Called again on an average pool's
    output with `average_of` (and training=False), it rounds that onto its own grid, as an
    int8 average pool does (or a bilinear upsampling's, with `halves="up"`).

    Args:
        bits: 2..8, the grid's size 2^bits.
        momentum: weight of the old value in the range averages, in [0, 1).
        **kwargs: base layer arguments (`name`, `trainable`, ...).

    Raises:
        ValueError: `bits` or `momentum` out of range (the message names the value).
    """

    # The state's variables, created by build.
    range_min: Any
    range_max: Any
    range_initialized: Any
    ranges_frozen: Any

    def __init__(self, bits: int = 8, momentum: float = 0.99, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bits: int = fake_quant.validate_bits(bits, "bits")
        self.momentum = validate_momentum(momentum, "momentum")
        self.range_min = self.range_max = None
        self.range_initialized = self.ranges_frozen = None

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        """Create the range and its two flags (the range does not depend on the shape).

        Args:
            input_shape: the input's shape.
        """
        for name in ("range_min", "range_max"):
            setattr(self, name, scalar_state(self, name, "float32"))
        for name in ("range_initialized", "ranges_frozen"):
            setattr(self, name, scalar_state(self, name, "bool"))

    def call(
        self,
        inputs: Any,
        training: bool | None = None,
        average_of: int | None = None,
        halves: str = "away",
    ) -> Any:
        """Fake-quantize `inputs`, first moving the range in training.

        Args:
            inputs: float tensor.
            training: Python bool or None; true (and the layer trainable) updates the range
                from this batch unless it is frozen.
            average_of: None, or the window size of the average pool whose output `inputs`
                is, the pool's input being on this layer's grid: the range then stays as it
                is, and halves round as TFLite's int8 AVERAGE_POOL_2D rounds them
                (`fake_quant.round_halves`).
            halves: with `average_of`, how the int8 kernel rounds halves: "away" from the int8
                zero (an average pool's) or "up" (a bilinear upsampling's, whose weighted
                averages have weights in multiples of 1/`average_of`).

        Returns:
            The fake-quantized tensor (the input itself while no range has been observed).
        """
        low, high, initialized = self.batch_range(inputs, training and average_of is None)
        return self.round_onto(inputs, low, high, initialized, average_of, halves)

    def batch_range(self, inputs: Any, training: bool | None = None) -> tuple[Any, Any, Any]:
        """The range `call` rounds `inputs` onto: in training (and the layer trainable) the
        stored range moved toward this batch's, and stored (unless frozen or not finite),
        else the stored one.

        Args:
            inputs: float tensor.
            training: as in `call`.

        Returns:
            (low, high, initialized): float32 scalars and a bool scalar, false while no
            range has been observed.
        """
        x = ops.cast(inputs, "float32")
        low, high = backend.get().read(self.range_min), backend.get().read(self.range_max)
        initialized = backend.get().read(self.range_initialized)
        if training and self.trainable:
            low, high, initialized = self._observe(x, low, high, initialized)
        return low, high, initialized

    def round_onto(
        self,
        inputs: Any,
        low: Any,
        high: Any,
        initialized: Any,
        average_of: int | None = None,
        halves: str = "away",
    ) -> Any:
        """`inputs` fake-quantized on the layer's `bits`-bit grid of [low, high] (a
        `batch_range`), or passed through where `initialized` is false.

        Args:
            inputs: float tensor.
            low: float32 scalar ≤ 0.
            high: float32 scalar ≥ 0.
            initialized: bool scalar.
            average_of: as in `call`.
            halves: as in `call`.

        Returns:
            The tensor in the layer's compute dtype.
        """
        x = ops.cast(inputs, "float32")
        moved = x
        if average_of is not None:
            moved = fake_quant.round_halves(x, low, high, self.bits, average_of, halves)
        quantized = backend.get().cond(
            initialized,
            lambda: fake_quant.fake_quant_activations(moved, low, high, self.bits),
            lambda: x,
        )
        return ops.cast(quantized, self.compute_dtype)

    def _observe(self, x: Any, low: Any, high: Any, initialized: Any) -> tuple[Any, Any, Any]:
        """Move the stored range toward this batch's (unless frozen or not finite), store it,
        and return the range and flag to quantize with (the backend's `moved_range`)."""
        frozen = backend.get().read(self.ranges_frozen)
        low, high, initialized = backend.get().moved_range(
            x, low, high, initialized, frozen, self.momentum
        )
        self.range_min.assign(low)
        self.range_max.assign(high)
        self.range_initialized.assign(initialized)
        return low, high, initialized

    def step(self) -> tuple[Any, Any]:
        """The stored range's step, as a tensor that follows the range in training.

        Read after the layer's call in the same step, it is the step this call rounded to
        (the call stores the range it moved to).

        Returns:
            (step, initialized): float32 and bool scalars; the step means nothing while
            `initialized` is false (no range yet: the layer passes its input through).
        """
        low, high = backend.get().read(self.range_min), backend.get().read(self.range_max)
        return (
            fake_quant.activation_step(low, high, self.bits),
            backend.get().read(self.range_initialized),
        )

    def grid_quantizer(self) -> "ActivationQuantizer":
        """The quantizer whose grid the layer's output lies on: itself.

        Returns:
            self.
        """
        return self

    def grid(self) -> fake_quant.ActivationGrid:
        """The grid the layer's inference rounds to: its stored range, as the op nudges it.

        Returns:
            fake_quant.ActivationGrid.

        Raises:
            ValueError: the layer is not built, or has not seen a training batch (it has no
                range; its inference passes its input through).
        """
        if not self.built:
            raise ValueError(f"Activation quantizer '{self.name}' is not built: it has no range.")
        if not bool(self.range_initialized.numpy()):
            raise ValueError(
                f"Activation quantizer '{self.name}' has not seen a training batch, so it has "
                f"no range: its inference passes its input through unquantized, and no integer "
                f"file can compute that. Train the model (a few QAT steps set every range) "
                f"before exporting it."
            )
        return fake_quant.activation_grid(
            float(self.range_min.numpy()), float(self.range_max.numpy()), self.bits
        )

    def export_function(self, halves_as_ops: bool = False) -> Callable[..., Any]:
        """The layer's inference as an exporter traces it, from the range it holds now.

        The range is read once, here, and becomes constants of the function:
        `export_activations` (TensorFlow backend) on `grid()`, with 8-bit FakeQuant ops only, which
        computes what `call(x, training=False)` computes. The function takes `average_of`
        as `call` does.

        Args:
            halves_as_ops: with `average_of`, write the move that rounds halves as TFLite's
                int8 AVERAGE_POOL_2D (`fake_quant.halves_away_from_int8_zero`) as ops, for a
                runtime that rounds a pool's output in float (onnxruntime, whose halves fall
                either way); False leaves it to that int8 pool, which rounds them so itself.

        Returns:
            A function of a float tensor (and `average_of`).

        Raises:
            ValueError: as `grid`.
        """
        grid = self.grid()

        from keras_bn.backend.tensorflow.fake_quant import export_activations  # writers: TF

        def quantize(inputs: Any, average_of: int | None = None, halves: str = "away") -> Any:
            x = ops.cast(inputs, "float32")
            if average_of is not None and halves_as_ops:
                x = fake_quant.round_halves(
                    x, grid.minimum, grid.maximum, grid.bits, average_of, halves
                )
            return export_activations(x, grid)

        return quantize

    def get_config(self) -> dict[str, Any]:
        """Every constructor argument, for `from_config` and saving.

        Returns:
            A dict with the base layer's config, `bits` and `momentum`.
        """
        return {**super().get_config(), "bits": self.bits, "momentum": self.momentum}


def scalar_state(layer: keras.layers.Layer, name: str, dtype: str) -> keras.Variable:
    """A new scalar weight of `layer` for its state: zero, not trainable, never autocast.

    Args:
        layer: the layer, in its `build`.
        name: the weight's name.
        dtype: "float32" or "bool".

    Returns:
        The variable.
    """
    return layer.add_weight(
        shape=(), name=name, dtype=dtype, initializer="zeros", trainable=False, autocast=False
    )


def validate_momentum(momentum: object, name: str) -> float:
    """A float in [0, 1).

    Raises:
        ValueError: not a real number in [0, 1) (bools included); the message names it.
    """
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise ValueError(f"{name} must be a float in [0, 1); received {name}={momentum!r}.")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"{name} must be in [0, 1); received {name}={momentum!r}.")
    return float(momentum)

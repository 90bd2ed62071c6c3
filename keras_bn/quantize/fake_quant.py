"""Fake quantization: the k-bit grids quantization-aware training rounds to, as pure functions.

Two grids (Jacob et al., "Quantization and Training of Neural Networks for Efficient
Integer-Arithmetic-Only Inference", 2018; Krishnamoorthi, "Quantizing deep convolutional
networks for efficient inference: A whitepaper", 2018):

- weights: symmetric, narrow range. With m = max abs(w) (per output channel or per tensor; 1
  for an all-zero one) and q_max = 2^(k−1) − 1, w ↦ q·m/q_max for the integer
  q = round(w·q_max/m), abs(q) ≤ q_max;
- activations: asymmetric, per tensor, over a range [min, max] that holds 0.

The TensorFlow side uses `tf.quantization.fake_quant_with_min_max_vars` and its per-channel
sibling, the ops the TFLite converter turns into quantized tensors (the per-channel op
quantizes along the LAST axis). They "nudge" [min, max] so that 0 lies exactly on the grid:
scale = (max − min)/(q_hi − q_lo), zero point z = round(q_lo − min/scale) clamped to
[q_lo, q_hi], and x ↦ (⌊(clamp(x) − min')/scale + ½⌋)·scale + min' with min' = (q_lo − z)·scale
(q_lo = 1 with a narrow range, else 0; q_hi = 2^k − 1). For the symmetric weight range
[−m, m] the nudge changes nothing: z = 2^(k−1), scale = m/q_max.

`nudged_grid` and `weight_grid` are the same arithmetic in float32 numpy: the scales a file
holds, and the integers of every value off a rounding boundary. On a boundary TensorFlow's
kernels need not agree with them (its per-channel CPU kernel rounds some halves the other way;
XLA multiplies by 1/scale instead of dividing), and QAT leaves weights there: a weight
oscillates across a boundary as it trains. So the exporters read a kernel's integers from the
QAT layer's own ops (`QuantizedHost.weight_grids`), not from `weight_grid`. `WeightGrid` and
`ActivationGrid` hold one tensor's grid for the exporters.

An integer file adds a layer's bias as int32 on the grid of its input's step times its
weights' (`round_bias`, which the QAT layers apply to their float bias).

The weight range m is max|w| ("max", the observers' choice: nothing is clipped, and at 8 bits
nothing is lost) or learned ("learned": Esser et al., "Learned Step Size Quantization", ICLR
2020). Below 4 bits max|w| wastes the few levels on the largest weight: at 2 bits the grid is
{−m, 0, m}, and every weight under m/2 rounds to 0. A learned range starts where the squared
rounding error is least (`mse_weight_range`) and trains with the weights
(`fake_quant_weights_learned`: LSQ's gradient, with its scale 1/√(N·q_max)).

Converters take 8-bit FakeQuant ops only (the TFLite converter refuses a k-bit activation
tensor and re-rounds 3- and 5..7-bit weights onto its own storage grid; tf2onnx converts only
8-bit ones). A k-bit grid is the int8 grid with the same step, restricted to 2^k of its
levels, so the exporters (`export_activations` of keras_bn/backend/tensorflow/fake_quant.py)
and `WeightGrid.values` state the k-bit grids that way.
"""

import typing

import numpy as np
from keras import ops

from keras_bn import backend
from keras_bn.backend.constants import MIN_RANGE, ZERO_WEIGHT_RANGE

MIN_BITS = 2
MAX_BITS = 8
#: How a weight range is set: max|w| each step, or learned (see the module docstring).
WEIGHT_RANGES = ("max", "learned")
#: The most bits at which `weight_range=None` means "learned" (measured in
#: benchmarks/bench_qat.py: below 4 bits max|w| loses points that learned ranges keep).
LEARNED_UP_TO_BITS = 3


@typing.overload
def validate_bits(bits: object, name: str, allow_none: typing.Literal[False] = False) -> int: ...


@typing.overload
def validate_bits(bits: object, name: str, allow_none: bool) -> int | None: ...


def validate_bits(bits: object, name: str, allow_none: bool = False) -> int | None:
    """`bits` as an int in [MIN_BITS, MAX_BITS] (or None where `allow_none`).

    Args:
        bits: the value to check.
        name: the argument's name, for the message.
        allow_none: whether None (no fake quantization) is accepted.

    Returns:
        `bits` (an int, or None).

    Raises:
        ValueError: `bits` is not an int in range (bools and floats included).
    """
    if bits is None and allow_none:
        return None
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise ValueError(
            f"{name} must be an int from {MIN_BITS} to {MAX_BITS}"
            f"{' or None' if allow_none else ''}; received {name}={bits!r}."
        )
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"{name} must be from {MIN_BITS} to {MAX_BITS}; received {name}={bits!r}.")
    return int(bits)


def validate_weight_range(weight_range: object, weight_bits: int | None) -> str:
    """The weight range mode: "max" or "learned"; None picks "learned" at `LEARNED_UP_TO_BITS`
    bits or fewer, else "max" (float weights: "max", which nothing reads).

    Args:
        weight_range: None, "max" or "learned".
        weight_bits: the weights' bits (None for float weights).

    Returns:
        "max" or "learned".

    Raises:
        ValueError: anything else; the message names it.
    """
    if weight_range is None:
        learned = weight_bits is not None and weight_bits <= LEARNED_UP_TO_BITS
        return "learned" if learned else "max"
    if weight_range not in WEIGHT_RANGES:
        raise ValueError(
            f"weight_range must be None, 'max' or 'learned'; received "
            f"weight_range={weight_range!r}."
        )
    return weight_range


def q_max(bits: int) -> int:
    """The largest |q| of the symmetric narrow-range k-bit weight grid.

    Args:
        bits: 2..8.

    Returns:
        2^(bits−1) − 1.
    """
    return 2 ** (bits - 1) - 1


def weight_max_abs(kernel: typing.Any, per_channel: bool) -> typing.Any:
    """m for the symmetric weight grid: max|w| per output channel (the last axis) or per tensor.

    The range carries no gradient: the fake quantization's gradient is straight-through for the
    weights only (the scale is a constant of each step, as with an observer's range).

    Args:
        kernel: float tensor whose last axis is the output channel.
        per_channel: one range per output channel (a vector) rather than one (a scalar).

    Returns:
        A float32 vector of the last axis's size, or a scalar, at least MIN_RANGE;
        ZERO_WEIGHT_RANGE where every weight is 0.
    """
    return backend.get().weight_max_abs(kernel, per_channel)


def fake_quant_weights(kernel: typing.Any, max_abs: typing.Any, bits: int) -> typing.Any:
    """FQ_w: round `kernel` to the symmetric narrow-range `bits`-bit grid of ±`max_abs`.

    Args:
        kernel: float32 tensor whose last axis is the output channel.
        max_abs: `weight_max_abs(kernel, per_channel)`: a vector (per channel) or a scalar.
        bits: 2..8.

    Returns:
        The fake-quantized kernel, same shape. Its gradient is straight-through: 1 for every
        weight, all of which lie in [−max_abs, max_abs] (the range is the largest magnitude),
        as torch.ao's weight fake quantization gives. TensorFlow's op alone would give 0 to
        the weight that sets the range wherever float32 rounds its nudged maximum just below
        it (7% of channels at 3 bits).
    """
    return backend.get().fake_quant_weights(kernel, max_abs, bits)


def fake_quant_weights_learned(kernel: typing.Any, max_abs: typing.Any, bits: int) -> typing.Any:
    """FQ_w on a learned range: `fake_quant_weights`' values, with LSQ's gradients.

    With the step s = m/q_max and q = clamp(round(w/s), −q_max, q_max), Esser et al. (2020)
    train s with

        ∂FQ/∂w = 1 where |w| < m, 0 where the weight is clipped (|w| ≥ m);
        ∂FQ/∂s = q − w/s where |w| < m, ±q_max where clipped;

    and s's gradient scaled by g = 1/√(N·q_max), N the weights per range. The parameter here is
    m = q_max·s, so ∂FQ/∂m = ∂FQ/∂s / q_max, and its gradient is scaled by q_max²·g: an SGD
    step then moves m = q_max·s exactly as LSQ's moves s (Adam is invariant to the scale). A
    weight at |w| = m (where `mse_weight_range` may put m) takes the clipped branch, whatever
    the backend. The values are those of `fake_quant_weights(kernel, m, bits)` bit for bit:
    the gradient terms are added as t − stop_gradient(t), which is exactly 0.

    Args:
        kernel: float32 tensor whose last axis is the output channel.
        max_abs: the range m > 0, a float32 vector (per channel) or scalar, with its gradient.
        bits: 2..8.

    Returns:
        The fake-quantized kernel, same shape.
    """
    top = q_max(bits)
    size = int(np.prod(kernel.shape))
    per_range = size // int(max_abs.shape[0]) if len(max_abs.shape) else size
    fixed = ops.stop_gradient(max_abs)
    scaled = fixed + (max_abs - fixed) * float(top * top / np.sqrt(per_range * top))
    inside = ops.abs(kernel) < fixed
    # A select, not min/max: its gradient takes one branch, where min/max split it at a tie.
    clipped = ops.where(inside, kernel, ops.sign(kernel) * scaled)  # ∂/∂m = sign(w) outside
    rounded = fake_quant_weights(clipped, fixed, bits)
    error = ops.stop_gradient(ops.where(inside, (rounded - kernel) / fixed, 0.0))  # (q − w/s)/q_max
    return rounded + (scaled * error - ops.stop_gradient(scaled * error))


def mse_weight_range(kernel: np.ndarray, bits: int, per_channel: bool) -> np.ndarray:
    """The symmetric range m whose `bits`-bit grid rounds `kernel` with the least squared error
    (per output channel, or for the whole tensor): where a learned range starts.

    A search over m = f·max|w|, f = 0.01, 0.02, ..., 1, then around the best f in steps of
    0.0005 (the error is not convex in m: each m at which a weight crosses a rounding boundary
    is a kink), in numpy float64.

    Args:
        kernel: array whose last axis is the output channel.
        bits: 2..8.
        per_channel: one range per output channel rather than one.

    Returns:
        float32: a vector of the last axis's size, or a 0-d array; ZERO_WEIGHT_RANGE where
        every weight is 0.
    """
    kernel = np.asarray(kernel, np.float64)
    flat = kernel.reshape(-1, kernel.shape[-1]) if per_channel else kernel.reshape(-1, 1)
    largest = np.abs(flat).max(axis=0)
    top = q_max(bits)

    def least(fractions: np.ndarray) -> np.ndarray:
        """The fraction of each channel's max|w| (a row of `fractions`) with the least error."""
        errors = []
        for fraction in fractions.T:
            step = np.maximum(largest * fraction, MIN_RANGE) / top
            rounded = np.clip(np.round(flat / step), -top, top) * step
            errors.append(((rounded - flat) ** 2).sum(axis=0))
        best: np.ndarray = fractions[np.arange(len(largest)), np.argmin(errors, axis=0)]
        return best

    coarse = least(np.tile(np.linspace(0.01, 1.0, 100), (len(largest), 1)))
    fine = least(np.clip(coarse[:, None] + np.linspace(-0.01, 0.01, 41), 0.001, 1.0))
    best = np.where(largest > 0, np.maximum(largest * fine, MIN_RANGE), ZERO_WEIGHT_RANGE)
    return (best if per_channel else best.reshape(())).astype(np.float32)


def fake_quant_activations(
    x: typing.Any, minimum: typing.Any, maximum: typing.Any, bits: int
) -> typing.Any:
    """Round `x` to the asymmetric `bits`-bit grid of [minimum, maximum] (nudged to hold 0).

    Args:
        x: float32 tensor.
        minimum: float32 scalar ≤ 0, the range's low end.
        maximum: float32 scalar ≥ 0, the range's high end (widened here to at least
            MIN_RANGE above `minimum`).
        bits: 2..8.

    Returns:
        The fake-quantized tensor; the gradient passes where x is inside the nudged range and
        is 0 outside it (clipped values).
    """
    return backend.get().fake_quant_activations(x, minimum, maximum, bits)


def weight_step(max_abs: typing.Any, bits: int) -> typing.Any:
    """The step of the symmetric narrow-range `bits`-bit grid of ±`max_abs`, as the FakeQuant
    op computes it: (max − min)/(q_hi − q_lo) (`nudged_grid`'s scale, in TensorFlow).

    Args:
        max_abs: `weight_max_abs(...)`: a vector (per channel) or a scalar.
        bits: 2..8.

    Returns:
        float32 tensor of max_abs's shape.
    """
    return backend.get().weight_step(max_abs, bits)


def activation_step(
    minimum: typing.Any | float, maximum: typing.Any | float, bits: int
) -> typing.Any:
    """The step of the asymmetric `bits`-bit grid `fake_quant_activations` rounds to on
    [minimum, maximum], in TensorFlow.

    Args:
        minimum: the range's low end (≤ 0).
        maximum: its high end (≥ 0), widened here to at least MIN_RANGE above `minimum`.
        bits: 2..8.

    Returns:
        float32 scalar tensor.
    """
    return backend.get().activation_step(minimum, maximum, bits)


def round_bias(bias: typing.Any, step: typing.Any) -> typing.Any:
    """`bias` rounded to the nearest multiple of `step`, with a straight-through gradient.

    An integer file adds a layer's bias as int32 in units of its input's step times its
    weights' (s_in·s_w, per output channel): the converters round bias/(s_in·s_w). Below 8 bits
    s_w is coarse, and a float bias lies up to half of that step away from the file's, a
    sizeable fraction of an output step. Rounded here, the bias is the file's, and a converter
    rounding it again finds an integer.

    Args:
        bias: float32 tensor (the bias per output channel).
        step: float32 tensor broadcastable to it, > 0 (s_in·s_w).

    Returns:
        round(bias/step)·step (halves to even); the gradient passes to `bias` unchanged and
        none to `step`. bias + (rounded − bias) is exactly `rounded` in float32: the two lie
        within a factor of 2 of each other, or `rounded` is 0, so the difference is exact.
    """
    return backend.get().round_bias(bias, step)


def nudged_grid(
    minimum: np.ndarray, maximum: np.ndarray, bits: int, narrow_range: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The grid TensorFlow's FakeQuant ops use for [minimum, maximum], in float32 numpy.

    Args:
        minimum: array (or scalar) ≤ 0, the ranges' low ends.
        maximum: array of minimum's shape, > minimum and ≥ 0, the high ends.
        bits: 2..8.
        narrow_range: whether the lowest integer is left out (the weights' symmetric grid).

    Returns:
        (scale, zero_point, nudged_min, nudged_max): float32 arrays of the ranges' shape; a
        value x maps to the integer q_lo + ⌊(clamp(x) − nudged_min)/scale + ½⌋ of
        [q_lo, 2^bits − 1] (q_lo = 1 with a narrow range, else 0), and that integer minus
        `zero_point` is the signed one.
    """
    minimum = np.asarray(minimum, np.float32)
    maximum = np.asarray(maximum, np.float32)
    q_lo = np.float32(1 if narrow_range else 0)
    q_hi = np.float32(2**bits - 1)
    scale = (maximum - minimum) / (q_hi - q_lo)
    zero_point_from_min = q_lo - minimum / scale
    # std::round (halves away from zero) of a value that is ≥ q_lo ≥ 0 here.
    zero_point = np.clip(np.floor(zero_point_from_min + np.float32(0.5)), q_lo, q_hi)
    zero_point = np.where(zero_point_from_min < q_lo, q_lo, zero_point)
    zero_point = np.where(zero_point_from_min > q_hi, q_hi, zero_point).astype(np.float32)
    nudged_min = (q_lo - zero_point) * scale
    nudged_max = (q_hi - zero_point) * scale
    return scale, zero_point, nudged_min, nudged_max


def quantize(
    x: np.ndarray, minimum: np.ndarray, maximum: np.ndarray, bits: int, narrow_range: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The signed integers TensorFlow's FakeQuant ops round `x` to (as float32 numpy), for
    every value off a rounding boundary: on one, TensorFlow's per-channel kernel, which
    multiplies by the inverse range where this divides by the scale, may round the other way
    (the module docstring; keras_bn/backend/jax/fake_quant.py has the kernels' exact order).

    Args:
        x: array whose last axis lines up with the ranges when they are vectors.
        minimum: the ranges' low ends, a scalar or a vector of x's last axis (per channel).
        maximum: the high ends, of minimum's shape.
        bits: 2..8.
        narrow_range: as in `nudged_grid`.

    Returns:
        (q, scale, zero_point): q the signed integers as float32 (the grid's integer minus
        the zero point), and the grid's scale and zero point; x's fake-quantized value is
        q·scale, up to float32 rounding.
    """
    x = np.asarray(x, np.float32)
    scale, zero_point, nudged_min, nudged_max = nudged_grid(minimum, maximum, bits, narrow_range)
    clamped = np.minimum(np.maximum(x, nudged_min), nudged_max)
    steps = np.floor((clamped - nudged_min) / scale + np.float32(0.5))
    q_lo = np.float32(1 if narrow_range else 0)
    return steps + q_lo - zero_point, scale, zero_point


class WeightGrid(typing.NamedTuple):
    """One kernel's fake-quantized weights as integers and scales: what an int8 file holds.

    Attributes:
        q: int8 array, the kernel viewed with its output channels on the last axis (the layout
            `fake_quant_weights` quantizes), |q| ≤ 2^(bits−1) − 1.
        scale: float32, one per output channel (a vector of q's last axis) or a 0-d array.
        bits: the grid's bits, 2..8.
    """

    q: np.ndarray
    scale: np.ndarray
    bits: int

    @property
    def per_channel(self) -> bool:
        """Whether each output channel has its own scale."""
        return np.ndim(self.scale) == 1

    @property
    def values(self) -> np.ndarray:
        """q·scale as float32: the fake-quantized kernel (to float32 rounding)."""
        return (self.q.astype(np.float32) * self.scale).astype(np.float32)


class ActivationGrid(typing.NamedTuple):
    """An activation range's grid as `fake_quant_activations` rounds to it (float32 values).

    Attributes:
        bits: 2..8.
        minimum: the range's low end as the op receives it.
        maximum: the high end, widened to at least `MIN_RANGE` above `minimum` as the op
            receives it.
        scale: the step, (maximum − minimum)/(2^bits − 1).
        zero_point: the unsigned integer that stands for 0, in [0, 2^bits − 1].
        nudged_min: the grid's lowest value, −zero_point·scale.
        nudged_max: its highest, (2^bits − 1 − zero_point)·scale.
    """

    bits: int
    minimum: float
    maximum: float
    scale: float
    zero_point: int
    nudged_min: float
    nudged_max: float


def activation_grid(minimum: float, maximum: float, bits: int) -> ActivationGrid:
    """The grid `fake_quant_activations(x, minimum, maximum, bits)` rounds to.

    Args:
        minimum: the range's low end (≤ 0), as the layer stores it.
        maximum: the high end (≥ 0).
        bits: 2..8.

    Returns:
        ActivationGrid, computed in float32 as the op computes it.
    """
    low = np.float32(minimum)
    high = np.maximum(np.float32(maximum), low + np.float32(MIN_RANGE))
    scale, zero_point, nudged_min, nudged_max = nudged_grid(low, high, bits, False)
    return ActivationGrid(
        bits,
        float(low),
        float(high),
        float(scale),
        int(zero_point),
        float(nudged_min),
        float(nudged_max),
    )


#: How an int8 kernel rounds the halves of an average onto its input's grid: "away" from
#: the int8 zero (AVERAGE_POOL_2D), or "up" (RESIZE_BILINEAR, whose kernel adds ½ and shifts).
HALVES = ("away", "up")


def round_halves(
    average: typing.Any,
    minimum: typing.Any | float,
    maximum: typing.Any | float,
    bits: int,
    window: int,
    halves: str,
) -> typing.Any:
    """An average of on-grid values moved so that `fake_quant_activations` on [minimum,
    maximum] rounds its halves as the int8 kernel that computed it does (`HALVES`), and every
    other value as before: `halves_away_from_int8_zero`, or a move up by a quarter of the
    least distance from a half (a half of the grid then rounds up whatever float error it
    carries, as the kernel's (n + ½·2^20) >> 20 does).

    Args:
        average: float32 tensor, each value a sum of on-grid values with weights in multiples
            of 1/`window`.
        minimum: the range's low end (≤ 0), as `fake_quant_activations` receives it.
        maximum: its high end (≥ 0).
        bits: 2..8.
        window: that count.
        halves: "away" or "up".

    Returns:
        The moved tensor.
    """
    if halves == "up":
        return average + activation_step(minimum, maximum, bits) / (4.0 * window)
    return halves_away_from_int8_zero(average, minimum, maximum, bits, window)


def halves_away_from_int8_zero(
    average: typing.Any,
    minimum: typing.Any | float,
    maximum: typing.Any | float,
    bits: int,
    window: int,
) -> typing.Any:
    """An average of on-grid values moved so that `fake_quant_activations` on [minimum,
    maximum] rounds its halves as TFLite's int8 AVERAGE_POOL_2D does, away from the int8 zero,
    and every other value as before.

    The int8 kernel sums the input's integers q (a k-bit grid is the int8 grid's lowest 2^k
    levels: q = index − 128) and rounds sum/count half away from 0, where FakeQuant rounds a
    half up (or either way, by float error). An average that is not a half lies at least
    1/(2·count) of a step from one, so a move of a quarter of that toward the side TFLite
    takes changes halves only; float error is far smaller.

    Args:
        average: float32 tensor, each value the average of at most `window` values on the grid.
        minimum: the range's low end (≤ 0), as `fake_quant_activations` receives it.
        maximum: its high end (≥ 0).
        bits: 2..8.
        window: the most values one average takes (an average pool's window size).

    Returns:
        The moved tensor.
    """
    return backend.get().halves_away_from_int8_zero(average, minimum, maximum, bits, window)


def weight_grid(kernel: np.ndarray, bits: int, per_channel: bool) -> tuple[np.ndarray, np.ndarray]:
    """The int8 weights and scales of `fake_quant_weights` for a float32 kernel, in numpy.

    Args:
        kernel: array whose last axis is the output channel (the layout `fake_quant_weights`
            quantizes).
        bits: 2..8.
        per_channel: one scale per output channel rather than one.

    Returns:
        (q, scale): q int8 of the kernel's shape with |q| ≤ 2^(bits−1) − 1, and the float32
        scale (a vector of the last axis's size, or a scalar), so that q·scale is the
        fake-quantized kernel.
    """
    kernel = np.asarray(kernel, np.float32)
    magnitude = np.abs(kernel)
    if per_channel:
        largest = magnitude.reshape(-1, kernel.shape[-1]).max(axis=0)
    else:
        largest = magnitude.max()
    largest = np.where(
        largest > 0, np.maximum(largest, np.float32(MIN_RANGE)), np.float32(ZERO_WEIGHT_RANGE)
    )
    q, scale, _ = quantize(kernel, -largest, largest, bits, narrow_range=True)
    return q.astype(np.int8), scale

"""Algorithm 2's population statistics for one BN layer: pool its batch moments in float64
(`PooledMoments`), set them as its moving statistics (`assign`, which reports a `LayerChange`),
and settle a QAT layer's to a fixed point of its rounded kernel (`settle`). Both methods of
`recalibrate` (the one pass and the per-layer method) and `check_batchnorm` use them."""

import contextlib
import contextvars
import dataclasses
import typing
import warnings
from collections.abc import Callable

import keras
import numpy as np
import numpy.typing as npt

from keras_bn import backend
from keras_bn._errors import KerasBNWarning
from keras_bn._graph import bn_layers


@dataclasses.dataclass(frozen=True)
class LayerChange:
    """One layer's statistics before and after recalibration (float64 arrays, per channel).

    Attributes:
        name: the BN layer's name.
        convention: "unbiased" for `keras_bn.BatchNormalization` (m/(m−1)·E_B[σ²_B]), "biased"
            for `keras.layers.BatchNormalization` (E_B[σ²_B]).
        old_mean: `moving_mean` before.
        new_mean: `moving_mean` after.
        old_variance: `moving_variance` before.
        new_variance: `moving_variance` after.
        batches_used: the batches whose statistics entered (at least one channel; every
            channel for keras_bn's `momentum=None`); fewer than the report's `batches` where
            some left this layer m ≤ 1 values in every channel (skipped, as training skips
            them).
        unchanged_channels: flat indices of the channels that no batch gave 2 values (a time
            step that is padding in every sequence, under a mask): they keep their statistics.
        passes: the passes over the data this layer took: 1 for a BN; for a layer that folds
            its BN into rounded weights (QAT), one per fixed-point iteration (`settle`): 1 or
            2 with per-channel weight ranges, up to 10 with a per-tensor range.
        unsettled_weights: for such a layer, how many of its kernel's weights round, with
            the statistics kept, to other integers than those they were measured with; 0 for
            a BN.
        settling_error: for such a layer, how far the statistics kept are from those of the
            weights they give: the largest change of the mean or of σ, in units of σ, that
            measuring with those weights gives (0 where no weight moved; inf where a single
            pass could not tell). With per-channel ranges and 2 passes, the distance between
            the two, which only weights at float32 rounding ties move (see `settle`).
    """

    name: str
    convention: str  # "unbiased" (keras_bn) or "biased" (keras.layers.BatchNormalization)
    old_mean: np.ndarray
    new_mean: np.ndarray
    old_variance: np.ndarray
    new_variance: np.ndarray
    batches_used: int | None = None
    unchanged_channels: tuple[int, ...] = ()
    passes: int = 1
    unsettled_weights: int = 0
    settling_error: float = 0.0

    @property
    def mean_change(self) -> np.ndarray:
        """new − old moving mean, per channel (float64 array)."""
        return self.new_mean - self.old_mean

    @property
    def variance_change(self) -> np.ndarray:
        """new − old moving variance, per channel (float64 array)."""
        return self.new_variance - self.old_variance


class PooledMoments:
    """Algorithm 2's pooling of one layer's batch moments, per channel, as running float64
    sums over batches: Σm, Σm·μ, Σm·σ² and the batches each channel used.

    A batch leaves out each channel where its count m_c ≤ 1 (no variance), as the layer's
    moving update does. With `whole_batches` (keras_bn's `momentum=None`, whose one batch
    counter must count every channel's batches) a batch with such a channel is left out of
    every channel. A batch left out of every channel is only counted as skipped.

    Args:
        whole_batches: use a batch in every channel or in none.

    Attributes:
        batches: the batches used (in at least one channel).
        skipped: the batches used in no channel.
        first_non_finite: the index (among all batches added, from 0) of the first batch whose
            mean or variance is NaN or inf in a channel it is used in; None if none.
    """

    def __init__(self, whole_batches: bool = False) -> None:
        self.whole_batches = whole_batches
        self.batches = 0
        self.skipped = 0
        self.first_non_finite: int | None = None
        # Pooled over processes: whether some process's shard had such a batch.
        self.non_finite_in_shards = False
        # 0-d until the first batch broadcasts them to its channels' shape.
        self._channel_batches: npt.NDArray[np.float64] = np.zeros(())
        self._count: npt.NDArray[np.float64] = np.zeros(())
        self._weighted_mean: npt.NDArray[np.float64] = np.zeros(())
        self._weighted_variance: npt.NDArray[np.float64] = np.zeros(())

    @classmethod
    def for_layer(cls, layer: keras.layers.Layer) -> "PooledMoments":
        """The pooling that matches `layer`'s own moving update: whole batches for a keras_bn
        layer with `momentum=None`, per channel otherwise.

        Args:
            layer: a BN layer of either class.

        Returns:
            An empty `PooledMoments`.
        """
        return cls(whole_batches=getattr(layer, "num_batches_tracked", None) is not None)

    def add(self, mean: npt.ArrayLike, variance: npt.ArrayLike, count: npt.ArrayLike) -> None:
        """Pool one batch's mean and biased variance over `count` values in each channel.

        Args:
            mean: the batch's per-channel mean.
            variance: the batch's per-channel biased variance.
            count: m_c, per channel or one number for all.
        """
        mean = backend.to_numpy(mean, np.float64)
        count = np.broadcast_to(backend.to_numpy(count, np.float64), mean.shape)
        used = count >= 2
        if self.whole_batches and not used.all():
            used = np.zeros_like(used)
        if not used.any():
            self.skipped += 1
            return
        variance = backend.to_numpy(variance, np.float64)
        finite = np.isfinite(mean) & np.isfinite(variance)
        if self.first_non_finite is None and not finite[used].all():
            self.first_non_finite = self.batches + self.skipped
        self.batches += 1
        weight = np.where(used, count, 0.0)
        self._channel_batches = self._channel_batches + used
        self._count = self._count + weight
        self._weighted_mean = self._weighted_mean + weight * np.where(used, mean, 0.0)
        self._weighted_variance = self._weighted_variance + weight * np.where(used, variance, 0.0)

    def summed(
        self,
        all_sum: Callable[[np.ndarray], np.ndarray],
        shape: tuple[int, ...],
    ) -> "PooledMoments":
        """These sums added up over processes, in float64: Algorithm 2's sums are sums over
        batches, so the union of the shards' batches has the sum of each shard's.

        Args:
            all_sum: a float64 vector → its sum over the processes (one collective call).
            shape: the layer's channels (a shard with no batch has 0-d sums).

        Returns:
            A new `PooledMoments`, the same on every process; `first_non_finite` is None (a
            batch index means nothing across shards) and `non_finite_in_shards` says whether
            some shard had a non-finite batch.
        """
        sums = (self._channel_batches, self._count, self._weighted_mean, self._weighted_variance)
        flags = [self.batches, self.skipped, self.first_non_finite is not None]
        total = all_sum(np.concatenate([*(np.broadcast_to(a, shape).ravel() for a in sums), flags]))
        size = int(np.prod(shape))
        pooled = PooledMoments(self.whole_batches)
        parts = [total[i * size : (i + 1) * size].reshape(shape) for i in range(4)]
        (
            pooled._channel_batches,
            pooled._count,
            pooled._weighted_mean,
            pooled._weighted_variance,
        ) = parts
        pooled.batches, pooled.skipped = int(total[-3]), int(total[-2])
        pooled.non_finite_in_shards = bool(total[-1])
        return pooled

    @property
    def seen(self) -> np.ndarray:
        """Per channel, whether some batch was used in it (its population is defined)."""
        return np.asarray(self._channel_batches) > 0

    def population(self, unbiased: bool) -> tuple[np.ndarray, np.ndarray]:
        """(E[x], Var[x]) per channel over the batches pooled, NaN where none was (see `seen`).

        Args:
            unbiased: Σm·σ² / Σ(m − 1), keras_bn's convention, when True; else Σm·σ² / Σm.

        Returns:
            (mean, variance) as float64 arrays.
        """
        divisor = self._count - self._channel_batches if unbiased else self._count
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._weighted_mean / self._count, self._weighted_variance / divisor


# The processes whose sums `assign` pools (`recalibrate(synchronized=True)`: the backend's
# `recalibration_processes()`), or None: this process's alone.
_PROCESSES: contextvars.ContextVar[backend.ProcessSum | None] = contextvars.ContextVar(
    "keras_bn_recalibration_processes", default=None
)


@contextlib.contextmanager
def pooled_across(processes: backend.ProcessSum | None) -> typing.Iterator[None]:
    """Within the block, `assign` sets statistics pooled over `processes` (None: this process
    alone): every process passes its own shard,
    and every one gets Algorithm 2 over their union."""
    token = _PROCESSES.set(processes)
    try:
        yield
    finally:
        _PROCESSES.reset(token)


def pooling() -> bool:
    """Whether `assign` pools over other processes now (`pooled_across`)."""
    return _PROCESSES.get() is not None


def all_processes_sum(values: npt.ArrayLike) -> np.ndarray:
    """`values` (float64) summed over the processes of `pooled_across`, or as they are."""
    processes = _PROCESSES.get()
    values = np.asarray(values, np.float64)
    return values if processes is None else processes.all_sum_array(values)


def _across_processes(sums: PooledMoments, shape: tuple[int, ...]) -> PooledMoments:
    """`sums` added up over the processes of `pooled_across` (every process calls this for
    the same layer, in the same order); `shape`: the layer's channels."""
    return sums if not pooling() else sums.summed(all_processes_sum, shape)


def assign(layer: keras.layers.Layer, sums: PooledMoments) -> LayerChange:
    """Set `layer`'s statistics (a folding layer's: its BN's) to the pooled ones in the
    channels some batch reached.

    Raises:
        ValueError: no batch gave the layer 2 values in any channel; or the statistics are NaN
            or inf in some channel (NaN or inf in the layer's input, or values too large for
            its statistics' dtype): the layer is left as it was.
    """
    return _assign_pooled(layer, _pooled_over_processes(layer, sums))


def _pooled_over_processes(layer: keras.layers.Layer, sums: PooledMoments) -> PooledMoments:
    """`layer`'s `sums` added up over the processes of `pooled_across` (`_across_processes`)."""
    return _across_processes(sums, tuple(bn_layers.statistics_of(layer).moving_mean.shape))


def _assign_pooled(layer: keras.layers.Layer, sums: PooledMoments) -> LayerChange:
    """`assign` of sums already pooled over the processes."""
    if not sums.batches:
        raise ValueError(
            f"recalibrate: no batch of `data` gives layer '{layer.name}' at least 2 "
            f"values per channel (m ≤ 1 in all {sums.skipped} batches), which "
            f"Algorithm 2 needs to estimate a batch variance. Use larger batches."
        )
    name, layer = layer.name, bn_layers.statistics_of(layer)
    mean, variance = sums.population(bn_layers.unbiased_variance(layer))
    seen = sums.seen
    old_mean = layer.moving_mean.numpy().astype(np.float64)
    old_variance = layer.moving_variance.numpy().astype(np.float64)
    mean, variance = np.where(seen, mean, old_mean), np.where(seen, variance, old_variance)
    with np.errstate(over="ignore"):  # too large for the dtype: inf, refused below
        mean = mean.astype(layer.moving_mean.dtype)
        variance = variance.astype(layer.moving_variance.dtype)
    _refuse_non_finite(name, layer, sums, seen & ~(np.isfinite(mean) & np.isfinite(variance)))
    layer.moving_mean.assign(mean)
    layer.moving_variance.assign(variance)
    # Renorm layers (both classes) keep moving_stddev = √(moving_variance + ε) for Keras.
    if getattr(layer, "moving_stddev", None) is not None:
        stddev = np.where(seen, np.sqrt(variance + layer.epsilon), layer.moving_stddev.numpy())
        layer.moving_stddev.assign(stddev.astype("float32"))
    # momentum=None: the cumulative average now stands for these batches (whole ones).
    if getattr(layer, "num_batches_tracked", None) is not None:
        layer.num_batches_tracked.assign(sums.batches)
    return LayerChange(
        name=name,
        convention=bn_layers.variance_convention(layer),
        old_mean=old_mean,
        new_mean=layer.moving_mean.numpy().astype(np.float64),
        old_variance=old_variance,
        new_variance=layer.moving_variance.numpy().astype(np.float64),
        batches_used=sums.batches,
        unchanged_channels=tuple(int(i) for i in np.flatnonzero(~seen)),
    )


def _refuse_non_finite(
    name: str, layer: keras.layers.Layer, sums: PooledMoments, bad: np.ndarray
) -> None:
    """ValueError naming the layer, the first batch and the channels (flat indices) where its
    statistics came out NaN or inf, if any did."""
    if not bad.any():
        return
    channels = [int(i) for i in np.flatnonzero(bad)]
    shown = f"{channels[:10]}{' …' if len(channels) > 10 else ''}"
    cause = f"they overflow {layer.moving_variance.dtype}"
    if sums.first_non_finite is not None:
        cause = (
            f"the moments of its input in batch {sums.first_non_finite} of `data` are NaN or "
            f"inf (NaN or inf in that input, or values too large for float32)"
        )
    elif sums.non_finite_in_shards:
        cause = (
            "the moments of its input in a batch of some process's shard are NaN or inf "
            "(NaN or inf in that input, or values too large for float32)"
        )
    raise ValueError(
        f"recalibrate: layer '{name}' would get NaN or inf statistics: {cause}, in "
        f"channels {shown} ({len(channels)} of {bad.size}). Every layer's statistics are left "
        f"as they were. Check the data, and the weights and statistics of the layers before it."
    )


# The most passes `settle` makes for one layer that folds its BN.
MAX_SETTLING_PASSES = 10
# A settling error (in units of σ) within float32 rounding of the statistics: settled.
SETTLED = 1e-5
# A per-tensor range's passes that end this many integer steps (`step_bound`) or fewer from
# their fixed point in every channel are cycling across rounding boundaries: no warning. On
# MobileNetV2 (alpha 0.35, 32 px, random weights and data, all 52 layers per tensor, none
# settled within SETTLED at 8 bits) the passes ended at most 1.16 steps off at 8 bits and
# 1.00 at 4 bits (each channel's distance in σ times its largest integer).
CYCLE_STEPS = 2


def ties_bound(weight_bits: int) -> float:
    """Per-channel weight ranges: the distance (in units of σ) between a layer's two passes
    above which `settle` warns, 1/q_max (one integer step of the channel's largest weight,
    q_max = 2^(bits−1) − 1). Only weights at float32 rounding ties move there, each by one
    step: on MobileNetV2 (alpha 0.35, random weights and data) recalibrated 12 times from
    statistics scaled by U(0.25, 4) per channel, 8-bit ties moved 1–3 weights in 46 of 624
    layer passes, by at most 1.03e-3·σ (a depthwise layer: 9 weights per channel), 0.13 of
    this bound; at 4 bits no weight was at a tie in 624."""
    return 1.0 / (2 ** (weight_bits - 1) - 1)


def start_afresh(layer: keras.layers.Layer) -> tuple[np.ndarray, np.ndarray] | None:
    """For a layer that folds its BN into rounded weights (QAT): set its moving variance to
    ones, the start of `settle`'s passes whatever the statistics were, and return
    (moving mean, moving variance) before, as float64. None (and nothing set) for a BN, or
    float weights.

    The first pass measures the weights that the moving variance rounds to, and where the
    passes do not reach a fixed point (a per-tensor range can cycle), or reach one of several,
    the statistics kept depend on where they started: from the stored ones, a second call gave
    other statistics than the first (by 13% of the variance, a 3-bit Dense layer). From one
    start the passes are those of the data and the weights alone. Ones, as the start: the
    integers then are those of W·γ, without a σ from an earlier call or from training. Only the
    variance: the mean does not enter the kernel's rounding. A layer's input has no mask, so
    every channel is seen, and none keeps the start.
    """
    if not _rounds_weights(layer):
        return None
    statistics = bn_layers.statistics_of(layer)
    before = (
        statistics.moving_mean.numpy().astype(np.float64),
        statistics.moving_variance.numpy().astype(np.float64),
    )
    statistics.moving_variance.assign(np.ones_like(before[1], statistics.moving_variance.dtype))
    return before


def settle(
    layer: keras.layers.Layer,
    pooled: Callable[[], PooledMoments],
    another_pass: Callable[[], None] = lambda: None,
    before: tuple[np.ndarray, np.ndarray] | None = None,
) -> LayerChange:
    """`assign(layer, pooled())`, and for a layer that folds its BN into rounded weights
    (QAT), again until the statistics are those of the weights they give, the first pass
    from `start_afresh`'s start, so that two calls with the same data give the same
    statistics.

    Such a layer rounds W·s' with s' = γ/σ (σ from the moving variance) and normalizes
    z/s' = host(x, q·Δ)/s', q the integers and Δ the weight step. Each pass after the first
    measures with the weights the last one left: pass k + 1 measures exactly the weights pass
    k's statistics give, so their distance (`_distance`: the largest change of the mean or of
    σ, in units of σ) is how far pass k is from a fixed point.

    With one weight range per output channel, Δ_c/s'_c = max|W_c|/q_max whatever σ is: the
    integers do not depend on σ, and a pass that moves none is exact (`settling_error` 0).
    What a pass can move are weights at float32 rounding ties (W·s'/Δ a half-integer to
    float32 rounding, which another σ's rounding tips the other way), so the passes stop
    after the second: it measures the weights the first one's statistics give, and is kept;
    a third would only flip ties again. `LayerChange.settling_error` is then the distance
    between the two passes (what the ties moved; those that the second pass's statistics
    move, `unsettled_weights`, are of the same kind), and a `KerasBNWarning` names a layer
    where it is above `ties_bound` (more than ties were measured to move).

    With one range per tensor, Δ = max_j|W_j·s'_j|/q_max, so Δ/s'_c depends on σ_c against
    the largest channel's even where no integer moves, and new statistics also move integers.
    The passes stop once one is within `SETTLED`, or after `MAX_SETTLING_PASSES`, and the
    layer keeps the closest pass; `LayerChange.settling_error` is its distance. A per-tensor
    range at 2–4 bits need not settle: a channel's σ that grows shrinks its integers and so
    its variance, and the passes can oscillate about a rounding boundary; so can 8 bits, by
    less. A `KerasBNWarning` names a layer kept further from its fixed point, in some channel,
    than `CYCLE_STEPS` integer steps (`step_bound`): more than weights cycling across a
    rounding boundary move it.

    Args:
        layer: a BN layer, or a layer that folds one.
        pooled: one pass over the data: the layer's pooled moments with its weights as they
            are now.
        another_pass: called before each pass after the first (the progress bar's total).
        before: `start_afresh(layer)`, where the caller started the layer afresh before
            `pooled`'s first pass (the one pass records it in the layer's segment); None:
            `settle` starts it.

    Returns:
        The `LayerChange` from the statistics before the first pass to those kept, with the
        passes made, the integers that the kept statistics round differently from those they
        were measured with, and the settling error.
    """
    if not _rounds_weights(layer):  # a BN, or float weights: nothing rounds
        return assign(layer, pooled())
    if before is None:
        before = start_afresh(layer)
        assert before is not None  # the layer rounds its kernel
    rounded = _rounded_weights(layer)
    epsilon = bn_layers.statistics_of(layer).epsilon
    passes: list[tuple[PooledMoments, LayerChange, int]] = []  # (moments, change, moved)
    errors: list[np.ndarray] = []  # errors[k]: pass k's distance from its own weights, per channel
    steps: list[np.ndarray] = []  # steps[k]: `step_bound` of the weights pass k's statistics give
    while True:
        # Pooled over the processes once: keeping an earlier pass re-assigns these sums.
        sums = _pooled_over_processes(layer, pooled())
        change = _assign_pooled(layer, sums)
        measured_with, rounded = rounded, _rounded_weights(layer)
        assert rounded is not None  # the layer still rounds its kernel
        moved = int(np.count_nonzero(rounded != measured_with))
        if passes:
            errors.append(_channel_distances(passes[-1][1], change, epsilon))
        passes.append((sums, change, moved))
        steps.append(step_bound(rounded))
        if layer.per_channel and not moved:  # σ cancels in each channel's grid: exact
            kept, error = change, 0.0
            break
        if layer.per_channel and len(passes) == 2:  # what moved are float32 ties
            kept, error = change, float(errors[0].max())
            bound = ties_bound(layer.weight_bits)
            if error > bound:
                warnings.warn(
                    f"recalibrate: layer '{layer.name}' has per-channel weight ranges, in "
                    f"which σ cancels, yet its second pass moved its statistics {error:.3g}·σ "
                    f"from the first's, more than weights at float32 rounding ties were "
                    f"measured to ({bound:.3g}·σ at {layer.weight_bits} bits). It keeps the "
                    f"second pass's statistics ({moved} weight(s) round with them to other "
                    f"integers than those they were measured with).",
                    KerasBNWarning,
                    stacklevel=3,
                )
            break
        largest = [float(e.max()) for e in errors]
        if (errors and min(largest) <= SETTLED) or len(passes) == MAX_SETTLING_PASSES:
            closest = int(np.argmin(largest)) if errors else 0
            error = largest[closest] if errors else float("inf")
            kept, moved = passes[closest][1], passes[closest][2]
            if closest < len(passes) - 1:
                kept = _assign_pooled(layer, passes[closest][0])
            # In steps of each channel's largest integer (`step_bound`): further than
            # CYCLE_STEPS is more than its integers' rounding cycles.
            over = errors[closest] / steps[closest] if errors else np.array([np.inf])
            if over.max() > CYCLE_STEPS:
                channel = int(np.argmax(over))
                warnings.warn(
                    f"recalibrate: layer '{layer.name}' did not settle in {len(passes)} "
                    f"passes: its weight range is shared by its channels, and each pass's σ "
                    f"changed the weights the next one measured. It keeps pass "
                    f"{closest + 1}'s statistics, the closest: within {error:.3g}·σ of those "
                    f"of the weights they give ({moved} weight(s) round to other integers "
                    f"than those they were measured with). Channel {channel} is "
                    f"{over[channel]:.3g} steps of its largest integer from them, more than "
                    f"the {CYCLE_STEPS} that weights cycling across a rounding boundary were "
                    f"measured to move.",
                    KerasBNWarning,
                    stacklevel=3,
                )
            break
        another_pass()
    return dataclasses.replace(
        kept,
        old_mean=before[0],
        old_variance=before[1],
        passes=len(passes),
        unsettled_weights=moved,
        settling_error=error,
    )


def _channel_distances(earlier: LayerChange, later: LayerChange, epsilon: float) -> np.ndarray:
    """Per channel, the larger change from `earlier`'s statistics to `later`'s, of the mean
    and of σ = √(v + ε), in units of `earlier`'s σ."""
    sigma = np.sqrt(earlier.new_variance + epsilon)
    mean = np.abs(later.new_mean - earlier.new_mean) / sigma
    scale = np.abs(np.sqrt(later.new_variance + epsilon) - sigma) / sigma
    return np.maximum(mean, scale).reshape(-1)


def step_bound(integers: np.ndarray) -> np.ndarray:
    """Per output channel (the last axis), 1/max|q_c| (1 where a channel holds only zeros):
    one integer step of the channel's largest weight, in units of what the channel computes.
    A per-tensor range's passes can cycle between weights that round either side of a
    boundary; each such weight moves its channel by one step, so the distance from a pass to
    the statistics of the weights it gives, per channel and in units of σ, stays within
    about this: `ties_bound` is its per-channel case (there max|q_c| = q_max)."""
    largest = np.abs(integers).reshape(-1, integers.shape[-1]).max(axis=0)
    return 1.0 / np.maximum(largest, 1).astype(np.float64)


def _rounds_weights(layer: keras.layers.Layer) -> bool:
    """Whether `layer` folds its BN into rounded weights (a QAT layer with weight bits), whose
    integers then depend on its statistics; without computing them (0.3 s a recalibration of
    a QAT MobileNetV2, in eager arithmetic)."""
    return bn_layers.folds_batch_norm(layer) and layer.weight_bits is not None


def _rounded_weights(layer: keras.layers.Layer) -> np.ndarray | None:
    """The integers a folding layer's kernel rounds to now (they depend on its statistics);
    None for a BN, or float weights."""
    if not _rounds_weights(layer):
        return None
    q: np.ndarray = layer.weight_grids()["kernel"].q
    return q


@dataclasses.dataclass(frozen=True)
class Recalibrated:
    """What the per-layer method (`layerwise.in_call_order`) did.

    Attributes:
        changes: one `LayerChange` per layer the forward function called, in call order.
        not_called: the indices (into `layers`) of the layers it never called.
    """

    changes: tuple[LayerChange, ...]
    not_called: tuple[int, ...]

"""recalibrate(model, data): exact population statistics for every BN layer (Algorithm 2).

Ioffe & Szegedy's Algorithm 2 sets each BN layer's inference statistics from the training
mini-batches B, each of m values per channel:

    E[x] = E_B[μ_B]        Var[x] = m/(m−1) · E_B[σ²_B]

A moving average only approximates this, and lags when the weights change quickly. When the
batches differ in size (a smaller last batch, or masks), each batch is weighted by its count,
which is the same for equal batches and is the pooled within-batch estimate otherwise:

    E[x] = Σ m_B·μ_B / Σ m_B        Var[x] = Σ m_B·σ²_B / Σ (m_B − 1)

per channel: under a mask each channel c has its own count m_B,c, and a batch that leaves a
channel at most one value is left out of that channel (of every channel for keras_bn's
`momentum=None`), as the layer's training step leaves it out; see `PooledMoments`.

`keras.layers.BatchNormalization` stores the biased variance, so its layers get
Σ m_B·σ²_B / Σ m_B, the same convention as their own moving average.

Upstream normalization while it runs: the layers are recalibrated one at a time, in the order
the forward pass calls them, and every pass runs the whole model in inference mode (BN layers
infer even where the model's code passes them training=True). So when a layer's statistics are
gathered, every BN layer upstream of it already normalizes with its new population statistics:
each layer's statistics describe exactly the input it gets at inference, which is what they are
used for. Dropout and the other training-only layers are off. The cost is one pass over the
data per BN layer (one compiled forward function serves every pass).
"""

import dataclasses
from collections.abc import Sequence

import keras
import numpy as np
import numpy.typing as npt
import tensorflow as tf

from keras_bn import _bn_layers
from keras_bn._batches import Batches, Data
from keras_bn._hooks import BatchNormCalls
from keras_bn.quantize.layers import refuse_folded_batch_norms


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
    """

    name: str
    convention: str  # "unbiased" (keras_bn) or "biased" (keras.layers.BatchNormalization)
    old_mean: np.ndarray
    new_mean: np.ndarray
    old_variance: np.ndarray
    new_variance: np.ndarray
    batches_used: int | None = None
    unchanged_channels: tuple[int, ...] = ()

    @property
    def mean_change(self) -> np.ndarray:
        """new − old moving mean, per channel (float64 array)."""
        return self.new_mean - self.old_mean

    @property
    def variance_change(self) -> np.ndarray:
        """new − old moving variance, per channel (float64 array)."""
        return self.new_variance - self.old_variance


@dataclasses.dataclass(frozen=True)
class RecalibrationReport:
    """What `recalibrate` changed: one `LayerChange` per BN layer, in the order recalibrated.

    `str()` of it is a table: per layer, its convention and the largest change of mean and
    variance over its channels.

    Attributes:
        layers: tuple of `LayerChange`, in the order the forward pass calls the layers.
        batches: how many batches each layer's statistics were computed from; None only
            when the forward pass called no BN layer and `data` does not tell its length.
        not_called: names of the BN layers the forward pass never reached; they are left as
            they were.
    """

    layers: tuple[LayerChange, ...]
    batches: int | None
    not_called: tuple[str, ...] = ()  # BN layers the forward pass never reached (left as they were)

    def __str__(self) -> str:
        lines = [
            f"Recalibrated {len(self.layers)} BN layer(s) over {self.batches} batch(es).",
            f"{'layer':<40} {'convention':<10} {'max |Δmean|':>12} {'max |Δvar|':>12}",
        ]
        for change in self.layers:
            lines.append(
                f"{change.name:<40} {change.convention:<10} "
                f"{np.abs(change.mean_change).max():>12.4g} "
                f"{np.abs(change.variance_change).max():>12.4g}"
            )
        skipped = {
            c.name: self.batches - c.batches_used
            for c in self.layers
            if self.batches is not None
            and c.batches_used is not None
            and c.batches_used < self.batches
        }
        if skipped:
            lines.append(f"Batches skipped (m ≤ 1 values per channel), per layer: {skipped}")
        unchanged = {
            c.name: list(c.unchanged_channels) for c in self.layers if c.unchanged_channels
        }
        if unchanged:
            lines.append(f"Channels no batch gave 2 values (unchanged), per layer: {unchanged}")
        if self.not_called:
            lines.append(f"Not called by the forward pass (unchanged): {list(self.not_called)}")
        return "\n".join(lines)


def recalibrate(
    model: keras.Model,
    data: Data,
    steps: int | None = None,
    progress: bool = True,
    batch_size: int = 32,
) -> RecalibrationReport:
    """Set every BN layer of `model` (nested models included) to Algorithm 2's statistics.

    Ioffe & Szegedy's Algorithm 2 sets the inference statistics from the mini-batches B (m_B
    values per channel each, μ_B and σ²_B their mean and biased variance), each weighted by
    its count so that a short last batch or a mask counts for what it holds::

        E[x] = Σ m_B·μ_B / Σ m_B
        Var[x] = Σ m_B·σ²_B / Σ (m_B − 1)     keras_bn.BatchNormalization (unbiased)
        Var[x] = Σ m_B·σ²_B / Σ m_B           keras.layers.BatchNormalization (biased)

    Each layer reads a mask as its own training step does (Keras's reading, the input's
    leading axes, for both classes; see `keras_bn.BatchNormalization.call`), so these are the
    statistics that Keras's own `fit` averages for a Keras layer. The sums are per channel:
    a mask can leave the channels different counts m_B,c (a (batch, time) mask with `axis=1`
    on (batch, time, features)).

    The layers are recalibrated one at a time in the order the forward pass calls them, with
    every pass in inference mode, so each layer's statistics describe the input it gets at
    inference (upstream layers already use their new statistics). This costs one pass over
    `data` per BN layer.
    Only `moving_mean` and `moving_variance` change (and the bookkeeping that follows them:
    `moving_stddev` = √(moving_variance + ε) for renorm layers, the batch counter for
    `momentum=None`); trainable weights are untouched. A batch that gives a layer's channel at
    most one value (a last batch of one sample, a mask leaving one token) has no variance
    there and is left out of that channel, as training leaves it out (of every channel, for
    a keras_bn layer with `momentum=None`); `LayerChange.batches_used` counts the batches
    used. A channel that no batch gives 2 values keeps its statistics
    (`LayerChange.unchanged_channels`). The layers are recalibrated whether or not they are
    trainable.

    Args:
        model: a built Keras model (Sequential, Functional, subclassed, nested).
        data: a `tf.data.Dataset`, a numpy array, a dict of numpy arrays (a model with named
            inputs), or an iterable of batches. Elements may be `x`, or `(x, y)` /
            `(x, y, sample_weight)` tuples, of which only `x` is used. An array, or each array
            of a dict, is split along its first axis into batches of `batch_size`.
        steps: how many batches to use; None uses them all (required for an infinite
            dataset).
        progress: show a progress bar (rich, on stderr).
        batch_size: batch size for numpy-array (or dict of arrays) data only.

    Returns:
        A `RecalibrationReport` with the change in mean and variance of each layer.

    Raises:
        ValueError: the model has no BN layer; `steps` or `batch_size` is not a positive int;
            the dataset is infinite and `steps` is None; the arrays of a dict differ in
            length; `data` gives no batch, or no batch with 2 values per channel for some
            layer, or a different number of batches on another pass; or a BN layer is called
            more than once per forward pass (shared).
        UnsupportedModelError: the model holds quantization-aware layers with folded batch
            norms (`keras_bn.quantize`); recalibrate the float model before quantizing it.

    Example:
        After training with weight averaging, or to replace the moving averages::

            report = keras_bn.recalibrate(model, x_train, batch_size=64)
            print(report)   # per layer: max |Δmean|, max |Δvar|
    """
    refuse_folded_batch_norms(model, "recalibrate")
    layers = _bn_layers.in_model(model)
    if not layers:
        raise ValueError(f"Model '{model.name}' has no BatchNormalization layer to recalibrate.")
    return recalibrate_layers(model, layers, Batches(data, steps, batch_size), progress)


def recalibrate_layers(
    model: keras.Model, layers: Sequence[keras.layers.Layer], batches: Batches, progress: bool
) -> RecalibrationReport:
    """`recalibrate` for the BN `layers` of `model` only, over `Batches`; the other BN layers
    keep their statistics (and normalize with them while the chosen ones are gathered)."""
    with BatchNormCalls(layers) as statistics:
        forward = tf.function(
            lambda x: statistics.record(lambda: model(x, training=False)),
            reduce_retracing=True,
        )
        forward(batches.first())
        order = statistics.order
        bar = _progress_bar(progress, len(order) * batches.count if batches.count else None)
        changes = []
        try:
            for index in order:
                layer = layers[index]
                bar.set_description(layer.name)
                sums = PooledMoments.for_layer(layer)
                for x in batches:
                    sums.add(*[t.numpy() for t in forward(x)[index]])
                    bar.update(1)
                batches.check_count(sums.batches + sums.skipped)
                if not sums.batches:
                    raise ValueError(
                        f"recalibrate: no batch of `data` gives layer '{layer.name}' at least 2 "
                        f"values per channel (m ≤ 1 in all {sums.skipped} batches), which "
                        f"Algorithm 2 needs to estimate a batch variance. Use larger batches."
                    )
                changes.append(_assign(layer, sums))
        finally:
            bar.close()
    not_called = tuple(layers[i].name for i in range(len(layers)) if i not in order)
    return RecalibrationReport(tuple(changes), batches.count, not_called)


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
    """

    def __init__(self, whole_batches: bool = False) -> None:
        self.whole_batches = whole_batches
        self.batches = 0
        self.skipped = 0
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
        mean = np.asarray(mean, np.float64)
        count = np.broadcast_to(np.asarray(count, np.float64), mean.shape)
        used = count >= 2
        if self.whole_batches and not used.all():
            used = np.zeros_like(used)
        if not used.any():
            self.skipped += 1
            return
        self.batches += 1
        weight = np.where(used, count, 0.0)
        self._channel_batches = self._channel_batches + used
        self._count = self._count + weight
        self._weighted_mean = self._weighted_mean + weight * np.where(used, mean, 0.0)
        self._weighted_variance = self._weighted_variance + weight * np.where(
            used, np.asarray(variance, np.float64), 0.0
        )

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


def _assign(layer: keras.layers.Layer, sums: PooledMoments) -> LayerChange:
    """Set `layer`'s statistics to the pooled ones in the channels some batch reached."""
    mean, variance = sums.population(_bn_layers.unbiased_variance(layer))
    seen = sums.seen
    old_mean = layer.moving_mean.numpy().astype(np.float64)
    old_variance = layer.moving_variance.numpy().astype(np.float64)
    mean, variance = np.where(seen, mean, old_mean), np.where(seen, variance, old_variance)
    layer.moving_mean.assign(mean.astype(layer.moving_mean.dtype))
    layer.moving_variance.assign(variance.astype(layer.moving_variance.dtype))
    # Renorm layers (both classes) keep moving_stddev = √(moving_variance + ε) for Keras.
    if getattr(layer, "moving_stddev", None) is not None:
        stddev = np.where(seen, np.sqrt(variance + layer.epsilon), layer.moving_stddev.numpy())
        layer.moving_stddev.assign(stddev.astype("float32"))
    # momentum=None: the cumulative average now stands for these batches (whole ones).
    if getattr(layer, "num_batches_tracked", None) is not None:
        layer.num_batches_tracked.assign(sums.batches)
    return LayerChange(
        name=layer.name,
        convention=_bn_layers.variance_convention(layer),
        old_mean=old_mean,
        new_mean=layer.moving_mean.numpy().astype(np.float64),
        old_variance=old_variance,
        new_variance=layer.moving_variance.numpy().astype(np.float64),
        batches_used=sums.batches,
        unchanged_channels=tuple(int(i) for i in np.flatnonzero(~seen)),
    )


def _progress_bar(enabled: bool, total: int | None) -> "_ProgressBar":
    return _ProgressBar(enabled, total)


class _ProgressBar:
    """A rich progress bar on stderr (rich comes with Keras): "<layer> ━━━ 3/8 0:00:01".

    Where stderr is not a terminal (a log file, CI), rich draws the final state once.
    """

    def __init__(self, enabled: bool, total: int | None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("recalibrate {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self._task = self._progress.add_task("", total=total)
        self._progress.start()

    def set_description(self, description: str) -> None:
        self._progress.update(self._task, description=description)

    def update(self, steps: int) -> None:
        self._progress.advance(self._task, steps)

    def close(self) -> None:
        self._progress.stop()

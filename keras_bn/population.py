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

Upstream normalization while it runs: the layers are recalibrated in the order the forward
pass calls them, in inference mode (BN layers infer even where the model's code passes them
training=True), each from activations computed with every BN upstream of it already
recalibrated: each layer's statistics describe exactly the input it gets at inference, which
is what they are used for. Dropout and the other training-only layers are off.

Two methods give the same statistics:
- one pass (keras_bn/_recalibration/one_pass.py), for Sequential and Functional models: the
  graph runs node by node over all the batches, cut into compiled segments at the BN layers (and
  the QAT layers, whose further settling passes run that layer alone); each BN is set once every
  batch has reached it, before anything downstream of it runs. The cost is about one inference
  pass. The tensors later nodes still read are kept per batch within `max_memory`, on disk past
  it.
- per layer (keras_bn/_recalibration/layerwise.py), for subclassed models and inside custom
  layers that hide BNs from the graph: one pass over the data per BN layer (one compiled forward
  function serves every pass). It is also the reference the one pass is tested against.
"""

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np

from keras_bn import backend
from keras_bn._graph import bn_layers
from keras_bn._recalibration import frontier, one_pass, statistics
from keras_bn._recalibration.batches import Batches, Data, input_count
from keras_bn._recalibration.hooks import Snapshot
from keras_bn._recalibration.layerwise import in_call_order
from keras_bn._recalibration.progress import ProgressBar
from keras_bn._recalibration.statistics import LayerChange, PooledMoments

__all__ = ["LayerChange", "PooledMoments", "RecalibrationReport", "recalibrate"]

# The strategies a `RecalibrationReport` names.
STRATEGIES = ("one_pass", "one_pass_spilled", "per_layer")


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
        strategy: how it ran: "one_pass" (the graph walked once over the data, its frontier
            in memory), "one_pass_spilled" (the same, with part of the frontier spilled to
            disk to stay within `max_memory`) or "per_layer" (one pass over the data per BN
            layer: a subclassed model).
        passes: the work in forward passes over the data: the layer (node) evaluations over
            all the batches divided by those of one inference pass of the model. "per_layer"
            makes one pass per BN layer (per settling pass, for a QAT layer); "one_pass"
            evaluates each node that leads to a BN once per batch (at most 1: the head after
            the last BN does not run), plus, for each BN recalibrated inside a custom layer and
            each settling pass of a QAT layer after its first, one evaluation of that layer per
            batch. None where unknown.
        peak_frontier_bytes: the most bytes the one pass kept in memory at once (the tensors
            later layers still read, for every batch); 0 for "per_layer".
        spilled_bytes: the bytes the one pass wrote to disk (0 unless "one_pass_spilled").
        fallbacks: the BN layers recalibrated by the per-layer method inside a layer whose
            `call` the graph does not expose (a custom layer, a subclassed model inside the
            graph): each one's path and why.
    """

    layers: tuple[LayerChange, ...]
    batches: int | None
    not_called: tuple[str, ...] = ()  # BN layers the forward pass never reached (left as they were)
    strategy: str = "per_layer"
    passes: float | None = None
    peak_frontier_bytes: int = 0
    spilled_bytes: int = 0
    fallbacks: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [
            f"Recalibrated {len(self.layers)} BN layer(s) over {self.batches} batch(es).",
            f"{'layer':<40} {'convention':<10} {'max |Δmean|':>12} {'max |Δvar|':>12}",
        ]
        for change in self.layers:
            settling = ""
            if change.passes > 1 or change.unsettled_weights:
                settling = f"  {change.passes} passes, " + (
                    f"within {change.settling_error:.2g}σ of settled"
                    if change.unsettled_weights
                    else "settled"
                )
            lines.append(
                f"{change.name:<40} {change.convention:<10} "
                f"{np.abs(change.mean_change).max():>12.4g} "
                f"{np.abs(change.variance_change).max():>12.4g}{settling}"
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
        passes = "" if self.passes is None else f", {self.passes:.3g} forward pass(es) of work"
        spilled = self.spilled_bytes / 2**20
        lines.append(
            f"Strategy: {self.strategy}{passes}; frontier peak "
            f"{self.peak_frontier_bytes / 2**20:.1f} MiB in memory"
            + (f", {spilled:.1f} MiB spilled to disk." if self.spilled_bytes else ".")
        )
        for fallback in self.fallbacks:
            lines.append(f"Per layer: {fallback}")
        return "\n".join(lines)


def recalibrate(
    model: keras.Model,
    data: Data,
    steps: int | None = None,
    progress: bool = True,
    batch_size: int = 32,
    max_memory: int | None = None,
    synchronized: bool = False,
) -> RecalibrationReport:
    """Set every BN layer of `model` (nested models included) to Algorithm 2's statistics.

    Ioffe & Szegedy's Algorithm 2 sets the inference statistics from the mini-batches B (m_B
    values per channel each, μ_B and σ²_B their mean and biased variance), each weighted by
    its count so that a short last batch or a mask counts for what it holds::

        E[x] = Σ m_B·μ_B / Σ m_B
        Var[x] = Σ m_B·σ²_B / Σ (m_B − 1)     keras_bn.BatchNormalization (unbiased)
        Var[x] = Σ m_B·σ²_B / Σ m_B           keras.layers.BatchNormalization (biased)

    A quantization-aware layer that folds its BN (`keras_bn.quantize`'s
    QuantizedHostBatchNorm) gets the statistics of what its BN normalizes in training: the
    host's output with the kernel rounded as the layer rounds it (z/s', with the host bias in
    the mean). That kernel is scaled by γ/σ before rounding, so the statistics change what
    they describe. With per-channel weight ranges σ cancels: one pass is exact, or a second
    measures the weights the first gives where some weight at a float32 rounding tie flipped
    (`LayerChange.settling_error` says how far those moved the statistics). With a per-tensor
    range (every Dense host) the layer takes passes, each measuring the weights the last one
    gave, until one is within 1e-5·σ of the statistics of the weights it gives, for at most
    10 (`LayerChange.passes`); it keeps the closest pass, `LayerChange.settling_error` says
    how close, and a `KerasBNWarning` names a layer left further off, in some channel, than
    two steps of that channel's largest integer (what weights cycling across a rounding
    boundary were measured to move). Every call starts those
    passes from σ = 1, not from the statistics the layer had, so that a second call with the
    same data gives the same statistics.

    Each layer reads a mask as its own training step does (Keras's reading, the input's
    leading axes, for both classes; see `keras_bn.BatchNormalization.call`), so these are the
    statistics that Keras's own `fit` averages for a Keras layer. The sums are per channel:
    a mask can leave the channels different counts m_B,c (a (batch, time) mask with `axis=1`
    on (batch, time, features)).

    The layers are recalibrated in the order the forward pass calls them, in inference mode,
    each from activations computed with every BN upstream of it already recalibrated, so each
    layer's statistics describe exactly the input it gets at inference.

    Cost: for a Sequential or Functional model (nested ones included) the graph runs layer by
    layer over all the batches, each stretch between two BN layers as one compiled function,
    and each BN is set once every batch has reached it: about one inference pass over `data`
    in all (strategy "one_pass"). Meanwhile the tensors that later layers still read are kept
    for every batch, within `max_memory` bytes, and written to a temporary folder past it
    (strategy "one_pass_spilled"; the folder is removed afterwards). A QAT layer's first pass
    runs in its compiled stretch, as a BN's does; its further passes, if any, run that layer
    alone over its inputs, kept meanwhile. A BN inside a custom layer, whose `call` the graph
    does not expose, is recalibrated by one pass of that layer alone per such BN
    (`RecalibrationReport.fallbacks` names them). A subclassed model has no graph to walk: it
    costs one pass over `data` per BN layer (strategy "per_layer").
    Only `moving_mean` and `moving_variance` change (and the bookkeeping that follows them:
    `moving_stddev` = √(moving_variance + ε) for renorm layers, the batch counter for
    `momentum=None`); trainable weights are untouched. A batch that gives a layer's channel at
    most one value (a last batch of one sample, a mask leaving one token) has no variance
    there and is left out of that channel, as training leaves it out (of every channel, for
    a keras_bn layer with `momentum=None`); `LayerChange.batches_used` counts the batches
    used. A channel that no batch gives 2 values keeps its statistics
    (`LayerChange.unchanged_channels`). The layers are recalibrated whether or not they are
    trainable. If it raises part way (an error in the model or the data), every layer keeps
    the statistics it had: none is left recalibrated while the others are not.

    Args:
        model: a built Keras model (Sequential, Functional, subclassed, nested).
        data: whole arrays as `fit` takes them: a numpy array, a dict of them (a model with
            named inputs), a list of them (a model with several inputs), or `(x, y)` /
            `(x, y, sample_weight)` of those, of which only x is used; each array is split
            along its first axis into batches of `batch_size`. Or a `tf.data.Dataset` or an
            iterable of batches, whose elements may be `x`, or `(x, y)` /
            `(x, y, sample_weight)` tuples, of which only `x` is used. A one-shot
            iterator (a generator) is read once: streamed by the one pass, held in memory
            for a subclassed model's passes.
        steps: how many batches to use; None uses them all (required for an infinite
            dataset).
        progress: show a progress bar (rich, on stderr).
        batch_size: batch size for numpy-array (or dict of arrays) data only.
        max_memory: the bytes the one pass may keep in memory (on the device that computes
            them) for the tensors later layers still read; past it they go to disk. None: 2 GiB,
            or half the memory available when that is less.
        synchronized: under torch.distributed (two or more processes in the default group),
            jax.distributed (two or more processes) or within the scope of a tf.distribute
            MultiWorkerMirroredStrategy, each process passes its own shard of the data (an
            empty one too) and every process ends with the statistics of the union of the
            shards: each layer's Algorithm 2 sums are added up over the processes (float64)
            before it is set, so the layers after it see the same statistics everywhere.
            Every process must call it, with the same model. In one process it is the plain
            call.

    Returns:
        A `RecalibrationReport` with the change in mean and variance of each layer, the
        strategy that ran, the passes it cost and its peak memory.

    Raises:
        ValueError: the model has no BN layer; `synchronized` is not a bool, or True with
            TF_CONFIG naming several workers outside their strategy's scope; `steps` or
            `batch_size` is not a positive int;
            `max_memory` is not an int ≥ 0 or None; whole arrays whose numbers of samples
            differ (x's, or x's and y's; the arrays of a dict), a list of arrays that is not
            one per model input, or a y that is no array; the dataset is infinite and `steps`
            is None; `data` gives no batch, or no batch with 2 values per channel for some
            layer, or a different number of batches on another pass; a layer's statistics
            would be NaN or inf (NaN or inf in the data or in the layer's input: the message
            names the layer, the first such batch and the channels); a BN layer is called
            more than once per forward pass (shared; a BN inside `TimeDistributed` is not:
            it is recalibrated over batch × time, its m values per channel); or the model
            holds a stateful layer (an RNN with `stateful=True`).

    Example:
        After training with weight averaging, or to replace the moving averages::

            report = keras_bn.recalibrate(model, x_train, batch_size=64)
            print(report)   # per layer: max |Δmean|, max |Δvar|
    """
    layers = bn_layers.in_model(model)
    if not layers:
        raise ValueError(f"Model '{model.name}' has no BatchNormalization layer to recalibrate.")
    check_synchronized(synchronized)
    budget = check_max_memory(max_memory)
    # The one pass reads `data` once: a generator is streamed, not held in memory.
    batches = Batches(
        data, steps, batch_size, keep=not one_pass.walkable(model), inputs=input_count(model)
    )
    return recalibrate_layers(model, layers, batches, progress, budget, synchronized)


def check_synchronized(synchronized: object) -> bool:
    """`synchronized` if it is a bool.

    Raises:
        ValueError: it is not, named.
    """
    if not isinstance(synchronized, bool):
        raise ValueError(
            f"synchronized must be True or False; received synchronized={synchronized!r}."
        )
    return synchronized


def check_max_memory(max_memory: int | None) -> int:
    """The frontier budget in bytes: `max_memory` checked, or the default for None.

    Args:
        max_memory: bytes (an int ≥ 0), or None for `frontier.default_max_memory()`.

    Returns:
        The budget in bytes.

    Raises:
        ValueError: `max_memory` is not an int ≥ 0 (a bool, a float, a string, negative).
    """
    if max_memory is None:
        return frontier.default_max_memory()
    if isinstance(max_memory, bool) or not isinstance(max_memory, int) or max_memory < 0:
        raise ValueError(
            f"max_memory must be a number of bytes (an int ≥ 0) or None; received "
            f"max_memory={max_memory!r}."
        )
    return max_memory


def recalibrate_layers(
    model: keras.Model,
    layers: Sequence[keras.layers.Layer],
    batches: Batches,
    progress: bool,
    max_memory: int | None = None,
    synchronized: bool = False,
) -> RecalibrationReport:
    """`recalibrate` for the BN `layers` of `model` only, over `Batches`; the other BN layers
    keep their statistics (and normalize with them while the chosen ones are gathered). One
    pass for a Sequential or Functional model, per layer for a subclassed one. On failure
    `layers` keep their statistics. `synchronized`: each layer's sums pooled over the
    backend's processes (`statistics.pooled_across`)."""
    _refuse_stateful_layers(model)
    processes = backend.get().recalibration_processes() if synchronized else None
    with statistics.pooled_across(processes):
        if not one_pass.walkable(model):
            report = recalibrate_per_layer(model, layers, batches, progress)
        else:
            report = _one_pass(model, layers, batches, progress, max_memory)
        if processes is None:
            return report
        # The batches of every process's shard (every process makes this call).
        batches_seen = int(statistics.all_processes_sum([report.batches or 0])[0])
    return dataclasses.replace(report, batches=batches_seen)


def _one_pass(
    model: keras.Model,
    layers: Sequence[keras.layers.Layer],
    batches: Batches,
    progress: bool,
    max_memory: int | None,
) -> RecalibrationReport:
    with _kept_on_failure(model, layers), ProgressBar(progress) as bar:
        result = one_pass.run(
            model, layers, batches, bar, check_max_memory(max_memory), per_layer=in_call_order
        )
    return RecalibrationReport(
        layers=result.changes,
        batches=result.batches,
        not_called=tuple(layers[i].name for i in result.not_called),
        strategy=result.strategy,
        passes=result.passes,
        peak_frontier_bytes=result.peak_frontier_bytes,
        spilled_bytes=result.spilled_bytes,
        fallbacks=result.fallbacks,
    )


def recalibrate_per_layer(
    model: keras.Model, layers: Sequence[keras.layers.Layer], batches: Batches, progress: bool
) -> RecalibrationReport:
    """The per-layer method on the whole model: one pass over `batches` per BN layer of
    `layers`, in the order the forward pass calls them. The reference the one pass is tested
    against, and the method for subclassed models. On failure `layers` keep their statistics."""
    first = _first_batch_everywhere(batches)
    with _kept_on_failure(model, layers), ProgressBar(progress) as bar:
        done = in_call_order(
            layers,
            lambda x: model(x, training=False),
            batches,
            first,
            batches.count,
            bar,
            batches.check_count,
            root=model,
        )
    return RecalibrationReport(
        layers=done.changes,
        batches=batches.count,
        not_called=tuple(layers[i].name for i in done.not_called),
        strategy="per_layer",
        passes=float(sum(change.passes for change in done.changes)),
    )


def _first_batch_everywhere(batches: Batches) -> Any:
    """The first batch, which the per-layer method traces to find the call order. Pooled over
    processes, every process learns whether each has one, and all raise if one has none
    (one raising alone would leave the others waiting for it in the first all-reduce).

    Raises:
        ValueError: `data` (or another process's) gives no batch.
    """
    try:
        first, missing = batches.first(), 0.0
    except ValueError:
        if not statistics.pooling():
            raise
        first, missing = None, 1.0
    if statistics.pooling() and statistics.all_processes_sum([missing])[0]:
        raise ValueError(
            "recalibrate(synchronized=True): the data of some process gave no batch, and a "
            "model without a layer graph (subclassed) needs one in every process's shard to "
            "find the order of its BN layers."
        )
    return first


@contextlib.contextmanager
def _kept_on_failure(model: keras.Model, layers: Sequence[keras.layers.Layer]) -> Iterator[None]:
    """Put the statistics of `layers` back if the block raises: the layers are set one after
    the other, and a failure part way would leave the model half recalibrated."""
    saved = Snapshot(
        [variable for layer in layers for variable in layer.non_trainable_variables],
        getattr(model, "distribute_strategy", None),  # TensorFlow's trainer only
    )
    try:
        yield
    except BaseException:
        saved.restore()
        raise


def _refuse_stateful_layers(model: keras.Model) -> None:
    """ValueError for a stateful layer (an RNN with `stateful=True`): its state carries from
    one batch to the next, so what the BNs after it receive depends on how often and in which
    order the batches run (the per-layer method runs them once per BN), and running them
    would change its state."""
    for layer in model._flatten_layers(include_self=False):
        if getattr(layer, "stateful", False) is True:
            raise ValueError(
                f"recalibrate: layer '{layer.name}' ({type(layer).__name__}) is stateful "
                f"(stateful=True): its state carries from one batch to the next, so the "
                f"inputs of the BN layers would depend on how often and in which order the "
                f"batches run, and recalibrating would change its state. Recalibrate a copy "
                f"of the model built with stateful=False and the same weights."
            )

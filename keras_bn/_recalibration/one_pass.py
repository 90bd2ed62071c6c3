"""`recalibrate`'s one pass: the model's graph run layer by layer over all the batches, each BN
layer recalibrated the moment the walk reaches it.

The per-layer method (`layerwise.in_call_order`) runs the whole model once per BN layer. Here
the nodes of a Sequential or Functional graph (nested ones walked through) run in the order
Keras's own `Functional._run_through_graph` runs them, cut into segments at the BN layers: a
segment runs, as one compiled tf.function, every node after one BN up to the next BN's input,
and records that input's moments as the per-layer method does (`_hooks.BatchNormCalls`, masks
read as the layer reads them). Once every batch has gone through a segment, its BN's Algorithm 2
statistics are set (`statistics.assign`), and the next segment starts with that BN: every
tensor a segment computes comes from nodes upstream of it, which already use their new
statistics, so each BN's statistics are exactly the per-layer method's. Between segments the
frontier (the tensors that later nodes still read, for every batch) is kept in a
`_frontier.Frontier`, in memory up to a budget and on disk past it. Nodes that lead to no BN
(the head) are not run.

A QAT layer that folds its BN (`keras_bn.quantize`) ends a segment as a BN does, its first
pass recorded inside the compiled segment. Its statistics decide how its kernel rounds, so it
may take more passes to reach a fixed point (`statistics.settle`: at most one more with
per-channel weight ranges, up to 10 in all with a per-tensor range): its inputs stay in the
frontier after its segment, and each further pass runs that layer alone over them, as one
compiled function per such layer kept with the segments' (a second recalibration traces
nothing again). A layer whose `call` hides BN layers (or QAT layers) from the graph (a custom
layer, a subclassed model inside the graph) is a segment boundary too, a "fallback": its BNs
are recalibrated by the per-layer method applied to that layer alone, over its inputs in the
frontier, one pass of that layer per BN (per settling pass, for a QAT layer).

Keras has no public API for running a graph's nodes one by one; this reads the internals that
`_run_through_graph` itself reads (`_nodes_by_depth`, each node's arguments), as
keras_bn/_graph/fold_plan.py does.

Under JAX the segments run eagerly, op by op: a jax.jit of a segment would bake the values of
the Keras variables it closes over in as constants, and each segment must read the statistics
the previous one just assigned.
"""

import dataclasses
import functools
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
from keras.src.backend import get_keras_mask, set_keras_mask
from keras.src.models.functional import Functional, operation_fn

from keras_bn import backend
from keras_bn._errors import UnsupportedModelError
from keras_bn._graph import bn_layers, models
from keras_bn._recalibration import statistics
from keras_bn._recalibration.batches import Batches
from keras_bn._recalibration.frontier import Frontier
from keras_bn._recalibration.hooks import BatchNormCalls, shared_error
from keras_bn._recalibration.progress import ProgressBar


def walkable(model: Any) -> bool:
    """Whether the walk can run `model`'s graph itself: a built Sequential or Functional model
    whose `call` is Keras's own (a subclass that overrides `call` computes something else)."""
    if isinstance(model, keras.Sequential):
        return type(model).call is keras.Sequential.call and model._functional is not None
    return isinstance(model, Functional) and type(model).call is Functional.call


@dataclasses.dataclass
class _Step:
    """One thing a forward pass does, in the walk's order.

    kind: "enter" (a model's call up to its graph: its inputs standardized, as Keras does),
    "call" (a node's operation), "record" (a BN's or a QAT layer's input moments) or
    "fallback" (the per-layer method on a layer that hides BNs). `reads` and `writes` are the
    tensors' canonical ids.
    """

    kind: str
    operation: Any
    node: Any  # its Keras node; None for the outer model's entry, which reads the data
    reads: list[int]
    writes: list[int]
    graph: Any = None  # "enter": the Functional whose inputs it writes
    layers: tuple[int, ...] = ()  # "record": (its BN's index); "fallback": the BNs inside
    # "record" of a layer that folds its BN (QAT): its inputs stay in the frontier after its
    # segment, for the settling passes of that layer alone (`statistics.settle`).
    settles: bool = False


@dataclasses.dataclass
class _Segment:
    """The steps one compiled function runs, then its boundary (a "record" step, run inside
    the function, or a "fallback" step, run after every batch went through)."""

    steps: list[_Step]
    boundary: _Step
    inputs: list[int] = dataclasses.field(default_factory=list)  # read from the frontier
    outputs: list[int] = dataclasses.field(default_factory=list)  # kept in the frontier


class Plan:
    """The walk of a model's graph: its steps, pruned to those that lead to a BN, and cut into
    segments.

    Args:
        model: a walkable model (`walkable`).
        layers: the BN layers to recalibrate; the others run as ordinary layers.

    Raises:
        ValueError: a BN layer of `layers` is called more than once per forward pass.
    """

    def __init__(self, model: keras.Model, layers: Sequence[keras.layers.Layer]) -> None:
        self.layers = layers
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        self._steps: list[_Step] = []
        self._canonical: dict[int, int] = {}  # tensor id → the id its value is kept under
        self.aliases: dict[int, list[int]] = {}  # canonical id → every id of that value
        self._recorded: set[int] = set()
        self.fallbacks: list[str] = []  # why each BN inside a layer is recalibrated per layer
        # (model, its graph) for every model walked: a nested Sequential's graph is rebuilt
        # by its `add` and `pop`, after which the plan no longer describes the model.
        self.graphs: list[tuple[keras.Model, Any]] = []
        self._walk(model, None, "")
        # One forward pass evaluates each node once: the unit of `passes`.
        self.nodes = sum(step.kind == "call" for step in self._steps)
        self.steps = _needed(self._steps)
        self.segments, self.last_read = _segments(self.steps)

    @property
    def current(self) -> bool:
        """Whether every model walked still has the graph it was walked with (a Sequential
        emptied by `pop` has none)."""
        try:
            return all(
                models.layer_graph(model, "recalibrate") is graph for model, graph in self.graphs
            )
        except UnsupportedModelError:
            return False

    def _id(self, tensor: Any) -> int:
        return self._canonical[id(tensor)]

    def _new(self, tensor: Any) -> int:
        self._canonical[id(tensor)] = id(tensor)
        self.aliases[id(tensor)] = [id(tensor)]
        return id(tensor)

    def _inside(self, operation: Any) -> list[int]:
        """The indices of the BNs to recalibrate that `operation` is or holds."""
        if id(operation) in self._index:
            return [self._index[id(operation)]]
        if not isinstance(operation, keras.layers.Layer):
            return []
        return [
            self._index[id(layer)]
            for layer in bn_layers.in_model(operation)
            if id(layer) in self._index
        ]

    def _record(self, indices: Sequence[int]) -> None:
        for index in indices:
            if index in self._recorded:
                raise shared_error(self.layers[index])
            self._recorded.add(index)

    def _walk(self, model: keras.Model, node: Any, prefix: str) -> None:
        graph = models.layer_graph(model, "recalibrate")
        self.graphs.append((model, graph))
        reads = [] if node is None else [self._id(t) for t in node.input_tensors]
        writes = [self._new(t) for t in graph.inputs]
        self._steps.append(_Step("enter", model, node, reads, writes, graph=graph))
        for depth in sorted(graph._nodes_by_depth, reverse=True):
            for inner in graph._nodes_by_depth[depth]:
                if inner.operation is None or inner.is_input:
                    continue
                # As Keras does: a node whose inputs are not computed is skipped.
                if any(id(t) not in self._canonical for t in inner.input_tensors):
                    continue
                self._visit(inner, prefix)

    def _visit(self, node: Any, prefix: str) -> None:
        operation = node.operation
        inside = self._inside(operation)
        reads = [self._id(t) for t in node.input_tensors]
        if id(operation) in self._index:
            self._record(inside)
            settles = bn_layers.folds_batch_norm(operation)
            self._steps.append(
                _Step("record", operation, node, reads, [], layers=(inside[0],), settles=settles)
            )
        elif inside and walkable(operation):
            self._walk(operation, node, f"{prefix}{operation.name}/")
            inner_graph = models.layer_graph(operation, "recalibrate")
            for outer, inner in zip(node.outputs, inner_graph.outputs):
                if id(inner) in self._canonical:  # the same value under the outer node's id
                    canonical = self._id(inner)
                    self._canonical[id(outer)] = canonical
                    self.aliases[canonical].append(id(outer))
            return
        elif inside:
            self._record(inside)
            self._steps.append(_Step("fallback", operation, node, reads, [], layers=tuple(inside)))
            hidden = {id(self.layers[i]) for i in inside}
            self.fallbacks += [
                f"{prefix}{operation.name}/{path}: inside '{operation.name}' "
                f"({type(operation).__name__}), whose call the graph walk cannot see into; "
                f"recalibrated by the per-layer method on '{operation.name}' alone"
                for path, bn in bn_layers.batch_norms_inside(operation)
                if id(bn) in hidden
            ]
        self._steps.append(
            _Step("call", operation, node, reads, [self._new(t) for t in node.outputs])
        )


def _needed(steps: list[_Step]) -> list[_Step]:
    """The steps that lead to a boundary (what comes after the last BN, the head, does not)."""
    needed: set[int] = set()
    kept = []
    for step in reversed(steps):
        if step.kind in ("record", "fallback") or needed.intersection(step.writes):
            kept.append(step)
            needed.update(step.reads)
    return kept[::-1]


def _segments(steps: list[_Step]) -> tuple[list[_Segment], dict[int, float]]:
    """`steps` cut after each boundary, with what each segment reads from the frontier and
    keeps in it; and for each tensor the last segment that reads it (+0.5 for a fallback, or
    a QAT layer's record, which read after their segment)."""
    segments: list[_Segment] = []
    current: list[_Step] = []
    for step in steps:
        if step.kind == "record":
            segments.append(_Segment(current + [step], step))
            current = []
        elif step.kind == "fallback":
            segments.append(_Segment(current, step))
            current = []
        else:
            current.append(step)
    produced: dict[int, int] = {}  # tensor → the segment that computes it
    last_read: dict[int, float] = {}
    for number, segment in enumerate(segments):
        for step in segment.steps:
            for tensor in step.reads:
                if produced[tensor] < number and tensor not in segment.inputs:
                    segment.inputs.append(tensor)
                last_read[tensor] = number
            for tensor in step.writes:
                produced[tensor] = number
        if segment.boundary.kind == "fallback" or segment.boundary.settles:
            for tensor in segment.boundary.reads:
                last_read[tensor] = max(last_read.get(tensor, 0), number + 0.5)
    for tensor, number in produced.items():
        if last_read.get(tensor, -1) > number:
            segments[number].outputs.append(tensor)
    return segments, last_read


@dataclasses.dataclass(frozen=True)
class Result:
    """What `run` did.

    Attributes:
        changes: one `LayerChange` per BN recalibrated, in the order the forward pass calls
            them.
        not_called: indices (into the layers) of the BNs the walk never reached.
        batches: the number of batches.
        strategy: "one_pass", or "one_pass_spilled" when the frontier went to disk.
        passes: the node evaluations, in forward passes over the data (see
            `RecalibrationReport`).
        peak_frontier_bytes: the most bytes the frontier held in memory at once.
        spilled_bytes: the bytes it wrote to disk.
        fallbacks: for each BN recalibrated by the per-layer method inside a layer that
            hides it, its path and why.
    """

    changes: tuple[statistics.LayerChange, ...]
    not_called: tuple[int, ...]
    batches: int | None
    strategy: str
    passes: float
    peak_frontier_bytes: int
    spilled_bytes: int
    fallbacks: tuple[str, ...]


def run(
    model: keras.Model,
    layers: Sequence[keras.layers.Layer],
    batches: Batches,
    bar: ProgressBar,
    max_memory: int,
    per_layer: Callable[..., statistics.Recalibrated],
) -> Result:
    """Recalibrate `layers` of a walkable `model` in one pass over `batches`.

    Args:
        model: a Sequential or Functional model (`walkable`).
        layers: its BN layers to recalibrate; the others keep their statistics.
        batches: the input batches.
        bar: the progress bar.
        max_memory: the bytes the frontier may hold in memory before it spills to disk.
        per_layer: the per-layer method (`layerwise.in_call_order`), for the BN layers a
            custom layer hides from the walk: the one pass runs that layer as one node.

    Returns:
        A `Result`.

    Raises:
        ValueError: a BN layer is shared; `data` gives no batch, or no batch with 2 values
            per channel for some layer; a layer's statistics come out NaN or inf.
    """
    compiled = _compiled(model, layers)
    plan = compiled.plan
    if not plan.segments:  # the forward pass reaches none of the layers
        batches.first()  # data that gives no batch is an error all the same
        return Result((), tuple(range(len(layers))), batches.count, "one_pass", 0.0, 0, 0, ())
    recorded = sum(segment.boundary.kind == "record" for segment in plan.segments)
    bar.add_total(recorded * batches.count if batches.count is not None else None)
    changes: list[statistics.LayerChange] = []
    not_called: list[int] = []
    evaluations = sum(step.kind == "call" for step in plan.steps)  # per batch
    with compiled.statistics, Frontier(max_memory) as kept:
        count = 0
        for number, segment in enumerate(plan.segments):
            boundary = segment.boundary
            sums = statistics.PooledMoments()
            before = None
            if boundary.kind == "record":
                layer = layers[boundary.layers[0]]
                bar.set_description(layer.name)
                sums = statistics.PooledMoments.for_layer(bn_layers.statistics_of(layer))
                # A QAT layer's first settling pass is the one its segment records.
                before = statistics.start_afresh(layer) if boundary.settles else None
            for batch, outputs, moments in compiled.segment(number, batches, kept, count):
                for tensor in segment.inputs:
                    if plan.last_read[tensor] <= number:
                        kept.drop(tensor, batch)
                for tensor, (value, mask) in zip(segment.outputs, outputs):
                    kept.put(tensor, batch, value, mask)
                if boundary.kind == "record":
                    sums.add(*moments)
                    bar.update(1)
                count = max(count, batch + 1)
            if number == 0:
                # No batch raises, unless other processes' shards pool with this one's (an
                # empty shard adds nothing; raising alone would leave them waiting for it).
                if not count and not statistics.pooling():
                    batches.first()  # raises: `data` gave no batch
                batches.check_count(count)
            if boundary.kind == "record" and not boundary.settles:
                changes.append(statistics.assign(layers[boundary.layers[0]], sums))
            elif boundary.kind == "record":
                change = statistics.settle(
                    layers[boundary.layers[0]],
                    _settling_passes(compiled, number, sums, kept, count, bar),
                    functools.partial(bar.add_total, count),
                    before,
                )
                changes.append(change)
                evaluations += change.passes - 1  # the layer alone, once per batch per pass
            else:
                done = per_layer(
                    [layers[i] for i in boundary.layers],
                    functools.partial(_call_bound, compiled, boundary),
                    _FrontierInputs(kept, boundary.reads, count),
                    next(iter(_FrontierInputs(kept, boundary.reads, 1))),
                    count,
                    bar,
                    root=boundary.operation,
                )
                changes += done.changes
                not_called += [boundary.layers[i] for i in done.not_called]
                evaluations += sum(change.passes for change in done.changes)  # one per pass
            # The boundary's inputs that no later segment reads.
            for tensor in set(boundary.reads):
                if plan.last_read[tensor] == number + 0.5:
                    for batch in range(count):
                        kept.drop(tensor, batch)
    reached = {index for segment in plan.segments for index in segment.boundary.layers}
    return Result(
        changes=tuple(changes),
        not_called=tuple(sorted(set(range(len(layers))) - reached | set(not_called))),
        batches=count,
        strategy="one_pass_spilled" if kept.spilled else "one_pass",
        passes=evaluations / max(plan.nodes, 1),
        peak_frontier_bytes=kept.peak_bytes,
        spilled_bytes=kept.spilled_bytes,
        fallbacks=tuple(plan.fallbacks),
    )


def _settling_passes(
    compiled: "_Compiled",
    number: int,
    first: statistics.PooledMoments,
    frontier: Frontier,
    count: int,
    bar: ProgressBar,
) -> Callable[[], statistics.PooledMoments]:
    """`settle`'s passes for the QAT layer at the boundary of segment `number`: the moments
    its segment recorded (`first`), then, for each later pass, those of that layer alone run
    over its inputs kept in the frontier."""
    passes = iter([first])
    layer = compiled.plan.layers[compiled.plan.segments[number].boundary.layers[0]]

    def pooled() -> statistics.PooledMoments:
        recorded = next(passes, None)
        if recorded is not None:
            return recorded
        sums = statistics.PooledMoments.for_layer(bn_layers.statistics_of(layer))
        for moments in compiled.settling_pass(number, frontier, count):
            sums.add(*moments)
            bar.update(1)
        return sums

    return pooled


class _FrontierInputs:
    """The frontier's (value, mask) pairs of some tensors, one tuple per batch: the inputs of
    a layer that hides BNs, re-iterable for each of its per-layer passes."""

    def __init__(self, frontier: Frontier, tensors: list[int], count: int) -> None:
        self._frontier, self._tensors, self._count = frontier, tensors, count

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        for batch in range(self._count):
            yield tuple(self._frontier.get(tensor, batch) for tensor in self._tensors)


# The attribute of a model that keeps its `_Compiled` plans, as Keras keeps `predict_function`.
_CACHE = "_keras_bn_recalibration"
_CACHED_PLANS = 4  # per model: recalibrate's (every BN) and the callback's (the trainable ones)


class _Cache:
    """A model's compiled plans, by the layers they recalibrate; a copy of the model starts
    with none (the plans hold the original's layers)."""

    def __init__(self) -> None:
        self.plans: list[_Compiled] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> "_Cache":
        return _Cache()


def _compiled(model: keras.Model, layers: Sequence[keras.layers.Layer]) -> "_Compiled":
    """The model's `_Compiled` plan for `layers`, made (and kept on the model) if it has none
    for them or the graph of the model or of a model nested in it has changed since (a
    Sequential's `add` or `pop`)."""
    cache = model.__dict__.get(_CACHE)
    if not isinstance(cache, _Cache):
        cache = _Cache()
        object.__setattr__(model, _CACHE, cache)  # untracked: not a layer, nor saved
    cache.plans = [compiled for compiled in cache.plans if compiled.plan.current]
    for compiled in cache.plans:
        if len(compiled.plan.layers) == len(layers) and all(
            a is b for a, b in zip(compiled.plan.layers, layers)
        ):
            return compiled
    compiled = _Compiled(model, layers)
    cache.plans = [compiled, *cache.plans][:_CACHED_PLANS]
    return compiled


class _Compiled:
    """A `Plan` with each segment as a tf.function, and the BN hooks its tracing records
    through. Kept on the model, so that recalibrating it again (the callback does, before
    each validation) traces nothing again: like Keras's predict function, the functions read
    the model's variables when they run, and trace again only for new input shapes. Under
    JAX each segment is its plain Python function, run eagerly (see the module's docstring).

    Args:
        model: a walkable model.
        layers: the BN layers to recalibrate.
    """

    def __init__(self, model: keras.Model, layers: Sequence[keras.layers.Layer]) -> None:
        self.plan = Plan(model, list(layers))
        recorded = [s.boundary.layers[0] for s in self.plan.segments if s.boundary.kind == "record"]
        self.statistics = BatchNormCalls([layers[i] for i in recorded])
        self._position = {index: k for k, index in enumerate(recorded)}
        # Without autograph, as Keras traces its own predict function (the layers' calls are
        # Keras's to trace; the walk itself has no tensor-dependent control flow).
        self._functions = [
            backend.get().compiled(self._body(segment, first=number == 0), autograph=False)
            for number, segment in enumerate(self.plan.segments)
        ]
        # A QAT layer's settling passes after its segment's: the layer alone, on its inputs.
        self._settling = {
            number: backend.get().compiled(self._settling_body(segment.boundary), autograph=False)
            for number, segment in enumerate(self.plan.segments)
            if segment.boundary.settles
        }

    def segment(
        self, number: int, batches: Batches, frontier: Frontier, count: int
    ) -> Iterator[tuple[int, Any, Any]]:
        """Run segment `number` on each batch: the data for the first, the frontier's
        entries of the `count` batches for the others. Yields (batch, its outputs' (value,
        mask) pairs, its BN's input moments)."""
        function = self._functions[number]
        if number == 0:
            for batch, x in enumerate(batches):
                yield (batch, *function(x))
            return
        inputs = self.plan.segments[number].inputs
        # One trace for every batch's entries, so that a smaller last batch traces nothing.
        function = backend.get().specialized(
            function, [[frontier.signature(t, batch) for batch in range(count)] for t in inputs]
        )
        for batch in range(count):
            outputs = function(tuple(frontier.get(tensor, batch) for tensor in inputs))
            yield (batch, *outputs)

    def settling_pass(self, number: int, frontier: Frontier, count: int) -> Iterator[Any]:
        """Run the QAT layer at segment `number`'s boundary alone on its inputs' frontier
        entries for each of the `count` batches. Yields its input moments, batch by batch."""
        reads = self.plan.segments[number].boundary.reads
        function = backend.get().specialized(
            self._settling[number],
            [[frontier.signature(t, batch) for batch in range(count)] for t in reads],
        )
        for batch in range(count):
            yield function(tuple(frontier.get(tensor, batch) for tensor in reads))

    def bound(self, tensors: Sequence[int], entries: Sequence[Any]) -> dict[int, Any]:
        """{tensor id: value} for every id of `tensors`' values, their masks attached."""
        values: dict[int, Any] = {}
        for tensor, (value, mask) in zip(tensors, entries):
            if mask is not None:
                set_keras_mask(value, mask)
            self._bind(values, tensor, value)
        return values

    def _bind(self, values: dict[int, Any], tensor: int, value: Any) -> None:
        for alias in self.plan.aliases[tensor]:
            values[alias] = value

    def _body(self, segment: _Segment, first: bool) -> Any:
        """The segment as a function of its frontier entries (or, for the `first`, the data):
        its outputs' (value, mask) pairs and its BN's input moments."""

        def body(entries: Any) -> tuple[tuple[Any, ...], Any]:
            values = {} if first else self.bound(segment.inputs, entries)
            moments: Any = ()
            for step in segment.steps:
                if step.kind == "enter":
                    inputs = _graph_inputs(step, values, entries)
                    for tensor, value in zip(step.writes, inputs):
                        self._bind(values, tensor, value)
                elif step.kind == "call":
                    outputs = keras.tree.flatten(_call(step, values))
                    for tensor, value in zip(step.writes, outputs):
                        self._bind(values, tensor, value)
                else:
                    # Its moments only: nothing reads the layer's output here.
                    recorded = self.statistics.record(
                        functools.partial(_call, step, values), outputs=False
                    )
                    moments = recorded[self._position[step.layers[0]]]
            outputs = tuple((values[t], get_keras_mask(values[t])) for t in segment.outputs)
            return outputs, moments

        return body

    def _settling_body(self, step: _Step) -> Any:
        """A "record" step alone, as a function of its inputs' frontier entries: its layer's
        input moments."""
        position = self._position[step.layers[0]]

        def body(entries: Any) -> Any:
            values = self.bound(step.reads, entries)
            call = functools.partial(_call, step, values)
            return self.statistics.record(call, outputs=False)[position]

        return body


def _call_bound(compiled: _Compiled, step: _Step, entries: Sequence[Any]) -> Any:
    """A "fallback" step's layer run on its inputs' frontier entries (value, mask pairs)."""
    return _call(step, compiled.bound(step.reads, entries))


def _call(step: _Step, values: dict[int, Any]) -> Any:
    """The step's node run on `values`, in inference mode as `model(x, training=False)` runs
    it."""
    args, kwargs = step.node.arguments.fill_in(values)
    with _name_scope():
        return operation_fn(step.operation, training=False)(*args, **kwargs)


def _name_scope() -> Any:
    """A TensorFlow name scope for the walk's calls: inside a model's call every layer's name
    scope has a parent; at the root, TensorFlow refuses a layer name such as "_private". JAX
    has none to refuse."""
    return backend.get().name_scope("recalibrate")


class _Entered(Exception):
    """Raised from a model's `_run_through_graph` to stop its call there."""


def _clear_frames(error: BaseException) -> None:
    """Clear the locals of the frames in `error`'s tracebacks (and those of the exceptions it
    chains): they hold the batch, and a frame that holds the exception itself (Keras's
    rewrapping) makes a reference cycle that would keep each batch alive until the cycle
    collector runs, where a streamed batch must be freed once it is done."""
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]


def _graph_inputs(step: _Step, values: dict[int, Any], data: Any) -> list[Any]:
    """The inputs of an "enter" step's graph, as the model's own call prepares them (its
    dtype policy, `_standardize_inputs`, masks): the call runs up to its graph, where it is
    stopped."""
    entered: list[list[Any]] = []

    def enter(inputs: Any, operation_fn: Any = None, call_fn: Any = None) -> Any:
        entered.append(keras.tree.flatten(inputs))
        raise _Entered()

    graph = step.graph
    own = graph.__dict__.get("_run_through_graph")
    object.__setattr__(graph, "_run_through_graph", enter)
    try:
        if step.node is None:
            with _name_scope():
                step.operation(data, training=False)
        else:
            _call(step, values)
    except Exception as error:
        # Keras rewraps an exception from inside a call (to add its arguments to the message):
        # whatever comes out, the graph was reached when `entered` holds its inputs.
        if not entered:
            raise
        _clear_frames(error)
    finally:
        if own is None:
            object.__delattr__(graph, "_run_through_graph")
        else:
            object.__setattr__(graph, "_run_through_graph", own)
    if not entered:
        raise RuntimeError(f"Model '{step.operation.name}' returned without running its graph.")
    return entered[0]

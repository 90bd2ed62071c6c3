"""check_batchnorm: the batch-normalization mistakes that raise no error, for any Keras model.

Statistics that never moved or drifted from the data, inputs that are NaN or inf, batches too
small for batch statistics, "good in training, bad at inference", and BNs the fold must keep,
each reported as a `Finding`. Exported as `keras_bn.diagnostics.check_batchnorm`, with
`Finding`, `Findings`, `KINDS` and the thresholds.
"""

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import keras
import numpy as np

from keras_bn import backend
from keras_bn._errors import UnsupportedModelError
from keras_bn._graph import augmentation as _augmentation
from keras_bn._graph import bn_layers, fold_plan
from keras_bn._recalibration import hooks
from keras_bn._recalibration.batches import Batches, Data, input_count
from keras_bn._recalibration.statistics import PooledMoments

#: stale_statistics: the largest |moving mean − input mean|, in input standard deviations.
STALE_MEAN_SHIFT = 0.5
#: stale_statistics: moving variance / input variance (both + ε) outside [1/2, 2].
STALE_VARIANCE_RATIO = 2.0
#: train_inference_gap: RMS(training − inference output) / RMS spread of the inference output.
GAP_THRESHOLD = 0.5
#: small_batch: the fewest values per channel in one batch (batch × spatial positions).
MIN_VALUES_PER_CHANNEL = 16

#: The kinds of `Finding`, in the order a layer's findings are listed.
KINDS = ("stale_statistics", "non_finite", "small_batch", "train_inference_gap", "unfoldable")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem `check_batchnorm` found.

    Attributes:
        layer: the BN layer's path, e.g. "backbone/batch_normalization_3" for a BN in the nested
            model "backbone" (the model's own name for `train_inference_gap`).
        kind: one of `KINDS`: "stale_statistics", "non_finite", "small_batch",
            "train_inference_gap", "unfoldable" (see `check_batchnorm`).
        message: what was measured, against which threshold, and what to do.
    """

    layer: str
    kind: str
    message: str


class Findings(list[Finding]):
    """The list of `Finding` objects that `check_batchnorm` returns; `str()` of it is a table.

    Args:
        findings: the `Finding` objects, in order.
        layers_checked: how many BN layers were checked (for the table's first line).

    Attributes:
        layers_checked: how many BN layers were checked.
    """

    def __init__(self, findings: Iterable[Finding] = (), layers_checked: int = 0) -> None:
        super().__init__(findings)
        self.layers_checked = layers_checked

    def __str__(self) -> str:
        if not self:
            return f"check_batchnorm: no finding in {self.layers_checked} BN layer(s)."
        rows = [("layer", "kind", "message")] + [(f.layer, f.kind, f.message) for f in self]
        widths = [max(len(row[i]) for row in rows) for i in range(2)]
        lines = [f"check_batchnorm: {len(self)} finding(s) in {self.layers_checked} BN layer(s)."]
        for i, (layer, kind, message) in enumerate(rows):
            lines.append(f"{layer:<{widths[0]}}  {kind:<{widths[1]}}  {message}")
            if i == 0:
                lines.append(f"{'-' * widths[0]}  {'-' * widths[1]}  {'-' * 7}")
        return "\n".join(lines)


def check_batchnorm(
    model: keras.Model,
    data: Data | None = None,
    *,
    batch_size: int = 32,
    steps: int | None = None,
) -> Findings:
    """Look for the batch-normalization mistakes that raise no error.

    Every `keras_bn.BatchNormalization` and `keras.layers.BatchNormalization` of `model` is
    checked, nested models included. The kinds of finding, and their thresholds (the module
    constants of the same names):

    - `stale_statistics`: the moving mean and variance are still exactly their initial values
      (the layer never ran in training mode: a custom loop that calls `model(x)` without
      `training=True`), or not finite; or, on `data`, the moving mean is more than
      `STALE_MEAN_SHIFT` = 0.5 standard deviations from the mean of the layer's input in some
      channel, or the moving variance is more than `STALE_VARIANCE_RATIO` = 2 times larger or
      smaller than the input's variance (both + epsilon). The input is what the layer gets at
      inference (upstream BNs use their moving statistics); its mean and variance are pooled
      over the batches of `data` in the layer's own convention (within-batch variances,
      m/(m−1) for keras_bn; a mask read as the layer reads it, per channel, as
      `keras_bn.recalibrate` pools), which is what the moving average estimates; a channel no
      batch gives 2 values is not compared. Training-time augmentation makes the statistics far
      from un-augmented `data` as well: when layers that change their input only in training
      (Keras's random image preprocessing layers, e.g. RandomTranslation or RandomFlip, and
      GaussianNoise, GaussianDropout, AlphaDropout, Dropout) are upstream of the BN, the message
      names them and advises recalibrating on un-augmented data; without them it names
      augmentation in the input pipeline as a possible cause. For a frozen BN (trainable=False)
      the message says so rather than advise recalibrating: the layers after it are trained for
      its statistics.
    - `non_finite`: on `data` (itself finite), the layer's input is NaN or inf: an upstream
      weight or statistic is not finite.
    - `small_batch`: the batches of `data` give a layer fewer than `MIN_VALUES_PER_CHANNEL` =
      16 values per channel (batch size × spatial positions, unmasked only; the median over
      batches of each batch's median channel, so a short last batch does not count): its
      batch mean and variance are too noisy to train with.
    - `train_inference_gap`: on `data`, the model's outputs with every BN in training mode
      (batch statistics; the other layers, Dropout included, infer) differ from its inference
      outputs by more than `GAP_THRESHOLD` = 0.5, measured as the RMS difference over the RMS
      spread of the inference outputs around their batch mean (all outputs pooled; a batch
      that leaves some BN channel m ≤ 1 values, e.g. a last batch of one sample, is left out:
      it has no batch statistics, and BN outputs β for it). Batch noise
      alone gives some gap (more for Dense→BN, whose m is the batch size, than after a
      convolution); the threshold sits above it for healthy models. Reported once, for the
      model; the message names the BN whose statistics are furthest from its input's.
    - `unfoldable`: `keras_bn.export.fold_batch_norms(model)` would keep this BN (as an
      affine layer), with the fold's reason; or the fold never reaches it (a BN inside a
      custom layer); or the fold cannot take the whole model (`UnsupportedModelError`: a
      subclassed model, a layer whose config does not round-trip). A BN whose inference
      scale or shift is not finite (NaN or inf statistics, γ or β), which the fold refuses, is
      reported as unfoldable itself, and the fold is then not run for the other BNs. Any
      other error of the fold propagates.

    Without `data` only the initial-value and fold checks run. The model is left exactly as
    found (training-mode passes move the statistics; they are put back after every batch).

    Args:
        model: a built Keras model (Sequential, Functional, subclassed, nested).
        data: optional batches, as for `keras_bn.recalibrate`: a `tf.data.Dataset` (finite,
            or with `steps`), whole arrays (an array, a dict or a list of them, or `(x, y)` of
            those; split into batches of `batch_size`), or an iterable of batches; `(x, y)`
            and `(x, y, sample_weight)` elements use `x`. Give batches of the size you train
            with: the small-batch and gap checks depend on it.
        batch_size: batch size for numpy-array (or dict of arrays) data.
        steps: how many batches of `data` to use; None uses them all.

    Returns:
        `Findings`: a list of `Finding(layer, kind, message)`, in the model's layer order
        (empty when nothing is wrong); `str()` of it is a table.

    Raises:
        ValueError: the model has no BN layer or is not built, `data` has a NaN or inf,
            `steps`/`batch_size` is not a positive int, the dataset is infinite without
            `steps`, `data` gives no batch, or a BN layer is called twice in one forward pass
            (shared).
        UnsupportedModelError: the model holds quantization-aware layers with folded batch
            norms (`keras_bn.quantize`); check the float model before quantizing it.
    """
    bn_layers.refuse_folded(model, "check_batchnorm")
    layers = bn_layers.in_model(model)
    if not layers:
        raise ValueError(f"Model '{model.name}' has no BatchNormalization layer to check.")
    unbuilt = [layer.name for layer in layers if not layer.built]
    if unbuilt:
        raise ValueError(f"check_batchnorm needs a built model; layers {unbuilt} are not built.")
    paths = _bn_paths(model)
    findings = [
        Finding(paths[id(layer)], "stale_statistics", message)
        for layer in layers
        for message in [_stale_without_data(layer)]
        if message
    ]
    if data is not None:
        batches = Batches(data, steps, batch_size, inputs=input_count(model))
        stale = {f.layer for f in findings}
        findings += _data_findings(model, layers, paths, batches, skip=stale)
    findings += _unfoldable(model, layers, paths)
    order = {path: i for i, path in enumerate(paths[id(layer)] for layer in layers)}
    findings.sort(key=lambda f: (order.get(f.layer, len(order)), KINDS.index(f.kind)))
    return Findings(findings, layers_checked=len(layers))


def _stale_without_data(layer: keras.layers.Layer) -> str | None:
    """The stale_statistics message that needs no data, or None."""
    statistics = [v.numpy() for v in (layer.moving_mean, layer.moving_variance)]
    if not all(np.all(np.isfinite(s)) for s in statistics):
        return (
            "moving mean or variance is not finite (NaN or inf): training diverged or the "
            "statistics were overwritten; run keras_bn.recalibrate"
        )
    if _at_initial_values(layer):
        if not layer.trainable:
            return "moving mean and variance are still their initial values" + _FROZEN
        return (
            "moving mean and variance are still their initial values: the layer never ran "
            "in training mode (a custom loop must call model(x, training=True)); or run "
            "keras_bn.recalibrate"
        )
    return None


# The advice for a frozen BN: recalibrating it, the advice for the others, would change the
# function the layers after it were trained with.
_FROZEN = (
    ": the layer is frozen (trainable=False), so fit never updates them, and the layers "
    "after it are trained for these values (recalibrating it would change the trained "
    "model); unfreeze it, or load the statistics it was trained with, if that is not "
    "intended"
)


def _bn_paths(model: keras.Model) -> dict[int, str]:
    """{id(BN layer): "outer/inner/name"}, the naming of the fold's report."""
    paths: dict[int, str] = {}
    for path, layer in bn_layers.batch_norms_inside(model):
        paths.setdefault(id(layer), path)
    return paths


def _at_initial_values(layer: keras.layers.Layer) -> bool:
    """Both statistics equal their (deterministic) initializers' values exactly."""
    pairs = (
        (layer.moving_mean, layer.moving_mean_initializer),
        (layer.moving_variance, layer.moving_variance_initializer),
    )
    for variable, initializer in pairs:
        first, second = (
            backend.to_numpy(initializer(variable.shape, dtype=variable.dtype)) for _ in range(2)
        )
        if not np.array_equal(first, second) or not np.array_equal(variable.numpy(), first):
            return False
    return True


def _data_findings(
    model: keras.Model,
    layers: Sequence[keras.layers.Layer],
    paths: dict[int, str],
    batches: Batches,
    skip: set[str],
) -> list[Finding]:
    """stale_statistics (far from the data), small_batch and train_inference_gap on `data`."""
    sums = [PooledMoments.for_layer(layer) for layer in layers]
    counts: list[list[float]] = [[] for _ in layers]  # each batch's median m_c
    difference = spread = 0.0
    training_statistics = hooks.bn_statistics(model)
    # One shadowing of the BN calls for both passes: `record` makes the BNs infer and records
    # their inputs; outside it they are forced into training mode (batch statistics) while
    # every other layer, Dropout included, infers.
    with hooks.BatchNormCalls(layers, training=True, root=model) as statistics:

        def infer_and_record(x: Any) -> tuple[dict[int, hooks.Moments], Any]:
            outputs = []
            recorded = statistics.record(lambda: outputs.append(model(x, training=False)))
            return recorded, outputs[0]

        def train(x: Any) -> Any:
            return model(x, training=False)  # the BNs forced into training mode

        # Compiled on TensorFlow; eager under JAX, where a jax.jit would bake in the statistics.
        infer = backend.get().compiled(infer_and_record)
        train = backend.get().compiled(train)
        for number, x in enumerate(batches):
            _check_finite(x, number)
            recorded, inferred = infer(x)
            degenerate = False  # some BN channel gets m ≤ 1: no batch statistics, it outputs β
            for index, (mean, variance, count) in recorded.items():
                count = backend.to_numpy(count)
                counts[index].append(float(np.median(count)))
                sums[index].add(mean, variance, count)  # skips m ≤ 1
                degenerate = degenerate or bool(np.any(count < 2))
            if degenerate:  # no training-mode pass: its outputs would be the guard's (and a
                continue  # static batch of one sample is an error in training mode)
            try:
                trained = _flat(train(x))
            finally:
                training_statistics.restore()
            inferred = _flat(inferred)
            for a, b in zip(trained, inferred):
                difference += float(np.sum(np.square(a - b)))
                spread += float(np.sum(np.square(b - b.mean(axis=0))))
    findings: list[Finding] = []
    furthest: tuple[float, str | None] = (0.0, None)  # (distance, path) of the furthest BN
    upstream = _augmentation.upstream_augmentation(model)
    for index in statistics.order:
        layer, path = layers[index], paths[id(layers[index])]
        augmentation = upstream.get(id(layer), [])
        typical = float(np.median(counts[index]))
        if typical < MIN_VALUES_PER_CHANNEL:
            findings.append(
                Finding(
                    path,
                    "small_batch",
                    (
                        f"the batches of `data` give it m={typical:g} values per channel "
                        "(median over batches; batch × spatial positions), fewer than "
                        f"{MIN_VALUES_PER_CHANNEL}: batch statistics that noisy hurt training; "
                        "use larger batches or renorm=True"
                    ),
                )
            )
        if sums[index].batches == 0:
            continue
        # Only the channels some batch gave 2 values: the others have no statistics to compare.
        seen = sums[index].seen
        mean, variance = sums[index].population(bn_layers.unbiased_variance(layer))
        if not (np.all(np.isfinite(mean[seen])) and np.all(np.isfinite(variance[seen]))):
            findings.append(
                Finding(
                    path,
                    "non_finite",
                    (
                        "its input is not finite on `data` (NaN or inf) although `data` is: "
                        "an upstream weight or statistic is not finite"
                    ),
                )
            )
            continue
        distance, message = _distance_from_data(layer, mean, variance, seen, augmentation)
        furthest = max(furthest, (distance, path), key=lambda pair: pair[0])
        if message and path not in skip:
            findings.append(Finding(path, "stale_statistics", message))
    if not np.isfinite(difference + spread):
        findings.append(
            Finding(
                model.name,
                "train_inference_gap",
                (
                    "on `data`, the outputs with batch statistics or with the moving "
                    "statistics are not finite (NaN or inf): check the findings above"
                ),
            )
        )
        return findings
    gap = np.sqrt(difference / spread) if spread > 0 else (0.0 if difference == 0 else np.inf)
    if gap > GAP_THRESHOLD:
        where = (
            f"; the BN furthest from its input's statistics is '{furthest[1]}'"
            if furthest[1]
            else ""
        )
        findings.append(
            Finding(
                model.name,
                "train_inference_gap",
                (
                    f"on `data`, outputs with batch statistics differ from inference outputs by "
                    f"{gap:.3g} of their spread (threshold {GAP_THRESHOLD}){where}: train "
                    "with larger or shuffled batches, or check the findings above"
                ),
            )
        )
    return findings


def _flat(outputs: Any) -> list[np.ndarray]:
    return [backend.to_numpy(t, np.float64) for t in keras.tree.flatten(outputs)]


def _check_finite(x: Any, number: int) -> None:
    for array in keras.tree.flatten(x):
        array = backend.to_numpy(array)
        if np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
            raise ValueError(
                f"check_batchnorm: batch {number} of `data` has {array[where]} at "
                f"index {where}; the checks need finite data."
            )


def _distance_from_data(
    layer: keras.layers.Layer,
    mean: np.ndarray,
    variance: np.ndarray,
    seen: np.ndarray,
    augmentation: Sequence[str] = (),
) -> tuple[float, str | None]:
    """(largest standardized distance, message or None) between the moving statistics and the
    input's pooled statistics on `data`, in the channels `seen` (the others score 0);
    `augmentation` names the training-time augmentation layers upstream of the layer, for the
    advice."""
    epsilon = layer.epsilon
    moving_mean = layer.moving_mean.numpy().astype(np.float64).ravel()
    moving_variance = layer.moving_variance.numpy().astype(np.float64).ravel()
    seen = np.broadcast_to(seen, np.shape(mean)).ravel()
    mean, variance = (
        np.where(seen, mean.ravel(), moving_mean),
        np.where(seen, variance.ravel(), moving_variance),
    )
    shift = np.abs(moving_mean - mean) / np.sqrt(variance + epsilon)
    ratio = (moving_variance + epsilon) / (variance + epsilon)
    fold = np.maximum(ratio, 1 / ratio)
    limit = STALE_VARIANCE_RATIO
    checks = (  # (score per channel, value shown, threshold, what, the channels counted)
        (
            shift,
            shift,
            STALE_MEAN_SHIFT,
            "moving mean is {:.3g} standard deviations from its input's mean",
            f"beyond {STALE_MEAN_SHIFT}",
        ),
        (
            fold,
            ratio,
            limit,
            "moving variance is {:.3g} × its input's variance",
            f"outside [1/{limit:g}, {limit:g}]",
        ),
    )
    problems = []
    for score, shown, threshold, what, counted in checks:
        if score.max() > threshold:
            worst = int(score.argmax())
            problems.append(
                f"{what.format(shown[worst])} on `data` (channel {worst}; "
                f"{int(np.sum(score > threshold))} of {score.size} channels {counted})"
            )
    distance = max(float(shift.max()), float(np.log(fold.max())))
    if not problems:
        return distance, None
    if not layer.trainable:
        advice = _FROZEN
    elif augmentation:
        advice = (
            f"; the model has training-time augmentation layer(s) {list(augmentation)} before "
            "this BN: its moving statistics averaged augmented inputs; if `data` is "
            "un-augmented, recalibrate on it: keras_bn.recalibrate(model, data)"
        )
    else:
        advice = (
            ": keep training in training mode, or run keras_bn.recalibrate; if training "
            "augments the inputs outside the model (in the input pipeline), the moving "
            "statistics averaged augmented inputs: recalibrate on un-augmented data, "
            "keras_bn.recalibrate(model, data)"
        )
    return distance, "; ".join(problems) + advice


def _unfoldable(
    model: keras.Model, layers: Sequence[keras.layers.Layer], paths: dict[int, str]
) -> list[Finding]:
    """The fold's own decision: a BN it keeps, with its reason, or one it never reaches.

    A model the fold cannot take (`UnsupportedModelError`: subclassed, a layer whose config
    does not round-trip) makes every BN unfoldable. A BN whose inference affine is not finite
    is reported here: the fold would refuse it by failing on the whole model. Any other error
    of the fold's decisions is a bug, and propagates.
    """
    not_finite = [layer for layer in layers if not _finite_affine(layer)]
    if not_finite:
        return [
            Finding(
                paths[id(layer)],
                "unfoldable",
                (
                    "its inference scale or shift is not finite (NaN or inf in its moving "
                    "statistics, gamma or beta), so it cannot be folded; the fold check of the "
                    "model's BN layers runs once every one is finite"
                ),
            )
            for layer in not_finite
        ]
    try:
        # the fold's decisions alone: no weight is folded, no probe is run
        folded_bns, kept_bns = fold_plan.plan(model).decisions()
    except UnsupportedModelError as error:
        return [
            Finding(paths[id(layer)], "unfoldable", f"the fold fails on the model: {error}")
            for layer in layers
        ]
    kept = {k.bn: k.reason for k in kept_bns}
    folded = {f.bn for f in folded_bns}
    findings = []
    for layer in layers:
        path = paths[id(layer)]
        if path in kept:
            findings.append(Finding(path, "unfoldable", f"the fold keeps it: {kept[path]}"))
        elif path not in folded:
            findings.append(
                Finding(
                    path,
                    "unfoldable",
                    (
                        "the fold leaves it as it is: it is inside a layer whose graph the "
                        "fold does not read (a custom layer)"
                    ),
                )
            )
    return findings


def _finite_affine(layer: keras.layers.Layer) -> bool:
    """The BN's inference map y = scale·x + shift is finite in every channel: the fold's own
    condition for folding it (`keras_bn.export.fold` refuses the others)."""
    return all(np.all(np.isfinite(part)) for part in bn_layers.inference_affine(layer))

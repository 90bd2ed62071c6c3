"""Diagnostics of how normalization shapes training, for any Keras model.

- `check_batchnorm`: the common BN mistakes that raise no error (statistics that never moved,
  "good in training, bad at inference", batches too small, BNs the fold must keep), as a
  list of `Finding` objects.
- `gradient_norms_by_layer`: squared gradient norm at each layer's kernel (Yang et al. 2019).
- `explosion_rate`: the per-layer growth λ fitted to those norms.
- `landscape_along_gradient`: loss variation, gradient predictiveness and effective
  β-smoothness along −∇L (Santurkar et al. 2018, §3.1).
- `internal_covariate_shift`: ‖G − G′‖ and cos(G, G′) per layer (Santurkar et al. 2018, Def. 2.1).

For the other functions, "layers" are the entries of `model.layers` that own a `kernel`
variable (Dense, Conv, ...), in that order; nested models are not searched. Losses are evaluated
with `training=True` by default, so BN layers use batch statistics, as during a training step.
Every function leaves the model (trainable and moving statistics alike) and the optimizer
exactly as it found them.
"""

import contextlib
import dataclasses

import keras
import numpy as np
import tensorflow as tf

from keras_bn import _bn_layers
from keras_bn.callbacks import _Snapshot
from keras_bn.layers import BatchNormalization
from keras_bn.population import _Batches, _InputStatistics, _Sums

__all__ = [
    "Finding",
    "Findings",
    "check_batchnorm",
    "explosion_rate",
    "gradient_norms_by_layer",
    "internal_covariate_shift",
    "landscape_along_gradient",
]


def gradient_norms_by_layer(model, x, y, loss, training=True):
    """Squared norm ‖∂L/∂W‖² of the loss gradient at each layer's kernel W.

    The kernel rather than the pre-activation: it is what an optimizer sees, and in a BN network
    the layer inputs have a fixed scale, so both grow at the same per-layer rate. The model is
    left as it was (a training-mode pass would move BN's statistics; they are put back).

    Args:
        model: a built Keras model whose `model.layers` include layers with a kernel.
        x: an input batch.
        y: its targets.
        loss: a Keras loss: a name ("mse"), a `keras.losses.Loss` or a function
            `loss(y_true, y_pred)`; its mean over the batch is differentiated.
        training: the `training` flag of the forward passes; True (the default) makes BN
            layers use batch statistics, as in a training step.

    Returns:
        dict: {layer name → float}, in `model.layers` order (input side first), for the
        layers that own a `kernel`.

    Raises:
        ValueError: no entry of `model.layers` has a kernel, or the loss does not depend on
            some kernel.

    Example:
        Gradient explosion in a deep BN network (Yang et al., "A Mean Field Theory of Batch
        Normalization", 2019)::

            norms = keras_bn.diagnostics.gradient_norms_by_layer(model, x, y, "mse")
            rate = keras_bn.diagnostics.explosion_rate(norms, first=1, last=-1)
    """
    layers = _kernel_layers(model)
    with _restored(model):
        grads = _gradients(model, x, y, loss, [layer.kernel for layer in layers], training)
    return {layer.name: float(np.sum(np.square(g))) for layer, g in zip(layers, grads)}


def explosion_rate(squared_norms, first=0, last=None):
    """The per-layer growth λ of squared gradient norms going backwards (output to input).

    λ = exp(−slope) of the least-squares line through log(norm) against depth, fitted over
    the entries [first, last), so that the boundary layers can be left out. λ > 1: the norms
    grow towards the input.

    Args:
        squared_norms: a sequence of squared norms ordered from the input side, or the dict
            that `gradient_norms_by_layer` returns.
        first: index of the first entry fitted.
        last: index one past the last entry fitted (negative counts from the end); None for
            the end.

    Returns:
        λ, a float.

    Raises:
        ValueError: fewer than 2 entries in [first, last), or one that is not positive and
            finite.
    """
    if isinstance(squared_norms, dict):
        squared_norms = list(squared_norms.values())
    values = np.asarray(squared_norms, dtype=np.float64)[first:last]
    if values.size < 2 or np.any(values <= 0) or not np.all(np.isfinite(values)):
        raise ValueError(
            f"explosion_rate needs at least 2 positive finite norms; received {values.tolist()}."
        )
    slope = np.polyfit(np.arange(values.size), np.log(values), 1)[0]
    return float(np.exp(-slope))


def landscape_along_gradient(model, x, y, loss, step_sizes, training=True):
    """Probe the loss landscape at the current weights θ along the step −η∇L(θ).

    Santurkar et al., "How Does Batch Normalization Help Optimization?" (2018), Fig. 4.
    Gradients are over all trainable variables. The model's variables are restored afterwards.

    Args:
        model: a built Keras model; every trainable variable takes the step.
        x: the input batch the loss and gradients are taken on.
        y: the targets of `x`.
        loss: a Keras loss: a name ("mse"), a `keras.losses.Loss` or a function
            `loss(y_true, y_pred)`; its mean over the batch is differentiated.
        step_sizes: the step sizes η_k to probe.
        training: the `training` flag of the forward passes; True (the default) makes BN
            layers use batch statistics, as in a training step.

    Returns:
        dict: the step sizes and what was measured at each, under the keys below.

        - `step_sizes`: the η_k, as a float64 array;
        - `losses`: L(θ − η_k∇L(θ)) per η_k;
        - `gradient_changes`: ‖∇L(θ) − ∇L(θ − η_k∇L(θ))‖ per η_k;
        - `loss_variation`: max − min of the losses, L(θ) included;
        - `gradient_predictiveness`: max − min of the gradient changes;
        - `beta_smoothness`: max_k gradient_changes[k] / ‖η_k∇L(θ)‖, the effective
          β-smoothness.

    Raises:
        ValueError: the loss does not depend on some trainable variable.
    """
    step_sizes = np.asarray(step_sizes, dtype=np.float64)
    variables = model.trainable_variables
    with _restored(model):
        start_loss, grads = _loss_and_gradients(model, x, y, loss, variables, training)
        origin = [v.numpy() for v in variables]
        grad_norm = _global_norm(grads)
        losses, changes = [], []
        for eta in step_sizes:
            for v, w, g in zip(variables, origin, grads):
                v.assign(w - eta * g)
            moved_loss, moved = _loss_and_gradients(model, x, y, loss, variables, training)
            losses.append(moved_loss)
            changes.append(_global_norm([a - b for a, b in zip(grads, moved)]))
    losses, changes = np.array(losses), np.array(changes)
    all_losses = np.append(losses, start_loss)
    return {
        "step_sizes": step_sizes,
        "losses": losses,
        "gradient_changes": changes,
        "loss_variation": float(all_losses.max() - all_losses.min()),
        "gradient_predictiveness": float(changes.max() - changes.min()),
        "beta_smoothness": float(np.max(changes / (np.abs(step_sizes) * grad_norm))),
    }


def internal_covariate_shift(model, x, y, loss, optimizer, training=True):
    """Santurkar et al.'s internal covariate shift (Def. 2.1) of one optimizer step on (x, y).

    G_i is the gradient at layer i's kernel at the current weights; G′_i is the same gradient
    after `optimizer` has updated every trainable variable of the layers before i (layer i and
    later keep their current values). The model's variables and the optimizer's state are
    restored afterwards; an optimizer not yet built is built for the model's trainable
    variables.

    Args:
        model: a built Keras model whose `model.layers` include layers with a kernel
            (G_i is taken at each).
        x: the input batch of the step and of the gradients.
        y: the targets of `x`.
        loss: a Keras loss: a name ("mse"), a `keras.losses.Loss` or a function
            `loss(y_true, y_pred)`; its mean over the batch is differentiated.
        optimizer: a `keras.optimizers.Optimizer` that takes the step.
        training: the `training` flag of the forward passes; True (the default) makes BN
            layers use batch statistics, as in a training step.

    Returns:
        dict: `layers` (the names of the layers with a kernel, in `model.layers` order),
        `l2_difference` (‖G_i − G′_i‖) and `cosine` (cos(G_i, G′_i)), both arrays.

    Raises:
        ValueError: no entry of `model.layers` has a kernel, or the loss does not depend on
            some trainable variable.
    """
    layers = _kernel_layers(model)
    variables = model.trainable_variables
    if not optimizer.built:
        optimizer.build(variables)
    with _restored(model, optimizer):
        _, grads = _loss_and_gradients(model, x, y, loss, variables, training)
        before = [v.numpy() for v in variables]
        optimizer.apply_gradients(zip(grads, variables))
        after = [v.numpy() for v in variables]
        index = {id(v): k for k, v in enumerate(variables)}
        seen = set()
        distances, cosines = [], []
        for layer in model.layers:
            if _has_kernel(layer):
                for v, old, new in zip(variables, before, after):
                    v.assign(new if id(v) in seen else old)
                (shifted,) = _gradients(model, x, y, loss, [layer.kernel], training)
                original = grads[index[id(layer.kernel)]]
                distances.append(float(np.linalg.norm(original - shifted)))
                cosines.append(_cosine(original, shifted))
            seen.update(id(v) for v in layer.trainable_variables)
    return {
        "layers": [layer.name for layer in layers],
        "l2_difference": np.array(distances),
        "cosine": np.array(cosines),
    }


def _has_kernel(layer):
    return isinstance(getattr(layer, "kernel", None), keras.Variable)


def _kernel_layers(model):
    layers = [layer for layer in model.layers if _has_kernel(layer)]
    if not layers:
        raise ValueError(f"Model {model.name!r} has no layer with a kernel to diagnose.")
    return layers


def _loss_and_gradients(model, x, y, loss, variables, training):
    """(L as a float, [∂L/∂v as numpy]) for the loss of the model's outputs alone."""
    loss_fn = keras.losses.get(loss)
    with tf.GradientTape() as tape:
        value = loss_fn(y, model(x, training=training))
        value = tf.reduce_mean(value)
    grads = tape.gradient(value, variables)
    if any(g is None for g in grads):
        missing = [v.path for v, g in zip(variables, grads) if g is None]
        raise ValueError(f"The loss does not depend on {missing}.")
    return float(value), [tf.convert_to_tensor(g).numpy() for g in grads]


def _gradients(model, x, y, loss, variables, training):
    return _loss_and_gradients(model, x, y, loss, variables, training)[1]


@contextlib.contextmanager
def _restored(model, optimizer=None):
    """Put back every variable of the model (and optimizer) on exit: training-mode calls move
    BN's moving statistics, and the probes move the weights."""
    variables = list(model.variables) + (list(optimizer.variables) if optimizer else [])
    saved = [v.numpy() for v in variables]
    try:
        yield
    finally:
        for v, value in zip(variables, saved):
            v.assign(value)


def _global_norm(arrays):
    return float(np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a in arrays)))


def _cosine(a, b):
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# check_batchnorm's thresholds.
STALE_MEAN_SHIFT = 0.5  # |moving mean − input mean|, in input standard deviations
STALE_VARIANCE_RATIO = 2.0  # moving variance / input variance outside [1/2, 2]
GAP_THRESHOLD = 0.5  # RMS(training − inference output) / RMS spread of the inference output
MIN_VALUES_PER_CHANNEL = 16  # values per channel in one batch (batch × spatial positions)

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


class Findings(list):
    """The list of `Finding` objects that `check_batchnorm` returns; `str()` of it is a table.

    Args:
        findings: the `Finding` objects, in order.
        layers_checked: how many BN layers were checked (for the table's first line).

    Attributes:
        layers_checked: how many BN layers were checked.
    """

    def __init__(self, findings=(), layers_checked=0):
        super().__init__(findings)
        self.layers_checked = layers_checked

    def __str__(self):
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


def check_batchnorm(model, data=None, *, batch_size=32, steps=None):
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
      m/(m−1) for keras_bn), which is what the moving average estimates. For a frozen BN
      (trainable=False) the message says so rather than advise recalibrating: the layers after
      it are trained for its statistics.
    - `non_finite`: on `data` (itself finite), the layer's input is NaN or inf: an upstream
      weight or statistic is not finite.
    - `small_batch`: the batches of `data` give a layer fewer than `MIN_VALUES_PER_CHANNEL` =
      16 values per channel (batch size × spatial positions, unmasked only; the median over
      batches, so a short last batch does not count): its batch mean and variance are too noisy
      to train with.
    - `train_inference_gap`: on `data`, the model's outputs with every BN in training mode
      (batch statistics; the other layers, Dropout included, infer) differ from its inference
      outputs by more than `GAP_THRESHOLD` = 0.5, measured as the RMS difference over the RMS
      spread of the inference outputs around their batch mean (all outputs pooled; a batch
      that leaves some BN m ≤ 1 values, e.g. a last batch of one sample, is left out: it has
      no batch statistics, and BN outputs β for it). Batch noise
      alone gives some gap (more for Dense→BN, whose m is the batch size, than after a
      convolution); the threshold sits above it for healthy models. Reported once, for the
      model; the message names the BN whose statistics are furthest from its input's.
    - `unfoldable`: `keras_bn.export.fold_batch_norms(model)` would keep this BN (as an
      affine layer), with the fold's reason; or the fold never reaches it (a BN inside a
      custom layer); or the fold fails on the whole model (subclassed; NaN statistics).

    Without `data` only the initial-value and fold checks run. The model is left exactly as
    found (training-mode passes move the statistics; they are put back after every batch).

    Args:
        model: a built Keras model (Sequential, Functional, subclassed, nested).
        data: optional batches, as for `keras_bn.recalibrate`: a `tf.data.Dataset` (finite,
            or with `steps`), a numpy array or a dict of them (named inputs; split into batches
            of `batch_size`), or an iterable of batches; `(x, y)` and `(x, y, sample_weight)` elements use `x`. Give batches of
            the size you train with: the small-batch and gap checks depend on it.
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
    """
    layers = _bn_layers.in_model(model)
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
    probe = None
    if data is not None:
        batches = _Batches(data, steps, batch_size)
        probe = batches.first()
        stale = {f.layer for f in findings}
        findings += _data_findings(model, layers, paths, batches, skip=stale)
    findings += _unfoldable(model, layers, paths, probe)
    order = {path: i for i, path in enumerate(paths[id(layer)] for layer in layers)}
    findings.sort(key=lambda f: (order.get(f.layer, len(order)), KINDS.index(f.kind)))
    return Findings(findings, layers_checked=len(layers))


def _stale_without_data(layer):
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


def _bn_paths(model):
    """{id(BN layer): "outer/inner/name"}, the naming of the fold's report."""
    paths = {}
    for path, layer in _bn_layers.batch_norms_inside(model):
        paths.setdefault(id(layer), path)
    return paths


def _at_initial_values(layer):
    """Both statistics equal their (deterministic) initializers' values exactly."""
    pairs = (
        (layer.moving_mean, layer.moving_mean_initializer),
        (layer.moving_variance, layer.moving_variance_initializer),
    )
    for variable, initializer in pairs:
        first, second = (
            np.asarray(initializer(variable.shape, dtype=variable.dtype)) for _ in range(2)
        )
        if not np.array_equal(first, second) or not np.array_equal(variable.numpy(), first):
            return False
    return True


def _data_findings(model, layers, paths, batches, skip):
    """stale_statistics (far from the data), small_batch and train_inference_gap on `data`."""
    sums = [_Sums() for _ in layers]
    counts = [[] for _ in layers]  # values per channel, per batch
    difference = spread = 0.0
    training_statistics = _Snapshot(model)
    # Inner wrapper: records each BN's input and forces inference while collecting. Outer
    # wrapper: forces training mode (batch statistics) in BN layers only, for the other pass.
    with _InputStatistics(layers) as statistics, _TrainingModeBN(layers):

        def infer_and_record(x):
            outputs = []
            recorded = statistics.collect(lambda: outputs.append(model(x, training=False)))
            return recorded, outputs[0]

        infer = tf.function(infer_and_record, reduce_retracing=True)
        train = tf.function(lambda x: model(x, training=False), reduce_retracing=True)
        for number, x in enumerate(batches):
            _check_finite(x, number)
            recorded, inferred = infer(x)
            inferred = _flat(inferred)
            try:
                trained = _flat(train(x))
            finally:
                training_statistics.restore()
            degenerate = False  # some BN got m ≤ 1: no batch statistics, it output β
            for index, (mean, variance, count) in recorded.items():
                count = float(count)
                counts[index].append(count)
                sums[index].add(mean.numpy(), variance.numpy(), count)  # skips m ≤ 1
                degenerate = degenerate or count < 2
            if degenerate:  # its training-mode outputs are the guard's, not batch statistics
                continue
            for a, b in zip(trained, inferred):
                difference += float(np.sum(np.square(a - b)))
                spread += float(np.sum(np.square(b - b.mean(axis=0))))
    findings, furthest = [], (0.0, None)
    for index in statistics.order:
        layer, path = layers[index], paths[id(layers[index])]
        typical = float(np.median(counts[index]))
        if typical < MIN_VALUES_PER_CHANNEL:
            findings.append(
                Finding(
                    path,
                    "small_batch",
                    (
                        f"the batches of `data` give it m={typical:g} values per channel (median over "
                        f"batches; batch × spatial positions), fewer than {MIN_VALUES_PER_CHANNEL}: batch "
                        "statistics that noisy hurt training; use larger batches or renorm=True"
                    ),
                )
            )
        if sums[index].batches == 0:
            continue
        mean, variance = sums[index].population(unbiased=isinstance(layer, BatchNormalization))
        if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(variance))):
            findings.append(
                Finding(
                    path,
                    "non_finite",
                    (
                        "its input is not finite on `data` (NaN or inf) although `data` is: an upstream "
                        "weight or statistic is not finite"
                    ),
                )
            )
            continue
        distance, message = _distance_from_data(layer, mean, variance)
        furthest = max(furthest, (distance, path), key=lambda pair: pair[0])
        if message and path not in skip:
            findings.append(Finding(path, "stale_statistics", message))
    if not np.isfinite(difference + spread):
        findings.append(
            Finding(
                model.name,
                "train_inference_gap",
                (
                    "on `data`, the outputs with batch statistics or with the moving statistics are not "
                    "finite (NaN or inf): check the findings above"
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
                    f"{gap:.3g} of their spread (threshold {GAP_THRESHOLD}){where}: train with larger "
                    "or shuffled batches, or check the findings above"
                ),
            )
        )
    return findings


class _TrainingModeBN(_InputStatistics):
    """recalibrate's call shadowing with another wrapper: BN layers get training=True (batch
    statistics) whatever the model passes them, so that everything else (Dropout, …) infers."""

    def _wrap(self, index, layer, call):
        def call_in_training_mode(inputs, *args, **kwargs):
            kwargs["training"] = True
            return call(inputs, *args, **kwargs)

        return call_in_training_mode


def _flat(outputs):
    return [np.asarray(t, dtype=np.float64) for t in tf.nest.flatten(outputs)]


def _check_finite(x, number):
    for array in tf.nest.flatten(x):
        array = np.asarray(array)
        if np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
            raise ValueError(
                f"check_batchnorm: batch {number} of `data` has {array[where]} at "
                f"index {where}; the checks need finite data."
            )


def _distance_from_data(layer, mean, variance):
    """(largest standardized distance, message or None) between the moving statistics and the
    input's pooled statistics on `data`."""
    epsilon = layer.epsilon
    moving_mean = layer.moving_mean.numpy().astype(np.float64).ravel()
    moving_variance = layer.moving_variance.numpy().astype(np.float64).ravel()
    mean, variance = mean.ravel(), variance.ravel()
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
    advice = (
        ": keep training in training mode, or run keras_bn.recalibrate"
        if layer.trainable
        else _FROZEN
    )
    return distance, "; ".join(problems) + advice


def _unfoldable(model, layers, paths, probe):
    """The fold's own decision: a BN it keeps, with its reason, or one it never reaches."""
    from keras_bn.export import fold_batch_norms  # the export stack loads only when needed

    try:
        _, report = fold_batch_norms(model, probe)
    except (TypeError, ValueError) as error:  # no layer graph (subclassed); NaN statistics
        return [
            Finding(paths[id(layer)], "unfoldable", f"the fold fails on the model: {error}")
            for layer in layers
        ]
    kept = {k.bn: k.reason for k in report.kept}
    folded = {f.bn for f in report.folded}
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
                        "the fold leaves it as it is: it is inside a layer whose graph the fold does not "
                        "read (a custom layer)"
                    ),
                )
            )
    return findings

"""Diagnostics of how normalization shapes training, for any Keras model.

- `gradient_norms_by_layer`: squared gradient norm at each layer's kernel (Yang et al. 2019).
- `explosion_rate`: the per-layer growth λ fitted to those norms.
- `landscape_along_gradient`: loss variation, gradient predictiveness and effective
  β-smoothness along −∇L (Santurkar et al. 2018, §3.1).
- `internal_covariate_shift`: ‖G − G′‖ and cos(G, G′) per layer (Santurkar et al. 2018, Def. 2.1).
- `check_batchnorm` (with `Finding`, `Findings`, `KINDS` and its thresholds): the common BN
  mistakes that raise no error, as a list of `Finding` objects; defined in `keras_bn.check`
  and exported here.

For the probes, "layers" are the entries of `model.layers` that own a `kernel` variable (Dense,
Conv, ...), in that order; nested models are not searched. Losses are evaluated with
`training=True` by default, so BN layers use batch statistics, as during a training step.
Every function leaves the model (trainable and moving statistics alike) and the optimizer
exactly as it found them. `check_batchnorm` runs under every backend; the gradient probes need
TensorFlow (under JAX and PyTorch they raise ImportError).
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias

import keras
import numpy as np
import numpy.typing as npt

from keras_bn._recalibration import hooks
from keras_bn.backend import guard
from keras_bn.check import (
    GAP_THRESHOLD,
    KINDS,
    MIN_VALUES_PER_CHANNEL,
    STALE_MEAN_SHIFT,
    STALE_VARIANCE_RATIO,
    Finding,
    Findings,
    check_batchnorm,
)

__all__ = [
    "GAP_THRESHOLD",
    "KINDS",
    "MIN_VALUES_PER_CHANNEL",
    "STALE_MEAN_SHIFT",
    "STALE_VARIANCE_RATIO",
    "Finding",
    "Findings",
    "check_batchnorm",
    "explosion_rate",
    "gradient_norms_by_layer",
    "internal_covariate_shift",
    "landscape_along_gradient",
]

# A model input batch (an array, or a dict of them for named inputs), and a loss as
# keras.losses.get takes it: a name, a Loss, or a function loss(y_true, y_pred).
_Inputs: TypeAlias = npt.ArrayLike | dict[str, Any]
_Loss: TypeAlias = str | keras.losses.Loss | Callable[[Any, Any], Any]


def gradient_norms_by_layer(
    model: keras.Model, x: _Inputs, y: npt.ArrayLike, loss: _Loss, training: bool = True
) -> dict[str, float]:
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
        ImportError: Keras runs on another backend than TensorFlow.

    Example:
        Gradient explosion in a deep BN network (Yang et al., "A Mean Field Theory of Batch
        Normalization", 2019)::

            norms = keras_bn.diagnostics.gradient_norms_by_layer(model, x, y, "mse")
            rate = keras_bn.diagnostics.explosion_rate(norms, first=1, last=-1)
    """
    guard.require_tensorflow("keras_bn.diagnostics.gradient_norms_by_layer")
    layers = _kernel_layers(model)
    with hooks.model_state(model):
        _, grads = _loss_and_gradients(
            model, x, y, loss, [layer.kernel for layer in layers], training
        )
    return {layer.name: float(np.sum(np.square(g))) for layer, g in zip(layers, grads)}


def explosion_rate(
    squared_norms: npt.ArrayLike | dict[str, float], first: int = 0, last: int | None = None
) -> float:
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


def landscape_along_gradient(
    model: keras.Model,
    x: _Inputs,
    y: npt.ArrayLike,
    loss: _Loss,
    step_sizes: npt.ArrayLike,
    training: bool = True,
) -> dict[str, np.ndarray | float]:
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
        ImportError: Keras runs on another backend than TensorFlow.
    """
    guard.require_tensorflow("keras_bn.diagnostics.landscape_along_gradient")
    etas = np.asarray(step_sizes, dtype=np.float64)
    variables = model.trainable_variables
    with hooks.model_state(model):
        start_loss, grads = _loss_and_gradients(model, x, y, loss, variables, training)
        origin = [v.numpy() for v in variables]
        grad_norm = _global_norm(grads)
        moved_losses, gradient_changes = [], []
        for eta in etas:
            for v, w, g in zip(variables, origin, grads):
                v.assign(w - eta * g)
            moved_loss, moved = _loss_and_gradients(model, x, y, loss, variables, training)
            moved_losses.append(moved_loss)
            gradient_changes.append(_global_norm([a - b for a, b in zip(grads, moved)]))
    losses, changes = np.array(moved_losses), np.array(gradient_changes)
    all_losses = np.append(losses, start_loss)
    return {
        "step_sizes": etas,
        "losses": losses,
        "gradient_changes": changes,
        "loss_variation": float(all_losses.max() - all_losses.min()),
        "gradient_predictiveness": float(changes.max() - changes.min()),
        "beta_smoothness": float(np.max(changes / (np.abs(etas) * grad_norm))),
    }


def internal_covariate_shift(
    model: keras.Model,
    x: _Inputs,
    y: npt.ArrayLike,
    loss: _Loss,
    optimizer: keras.optimizers.Optimizer,
    training: bool = True,
) -> dict[str, list[str] | np.ndarray]:
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
        ImportError: Keras runs on another backend than TensorFlow.
    """
    guard.require_tensorflow("keras_bn.diagnostics.internal_covariate_shift")
    layers = _kernel_layers(model)
    variables = model.trainable_variables
    if not optimizer.built:
        optimizer.build(variables)
    with hooks.model_state(model, optimizer):
        _, grads = _loss_and_gradients(model, x, y, loss, variables, training)
        before = [v.numpy() for v in variables]
        optimizer.apply_gradients(zip(grads, variables))
        after = [v.numpy() for v in variables]
        index = {id(v): k for k, v in enumerate(variables)}
        seen: set[int] = set()  # ids of the variables of the layers before this one
        distances, cosines = [], []
        for layer in model.layers:
            if _has_kernel(layer):
                for v, old, new in zip(variables, before, after):
                    v.assign(new if id(v) in seen else old)
                _, (shifted,) = _loss_and_gradients(model, x, y, loss, [layer.kernel], training)
                original = grads[index[id(layer.kernel)]]
                distances.append(float(np.linalg.norm(original - shifted)))
                cosines.append(_cosine(original, shifted))
            seen.update(id(v) for v in layer.trainable_variables)
    return {
        "layers": [layer.name for layer in layers],
        "l2_difference": np.array(distances),
        "cosine": np.array(cosines),
    }


def _has_kernel(layer: keras.layers.Layer) -> bool:
    return isinstance(getattr(layer, "kernel", None), keras.Variable)


def _kernel_layers(model: keras.Model) -> list[keras.layers.Layer]:
    layers = [layer for layer in model.layers if _has_kernel(layer)]
    if not layers:
        raise ValueError(f"Model {model.name!r} has no layer with a kernel to diagnose.")
    return layers


def _loss_and_gradients(
    model: keras.Model,
    x: _Inputs,
    y: npt.ArrayLike,
    loss: _Loss,
    variables: Sequence[keras.Variable],
    training: bool,
) -> tuple[float, list[np.ndarray]]:
    """(L as a float, [∂L/∂v as numpy]) for the loss of the model's outputs alone."""
    import tensorflow as tf  # the probes need TensorFlow's backend (`require_tensorflow`)

    loss_fn = keras.losses.get(loss)
    with tf.GradientTape() as tape:
        value = loss_fn(y, model(x, training=training))
        value = tf.reduce_mean(value)
    grads = tape.gradient(value, variables)
    if any(g is None for g in grads):
        missing = [v.path for v, g in zip(variables, grads) if g is None]
        raise ValueError(f"The loss does not depend on {missing}.")
    return float(value), [tf.convert_to_tensor(g).numpy() for g in grads]


def _global_norm(arrays: Iterable[np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a in arrays)))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

"""Diagnostics of how normalization shapes training, for any Keras model.

- `gradient_norms_by_layer`: squared gradient norm at each layer's kernel (Yang et al. 2019).
- `explosion_rate`: the per-layer growth λ fitted to those norms.
- `landscape_along_gradient`: loss variation, gradient predictiveness and effective
  β-smoothness along −∇L (Santurkar et al. 2018, §3.1).
- `internal_covariate_shift`: ‖G − G′‖ and cos(G, G′) per layer (Santurkar et al. 2018, Def. 2.1).

"Layers" are the entries of `model.layers` that own a `kernel` variable (Dense, Conv, ...), in
that order; nested models are not searched. Losses are evaluated with `training=True` by default,
so BN layers use batch statistics, as during a training step. Every function leaves the model
(trainable and moving statistics alike) and the optimizer exactly as it found them.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

__all__ = [
    "gradient_norms_by_layer",
    "explosion_rate",
    "landscape_along_gradient",
    "internal_covariate_shift",
]


def gradient_norms_by_layer(model, x, y, loss, training=True):
    """Squared norm ‖∂L/∂W‖² of the loss gradient at each layer's kernel W.

    Returns a dict {layer name: float}, in `model.layers` order (input side first).
    The kernel rather than the pre-activation: it is what an optimizer sees, and in a BN network
    the layer inputs have a fixed scale, so both grow at the same per-layer rate.
    """
    layers = _kernel_layers(model)
    with _restored(model):
        grads = _gradients(model, x, y, loss, [layer.kernel for layer in layers], training)
    return {layer.name: float(np.sum(np.square(g))) for layer, g in zip(layers, grads)}


def explosion_rate(squared_norms, first=0, last=None):
    """The per-layer growth λ of squared gradient norms going backwards (output to input).

    `squared_norms` is a sequence (or the dict from `gradient_norms_by_layer`) ordered from the
    input side; λ = exp(−slope) of the least-squares line through log(norm) against depth,
    fitted over entries [first, last) so that the boundary layers can be left out.
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

    For each η in `step_sizes` (Santurkar et al. 2018, Fig. 4):
    - `losses[k]` = L(θ − η_k∇L(θ));
    - `gradient_changes[k]` = ‖∇L(θ) − ∇L(θ − η_k∇L(θ))‖.
    Summaries: `loss_variation` = max − min of the losses (L(θ) included);
    `gradient_predictiveness` = max − min of the gradient changes;
    `beta_smoothness` = max_k gradient_changes[k] / ‖η_k∇L(θ)‖, the effective β-smoothness.
    Gradients are over all trainable variables. The weights are restored afterwards.
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
    later keep their current values). Returns a dict with `layers` (names), `l2_difference`
    (‖G_i − G′_i‖) and `cosine` (cos(G_i, G′_i)) as arrays. The model's weights and the
    optimizer's state are restored afterwards; an optimizer not yet built is built for the
    model's trainable variables.
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

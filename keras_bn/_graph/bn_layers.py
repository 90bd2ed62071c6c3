"""The two batch-norm classes keras_bn reads and writes, and what differs between them.

`keras_bn.BatchNormalization` and `keras.layers.BatchNormalization` hold the same four weights
with the same meaning, except:
- channel axes: keras_bn takes an int or a list (kept in `_channel_axes` once built); Keras one
  int axis, which may be negative;
- γ and β: either class may lack them (`scale=False`, `center=False`), standing for 1 and 0;
- the variance convention: keras_bn's moving variance is the unbiased m/(m−1)·E_B[σ²_B]
  (Algorithm 2), Keras's the biased E_B[σ²_B];
- masks: both read a mask of the input's rank − 1 as Keras does (the leading axes, broadcast
  over the last); keras_bn also reads one over the non-channel axes where Keras's reading
  does not fit (`keras_bn.backend.axes.mask_axes`).

Folding (keras_bn.export), `recalibrate` and `convert` all work from this one description,
which holds under every backend alike (the TensorFlow-only features guard themselves).
"""

from typing import Any

import keras
import numpy as np

from keras_bn import backend
from keras_bn._errors import UnsupportedModelError
from keras_bn.layers import BatchNormalization

KERAS_BN = keras.layers.BatchNormalization
KERAS_BN_BN = BatchNormalization
BN_TYPES = (KERAS_BN_BN, KERAS_BN)


def is_batch_norm(layer):
    """True for either class (and subclasses; callers that need the exact class check it)."""
    return isinstance(layer, BN_TYPES)


def folds_batch_norm(layer):
    """True for a layer that folds a batch norm into weights it rounds (the QAT layers: class
    attribute `folds_batch_norm`): its BN is never called, and what it normalizes in training
    comes from the layer itself (its `batch_norm_moments`)."""
    return getattr(type(layer), "folds_batch_norm", False)


def sets_statistics(layer):
    """True for a layer whose moving statistics `recalibrate` sets: a BN layer (either class),
    or a layer that folds one (whose own BN, never called, is part of it)."""
    return is_batch_norm(layer) or folds_batch_norm(layer)


def in_model(model):
    """Every layer of `model` whose statistics `recalibrate` sets (`sets_statistics`), nested
    models included, in layer order: the BN layers (either class), and the layers that fold one
    (whose own BN, never called, is theirs to set and not listed)."""
    found, seen = [], set()

    def walk(parent):
        for layer in parent._flatten_layers(include_self=False, recursive=False):
            if id(layer) in seen:  # a layer shared by two parents
                continue
            seen.add(id(layer))
            if sets_statistics(layer):
                found.append(layer)
            if not folds_batch_norm(layer):
                walk(layer)

    walk(model)
    return found


def statistics_of(layer):
    """The BN layer holding `layer`'s moving statistics: its folded BN, or itself."""
    return layer.batch_norm if folds_batch_norm(layer) else layer


def batch_norms_inside(layer):
    """[(path, layer)] for every batch norm inside `layer` (not `layer` itself), in layer
    order: the BN layers, and the layers that fold one (`sets_statistics`), not the BN such a
    layer holds, which is no free-standing BN (never called: its statistics scale the
    layer's kernel). A path is "inner/…/name", the names of the layers in between joined by
    "/"; the naming of the fold's report, `recalibrate`'s and `check_batchnorm`'s."""
    found = []

    def walk(parent, prefix):
        for child in parent._flatten_layers(include_self=False, recursive=False):
            if sets_statistics(child):
                found.append((prefix + child.name, child))
            else:
                walk(child, prefix + child.name + "/")

    walk(layer, "")
    return found


def channel_axes(layer, rank):
    """The layer's channel axes for an input of `rank`, sorted and non-negative."""
    if isinstance(layer, KERAS_BN_BN) and layer._channel_axes is not None:
        return list(layer._channel_axes)
    axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
    return sorted(a % rank for a in axes)


def unbiased_variance(layer):
    """True when the moving variance is the unbiased m/(m−1) estimate (keras_bn), False when it
    is the biased one (Keras)."""
    return isinstance(layer, KERAS_BN_BN)


def reads_channel_masks(layer):
    """True when the layer also reads a mask over its non-channel axes (keras_bn), False when
    it reads only Keras's (the leading axes, rank − 1)."""
    return isinstance(layer, KERAS_BN_BN)


def variance_convention(layer):
    """ "unbiased" (keras_bn) or "biased" (keras.layers.BatchNormalization)."""
    return "unbiased" if unbiased_variance(layer) else "biased"


def gamma_beta(layer):
    """(γ, β) as float64 arrays; 1 and 0 where the layer has no scale or no center."""
    channels = layer.moving_mean.shape
    gamma = np.ones(channels) if layer.gamma is None else np.asarray(layer.gamma, np.float64)
    beta = np.zeros(channels) if layer.beta is None else np.asarray(layer.beta, np.float64)
    return gamma, beta


def inference_affine(layer):
    """(scale, shift), flat float64: the layer's inference map y = scale·x + shift per channel,
    with its own epsilon. Either convention's moving variance is the one inference uses."""
    gamma, beta = gamma_beta(layer)
    mean = np.asarray(layer.moving_mean, np.float64)
    scale = gamma / np.sqrt(np.asarray(layer.moving_variance, np.float64) + float(layer.epsilon))
    return scale.ravel(), (beta - scale * mean).ravel()


def refuse_folded(model, action):
    """Refuse a model that holds layers folding a batch norm into their weights (the QAT
    layers: class attribute `folds_batch_norm`), for a tool that measures the input of every
    BN layer (`recalibrate`, `check_batchnorm`).

    Such a layer's batch norm is never called: its statistics scale the host's kernel before
    that is rounded, so the host's output they describe changes with them, and there is no
    input of the BN's own to measure.

    Args:
        model: a Keras model or layer (nested ones are searched).
        action: the tool, for the message ("recalibrate").

    Raises:
        UnsupportedModelError: `model` holds such layers (the message names them and what to
            do instead).
    """
    folded = [
        layer.name for layer in model._flatten_layers(include_self=True) if folds_batch_norm(layer)
    ]
    if folded:
        raise UnsupportedModelError(
            f"{action} cannot take '{model.name}': its quantization-aware layers {folded} fold "
            f"their batch norms into fake-quantized weights. Those statistics decide how the "
            f"weights round, so the output they describe changes with them: there is no BN "
            f"input of their own to measure. Run {action} on the float model before "
            f"keras_bn.quantize.quantize_model; during QAT the layers keep moving averages of "
            f"their batch statistics until FreezeBatchNorm freezes them."
        )


def batch_moments(layer: keras.layers.Layer, inputs: Any, mask: Any) -> tuple[Any, Any, Any]:
    """(mean, biased variance, m) of a BN layer's input over its reduced axes (unmasked values
    only), in the layer's statistics dtype and its moving statistics' shape; m per channel.

    The mask is read as the layer itself reads it in training (the backend's `expand_mask`):
    Keras's reading for both classes, keras_bn's non-channel reading only for keras_bn's
    layer, so that the moments are those the layer's own training step computes. The moments
    are the backend's `input_moments`.
    """
    ops = backend.get()
    x = keras.ops.cast(inputs, ops.statistics_dtype(inputs.dtype))
    axes = channel_axes(layer, len(x.shape))
    if mask is not None:
        mask = ops.expand_mask(mask, x, axes, channel_reading=reads_channel_masks(layer))
    mean, variance = ops.input_moments(x, axes, mask)
    # m_c per channel: a mask may leave the channels different counts.
    count = keras.ops.zeros_like(mean) + keras.ops.cast(ops.element_count(x, axes, mask), x.dtype)
    shape = tuple(layer.moving_mean.shape)
    mean, variance, count = (keras.ops.reshape(t, shape) for t in (mean, variance, count))
    return mean, variance, count

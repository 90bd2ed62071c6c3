"""Swap keras.layers.BatchNormalization and keras_bn.BatchNormalization in a model, weights kept.

`from_keras(model)` and `to_keras(model)` return a clone (keras.models.clone_model, nested
Sequential and Functional models included); the original model is untouched. Every argument
and every weight is carried over as it is, in particular the moving variance: Keras stores the
biased E_B[σ²_B] and keras_bn the unbiased m/(m−1)·E_B[σ²_B]. Inference outputs are therefore
the same before and after; only training afterwards continues the average in the new layer's
convention (or run keras_bn.recalibrate to recompute it in that convention).

Only the layer classes themselves are converted, never subclasses, and only through Sequential
and Functional models: a subclassed model, a BN subclass, a BN inside a custom layer's own code
or a layer whose config does not round-trip is an `UnsupportedModelError`, not a silent skip.

Example::

    ours = keras_bn.convert.from_keras(keras.applications.ResNet50(weights=None))
    back = keras_bn.convert.to_keras(ours)
"""

from typing import Any

import keras

from keras_bn._errors import UnsupportedModelError
from keras_bn._graph import models
from keras_bn._graph.bn_layers import KERAS_BN as _KERAS_BN
from keras_bn._graph.bn_layers import KERAS_BN_BN as BatchNormalization

__all__ = ["from_keras", "to_keras"]


def from_keras(model: keras.Model) -> keras.Model:
    """A clone of `model` with every keras.layers.BatchNormalization a keras_bn one.

    Every argument and weight is copied as it is, so inference outputs are unchanged; the
    moving variance, Keras's biased E_B[σ²_B], is then read as keras_bn's unbiased estimate
    (run `keras_bn.recalibrate` to recompute it in that convention).

    Args:
        model: a built Sequential or Functional Keras model (nested ones included).

    Returns:
        The clone, whose BN layers are all keras_bn.BatchNormalization; `model` is left
        untouched.

    Raises:
        UnsupportedModelError: the model is subclassed or an unbuilt Sequential; a layer
            subclasses keras.layers.BatchNormalization (only the class itself is converted);
            a layer other than a Sequential or Functional model holds a BN in its own code; a
            layer's config does not round-trip. A TypeError and a ValueError.
    """
    return _swap(model, _KERAS_BN, BatchNormalization)


def to_keras(model: keras.Model) -> keras.Model:
    """A clone of `model` with every keras_bn.BatchNormalization a keras.layers one.

    Every argument and weight is copied as it is, so inference outputs are unchanged; the
    moving variance, keras_bn's unbiased m/(m−1)·E_B[σ²_B], is then read as Keras's biased
    estimate.

    Args:
        model: a built Sequential or Functional Keras model (nested ones included).

    Returns:
        The clone, whose BN layers are all keras.layers.BatchNormalization; `model` is left
        untouched.

    Raises:
        UnsupportedModelError: the model is subclassed or an unbuilt Sequential; a layer
            subclasses keras_bn.BatchNormalization; a layer other than a Sequential or
            Functional model holds a BN in its own code; a layer's config does not round-trip;
            or a BN uses what Keras's BN cannot express: `momentum=None`, several channel
            axes, or a `virtual_batch_size`. A TypeError and a ValueError.
    """
    return _swap(model, BatchNormalization, _KERAS_BN)


def _check_keras_can_take(config: dict[str, Any]) -> None:
    """keras_bn arguments with no Keras form; `models.translate_config` checks the others."""
    name = config["name"]
    if config["momentum"] is None:
        raise UnsupportedModelError(
            f"Layer '{name}': momentum=None (a cumulative average) has no Keras equivalent."
        )
    if not isinstance(config["axis"], int):
        raise UnsupportedModelError(
            f"Layer '{name}': axis={config['axis']} (several channel axes) has no Keras "
            f"equivalent; keras.layers.BatchNormalization takes one int axis."
        )


def _swap(
    model: keras.Model, source: type[keras.layers.Layer], target: type[keras.layers.Layer]
) -> keras.Model:
    models.layer_graph(model, "convert the batch norms of")

    def copy_layer(layer: keras.layers.Layer) -> keras.layers.Layer:
        if type(layer) is source:
            config = models.config_of(layer)
            if target is _KERAS_BN:
                _check_keras_can_take(config)
            return models.from_config(
                layer, models.translate_config(config, source, target), cls=target
            )
        if isinstance(layer, source):
            raise UnsupportedModelError(
                f"Layer '{layer.name}' is a subclass of {source.__name__} "
                f"({type(layer).__name__}); only the class itself is converted."
            )
        hidden = [sub.name for sub in models.layers_within(layer, source)]
        if hidden:
            raise UnsupportedModelError(
                f"Layer '{layer.name}' ({type(layer).__name__}) holds BatchNormalization "
                f"layer(s) {hidden} inside its own code; only Sequential and Functional "
                f"models can be converted through."
            )
        return models.from_config(layer, models.config_of(layer))

    return models.clone_replacing(model, copy_layer)

"""The training-time augmentation layers upstream of each batch-norm layer of a model.

A layer that changes its input only in training (Keras's random image preprocessing layers such
as RandomTranslation or RandomFlip, and the noise layers GaussianNoise, GaussianDropout,
AlphaDropout and Dropout) feeds the BNs after it inputs that inference never sees, so their
moving statistics average augmented inputs. `check_batchnorm` names these layers when it finds
a BN's statistics stale.

Upstream is read from the graph in a Functional model, from the layer order in a Sequential
one, and from the order the layers were assigned in a subclassed model or custom layer (whose
call is not a graph that can be read). A nested model or layer upstream of a BN counts with
every augmentation layer inside it; one that holds the BN passes on what is upstream of it.
"""

import keras
from keras.src.layers.preprocessing.image_preprocessing.base_image_preprocessing_layer import (
    BaseImagePreprocessingLayer,
)

from keras_bn._graph import bn_layers

# Identity at inference, random in training: additive or multiplicative noise, and dropout,
# whose training-time variance shift is a known cause of BN statistics that do not match
# inference (Li, Chen, Hu & Yang, "Understanding the Disharmony between Dropout and Batch
# Normalization by Variance Shift", 2019). SpatialDropout*D are Dropout subclasses.
_NOISE_LAYERS = (
    keras.layers.GaussianNoise,
    keras.layers.GaussianDropout,
    keras.layers.AlphaDropout,
    keras.layers.Dropout,
)


def is_augmentation(layer: keras.layers.Layer) -> bool:
    """True for a layer that changes its input only in training.

    Keras's image preprocessing layers share `BaseImagePreprocessingLayer`; the random ones
    (RandomFlip, RandomTranslation, RandomRotation, RandomZoom, RandomContrast, …, RandAugment,
    MixUp, CutMix, Solarization) draw from a `SeedGenerator` and leave inputs unchanged at
    inference, while the deterministic ones (Resizing, CenterCrop, AutoContrast, …) act the same
    way in both modes and are not counted. The noise layers are listed in `_NOISE_LAYERS`.
    """
    if isinstance(layer, _NOISE_LAYERS):
        return True
    return isinstance(layer, BaseImagePreprocessingLayer) and isinstance(
        getattr(layer, "generator", None), keras.random.SeedGenerator
    )


def upstream_augmentation(model: keras.layers.Layer) -> dict[int, list[str]]:
    """{id(BN layer): [paths of the augmentation layers upstream of it]}, for every BN: the
    layers `bn_layers.in_model` lists (a QAT layer for the BN it folds, not that BN).

    Args:
        model: a Keras model or layer.

    Returns:
        The paths ("outer/inner/name", as `bn_layers.batch_norms_inside` names BNs), in layer
        order, without repeats; an empty list for a BN with none upstream.
    """
    found: dict[int, list[str]] = {}
    _walk(model, "", [], found)
    return found


def _walk(
    container: keras.layers.Layer, prefix: str, before: list[str], found: dict[int, list[str]]
) -> None:
    """Record each BN inside `container`, given `before`, the augmentation upstream of it."""
    children = _children(container)
    upstream = _upstream_children(container, children)
    for child in children:
        here = list(before)
        for sibling in upstream[id(child)]:
            for path in _augmentation_inside(sibling, prefix):
                if path not in here:
                    here.append(path)
        if bn_layers.sets_statistics(child):  # a QAT layer stands for the BN it folds
            found.setdefault(id(child), here)
        else:
            _walk(child, prefix + child.name + "/", here, found)


def _children(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    return list(layer._flatten_layers(include_self=False, recursive=False))


def _augmentation_inside(layer: keras.layers.Layer, prefix: str) -> list[str]:
    """The paths of `layer` (when it augments) and of every augmentation layer inside it."""
    if is_augmentation(layer):
        return [prefix + layer.name]
    return [
        path
        for child in _children(layer)
        for path in _augmentation_inside(child, prefix + layer.name + "/")
    ]


def _upstream_children(
    container: keras.layers.Layer, children: list[keras.layers.Layer]
) -> dict[int, list[keras.layers.Layer]]:
    """{id(child): [the children of `container` that feed it]}: from the graph of a Functional
    model, else the children before it in layer order."""
    nodes_by_depth = getattr(container, "_nodes_by_depth", None)
    if isinstance(container, keras.Sequential) or not nodes_by_depth:
        return {id(child): children[:i] for i, child in enumerate(children)}
    in_graph = {id(node) for nodes in nodes_by_depth.values() for node in nodes}
    upstream = {}
    for child in children:
        pending = [node for node in child._inbound_nodes if id(node) in in_graph]
        seen, feeding = set(), {}
        while pending:
            node = pending.pop()
            for parent in node.parent_nodes:
                if id(parent) in in_graph and id(parent) not in seen:
                    seen.add(id(parent))
                    feeding[id(parent.operation)] = parent.operation
                    pending.append(parent)
        upstream[id(child)] = [c for c in children if id(c) in feeding]
    return upstream

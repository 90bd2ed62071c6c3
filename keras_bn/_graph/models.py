"""The models keras_bn can walk, and copies of their layers, for the fold, the exporters and
`keras_bn.convert`.

Only a Sequential or Functional model has a layer graph to read (what feeds what, its inputs
and outputs before it is called); a subclassed model has only its `call` code. Which is which
is decided here, by type, and so is the copy of a layer from its config; what cannot be taken
raises `UnsupportedModelError`, with the model or layer named.
"""

import inspect

import keras
from keras.src.models.functional import Functional

from keras_bn._errors import UnsupportedModelError

# What a layer whose config does not round-trip raises, found by trying: Layer.get_config's
# NotImplementedError (an `__init__` argument it cannot serialize, and no get_config of the
# layer's own); from_config's TypeError (Keras wraps any failure of the class's `__init__` in
# one: an argument missing from the config, or one `__init__` does not take; also a nested
# object of a class Keras cannot locate); ValueError from a layer's own from_config or from
# deserializing a nested object (an initializer, a constraint) Keras cannot interpret. Anything
# else is not the config's fault and propagates.
CONFIG_ERRORS = (NotImplementedError, TypeError, ValueError)
# The arguments every layer takes (name, dtype, trainable, ...), whatever its class.
_BASE_ARGUMENTS = set(inspect.signature(keras.layers.Layer.__init__).parameters)


def has_layer_graph(model):
    """True for a Sequential or Functional model: those have a layer graph to read.

    Args:
        model: a Keras layer or model.

    Returns:
        bool.
    """
    return isinstance(model, (keras.Sequential, Functional))


def layer_graph(model, action):
    """The Functional graph behind a built Sequential or Functional model.

    Args:
        model: a Keras model.
        action: what was asked, for the message ("fold batch norms in", "export").

    Returns:
        The Functional model itself, or a Sequential's Functional graph.

    Raises:
        UnsupportedModelError: `model` is subclassed (it has no layer graph), or is an unbuilt
            Sequential.
    """
    if not has_layer_graph(model):
        raise UnsupportedModelError(
            f"Cannot {action} '{model.name}', a subclassed {type(model).__name__}: it has no "
            f"layer graph to inspect. Build it as a Sequential or Functional model."
        )
    if isinstance(model, Functional):
        return model
    graph = getattr(model, "_functional", None)
    if graph is None:
        raise UnsupportedModelError(
            f"Cannot {action} '{model.name}': the Sequential model is not built. Give it a "
            f"keras.Input (or call build()) first."
        )
    return graph


def from_config(layer, config, cls=None):
    """A new layer of `cls` (default: the layer's own class) from `config`.

    Args:
        layer: the layer copied, for the message.
        config: the config to build from (`layer.get_config()`, possibly edited).
        cls: the class to build; default `type(layer)`.

    Returns:
        The new, unbuilt layer.

    Raises:
        UnsupportedModelError: the config does not round-trip (CONFIG_ERRORS), naming the
            layer and the cause.
    """
    cls = type(layer) if cls is None else cls
    try:
        return cls.from_config(config)
    except CONFIG_ERRORS as error:
        raise _not_round_tripping(layer, error) from error


def config_of(layer):
    """`layer.get_config()`.

    Args:
        layer: a Keras layer.

    Returns:
        dict.

    Raises:
        UnsupportedModelError: the layer has no config that round-trips (CONFIG_ERRORS).
    """
    try:
        return layer.get_config()
    except CONFIG_ERRORS as error:
        raise _not_round_tripping(layer, error) from error


def layers_within(model, classes, include_self=False):
    """Every layer of `model` (nested ones included) that is an instance of `classes`.

    Args:
        model: a Keras model or layer.
        classes: a class or a tuple of classes.
        include_self: whether `model` itself counts.

    Returns:
        list of layers, in Keras's walk order.
    """
    return [
        layer
        for layer in model._flatten_layers(include_self=include_self)
        if isinstance(layer, classes)
    ]


def clone_replacing(model, replace):
    """A copy of `model` (nested Sequential/Functional models copied too) in which each layer
    `replace` returns a new layer for is that new layer, with the old one's weights; every
    other layer is shared.

    Args:
        model: a built Sequential or Functional model.
        replace: called with each layer; returns its replacement (unbuilt, from its config)
            or None to share the layer.

    Returns:
        The copy.
    """
    pairs = []

    def clone(layer):
        new = replace(layer)
        if new is None:
            return layer
        pairs.append((layer, new))
        return new

    copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    for old, new in pairs:
        new.set_weights(old.get_weights())
    return copy


def _not_round_tripping(layer, error):
    return UnsupportedModelError(
        f"Cannot copy layer '{layer.name}' ({type(layer).__name__}) from its config, which does "
        f"not round-trip (give the layer a get_config that its from_config accepts): "
        f"{type(error).__name__}: {error}"
    )


def unique_name(name, taken):
    """`name`, or `name_1`, `name_2`, ... : the first not in `taken`.

    Args:
        name: the name wanted.
        taken: the names in use (any container).

    Returns:
        str.
    """
    unique, count = name, 0
    while unique in taken:
        count += 1
        unique = f"{name}_{count}"
    return unique


def translate_config(config, source, target):
    """`config`, a `source` layer's, as a config for `target`: the arguments `target` lacks must
    be at `source`'s default.

    Args:
        config: a `source` layer's `get_config()`.
        source: the class the config comes from.
        target: the class it is for.

    Returns:
        dict: the arguments of `config` that `target` takes.

    Raises:
        UnsupportedModelError: an argument `target` lacks is not at `source`'s default (the
            message names the layer, the argument and its value).
    """
    accepted = set(inspect.signature(target.__init__).parameters) | _BASE_ARGUMENTS
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(source.__init__).parameters.items()
    }
    translated = {}
    for key, value in config.items():
        if key in accepted:
            translated[key] = value
        elif key not in defaults or value != defaults[key]:
            raise UnsupportedModelError(
                f"Layer '{config['name']}': {key}={value!r} has no equivalent in "
                f"{target.__module__}.{target.__name__}."
            )
    return translated

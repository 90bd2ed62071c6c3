"""Public names imported on first use (PEP 562), for keras_bn and keras_bn.export.

`import keras_bn` (and so the `keras-bn-export` command, whose module lives in the package)
must not load TensorFlow, Keras, tf2onnx or LiteRT: `keras-bn-export --help` would take
seconds, and the command could not set its environment (TF_CPP_MIN_LOG_LEVEL,
KERAS_BACKEND) before TensorFlow reads it. Each package lists where its names live; the
first use of one runs the backend guard (keras_bn/backend/guard.py: the layer under TensorFlow or
JAX, the rest under TensorFlow only), imports its module and keeps the value.
"""

import importlib

from keras_bn.backend import guard


def attach(namespace, names):
    """A package's `__getattr__` and `__dir__` for names that are imported on first use.

    Args:
        namespace: the package's `globals()`; a value is kept there once imported.
        names: {public name: (module, attribute)}; attribute None for the module itself.

    Returns:
        (`__getattr__`, `__dir__`), to assign in the package.
    """

    def __getattr__(name):
        if name not in names:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        guard.require(f"{namespace['__name__']}.{name}")
        module_name, attribute = names[name]
        value = importlib.import_module(module_name)
        if attribute is not None:
            value = getattr(value, attribute)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__

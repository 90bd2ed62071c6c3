"""The TensorFlow-backend guard: keras_bn's layers and exporters are TensorFlow code.

A tiny module of its own so that `import keras_bn` stays light (the package's names load on
first use, keras_bn/_lazy.py): the guard runs when a public name is first used and when
keras_bn.layers (which every heavy module imports) or keras_bn.export.affine is imported, so it
fires before any keras_bn layer is built under another backend.
"""


def is_tensorflow():
    """True when Keras runs on TensorFlow (imports keras).

    Returns:
        bool.
    """
    import keras

    return keras.backend.backend() == "tensorflow"


def require_tensorflow():
    """Raise unless Keras runs on TensorFlow.

    Raises:
        ImportError: Keras uses another backend; the message names it and the fix.
    """
    import keras

    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ImportError(
            "keras_bn needs the TensorFlow Keras backend, but Keras is using "
            f"{backend!r}. Set KERAS_BACKEND=tensorflow before importing keras."
        )

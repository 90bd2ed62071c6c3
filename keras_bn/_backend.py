"""The Keras-backend guard: what of keras_bn runs under which Keras backend.

`keras_bn.BatchNormalization` runs under TensorFlow and JAX (keras_bn/_jax_ops.py holds its
JAX maths), and so do `recalibrate`, `callbacks.Recalibrate` and `diagnostics.check_batchnorm`
(a backend switch at their few TensorFlow-specific points, `on_tensorflow`), `convert`,
`keras_bn.export.fold_batch_norms` (Keras-API code and numpy weight maths) and `quantize`
(training; keras_bn/quantize/_jax_fake_quant.py); everything else (the diagnostics' gradient
probes, the TFLite and ONNX writers) is TensorFlow code.
A tiny module of its own so that `import keras_bn` stays light (the package's names load on
first use, keras_bn/_lazy.py): the guard runs when a public name is first used, when a module
is imported (keras_bn.layers, keras_bn.export.affine, the TFLite and ONNX writers) and when a
function is called (`quantize.quantize_model`, the diagnostics' gradient
probes), so it fires before anything of keras_bn is built under a backend that cannot run it.
"""

# The backends the layer runs on. PyTorch is refused: torch is a large dependency that no test
# or benchmark of this project installs, so nothing of keras_bn is measured on it.
LAYER_BACKENDS = ("tensorflow", "jax")
# The public names that work under every backend of LAYER_BACKENDS (the rest need TensorFlow).
# keras_bn.diagnostics' gradient probes check for TensorFlow themselves (`require_tensorflow`).
LAYER_NAMES = frozenset(
    {
        "keras_bn.BatchNormalization",
        "keras_bn.layers",
        "keras_bn.recalibrate",
        "keras_bn.LayerChange",
        "keras_bn.RecalibrationReport",
        "keras_bn.callbacks",
        "keras_bn.diagnostics",
        "keras_bn.quantize",
    }
)
# The fold and `convert`, and what they return or raise: also under every backend of
# LAYER_BACKENDS. The TFLite and ONNX writers are not: they convert TensorFlow functions.
FOLD_NAMES = frozenset(
    {"keras_bn.convert"}
    | {
        f"keras_bn.export.{name}"
        for name in (
            "fold_batch_norms",
            "FoldedBN",
            "KeptBN",
            "InferenceAffine",
            "ChannelBias",
            "FoldReport",
            "ChannelSpread",
            "WorstChannel",
            "INT8_READINESS_TOLERANCE",
            "INT8_SPREAD_THRESHOLD",
        )
    }
)
# What the first use of a TensorFlow-only writer says under another backend.
EXPORT_HINT = (
    ' Save the model (model.save("model.keras")) and load the .keras file under '
    "KERAS_BACKEND=tensorflow to write TFLite or ONNX (a .keras file crosses backends)."
)


def backend():
    """The Keras backend's name (imports keras).

    Returns:
        str, e.g. "tensorflow" or "jax".
    """
    import keras

    return keras.backend.backend()


def require(name):
    """Raise unless the Keras backend can run `name`: the layer's backends for LAYER_NAMES,
    TensorFlow for every other.

    Args:
        name: the dotted public name or module about to be used, e.g. "keras_bn.convert".

    Raises:
        ImportError: Keras uses a backend that cannot run `name`; see `require_tensorflow`.
    """
    if name in LAYER_NAMES or name in FOLD_NAMES:
        require_layer_backend(name)
    else:
        require_tensorflow(name)


def require_layer_backend(name="keras_bn.BatchNormalization"):
    """Raise unless Keras runs on a backend keras_bn.BatchNormalization supports.

    Args:
        name: what is about to be used, named in the message.

    Raises:
        ImportError: Keras uses another backend (PyTorch, NumPy, OpenVINO); the message names
            it, the supported ones and the fix.
    """
    found = backend()
    if found not in LAYER_BACKENDS:
        raise ImportError(
            f"{name} needs the TensorFlow or JAX Keras backend, but Keras "
            f"is using {found!r} (PyTorch is not supported: torch is a large dependency, and "
            f"keras_bn is not tested or measured on it). Set KERAS_BACKEND=tensorflow or "
            f"KERAS_BACKEND=jax before importing keras."
        )


def require_tensorflow(name="keras_bn"):
    """Raise unless Keras runs on TensorFlow.

    Args:
        name: what is about to be used, named in the message.

    Raises:
        ImportError: Keras uses another backend; the message names it, what works there and
            the fix.
    """
    found = backend()
    if found != "tensorflow":
        works = (
            " Under JAX keras_bn.BatchNormalization, recalibrate, callbacks.Recalibrate, "
            "diagnostics.check_batchnorm, convert, keras_bn.export.fold_batch_norms and "
            "quantize work; the diagnostics' gradient probes and the TFLite and ONNX "
            "writers need TensorFlow for now."
            if found == "jax"
            else ""
        )
        if name.startswith("keras_bn.export"):
            works += EXPORT_HINT
        raise ImportError(
            f"{name} needs the TensorFlow Keras backend, but Keras is using {found!r}.{works} "
            f"Set KERAS_BACKEND=tensorflow before importing keras."
        )


def on_tensorflow():
    """Whether Keras runs on TensorFlow (else JAX, for the code that runs on both): where the
    code that runs on both picks its TensorFlow-specific path (tf.function, tf.distribute).

    Returns:
        bool.
    """
    return backend() == "tensorflow"

"""The guard: what of keras_bn runs where, and the message when it cannot.

Everything runs under every backend of keras_bn.backend (TensorFlow, JAX and PyTorch), except
what converts TensorFlow functions: the TFLite and ONNX writers (`export_tflite`,
`export_onnx`, which also need the `export` extra's converters and runtimes) and the
diagnostics' gradient probes. The guard runs when a public name is first used
(keras_bn/_lazy.py) and when one of those functions is called, before anything is built where
it cannot run.
"""

import importlib.util

from keras_bn import backend

# The public names that need TensorFlow (each with the packages of the `export` extra).
WRITER_NAMES = frozenset({"keras_bn.export.export_tflite", "keras_bn.export.export_onnx"})
# What the writers import beyond TensorFlow (module names), all in the `export` extra.
WRITER_MODULES = ("tensorflow", "tf2onnx", "onnx", "onnxruntime", "ai_edge_litert")
# How a model trained elsewhere gets written.
EXPORT_HINT = (
    'Save the model (model.save("model.keras")) and load the .keras file under '
    "KERAS_BACKEND=tensorflow to write TFLite or ONNX (a .keras file crosses backends)."
)


def require(name):
    """Raise unless `name` can run here: the writers need TensorFlow and the `export` extra,
    everything else a backend of keras_bn.backend.

    Args:
        name: the dotted public name or module about to be used, e.g. "keras_bn.convert".

    Raises:
        ImportError: Keras uses a backend keras_bn does not run on, or `name` is a writer and
            Keras does not run on TensorFlow, or a package the writers need is missing; the
            message names the fix.
    """
    if name in WRITER_NAMES:
        require_writers(name)
    else:
        backend.get(name)


def require_writers(name):
    """Raise unless the TFLite and ONNX writers can run: Keras on TensorFlow, and every
    package of the `export` extra installed.

    Args:
        name: the writer about to be used, named in the message.

    Raises:
        ImportError: naming what is missing, what to install and how to export instead.
    """
    missing = [m for m in WRITER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"{name} needs the packages of keras-bn's `export` extra, but {missing} "
            f"{'is' if len(missing) == 1 else 'are'} not installed: pip install "
            f'"keras-bn[export]". Everything else of keras_bn works without them. ' + EXPORT_HINT
        )
    require_tensorflow(name)


def require_tensorflow(name="keras_bn"):
    """Raise unless Keras runs on TensorFlow.

    Args:
        name: what is about to be used, named in the message.

    Raises:
        ImportError: Keras uses another backend; the message names it, what works there and
            the fix.
    """
    found = backend.name()
    if found != "tensorflow":
        hint = " " + EXPORT_HINT if name.startswith("keras_bn.export") else ""
        if importlib.util.find_spec("tensorflow") is None:
            hint += ' TensorFlow is not installed: pip install "keras-bn[tensorflow]".'
        works = (
            f" Under {_BACKEND_NAMES.get(found, found)} keras_bn.BatchNormalization, "
            f"recalibrate, callbacks.Recalibrate, diagnostics.check_batchnorm, convert, "
            f"keras_bn.export.fold_batch_norms and quantize work; the diagnostics' gradient "
            f"probes and the TFLite and ONNX writers need TensorFlow."
            if found in backend.SUPPORTED
            else ""
        )
        raise ImportError(
            f"{name} needs the TensorFlow Keras backend, but Keras is using {found!r}.{works}"
            f"{hint} Set KERAS_BACKEND=tensorflow before importing keras."
        )


_BACKEND_NAMES = {"jax": "JAX", "torch": "PyTorch"}

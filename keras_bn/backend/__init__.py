"""The one switch point between keras_bn's maths and the Keras backend it runs on.

`get()` returns the module of the backend Keras uses, chosen once, the first time it is asked:
keras_bn/backend/tensorflow/, keras_bn/backend/jax/ or keras_bn/backend/torch/. Each exposes the
same functions, with the same signatures, and everything outside this package calls them
through `get()` (as Keras's `keras.ops` call `keras/src/backend/<name>/`), so that the layers,
`recalibrate`, the fold and QAT are written once, and only the backend Keras runs is imported:
a JAX or PyTorch user needs no TensorFlow.

The interface is `INTERFACE`, each backend module's `__all__`.
"""

import importlib
import types
import typing

import numpy as np

# The functions every backend module exposes, with the same signatures (its `__all__`).
INTERFACE = (
    # the layer's train step
    "statistics_dtype",
    "is_floating",
    "parameter",
    "read",
    "expand_mask",
    "ghost_split",
    "ghost_average",
    "element_count",
    "batch_size_traced",
    "run_time_count",
    "zero_unless_enough",
    "batch_norm_train",  # with the hand-written backward
    "unit_affine",
    "batch_norm_inference",
    "batch_norm_eval",
    "renorm_corrections",
    "reshape_like",
    "per_channel",
    "add",
    "cond",
    # the moving statistics
    "unbiased_estimates",
    "usable",
    "pool_statistics",  # across tf.distribute replicas; JAX has none
    "replica_context",
    "moving_average",
    "cumulative_average",
    "statistics_update",
    "counter_dtype",
    # recalibration and snapshots
    "moments",
    "input_moments",
    "local_copies",
    "recalibration_processes",  # recalibrate(synchronized=True)
    "compiled",
    "specialized",
    "name_scope",
    # fake quantization
    "weight_max_abs",
    "fake_quant_weights",
    "fake_quant_activations",
    "weight_step",
    "activation_step",
    "round_bias",
    "halves_away_from_int8_zero",
    "moved_range",  # an activation quantizer's range update
    # what the backend can do, which shared code asks instead of the backend's name
    "takes_tf_data",
    "traced_functions_read_weights",
    "bias_add_may_miss_channels_first",
)


class ProcessSum(typing.Protocol):
    """What a backend's `recalibration_processes()` returns where several processes recalibrate
    together (torch.distributed's group, jax.distributed's processes, a tf.distribute
    strategy's workers)."""

    def all_sum_array(self, values: np.ndarray) -> np.ndarray:
        """The float64 array `values` summed elementwise over every process, the same bits on
        each; every process calls it with the same shape, in the same order."""
        ...


# The Keras backends keras_bn runs on, each a subpackage here.
SUPPORTED = ("tensorflow", "jax", "torch")

_chosen: types.ModuleType | None = None


def name() -> str:
    """The Keras backend's name (imports keras).

    Returns:
        str, e.g. "tensorflow", "jax" or "torch".
    """
    import keras

    return keras.backend.backend()


def is_supported() -> bool:
    """Whether Keras's backend is one keras_bn runs on (imports keras, not the backend).

    Returns:
        bool.
    """
    return name() in SUPPORTED


def loads_tensorflow() -> bool:
    """Whether Keras's backend is TensorFlow's, whose modules must have finished loading before
    keras_bn's layers register (keras_bn/_registration.py); the backend module itself is not
    imported (it would import the framework).

    Returns:
        bool.
    """
    return name() == "tensorflow"


def to_numpy(x: typing.Any, dtype: typing.Any = None) -> np.ndarray:
    """`x` (a backend tensor, a Keras variable, a numpy array or a Python number) as a numpy
    array in host memory: the one conversion that code outside this package makes, since a
    tensor on an accelerator refuses `np.asarray` (a CUDA torch tensor's `__array__` raises).

    Args:
        x: the value.
        dtype: the numpy dtype wanted, or None for x's own.

    Returns:
        np.ndarray.
    """
    import keras

    array = keras.ops.convert_to_numpy(x)
    return np.asarray(array, dtype=dtype)


def get(what: str = "keras_bn") -> types.ModuleType:
    """The backend module for the Keras backend in use, imported on the first call.

    Args:
        what: what is about to be used, named in the error.

    Returns:
        keras_bn.backend.tensorflow, keras_bn.backend.jax or keras_bn.backend.torch.

    Raises:
        ImportError: Keras runs on a backend keras_bn does not support; the message names it
            and the ones it does.
    """
    global _chosen
    if _chosen is None:
        found = name()
        if found not in SUPPORTED:
            raise ImportError(
                f"{what} needs the TensorFlow, JAX or PyTorch Keras backend, but Keras is "
                f"using {found!r}. Set KERAS_BACKEND=tensorflow, KERAS_BACKEND=jax or "
                f"KERAS_BACKEND=torch before importing keras."
            )
        _chosen = importlib.import_module(f"keras_bn.backend.{found}")
    return _chosen

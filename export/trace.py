"""A Keras model's inputs and outputs by name, and the model as a traced inference function.

Every exporter and the fold report work on flat {name: array} maps: the runtimes (LiteRT
signatures, onnxruntime sessions) take and give named tensors, and a report needs one error
per output name. `Signature` fixes those names once per model:
- inputs: the key where the model takes a dict, else the Input layer's name (a feed may use
  these, `Signature.input_keys`, even where the file's name differs);
- outputs: the key where the model returns a dict, else the name of the layer that produces it
  (`_1`, `_2` appended where two outputs would share a name, or an output an input's: a file's
  tensors need distinct names, and a model may return one of its inputs).
Either is made converter-safe: characters outside [A-Za-z0-9_.-] become "_", and a leading
"_" or "-" is dropped (TensorFlow's signatures refuse such argument names).

The converters start from `inference_function`: a tf.function with an explicit signature and
a dynamic batch dim (TFLite via a SavedModel, tf2onnx's from_function), which avoids the
Keras 3 paths of tf2onnx's from_keras (tf2onnx#2329, #2348, #2448).
"""

import dataclasses
import re

import keras
import numpy as np
import tensorflow as tf

from keras_bn import _models

RANDOM_BATCH = 4
UNKNOWN_DIM = 8  # a free non-batch dim in random input


@dataclasses.dataclass(frozen=True)
class Signature:
    """Names, shapes and dtypes of a model's inputs and outputs, in the model's flat order."""

    input_names: tuple  # converter-safe and unique: the names in the files and in feeds
    input_keys: tuple  # the model's own name of each input (dict key path, or Input name)
    input_specs: tuple  # tf.TensorSpec per input, batch dim free, named as the input
    output_names: tuple
    _inputs_struct: object  # what the model is called with, with inputs as leaves

    def pack(self, feed):
        """The model's own input structure from a {name: array} feed."""
        return keras.tree.pack_sequence_as(
            self._inputs_struct, [feed[name] for name in self.input_names]
        )


def signature(model):
    """The Signature of a built Sequential or Functional model (nested structures allowed).

    Raises UnsupportedModelError for a subclassed model (its inputs are not known before it is
    called) and for an unbuilt Sequential one.
    """
    _models.layer_graph(model, "export")
    inputs = getattr(model, "_inputs_struct", None)
    if inputs is None:  # Sequential
        inputs = model.inputs[0] if len(model.inputs) == 1 else list(model.inputs)
    outputs = getattr(model, "_outputs_struct", None)
    if outputs is None:
        outputs = model.outputs[0] if len(model.outputs) == 1 else list(model.outputs)
    input_keys = _keys(inputs)
    input_names = _safe_names(input_keys)
    specs = tuple(
        tf.TensorSpec([None, *t.shape[1:]], t.dtype, name=name)
        for name, t in zip(input_names, keras.tree.flatten(inputs))
    )
    output_names = _safe_names(_keys(outputs), taken=input_names)
    return Signature(input_names, input_keys, specs, output_names, inputs)


def _keys(structure):
    """Each leaf's own name: the dict keys along its path, else its producing layer's name."""
    keys = []
    for path, tensor in keras.tree.flatten_with_path(structure):
        along = [str(p) for p in path if isinstance(p, str)]
        keys.append("_".join(along) if along else tensor._keras_history.operation.name)
    return keys


def _safe_names(keys, taken=()):
    """One unique, converter-safe name per key; none of them in `taken`."""
    names = list(taken)
    for key in keys:
        # TensorFlow's rule for a signature's argument names: [A-Za-z0-9.][A-Za-z0-9_.\-/]*.
        name = re.sub(r"^[^A-Za-z0-9.]+", "", re.sub(r"[^A-Za-z0-9_.\-]", "_", key))
        names.append(_models.unique_name(name or "tensor", names))
    return tuple(names[len(taken) :])


def feed(sig, data, what="probe"):
    """{input name: array} from `data` in any structure `model.predict` takes.

    Args:
        sig: the model's Signature.
        data: the model's own input structure (nested lists and dicts as the model takes
            them), one array (single-input models), a flat list/tuple of arrays in the model's
            input order, or a flat dict keyed by input name (the model's own keys, or the
            converter-safe `sig.input_names` where they differ).
        what: the argument's name, for error messages.

    Returns:
        dict of numpy arrays in the inputs' dtypes, all with the same number of samples.

    Raises:
        ValueError naming the input when a name is missing or unknown, the count is wrong, the
        sample counts differ or are 0, or a float array is given for an integer input.
    """
    names = sig.input_names
    if isinstance(data, (dict, list, tuple)) and _same_structure(data, sig._inputs_struct):
        arrays = keras.tree.flatten(data)  # the order of the model's inputs, nested or not
    elif isinstance(data, dict) or hasattr(data, "files"):  # dict, or np.load's NpzFile
        aliases = {name: name for name in names}
        aliases.update(zip(sig.input_keys, names))  # the model's own key first
        given: dict = {}  # input name → the caller's key
        for key in data:  # a dict or an NpzFile: both are Mappings
            given.setdefault(aliases.get(key), []).append(key)
        unknown = sorted(map(str, given.pop(None, [])))
        missing = [key for key, name in zip(sig.input_keys, names) if name not in given]
        twice = [keys for keys in given.values() if len(keys) > 1]
        if unknown or missing or twice:
            raise ValueError(
                f"{what} has arrays for {sorted(map(str, data.keys()))}, but the model's inputs "
                f"are {list(sig.input_keys)} (missing {missing}, unknown {unknown}"
                f"{f', the same input twice {twice}' if twice else ''})."
            )
        arrays = [data[given[name][0]] for name in names]
    elif isinstance(data, (list, tuple)):
        if len(data) != len(names):
            raise ValueError(
                f"{what} has {len(data)} arrays, but the model has {len(names)} inputs "
                f"{list(names)}."
            )
        arrays = list(data)
    elif len(names) == 1:
        arrays = [data]
    else:
        raise ValueError(
            f"{what} is one array, but the model has {len(names)} inputs {list(names)}: give a "
            f"list in that order or a dict keyed by those names."
        )
    result = {}
    for name, array, spec in zip(names, arrays, sig.input_specs):
        result[name] = _as_input(name, np.asarray(array), spec, what)
    counts = {name: len(a) for name, a in result.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{what}'s arrays differ in their number of samples: {counts}.")
    if 0 in counts.values():  # every comparison on it would pass, having compared nothing
        raise ValueError(
            f"{what} has no samples (shapes "
            f"{[a.shape for a in result.values()]}): nothing to verify on."
        )
    return result


def _same_structure(data, structure):
    try:
        keras.tree.assert_same_structure(data, structure)
    except (ValueError, TypeError):
        return False
    return True


def _as_input(name, array, spec, what):
    dtype = np.dtype(spec.dtype.as_numpy_dtype)
    if array.ndim == 0:
        raise ValueError(f"{what} for input '{name}' is a scalar; it needs a batch axis.")
    if np.issubdtype(array.dtype, np.floating) and not np.issubdtype(dtype, np.floating):
        raise ValueError(
            f"{what} for input '{name}' is {array.dtype}, but the input is {dtype.name}."
        )
    expected = spec.shape[1:]
    if len(array.shape) - 1 != len(expected) or any(
        d is not None and d != a for d, a in zip(expected, array.shape[1:])
    ):
        raise ValueError(
            f"{what} for input '{name}' has shape {array.shape}, but the input takes "
            f"(batch, {', '.join('None' if d is None else str(d) for d in expected)})."
        )
    return array.astype(dtype, copy=False)


def random_feed(sig, batch=RANDOM_BATCH, seed=0):
    """Seeded input for every model input: standard normal for floats, 0s and 1s for integer
    and bool inputs (valid ids and masks for any vocabulary); free dims get 8."""
    rng = np.random.default_rng(seed)
    result = {}
    for name, spec in zip(sig.input_names, sig.input_specs):
        shape = [batch] + [UNKNOWN_DIM if d is None else d for d in spec.shape[1:]]
        dtype = np.dtype(spec.dtype.as_numpy_dtype)
        if np.issubdtype(dtype, np.floating):
            result[name] = rng.standard_normal(shape).astype(dtype)
        else:
            result[name] = rng.integers(0, 2, shape).astype(dtype)
    return result


def by_input_name(inputs, names, path):
    """{input name: array} for a runtime: `inputs` itself when it is a dict, else the one array
    of a single-input file under that input's name.

    Raises ValueError, naming `path` and its inputs, for one array and several inputs.
    """
    if isinstance(inputs, dict):
        return inputs
    if len(names) != 1:
        raise ValueError(f"{path} has the inputs {list(names)}: give a dict keyed by them.")
    return {names[0]: inputs}


def first_samples(inputs, count):
    """The first `count` samples of every array of a feed."""
    return {name: array[:count] for name, array in inputs.items()}


def outputs(model, sig, inputs):
    """{output name: float64 array}: the model run in inference mode on a feed."""
    results = keras.tree.flatten(model(sig.pack(inputs), training=False))
    return {name: np.asarray(r, np.float64) for name, r in zip(sig.output_names, results)}


def inference_function(model, sig):
    """tf.function(*inputs) -> {output name: tensor}, the model in inference mode.

    Its positional arguments follow `sig.input_names`, each with its TensorSpec.
    """

    def infer(*tensors):
        results = model(sig.pack(dict(zip(sig.input_names, tensors))), training=False)
        return dict(zip(sig.output_names, keras.tree.flatten(results)))

    return tf.function(infer, input_signature=list(sig.input_specs))

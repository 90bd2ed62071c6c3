"""A Keras model's inputs and outputs by name, its samples, and the model as a traced
inference function.

Every exporter and the fold report work on flat {name: array} maps: the runtimes (LiteRT
signatures, onnxruntime sessions) take and give named tensors, and a report needs one error
per output name. `Signature` fixes those names once per model and file format:
- user-chosen names, the keys of a model's top-level input or output dict, are kept as they
  are and keep their tensors;
- every other name is generated: the dict keys along a nested path joined by "_", else the
  name of the layer that produces the tensor (the Input layer's, for an input). A generated
  name avoids every user-chosen name of its namespace and every other name: where its own is
  taken it gets the first free `_1`, `_2`, ... suffix, and a suffix never takes a name another
  tensor has as its own. Generated output names also avoid the model's input names (a model
  may return one of its inputs).
- a format's limits (`NameRules`): TFLite's input names are TensorFlow signature arguments
  ([A-Za-z0-9.][A-Za-z0-9_.-]*): a generated one is cleaned to fit, a user-chosen one that
  does not fit is refused (UnsupportedModelError naming it), never renamed. An ONNX graph's
  inputs and outputs share one namespace: a generated input yields to a user-chosen output of
  its name, and an input and an output with the same user-chosen name are refused. Output
  names are any string in both formats, so they are the same in every file and report.

A feed (`feed`, `Feed`) is checked against the model the way `model.predict` takes inputs,
and remembers what the caller called it (for messages). `held_out_split` splits
representative samples into calibration and held-out verification rows.

The converters start from `inference_function`: a tf.function with an explicit signature and
a dynamic batch dim (TFLite via a SavedModel, tf2onnx's from_function), which avoids the
Keras 3 paths of tf2onnx's from_keras (tf2onnx#2329, #2348, #2448).
"""

import dataclasses
import os
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeAlias

import keras
import numpy as np

from keras_bn._errors import UnsupportedModelError
from keras_bn._graph import models
from keras_bn.export import defaults

# What `model.predict` takes: one array, or the model's own (nested) structure of arrays, a
# flat list or dict of them; its shape is the model's.
ModelInput: TypeAlias = Any

RANDOM_BATCH = 4
UNKNOWN_DIM = 8  # a free non-batch dim in random input


@dataclasses.dataclass(frozen=True)
class NameRules:
    """The names a file format can give its input and output tensors.

    Attributes:
        format: the format's name, for messages ("TFLite", "ONNX"); "" for no format.
        input_pattern: a regular expression every input name must match in full, or None for
            any string.
        input_characters: `input_pattern` in words, for the refusal.
        one_namespace: inputs and outputs share one namespace (an ONNX graph's values), so an
            output cannot have an input's name.
    """

    format: str = ""
    input_pattern: str | None = None
    input_characters: str = ""
    one_namespace: bool = False


ANY_NAMES = NameRules()


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One model input as the files take it: its shape with a free batch dim, and dtype."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str  # Keras's dtype name, e.g. "float32"

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        if self.dtype == "bfloat16":  # numpy knows it from ml_dtypes, as Keras does
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.dtype)


@dataclasses.dataclass(frozen=True)
class Signature:
    """Names, shapes and dtypes of a model's inputs and outputs, in the model's flat order."""

    # unique, and valid in the format: the names in the files and in feeds
    input_names: tuple[str, ...]
    # the model's own name of each input (dict key path, or Input name)
    input_keys: tuple[str, ...]
    input_specs: tuple[InputSpec, ...]  # per input, batch dim free, named as the input
    output_names: tuple[str, ...]
    _inputs_struct: object  # what the model is called with, with inputs as leaves

    def pack(self, feed: dict[str, Any]) -> ModelInput:
        """The model's own input structure from a {name: array} feed."""
        return keras.tree.pack_sequence_as(
            self._inputs_struct, [feed[name] for name in self.input_names]
        )


def signature(model: keras.Model, rules: NameRules = ANY_NAMES) -> Signature:
    """The Signature of a built Sequential or Functional model (nested structures allowed).

    Args:
        model: the model.
        rules: the NameRules of the file format the names are for (default: any name).

    Raises:
        UnsupportedModelError: a subclassed model (its inputs are not known before it is
            called), an unbuilt Sequential one, or a user-chosen name `rules` cannot hold
            (named, with the characters allowed).
    """
    models.layer_graph(model, "export")
    inputs = getattr(model, "_inputs_struct", None)
    if inputs is None:  # Sequential
        inputs = model.inputs[0] if len(model.inputs) == 1 else list(model.inputs)
    outputs = _outputs_struct(model)
    input_leaves, output_leaves = _leaves(inputs), _leaves(outputs)
    user_inputs = [user for user, _ in input_leaves if user is not None]
    user_outputs = [user for user, _ in output_leaves if user is not None]
    _check_user_names(user_inputs, user_outputs, rules)
    input_names = _names(
        input_leaves,
        reserved=user_outputs if rules.one_namespace else (),
        clean=_cleaner(rules),
    )
    input_keys = tuple(base for _, base in input_leaves)  # a user-chosen name is its own base
    output_names = _names(output_leaves, reserved=(*input_keys, *input_names))
    specs = tuple(
        InputSpec(name, (None, *t.shape[1:]), keras.backend.standardize_dtype(t.dtype))
        for name, t in zip(input_names, keras.tree.flatten(inputs))
    )
    return Signature(input_names, input_keys, specs, output_names, inputs)


def _outputs_struct(model: keras.Model) -> Any:
    outputs = getattr(model, "_outputs_struct", None)
    if outputs is None:  # Sequential
        outputs = model.outputs[0] if len(model.outputs) == 1 else list(model.outputs)
    return outputs


def output_tensors(model: keras.Model) -> list[keras.KerasTensor]:
    """A Sequential or Functional model's symbolic output tensors, in `Signature.output_names`
    order (the flattened output structure)."""
    return keras.tree.flatten(_outputs_struct(model))


def _leaves(structure: object) -> list[tuple[str | None, str]]:
    """(user-chosen name or None, generated base name) per leaf, in flat order.

    A leaf's name is user-chosen when it is the value of a top-level dict key; otherwise it
    is the dict keys along its path joined by "_", else its producing layer's name.
    """
    leaves: list[tuple[str | None, str]] = []
    for path, tensor in keras.tree.flatten_with_path(structure):
        along = [str(p) for p in path if isinstance(p, str)]
        user = path[0] if len(path) == 1 and isinstance(path[0], str) else None
        base = "_".join(along) if along else tensor._keras_history.operation.name
        leaves.append((user, base))
    return leaves


def _check_user_names(user_inputs: list[str], user_outputs: list[str], rules: NameRules) -> None:
    """Refuse a user-chosen name the format cannot hold: renaming it could hand it to, or
    take it from, another tensor."""
    if rules.input_pattern is not None:
        for key in user_inputs:
            if not re.fullmatch(rules.input_pattern, key):
                raise UnsupportedModelError(
                    f"{rules.format} cannot name an input {key!r} (the model's input dict "
                    f"key): its input names must start with {rules.input_characters}. Rename "
                    f"that key (the export does not rename a name you chose)."
                )
    both = sorted(set(user_inputs) & set(user_outputs))
    if rules.one_namespace and both:
        raise UnsupportedModelError(
            f"{rules.format} cannot name both an input and an output {both[0]!r} (keys of the "
            f"model's input and output dicts): a file's inputs and outputs share one "
            f"namespace. Rename one of them (the export does not rename a name you chose)."
        )


def _cleaner(rules: NameRules) -> Callable[[str], str]:
    """A generated name made to fit `rules` (TensorFlow's argument names, for TFLite)."""
    if rules.input_pattern is None:
        return lambda name: name
    return lambda name: (
        re.sub(r"^[^A-Za-z0-9.]+", "", re.sub(r"[^A-Za-z0-9_.-]", "_", name)) or "input"
    )


def _names(
    leaves: list[tuple[str | None, str]],
    reserved: Collection[str] = (),
    clean: Callable[[str], str] = lambda name: name,
) -> tuple[str, ...]:
    """One unique name per leaf: user-chosen ones as they are; generated ones (`clean`ed)
    never a user-chosen name nor one in `reserved`.

    Generated names that are free keep themselves first; only then do the rest get suffixes,
    so that a suffix (`x_1`) never takes the name another tensor has as its own.
    """
    names = {index: user for index, (user, _) in enumerate(leaves) if user is not None}
    taken = set(reserved) | set(names.values())
    later = []
    for index, (user, base) in enumerate(leaves):
        if user is not None:
            continue
        base = clean(base)
        if base in taken:
            later.append((index, base))
        else:
            names[index] = base
            taken.add(base)
    for index, base in later:
        names[index] = models.unique_name(base, taken)
        taken.add(names[index])
    return tuple(names[index] for index in range(len(leaves)))


class Feed(dict[str, np.ndarray]):
    """{input name: array}, as `feed` returns it, with `what`: what the caller called these
    samples ("probe", "representative_data", a CLI flag), for messages about them.

    Args:
        arrays: {input name: array}.
        what: the name for messages.
    """

    def __init__(self, arrays: dict[str, np.ndarray], what: str) -> None:
        super().__init__(arrays)
        self.what = what

    @property
    def samples(self) -> int:
        """The number of samples (the arrays' first dim)."""
        return len(next(iter(self.values()))) if self else 0

    def rows(self, indices: np.ndarray, what: str | None = None) -> "Feed":
        """The Feed of these samples (an index array), named `what` (default: the same)."""
        return Feed(
            {name: array[indices] for name, array in self.items()},
            self.what if what is None else what,
        )


def feed(sig: Signature, data: ModelInput, what: str = "probe") -> Feed:
    """A Feed ({input name: array}) from `data` in a structure `model.predict` takes.

    Args:
        sig: the model's Signature.
        data: the model's own input structure (nested lists and dicts as the model takes
            them), one array (single-input models), a flat list/tuple of arrays in the model's
            input order (not for a model that takes a dict of several inputs: the order would
            be ambiguous, and `model.predict` refuses it), a flat dict keyed by input name (the
            model's own keys, or the names in `sig.input_names` where they differ), or a Feed.
        what: the argument's name, for error messages; a Feed keeps its own.

    Returns:
        Feed of numpy arrays in the inputs' dtypes, all with the same number of samples.

    Raises:
        ValueError naming the input when a name is missing or unknown, the count is wrong, a
        list is given for a dict of inputs, the sample counts differ or are 0, or a float
        array is given for an integer input.
    """
    if isinstance(data, Feed):  # a dict subclass is a leaf to keras.tree: a plain dict
        data, what = dict(data), data.what
    names = sig.input_names
    takes_dict = isinstance(sig._inputs_struct, dict)
    if isinstance(data, (dict, list, tuple)) and _same_structure(data, sig._inputs_struct):
        arrays = keras.tree.flatten(data)  # the order of the model's inputs, nested or not
    elif isinstance(data, dict) or hasattr(data, "files"):  # dict, or np.load's NpzFile
        aliases = {name: name for name in names}
        aliases.update(zip(sig.input_keys, names))  # the model's own key first
        given: dict[str | None, list[Any]] = {}  # input name → the caller's keys
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
        if takes_dict and len(names) > 1:
            raise ValueError(
                f"{what} is a list of {len(data)} arrays, but the model takes a dict of inputs "
                f"{list(sig.input_keys)}: the order of a list is ambiguous (model.predict "
                f"refuses it too). Pass a dict keyed by the input names."
            )
        if len(data) != len(names):
            raise ValueError(
                f"{what} has {len(data)} arrays, but the model has {len(names)} inputs "
                f"{list(sig.input_keys)}."
            )
        arrays = list(data)
    elif len(names) == 1:
        arrays = [data]
    else:
        order = "" if takes_dict else "a list in that order or "
        raise ValueError(
            f"{what} is one array, but the model has {len(names)} inputs "
            f"{list(sig.input_keys)}: give {order}a dict keyed by those names."
        )
    result: dict[str, np.ndarray] = {}
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
    return Feed(result, what)


def _same_structure(data: ModelInput, structure: object) -> bool:
    try:
        keras.tree.assert_same_structure(data, structure)
    except (ValueError, TypeError):
        return False
    return True


def _as_input(name: str, array: np.ndarray, spec: InputSpec, what: str) -> np.ndarray:
    dtype = spec.numpy_dtype
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


def random_feed(sig: Signature, batch: int = RANDOM_BATCH, seed: int = 0) -> Feed:
    """Seeded input for every model input: standard normal for floats, 0s and 1s for integer
    and bool inputs (valid ids and masks for any vocabulary); free dims get 8. A Feed named
    "the seeded random probe"."""
    rng = np.random.default_rng(seed)
    result: dict[str, np.ndarray] = {}
    for name, spec in zip(sig.input_names, sig.input_specs):
        shape = [batch] + [UNKNOWN_DIM if d is None else d for d in spec.shape[1:]]
        dtype = spec.numpy_dtype
        if np.issubdtype(dtype, np.floating):
            result[name] = rng.standard_normal(shape).astype(dtype)
        else:
            result[name] = rng.integers(0, 2, shape).astype(dtype)
    return Feed(result, "the seeded random probe")


def by_input_name(
    inputs: np.ndarray | dict[str, np.ndarray], names: Sequence[str], path: str | os.PathLike[str]
) -> dict[str, np.ndarray]:
    """{input name: array} for a runtime: `inputs` itself when it is a dict, else the one array
    of a single-input file under that input's name.

    Raises ValueError, naming `path` and its inputs, for one array and several inputs.
    """
    if isinstance(inputs, dict):
        return inputs
    if len(names) != 1:
        raise ValueError(f"{path} has the inputs {list(names)}: give a dict keyed by them.")
    return {names[0]: inputs}


def evenly_spaced(count: int, total: int) -> np.ndarray:
    """`count` distinct indices spread evenly over range(total), first and last included
    (all of them when count >= total)."""
    if count >= total:
        return np.arange(total)
    return np.linspace(0, total - 1, count).round().astype(int)  # steps >= 1: distinct


def spread_samples(samples: Feed, count: int, what: str | None = None) -> Feed:
    """Up to `count` samples of a Feed, spread evenly over it (sorted data stays covered)."""
    return samples.rows(evenly_spaced(count, samples.samples), what)


def held_out_split(samples: Feed) -> tuple[Feed, Feed]:
    """(calibration rows, held-out rows) of representative samples: int8 is verified on
    samples it was not calibrated with.

    A quarter of the samples (`defaults.HELD_OUT_FRACTION`), at most `defaults.PROBE_SAMPLES`,
    are held out; up to `defaults.CALIBRATION_SAMPLES` of the rest calibrate. Both are spread
    evenly over the samples, so data sorted by class or by time is covered by both.

    Args:
        samples: a Feed.

    Returns:
        (Feed, Feed), disjoint.

    Raises:
        ValueError: fewer than `defaults.INT8_MIN_SAMPLES` samples, naming `samples.what`.
    """
    total = samples.samples
    if total < defaults.INT8_MIN_SAMPLES:
        raise ValueError(
            f"{samples.what} has {total} samples; int8 needs at least "
            f"{defaults.INT8_MIN_SAMPLES}: a quarter of them are held out to verify the file "
            f"on samples it was not calibrated with, and the rest calibrate."
        )
    held_out = evenly_spaced(
        min(defaults.PROBE_SAMPLES, int(total * defaults.HELD_OUT_FRACTION)), total
    )
    rest = np.setdiff1d(np.arange(total), held_out)
    calibration = rest[evenly_spaced(defaults.CALIBRATION_SAMPLES, len(rest))]
    return (
        samples.rows(calibration, f"{samples.what} (calibration samples)"),
        samples.rows(held_out, f"{samples.what} (held-out samples)"),
    )


def outputs(model: keras.Model, sig: Signature, inputs: Feed) -> dict[str, np.ndarray]:
    """{output name: float64 array}: the model run in inference mode on a feed (through
    keras.ops.convert_to_numpy: a PyTorch output may require grad, or lie on a GPU)."""
    results = keras.tree.flatten(model(sig.pack(inputs), training=False))
    return {
        name: np.asarray(keras.ops.convert_to_numpy(r), np.float64)
        for name, r in zip(sig.output_names, results)
    }


def tensor_specs(sig: Signature) -> list[Any]:
    """The inputs' tf.TensorSpecs, named as the inputs (the writers' traced signatures)."""
    import tensorflow as tf  # the writers' (keras_bn.backend.guard.require_writers)

    return [tf.TensorSpec(s.shape, s.dtype, name=s.name) for s in sig.input_specs]


def inference_function(model: keras.Model, sig: Signature) -> Any:
    """tf.function(*inputs) -> {output name: tensor}, the model in inference mode.

    Its positional arguments follow `sig.input_names`, each with its TensorSpec.
    """
    import tensorflow as tf  # the writers' (keras_bn.backend.guard.require_writers)

    def infer(*tensors: Any) -> dict[str, Any]:
        results = model(sig.pack(dict(zip(sig.input_names, tensors))), training=False)
        return dict(zip(sig.output_names, keras.tree.flatten(results)))

    return tf.function(infer, input_signature=tensor_specs(sig))

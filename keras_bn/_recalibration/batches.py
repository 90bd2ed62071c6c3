"""The input batches `x` that `recalibrate`, `callbacks.Recalibrate` and `check_batchnorm` read.

`data` comes in the forms `fit` takes: whole arrays (a numpy array, a dict of them for named
inputs, a list of them for a multi-input model, or `(x, y)` / `(x, y, sample_weight)` of those,
of which x alone is used), split here into batches; or a `tf.data.Dataset` or another iterable
of batches, whose elements are `x`, `(x, y)` or `(x, y, sample_weight)`. `Batches` checks it
once and yields each batch's `x`, as many times as a caller needs to pass over it. Under JAX a
dataset's elements come as numpy arrays (TensorFlow tensors are not JAX's).
"""

import copy
import sys
import typing
from collections.abc import Iterable, Iterator, Sized
from typing import Any, TypeAlias

import keras
import numpy as np

from keras_bn import backend

# What `data` may be: a tf.data.Dataset, whole arrays (split into batches here), or any other
# iterable of batches.
Data: TypeAlias = np.ndarray | dict[str, Any] | Iterable[Any]
_INFINITE = -1  # tf.data.INFINITE_CARDINALITY


def _cardinality(data: Data) -> int | None:
    """A tf.data.Dataset's cardinality (tf.data's constants: −1 infinite, −2 unknown), or None
    for anything else. TensorFlow is not imported for it: a dataset exists only where
    TensorFlow already is."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(data, tf.data.Dataset):
        return None
    return int(data.cardinality())


def input_count(model: keras.layers.Layer) -> int | None:
    """How many inputs `model` takes: its graph's, for a built Sequential or Functional model;
    None where unknown (a subclassed model, an unbuilt Sequential)."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    return None if inputs is None else len(inputs)


def _samples(value: Any) -> list[int] | None:
    """The first-axis lengths of the arrays in `value` (an array, or a dict, list or tuple of
    them); None where `value` is not made of arrays."""
    if isinstance(value, np.ndarray):
        return [len(value)] if value.ndim else None
    parts = list(value.values()) if isinstance(value, dict) else value
    if (
        isinstance(value, (dict, list, tuple))
        and value
        and all(isinstance(part, np.ndarray) and part.ndim for part in parts)
    ):
        return [len(part) for part in parts]
    return None


def _as_numpy(value: Any, depth: int = 2) -> Any:
    """`value` with the backend's tensors (tf.Tensor, jax.Array) as numpy arrays, at its top and
    in the tuples, lists and dicts that `fit`'s whole-array forms nest: `fit` takes tensors as
    whole arrays too."""
    if keras.ops.is_tensor(value):
        return keras.ops.convert_to_numpy(value)
    if depth and isinstance(value, dict):
        return {key: _as_numpy(part, depth - 1) for key, part in value.items()}
    if depth and isinstance(value, (list, tuple)):
        parts = [_as_numpy(part, depth - 1) for part in value]
        return tuple(parts) if isinstance(value, tuple) else parts
    return value


def whole_arrays(data: Data, inputs: int | None) -> Any:
    """`data`'s x when `data` is whole arrays in one of `fit`'s forms, else None (batches).

    The forms (the backend's tensors count as arrays): an array; a dict of arrays (named
    inputs); a list of arrays when the model takes more than one input (for a one-input model
    such a list is a list of batches, as before);
    `(x, y)` or `(x, y, sample_weight)`, a tuple whose x is one of those (or a tuple of
    arrays), y and sample_weight arrays (or dicts or lists of them) or None.

    Args:
        data: what the caller was given.
        inputs: how many inputs the model takes; None where unknown.

    Returns:
        x (an array, a dict or a list of arrays), or None.

    Raises:
        ValueError: the arrays of x, or x and y or sample_weight, differ in their number of
            samples; a list of arrays whose length is not the model's number of inputs; or a
            y or sample_weight that is no array. The message names what was given.
    """
    data = _as_numpy(data)
    if isinstance(data, (np.ndarray, dict)):
        return data  # checked by `split`, which names the lengths
    if isinstance(data, list) and inputs is not None and inputs > 1 and _samples(data):
        if len(data) != inputs:
            raise ValueError(
                f"`data` is a list of {len(data)} arrays, but the model takes {inputs} inputs; "
                f"pass one array per input (as `fit` takes them), or batches of them."
            )
        _checked_x(data)
        return data
    if not (isinstance(data, tuple) and len(data) in (2, 3)):
        return None
    x, *rest = data
    if not isinstance(x, (np.ndarray, dict)) and not (isinstance(x, (list, tuple)) and _samples(x)):
        return None
    x = list(x) if isinstance(x, tuple) else x
    total = _checked_x(x)
    for name, value in zip(("y", "sample_weight"), rest):
        if value is None:
            continue
        lengths = _samples(value)
        if lengths is None:
            raise ValueError(
                f"`data` was given as (x, y{', sample_weight' if len(data) == 3 else ''}), as "
                f"`fit` takes whole arrays, but {name} is {type(value).__name__}, not an array "
                f"(nor a dict or list of arrays, nor None). Pass x alone, or a dataset or "
                f"iterable of batches."
            )
        if set(lengths) != {total}:
            raise ValueError(
                f"`data` was given as (x, y{', sample_weight' if len(data) == 3 else ''}) of "
                f"whole arrays, but x has {total} samples and {name} has "
                f"{', '.join(map(str, sorted(set(lengths))))}; `fit` needs them equal. Pass x "
                f"alone (only x is used), or a list of batches."
            )
    return x


def _checked_x(x: Any) -> int:
    """The number of samples of x (an array or a list of arrays; a dict is checked by
    `split`); a ValueError naming the lengths when a list's arrays differ."""
    if isinstance(x, dict):
        return len(backend.to_numpy(next(iter(x.values())))) if x else 0
    lengths = _samples(x) or [0]
    if len(set(lengths)) != 1:
        shown = ", ".join(f"input {i} has {n} samples" for i, n in enumerate(lengths))
        raise ValueError(
            f"`data` as a list of arrays (a multi-input model's inputs, as `fit` takes them) "
            f"needs one number of samples; {shown}."
        )
    return lengths[0]


class Batches:
    """The input batches `x`, re-iterable once per pass (the per-layer method makes one per BN
    layer).

    A one-shot iterator is read once and kept in memory, unless `keep` is False (a caller that
    makes one pass only: it is then streamed, and a second pass finds it empty); datasets,
    arrays and other re-iterable containers are iterated again for each pass.

    Args:
        data: the data, in any form `Data` stands for.
        steps: how many batches to use; None for all.
        batch_size: the batch size for whole arrays.
        keep: hold a one-shot iterator's batches in memory for further passes.
        inputs: how many inputs the model takes (`input_count`); None where unknown, when a
            list of arrays is a list of batches.

    Raises:
        ValueError: `steps` or `batch_size` is not a positive int, a dataset is infinite
            without `steps`, or whole arrays that `whole_arrays` refuses.
    """

    def __init__(
        self,
        data: Data,
        steps: int | None,
        batch_size: int,
        keep: bool = True,
        inputs: int | None = None,
    ) -> None:
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise ValueError(f"steps must be a positive int or None; received steps={steps!r}.")
        self._given = (data, steps, batch_size, keep)
        x = whole_arrays(data, inputs)
        # Batches cut from whole arrays are x itself: a list of a multi-input model's arrays
        # must not be unpacked as (x, y).
        self._whole = x is not None
        if x is not None:
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(
                    f"batch_size must be a positive int; received batch_size={batch_size!r}."
                )
            data = split(x, batch_size)
        elif _cardinality(data) is not None:
            if steps is None and _cardinality(data) == _INFINITE:
                raise ValueError("recalibrate: the dataset is infinite; pass steps=.")
        elif keep and iter(data) is data:
            data = list(take(data, steps))
        self._data = data
        self._steps = steps
        self.count = known_length(data, steps)  # for the progress bar; None if unknown
        self._observed: int | None = None

    def __iter__(self) -> Iterator[Any]:
        data = self._data
        if _cardinality(data) is not None and not backend.get().takes_tf_data():
            data = typing.cast(Any, data).as_numpy_iterator()
        for element in take(data, self._steps):
            yield element if self._whole else keras.utils.unpack_x_y_sample_weight(element)[0]

    def first(self) -> Any:
        """The first batch's `x`; ValueError when `data` gives none."""
        for x in self:
            return x
        raise ValueError("recalibrate: `data` gave no batch.")

    def check_count(self, batches: int) -> None:
        """Every pass must see the same batches; the first pass fixes how many."""
        if self._observed is None:
            self._observed = self.count = batches
        elif batches != self._observed:
            raise ValueError(
                f"recalibrate: `data` gave {batches} batches on one pass and {self._observed} on "
                f"another; it must give the same batches on every pass (the per-layer method makes "
                f"one pass per BN layer)."
            )

    def for_model(self, model: keras.layers.Layer) -> "Batches":
        """These batches, or, where `data` is a list of arrays that was read as a list of
        batches before the model was known, and the model takes that many inputs, its arrays
        as the model's inputs (`whole_arrays`) split into batches.

        Args:
            model: the model the batches are for.

        Returns:
            A `Batches`.
        """
        data, steps, batch_size, keep = self._given
        inputs = input_count(model)
        if self._whole or inputs is None or inputs < 2 or whole_arrays(data, inputs) is None:
            return self
        return Batches(data, steps, batch_size, keep, inputs)

    def fresh(self) -> "Batches":
        """The same batches with no pass counted yet, for another run of passes (each
        recalibration of `callbacks.Recalibrate`); a one-shot iterator already read stays read,
        and `data` is not checked again."""
        renewed = copy.copy(self)
        renewed.count = known_length(self._data, self._steps)
        renewed._observed = None
        return renewed


def split(data: np.ndarray | dict[str, Any] | list[Any], batch_size: int) -> list[Any]:
    """An array, a dict of arrays (a model's named inputs) or a list of arrays (a multi-input
    model's inputs), as `fit` takes them, as a list of batches of `batch_size` along the first
    axis."""
    if isinstance(data, np.ndarray):
        return [data[i : i + batch_size] for i in range(0, len(data), batch_size)]
    if isinstance(data, list):
        return [
            [array[i : i + batch_size] for array in data]
            for i in range(0, len(data[0]), batch_size)
        ]
    arrays = {name: backend.to_numpy(value) for name, value in data.items()}
    lengths = {name: len(array) for name, array in arrays.items()}
    if not arrays or len(set(lengths.values())) != 1:
        raise ValueError(
            f"`data` as a dict needs arrays of one length (samples) per input name; received "
            f"lengths {lengths}."
        )
    total = next(iter(lengths.values()))
    return [
        {name: array[i : i + batch_size] for name, array in arrays.items()}
        for i in range(0, total, batch_size)
    ]


def known_length(data: Data, steps: int | None) -> int | None:
    """The number of batches when it is known before iterating, else None."""
    length: int | None
    length = _cardinality(data)
    if length is not None:
        length = None if length < 0 else length
    else:
        length = len(data) if isinstance(data, Sized) else None
    if length is None:
        return steps
    return length if steps is None else min(length, steps)


def take(iterable: Iterable[Any], steps: int | None) -> Iterator[Any]:
    """The first `steps` elements of `iterable` (all of them when `steps` is None)."""
    for i, element in enumerate(iterable):
        if steps is not None and i >= steps:
            return
        yield element

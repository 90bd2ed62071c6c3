"""The input batches `x` that `recalibrate`, `callbacks.Recalibrate` and `check_batchnorm` read.

`data` comes in the forms `fit` takes (a `tf.data.Dataset`, a numpy array or a dict of them, or
an iterable of batches; elements `x`, `(x, y)` or `(x, y, sample_weight)`); `Batches` checks it
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

# What `data` may be: a tf.data.Dataset, an array or a dict of arrays (split into batches
# here), or any other iterable of batches.
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


class Batches:
    """The input batches `x`, re-iterable once per pass (the per-layer method makes one per BN
    layer).

    A one-shot iterator is read once and kept in memory, unless `keep` is False (a caller that
    makes one pass only: it is then streamed, and a second pass finds it empty); datasets,
    arrays and other re-iterable containers are iterated again for each pass.
    """

    def __init__(self, data: Data, steps: int | None, batch_size: int, keep: bool = True) -> None:
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise ValueError(f"steps must be a positive int or None; received steps={steps!r}.")
        if isinstance(data, (np.ndarray, dict)):
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(
                    f"batch_size must be a positive int; received batch_size={batch_size!r}."
                )
            data = split(data, batch_size)
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
        if _cardinality(data) is not None and backend.name() != "tensorflow":
            data = typing.cast(Any, data).as_numpy_iterator()
        for element in take(data, self._steps):
            yield keras.utils.unpack_x_y_sample_weight(element)[0]

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

    def fresh(self) -> "Batches":
        """The same batches with no pass counted yet, for another run of passes (each
        recalibration of `callbacks.Recalibrate`); a one-shot iterator already read stays read,
        and `data` is not checked again."""
        renewed = copy.copy(self)
        renewed.count = known_length(self._data, self._steps)
        renewed._observed = None
        return renewed


def split(data: np.ndarray | dict[str, Any], batch_size: int) -> list[Any]:
    """An array, or a dict of arrays (a model's named inputs, as `fit` takes them), as a list
    of batches of `batch_size` along the first axis."""
    if isinstance(data, np.ndarray):
        return [data[i : i + batch_size] for i in range(0, len(data), batch_size)]
    arrays = {name: np.asarray(value) for name, value in data.items()}
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

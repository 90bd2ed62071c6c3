"""The frontier of `recalibrate`'s one pass: for every batch, the tensors that a later part of
the model still reads, held in memory up to a budget and spilled to disk past it.

Held tensors stay where the backend computed them (GPU memory on a GPU), and the budget counts
them wherever they are. A tensor that does not fit goes to a numpy memmap in a temporary folder
that is removed when the frontier closes, on failure too; it is read back, as a tensor of the
backend that wrote it, when a later part needs it.
"""

import math
import os
import shutil
import tempfile
from typing import Any

import keras
import numpy as np

from keras_bn import backend

# The default budget: 2 GiB, or half the memory available when the frontier opens if less.
DEFAULT_MAX_MEMORY = 2 * 1024**3


def default_max_memory() -> int:
    """`DEFAULT_MAX_MEMORY`, or half the memory available now where that is less (Linux's
    MemAvailable; elsewhere the fixed 2 GiB)."""
    available = _available_memory()
    return DEFAULT_MAX_MEMORY if available is None else min(DEFAULT_MAX_MEMORY, available // 2)


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# A tensor's shape and dtype name: what a compiled segment is traced for.
Signature = tuple[tuple[int | None, ...], str]


def signature(tensor: Any) -> Signature:
    """(shape, dtype name) of a tensor of any backend."""
    return tuple(tensor.shape), keras.backend.standardize_dtype(tensor.dtype)


def nbytes(tensor: Any) -> int:
    """The bytes a tensor's values take (0 for None and for non-numeric tensors)."""
    if tensor is None or not _numeric(tensor):
        return 0
    shape, dtype = signature(tensor)
    return math.prod(int(d or 0) for d in shape) * _itemsize(dtype)


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # bfloat16 and the float8 types: numpy knows them from ml_dtypes
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, dtype)).itemsize


def _numeric(tensor: Any) -> bool:
    dtype = keras.backend.standardize_dtype(tensor.dtype)
    return (
        dtype == "bool" or keras.backend.is_float_dtype(dtype) or keras.backend.is_int_dtype(dtype)
    )


class _Spilled:
    """A tensor written to a memmap file, read back as a tensor of its backend on `load`."""

    def __init__(self, directory: str, name: str, tensor: Any) -> None:
        array = backend.to_numpy(tensor)
        self.path = os.path.join(directory, name)
        self.shape, self.dtype = array.shape, array.dtype
        written = np.memmap(self.path, dtype=self.dtype, mode="w+", shape=self.shape)
        written[...] = array
        written.flush()
        del written

    def load(self) -> Any:
        array = np.memmap(self.path, dtype=self.dtype, mode="r", shape=self.shape)
        # A copy (np.array): the file is removed when the frontier drops it.
        return keras.ops.convert_to_tensor(np.array(array))

    def signature(self) -> Signature:
        return self.shape, keras.backend.standardize_dtype(self.dtype)

    def remove(self) -> None:
        os.remove(self.path)


def _spillable(tensor: Any) -> bool:
    # A memmap needs a non-empty numeric array; strings (and empty tensors) stay in memory.
    return nbytes(tensor) > 0


class Frontier:
    """Tensors (each with its Keras mask, or None) kept per (key, batch), in memory while their
    bytes stay within `max_memory`, else on disk. A context manager: leaving it removes the
    spill folder.

    Args:
        max_memory: the bytes the tensors held in memory may take.

    Attributes:
        peak_bytes: the most bytes held in memory at once.
        spilled_bytes: the bytes written to disk, all told.
    """

    def __init__(self, max_memory: int) -> None:
        self.max_memory = max_memory
        self.held_bytes = 0
        self.peak_bytes = 0
        self.spilled_bytes = 0
        self._entries: dict[tuple[Any, int], list[Any]] = {}
        self._directory: str | None = None
        self._written = 0

    def __enter__(self) -> "Frontier":
        return self

    def __exit__(self, *exc: object) -> None:
        self._entries.clear()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def put(self, key: Any, batch: int, value: Any, mask: Any | None) -> None:
        """Keep `value` and its `mask` for (key, batch), spilling each that does not fit."""
        self._entries[(key, batch)] = [self._keep(value), self._keep(mask)]

    def _keep(self, tensor: Any | None) -> Any:
        size = nbytes(tensor)
        if tensor is None or self.held_bytes + size <= self.max_memory or not _spillable(tensor):
            self.held_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            return tensor
        if self._directory is None:
            self._directory = tempfile.mkdtemp(prefix="keras_bn_recalibrate_")
        self._written += 1
        self.spilled_bytes += size
        return _Spilled(self._directory, f"{self._written}.dat", tensor)

    def get(self, key: Any, batch: int) -> tuple[Any, Any | None]:
        """The (value, mask) kept for (key, batch), read back from disk where spilled."""
        value, mask = (
            entry.load() if isinstance(entry, _Spilled) else entry
            for entry in self._entries[(key, batch)]
        )
        return value, mask

    def signature(self, key: Any, batch: int) -> tuple[Signature, Signature | None]:
        """The (value, mask) signatures of (key, batch), without reading a spilled one."""
        value, mask = (
            None
            if entry is None
            else entry.signature()
            if isinstance(entry, _Spilled)
            else signature(entry)
            for entry in self._entries[(key, batch)]
        )
        assert value is not None  # every entry has a value
        return value, mask

    def drop(self, key: Any, batch: int) -> None:
        """Forget (key, batch), freeing its memory or its files."""
        for entry in self._entries.pop((key, batch)):
            if isinstance(entry, _Spilled):
                entry.remove()
            else:
                self.held_bytes -= nbytes(entry)

    @property
    def spilled(self) -> bool:
        """Whether any tensor went to disk."""
        return self.spilled_bytes > 0

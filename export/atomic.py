"""Atomic file writes: a temporary file in the target folder, renamed over the target at the end.

A failure at any point leaves no partial file, and an existing file at the target path is
untouched until the complete new one replaces it. The new file gets the mode a plain
`open(path, "wb")` would give it (an existing file's mode, else 0o666 less the umask), not
mkstemp's 0o600, and is on disk (fsync) before the rename makes it visible. Like open(), a write
to a symlink goes to the file it points to, and the link stays. A target that is a folder, a
FIFO or a device (/dev/stdout) is refused up front: renaming a file over it would replace it.
"""

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import TypeVar, overload

_Checked = TypeVar("_Checked")


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temporary path next to `path`; on success it is renamed to `path`.

    The temporary name keeps `path`'s suffix, for writers that check it (Keras's `.keras`).
    Raises OSError naming `path` when its folder cannot be written, or (see `target`) it is
    not a regular file.
    """
    path = os.path.abspath(os.fspath(path))
    resolved = target(path)
    folder, name = os.path.split(resolved)
    stem, suffix = os.path.splitext(name)
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".tmp{suffix}", dir=folder)
        os.close(fd)
    except OSError as error:
        raise OSError(error.errno, f"Cannot write {path}: {error.strerror}", path) from error
    try:
        yield temporary
        os.chmod(temporary, _mode_for(resolved))
        _fsync(temporary, os.O_RDONLY)
        os.replace(temporary, resolved)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    with contextlib.suppress(OSError):  # the rename itself; not every file system allows it
        _fsync(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def target(path: str | os.PathLike[str]) -> str:
    """The file a write to `path` replaces: `path` with its symlinks resolved.

    Raises IsADirectoryError naming `path` when it is a folder, and OSError when it exists but
    is not a regular file (a FIFO, socket or device); callers may call it early, before
    producing the bytes.
    """
    path = os.path.abspath(os.fspath(path))
    try:
        mode = os.stat(path).st_mode  # follows links, /proc's magic ones (/dev/stdout) too
    except FileNotFoundError:
        return os.path.realpath(path)
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, f"Cannot write {path}: it is a folder", path)
    if not stat.S_ISREG(mode):
        raise OSError(
            errno.EINVAL,
            f"Cannot write {path}: it is a FIFO, socket or device, not "
            f"a regular file (a file renamed over it would replace it)",
            path,
        )
    return os.path.realpath(path)


@overload
def write_bytes(path: str | os.PathLike[str], data: bytes, check: None = None) -> None: ...


@overload
def write_bytes(
    path: str | os.PathLike[str], data: bytes, check: Callable[[str], _Checked]
) -> _Checked: ...


def write_bytes(
    path: str | os.PathLike[str],
    data: bytes,
    check: Callable[[str], _Checked] | None = None,
) -> _Checked | None:
    """Write `data` to `path` atomically (see `replacing`).

    `check(temporary_path)`, when given, runs on the complete file before it replaces `path`
    (an exporter verifies the file in its runtime there); its result is returned, and if it
    raises, `path` is left as it was.
    """
    with replacing(path) as temporary:
        with open(temporary, "wb") as file:
            file.write(data)
        return None if check is None else check(temporary)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def _mode_for(path: str) -> int:
    """An existing file's permission bits, else what open() would create under the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)  # the only portable way to read it; set straight back
        os.umask(umask)
        return 0o666 & ~umask


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Atomic file writes: a temporary file in the target folder, renamed over the target at the end.

A failure at any point leaves no partial file, and an existing file at the target path is
untouched until the complete new one replaces it.
"""

import contextlib
import os
import tempfile


@contextlib.contextmanager
def replacing(path):
    """Yield a temporary path next to `path`; on success it is renamed to `path`.

    The temporary name keeps `path`'s suffix, for writers that check it (Keras's `.keras`).
    Raises OSError naming `path` when its folder cannot be written.
    """
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    stem, suffix = os.path.splitext(name)
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".tmp{suffix}", dir=folder)
        os.close(fd)
    except OSError as error:
        raise OSError(error.errno, f"Cannot write {path}: {error.strerror}", path) from error
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def write_bytes(path, data, check=None):
    """Write `data` to `path` atomically (see `replacing`).

    `check(temporary_path)`, when given, runs on the complete file before it replaces `path`
    (an exporter verifies the file in its runtime there); its result is returned, and if it
    raises, `path` is left as it was.
    """
    with replacing(path) as temporary:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        return None if check is None else check(temporary)


def write_text(path, text):
    write_bytes(path, text.encode("utf-8"))

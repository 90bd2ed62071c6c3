"""TensorFlow's start-up and converter noise, kept off the terminal without hiding errors.

TensorFlow 2.21 writes lines to the process's stderr (file descriptor 2, from C++) that no
setting of the caller's silences: "oneDNN custom operations are on", absl's "All log messages
before absl::InitializeLog() is called are written to STDERR", "Could not find cuda drivers"
(each twice), "failed call to cuInit: ... UNKNOWN ERROR (303)" on a machine without a GPU when
it lists its devices; and while the TFLite converter runs, its raw "fully_quantize: 0,
inference_type: 6, ..." and a "tf.lite.Interpreter is deprecated" warning from its int8
calibrator (TF_CPP_MIN_LOG_LEVEL=2 silences only its C++ INFO and WARNING lines). This module
is the one place that deals with them:

- `entry_point()`, for the project's own commands (the demo, keras-bn-export, the benchmarks,
  the docs build and the notebooks' kernels through examples/kernelspec.py): sets
  `ENVIRONMENT` where the caller has not, then imports TensorFlow with its start-up lines
  captured; the known lines in `NOISE` are dropped and anything else is written back to
  stderr, so an error still shows. A caller who sets TF_CPP_MIN_LOG_LEVEL to 0 or 1 (asking
  for TensorFlow's logs) gets every line.
- `captured()`, around the converters and the runtimes that check their files
  (export/pipeline.py): what they write to stderr, what they log through Python's logging
  (TensorFlow's "INFO:tensorflow:Assets written to: ..." as a conversion saves, in a notebook's
  kernel where TensorFlow's logger is at INFO) and the known warnings go into a list, the
  export report's `log`, instead; if the call raises, everything it wrote is written back to
  stderr before the exception propagates. The process's logging is left as it was: the
  `tensorflow`, `absl` and root loggers' handlers, levels and propagation are set back (absl's
  log() calls logging.basicConfig() when the root logger has no handler, and TensorFlow's
  SavedModel writer sets absl's level), and no handler is left holding a stream that the
  capture closed.

`import keras_bn` calls neither: a library leaves the process's logging to its user.
"""

import contextlib
import io
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from typing import TextIO

# Set by entry_point() where the caller has not: TensorFlow's C++ INFO and WARNING lines off
# (its errors still print), the TensorFlow Keras backend.
ENVIRONMENT = {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}

# The lines TensorFlow prints at start-up whatever TF_CPP_MIN_LOG_LEVEL says, each a known
# message about the machine, not about the user's model.
NOISE = re.compile(
    r"oneDNN custom operations are on"
    r"|To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`"
    r"|All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|failed call to cuInit"
    r"|Could not find cuda drivers on your machine"
    r"|Unable to register cu(DNN|FFT|BLAS) factory"
    r"|computation placer already registered"
    r"|TF-TRT Warning: Could not find TensorRT"
    r"|This TensorFlow binary is optimized to use available CPU instructions"
    r"|To enable the following instructions: .* rebuild TensorFlow"
)
# The Python warnings a conversion raises that are about TensorFlow, not the model: the int8
# calibrator still builds the deprecated tf.lite.Interpreter (the files themselves are run in
# LiteRT's).
CONVERTER_WARNINGS = re.compile(r"tf\.lite\.Interpreter is deprecated")


def wants_logs() -> bool:
    """Whether the caller asked for TensorFlow's INFO or WARNING lines (TF_CPP_MIN_LOG_LEVEL
    0 or 1): then `entry_point` drops none of its start-up lines."""
    return os.environ.get("TF_CPP_MIN_LOG_LEVEL", "").strip() in ("0", "1")


def entry_point() -> None:
    """For a command's start, before anything imports TensorFlow: set `ENVIRONMENT` where unset,
    then import TensorFlow with its known start-up lines dropped (any other line is written to
    stderr). Does nothing more if TensorFlow is already imported or cannot be."""
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if wants_logs():
        return
    # Raised outside `captured()` too (a notebook cell converting for itself, say).
    warnings.filterwarnings("ignore", message="(?s).*" + CONVERTER_WARNINGS.pattern)
    if "tensorflow" not in sys.modules:
        with _native_stderr() as lines:
            try:
                import tensorflow as tf

                tf.config.list_physical_devices()  # the GPU probe logs here (cuInit), once
            except ImportError:
                pass  # a JAX-only environment: the command says what it needs
        _write_back(line for line in lines if not NOISE.search(line))
    if "tensorflow" in sys.modules:
        # TensorFlow's Python INFO lines ("Assets written to: /tmp/..." as a conversion
        # saves): its logger, made on first use, is set to INFO in an interactive session (a
        # notebook's kernel), so it is made here and set back.
        sys.modules["tensorflow"].get_logger().setLevel(logging.WARNING)


@contextlib.contextmanager
def captured(log: list[str]) -> Iterator[None]:
    """Capture what the body writes to stderr (file descriptor 2, C++ included), what it logs
    through the `tensorflow`, `absl` and root loggers (at their levels) and the
    `CONVERTER_WARNINGS` it raises, appending them to `log` as lines; other warnings are
    raised again as they were. If the body raises, everything captured is written back to
    stderr first. (Whatever TF_CPP_MIN_LOG_LEVEL says: importing JAX sets it to 1.)"""
    lines: list[str] = []
    records: list[str] = []
    caught: list[warnings.WarningMessage] = []
    try:
        with (
            _native_stderr() as lines,
            _python_logging(records),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            yield
    except BaseException:
        _write_back(lines)
        _write_back(records)
        _warn_again(caught)
        raise
    noise = [w for w in caught if CONVERTER_WARNINGS.search(str(w.message))]
    _warn_again([w for w in caught if w not in noise])
    log.extend(line for line in lines if line.strip())
    log.extend(line for line in records if line.strip())
    log.extend(f"{w.category.__name__}: {' '.join(str(w.message).split())}" for w in noise)


# The loggers a conversion writes through: TensorFlow's, absl's (TensorFlow's SavedModel
# writer logs through absl, whose log() calls logging.basicConfig() when the root logger has
# no handler) and the root logger, where both propagate.
LOGGERS = ("tensorflow", "absl", "")


class _ListHandler(logging.Handler):
    """Each record, formatted as TensorFlow's own handler does ("INFO:tensorflow:..."), into a
    list."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines
        self.setFormatter(logging.Formatter(logging.BASIC_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.extend(self.format(record).splitlines())
        except Exception:  # noqa: BLE001 (as logging's handlers do: a bad record stops nothing)
            self.handleError(record)


@contextlib.contextmanager
def _python_logging(lines: list[str]) -> Iterator[None]:
    """The records the body logs through `LOGGERS` (those their levels let through) into
    `lines` instead of those loggers' handlers; after the body, each logger's handlers, level,
    propagation and `disabled` are set back to what they were, whatever the body did to them.

    TensorFlow's logger makes its handler on first use, on sys.stderr (sys.stdout in an
    interactive session): it is made first, so that its handler holds the process's stream,
    not one the capture replaced. Where the body is the first to import TensorFlow, the
    handler TensorFlow made then is kept (set back to the process's stderr or stdout)."""
    tf_logging = sys.modules.get("tensorflow.python.platform.tf_logging")
    if tf_logging is not None:
        tf_logging.get_logger()
    loggers = [logging.getLogger(name) for name in LOGGERS]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers]
    streams = (sys.stdout, sys.stderr)
    capture = _ListHandler(lines)
    try:
        for lg in loggers:
            lg.handlers = []
            if lg.name != "root":
                lg.propagate = True  # to the root logger's capture, once
        logging.getLogger().handlers = [capture]  # and absl's log() calls no basicConfig()
        yield
    finally:
        made_by_tensorflow = []
        if tf_logging is None and "tensorflow.python.platform.tf_logging" in sys.modules:
            # The body imported TensorFlow: the handler its get_logger() made (once only).
            tensorflow = logging.getLogger("tensorflow")
            made_by_tensorflow = [h for h in tensorflow.handlers if h is not capture]
        for lg, handlers, level, propagate, disabled in saved:
            lg.handlers = handlers
            lg.setLevel(level)
            lg.propagate = propagate
            lg.disabled = disabled
        for handler in made_by_tensorflow:
            if isinstance(handler, logging.StreamHandler) and handler.stream not in streams:
                handler.setStream(streams[0] if _is_stdout(handler.stream) else streams[1])
            logging.getLogger("tensorflow").addHandler(handler)


def _is_stdout(stream: object) -> bool:
    return stream is sys.stdout or stream is sys.__stdout__


def _warn_again(caught: list[warnings.WarningMessage]) -> None:
    """Raise captured warnings again, through the caller's filters."""
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


@contextlib.contextmanager
def _native_stderr() -> Iterator[list[str]]:
    """File descriptor 2 into a temporary file for the body; Python's own sys.stderr (a
    progress display, a traceback) keeps writing to the terminal. Yields a list that holds
    the captured lines once the body is done.

    sys.stderr is, for the body, a `_Terminal`: one that anything may keep (a log handler
    the body makes: logging.basicConfig(), TensorFlow's first get_logger()), which writes
    to the process's sys.stderr again once the body is done, never to a closed file."""
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    lines: list[str] = []
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        terminal = _Terminal(os.fdopen(os.dup(saved), "w", buffering=1, closefd=True))
        sys.stderr = terminal
        try:
            yield lines
        finally:
            if sys.stderr is terminal:
                sys.stderr = python_stderr
            terminal.release(python_stderr)
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines[:] = capture.read().decode("utf-8", "replace").splitlines()


class _Terminal(io.TextIOBase):
    """sys.stderr while file descriptor 2 is captured: writes to the terminal (a duplicate of
    the original descriptor 2) until `release`, then to the stream that sys.stderr was."""

    def __init__(self, terminal: TextIO) -> None:
        self._target: TextIO = terminal
        self._own: TextIO | None = terminal

    def release(self, stream: TextIO) -> None:
        """From now on write to `stream`; closes the duplicate descriptor."""
        own, self._own, self._target = self._own, None, stream
        if own is not None:
            own.close()

    def write(self, text: str) -> int:
        return self._target.write(text)

    def flush(self) -> None:
        self._target.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._target.isatty()

    def fileno(self) -> int:
        return self._target.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", "utf-8")


def _write_back(lines: Iterable[str]) -> None:
    for line in lines:
        print(line, file=sys.stderr)

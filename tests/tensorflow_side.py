"""The other side of the JAX and PyTorch runs' cross-backend tests: a script run in a fresh
Python.

Keras fixes its backend when first imported, so a test that compares JAX or PyTorch with
TensorFlow runs each other side in a process of its own. `make test` runs tests/ under JAX in
.venv-jax and under PyTorch in .venv-torch, where TensorFlow is not installed,
and names a Python that has it in KERAS_BN_TF_PYTHON (.venv/bin/python); where that is unset,
this Python serves if it can import TensorFlow. Where neither holds, the tests that need
TensorFlow fail, saying so (CI must run them, never skip them). The tests marked
`tensorflow_side` use it; benchmarks/gpu_check.py leaves them out. It lives in tests/, on
pyproject's pythonpath, so that both suites import it.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

VARIABLE = "KERAS_BN_TF_PYTHON"


def tensorflow_python():
    """The Python that runs TensorFlow's side: KERAS_BN_TF_PYTHON, else this one if it has
    TensorFlow; otherwise the calling test fails with what to do."""
    given = os.environ.get(VARIABLE)
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            pytest.fail(f"{VARIABLE}={given!r} is not an executable file", pytrace=False)
        return given
    if importlib.util.find_spec("tensorflow") is not None:
        return sys.executable
    pytest.fail(
        f"this test compares with TensorFlow, run in a Python of its own, but {sys.executable} "
        f"cannot import tensorflow and {VARIABLE} is not set: set {VARIABLE} to a Python that "
        f'has keras-bn and TensorFlow (`make test` sets .venv/bin/python; pip install -e ".[all]"'
        f" makes one), or run the suite in such a Python",
        pytrace=False,
    )


def python_for(backend):
    """The Python for a script under `backend`: TensorFlow's, or this one for JAX or
    PyTorch."""
    return tensorflow_python() if backend == "tensorflow" else sys.executable


def run(source, *args, backend="tensorflow", timeout=600):
    """Run `source` (`python -c`, with `args` as sys.argv[1:]) under KERAS_BACKEND=`backend` in
    that backend's Python; returns the JSON of its last line of output. A failed run fails the
    test with the end of its stderr."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("KERAS_BN_NO_TENSORFLOW", None)  # said of this Python, not of TensorFlow's
    python = python_for(backend)
    result = subprocess.run(
        [python, "-c", source, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{python} (KERAS_BACKEND={backend}):\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])

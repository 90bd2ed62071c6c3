"""The Jupyter kernel that runs the example notebooks, for the tests and the docs build.

A 'python3' kernelspec that launches this Python (sys.executable), so the notebooks import the
keras_bn installed beside it. The kernel leaves its file descriptors alone
(`capture_fd_output=False`): what C++ libraries write there, TensorFlow's logging above all,
goes to the caller's stderr, not into the notebook. TF_CPP_MIN_LOG_LEVEL cannot keep it out:
TensorFlow 2.21 prints "oneDNN custom operations are on" and "Could not find cuda drivers"
before it reads the variable. What Python writes to sys.stderr (a warning a cell raises) is
still shown.
"""

import json
import pathlib
import sys


def write_kernelspec(folder: pathlib.Path, display_name: str) -> None:
    """Write the kernelspec under `folder`; put `folder` first in JUPYTER_PATH to use it.

    Args:
        folder: the Jupyter data folder (the spec goes to folder/kernels/python3/kernel.json).
        display_name: the kernel's name in Jupyter's lists.
    """
    spec_dir = folder / "kernels" / "python3"
    spec_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "--IPKernelApp.capture_fd_output=False"]
    spec = {
        "argv": [*argv, "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))

"""The Jupyter kernel that runs the example notebooks, for the tests and the docs build.

A 'python3' kernelspec that launches this Python (sys.executable), so the notebooks import the
keras_bn installed beside it. The kernel leaves its file descriptors alone
(`capture_fd_output=False`): what C++ libraries write there, TensorFlow's logging above all,
goes to the caller's stderr, not into the notebook. What Python writes to sys.stderr (a warning
a cell raises) is still shown.

The kernel starts as every entry point of the project does (keras_bn/_quiet.py): TensorFlow is
imported before the first cell, quiet, with the lines it prints as it loads dropped (TensorFlow
2.21 prints "oneDNN custom operations are on" and "Could not find cuda drivers" whatever
TF_CPP_MIN_LOG_LEVEL says), so that `make docs` and the tests' output stay readable; any other
line still shows.
"""

import json
import pathlib
import sys

# Run in the kernel before the first cell.
STARTUP = "from keras_bn import _quiet; _quiet.entry_point()"


def write_kernelspec(folder: pathlib.Path, display_name: str) -> None:
    """Write the kernelspec under `folder`; put `folder` first in JUPYTER_PATH to use it.

    Args:
        folder: the Jupyter data folder (the spec goes to folder/kernels/python3/kernel.json).
        display_name: the kernel's name in Jupyter's lists.
    """
    spec_dir = folder / "kernels" / "python3"
    spec_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "ipykernel_launcher",
        "--IPKernelApp.capture_fd_output=False",
        f"--IPKernelApp.exec_lines={STARTUP}",
    ]
    spec = {
        "argv": [*argv, "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))

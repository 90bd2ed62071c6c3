"""The Jupyter kernel that runs the example notebooks, for the tests and the docs build.

A 'python3' kernelspec that launches this Python (sys.executable), so the notebooks import the
keras_bn installed beside it. The kernel leaves its file descriptors alone
(`capture_fd_output=False`): what C++ libraries write there, TensorFlow's logging above all,
goes to the caller's stderr, not into the notebook. What Python writes to sys.stderr (a warning
a cell raises) is still shown.

The kernel starts plain, as the one a user opens the notebooks in: nothing runs before the
first cell (no `keras_bn._quiet.entry_point()`), so the pages and the tests show what a user's
kernel shows, Python's logging as TensorFlow sets it in an interactive session included (its
logger at INFO: a logging error after an export once hid behind such start-up lines). What
TensorFlow prints from C++ as it loads goes to the caller's stderr (`make docs`'s, the
tests'), not into a page.
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
    argv = [
        sys.executable,
        "-m",
        "ipykernel_launcher",
        "--IPKernelApp.capture_fd_output=False",
    ]
    spec = {
        "argv": [*argv, "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))

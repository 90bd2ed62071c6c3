"""After an export the process's logging works as before.

absl's log() calls logging.basicConfig() when the root logger has no handler; inside the
export's capture of stderr that bound the root logger's new handler to the capture's own
sys.stderr, which the capture then closed: every later TensorFlow or absl log call printed
"--- Logging error --- ValueError: I/O operation on closed file". And in a notebook's kernel,
where TensorFlow's logger is at INFO, a conversion's "INFO:tensorflow:Assets written to: ..."
lines went to the cell's output instead of the report's `log`.

Each test runs in a fresh process (a plain Python, a plain Jupyter kernel: no
`_quiet.entry_point()`), as a user's first export runs.
"""

import json
import subprocess
import sys
import textwrap

import nbformat
import pytest
from nbclient import NotebookClient
from test_notebooks import kernel_environment

pytestmark = [pytest.mark.backends("tensorflow"), pytest.mark.slow]

# Two exports in a row of a small conv/BN model, as examples/00_quickstart.ipynb writes its
# float and int8 files. Seeded: with unseeded weights a held-out sample past the 24
# calibration samples' range is, now and then, rightly refused (more than 0.1 of a scale).
TWO_EXPORTS = """
import os, tempfile
import numpy as np, keras, keras_bn
from keras_bn.export import export_tflite
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(32, 8, 8, 3)).astype("float32")
model = keras.Sequential([
    keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras_bn.BatchNormalization(),
    keras.layers.ReLU(),
])
folder = tempfile.mkdtemp()
reports = [
    export_tflite(model, os.path.join(folder, "m.tflite"), probe=x),
    export_tflite(model, os.path.join(folder, "m_int8.tflite"), quantization="int8",
                  representative_data=x, probe=x),
]
"""

LOGGING_STATE = """
import logging, os, sys

def logging_state():
    def stream(handler):
        s = getattr(handler, "stream", None)
        return None if s is None else [repr(s), bool(getattr(s, "closed", False))]
    state = {}
    for name in ("tensorflow", "absl", ""):
        lg = logging.getLogger(name)
        state[name or "root"] = [
            lg.level, lg.propagate, lg.disabled,
            [[type(h).__name__, h.level, stream(h)] for h in lg.handlers],
        ]
    state["sys"] = [repr(sys.stdout), repr(sys.stderr), sys.stderr.closed]
    state["fds"] = [os.path.samestat(os.fstat(fd), os.fstat(getattr(sys, name).fileno()))
                    for fd, name in ((1, "__stdout__"), (2, "__stderr__"))]
    return state
"""

SCRIPT = (
    LOGGING_STATE
    + """
import json
import tensorflow as tf
before = logging_state()
"""
    + TWO_EXPORTS
    + """
after = logging_state()

# A capture whose body raises (a failed conversion) leaves the same state.
from absl import logging as absl_logging
from keras_bn import _quiet
try:
    with _quiet.captured([]):
        absl_logging.warning("inside a failing capture")  # basicConfig() on a bare root
        raise RuntimeError("the converter failed")
except RuntimeError:
    pass
after_raise = logging_state()

tf.get_logger().warning("a TensorFlow warning after the exports")
absl_logging.warning("an absl warning after the exports")

@tf.function(reduce_retracing=False)
def square(v):
    return v * v
for n in range(8):  # retraced at every new shape: TensorFlow logs its retracing warning
    square(tf.zeros([n + 1]))
print(json.dumps({"before": before, "after": after, "after_raise": after_raise,
                  "logs": [r.log for r in reports]}))
"""
)


def test_two_exports_leave_the_process_logging_as_it_was(tmp_path):
    script = tmp_path / "two_exports.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**kernel_environment(), "KERAS_BACKEND": "tensorflow"},
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert "Logging error" not in result.stderr, result.stderr[-5000:]
    assert "I/O operation on closed file" not in result.stderr, result.stderr[-5000:]
    # The calls after the exports were shown, through the process's own handlers.
    assert "a TensorFlow warning after the exports" in result.stderr
    assert "an absl warning after the exports" in result.stderr
    # The failing capture wrote back what it captured, the absl record included.
    assert "inside a failing capture" in result.stderr
    state = json.loads(result.stdout.strip().splitlines()[-1])
    assert state["after"] == state["before"]
    assert state["after_raise"] == state["before"]
    assert state["before"]["sys"][2] is False


KERNEL_CELLS = [
    # The notebook's own first lines: no `_quiet.entry_point()` before them.
    TWO_EXPORTS,
    LOGGING_STATE + "state_after_exports = logging_state()",
    textwrap.dedent(
        """
        import tensorflow as tf
        from absl import logging as absl_logging
        tf.get_logger().warning("a TensorFlow warning after the exports")
        absl_logging.warning("an absl warning after the exports")
        print("\\n".join(reports[0].log + reports[1].log))
        """
    ),
]


def test_two_exports_in_a_plain_kernel_show_no_logging_error(tmp_path, monkeypatch):
    """A kernel as Jupyter starts one (ipykernel, its file descriptors captured into the
    notebook, TensorFlow's logger at INFO as in any interactive session), without the docs
    build's start-up lines: the exports' cell shows nothing of the converters, and the next
    cell's log calls work."""
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))  # python3: this Python, no exec_lines
    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.joinpath("kernel.json").write_text(json.dumps({"argv": argv, "language": "python"}))
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in KERNEL_CELLS])
    client = NotebookClient(notebook, kernel_name="python3", timeout=600)
    client.execute(env={**kernel_environment(), "KERAS_BACKEND": "tensorflow"})
    exports, _, after = notebook.cells
    for index, cell in enumerate(notebook.cells):
        for output in cell.outputs:
            text = output.get("text", "") + "\n".join(output.get("traceback", []))
            assert output.output_type != "error", (index, text)
            assert "Logging error" not in text and "Traceback" not in text, (index, text)
            assert "I/O operation on closed file" not in text, (index, text)
    shown = "".join(o.get("text", "") for o in exports.outputs)
    assert "INFO:tensorflow:" not in shown, shown
    after_text = "".join(o.get("text", "") for o in after.outputs)
    assert "a TensorFlow warning after the exports" in after_text, after_text
    # The converter's INFO lines went into the reports' log instead.
    assert "INFO:tensorflow:Assets written to:" in after_text, after_text

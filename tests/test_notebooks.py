"""Every notebook in examples/ runs clean, at CI size (KERAS_BN_SMALL=1), in a real Jupyter kernel.

Each notebook ends with asserts of its claim's checks, so a claim that stops reproducing fails
here. The kernel is the Python running the tests (the venv's), through a kernelspec written for
it, so the notebooks import this checkout's keras_bn.

`make notebooks` runs the same tests at full size: KERAS_BN_SMALL=0, a longer cell timeout
(KERAS_BN_CELL_TIMEOUT) and the executed notebooks, with outputs, written to
KERAS_BN_EXECUTED_DIR.
"""

import os
import pathlib
import re

import nbformat
import pytest
from kernelspec import write_kernelspec
from nbclient import NotebookClient

pytestmark = pytest.mark.backends("tensorflow")

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
CELL_TIMEOUT_S = int(os.environ.get("KERAS_BN_CELL_TIMEOUT", "300"))
EXECUTED_DIR = os.environ.get("KERAS_BN_EXECUTED_DIR")


def kernel_environment():
    """This process's environment less PYTEST_CURRENT_TEST, for a kernel (or a process that
    starts kernels): ipykernel forwards the output written to the kernel's file descriptors
    (a C++ library's logging) into the notebook, except under pytest, which it detects by that
    variable. Without it a kernel started here does what it does in `make docs`."""
    return {key: value for key, value in os.environ.items() if key != "PYTEST_CURRENT_TEST"}


@pytest.fixture
def kernel_for_this_python(tmp_path, monkeypatch):
    """examples/kernelspec.py's kernel (this Python; TensorFlow's C++ logging goes to this
    process's stderr, not into the executed notebook), searched first in JUPYTER_PATH."""
    write_kernelspec(tmp_path, "keras-bn (tests)")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("KERAS_BN_SMALL", os.environ.get("KERAS_BN_SMALL", "1"))
    # The inline backend (not Agg): plt.show() then leaves the figure in the executed copy.
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return "python3"


def test_every_reference_claim_has_a_notebook():
    stems = {p.stem for p in NOTEBOOKS}
    expected = {
        "01_ioffe_fig1",
        "02_bngd_ols",
        "03_gradient_explosion",
        "04_smoothness_and_ics",
        "05_length_direction",
        "06_population_statistics",
        "07_qat",
    }
    assert expected <= stems, sorted(expected - stems)


# TensorFlow's C++ log lines, which belong in the kernel's own stderr, never in a cell's output:
# absl's "I0000 00:00:1795684180.819180    6517 port.cc:153] ..." (TF 2.21), TF's older
# "2026-01-30 22:44:42.456316: I tensorflow/core/util/port.cc:153] ...", and the messages
# TensorFlow prints as it loads (some before it reads TF_CPP_MIN_LOG_LEVEL).
TENSORFLOW_LOG_LINE = re.compile(
    r"^\s*[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] \S+:\d+\]"
    r"|absl::InitializeLog\(\)|oneDNN custom operations are on|Could not find cuda drivers"
    r"|cudart_stub|cpu_feature_guard|cuInit"
)


def output_lines_matching(notebook, pattern):
    """(cell index, line) of every line of an executed notebook's outputs (streams' text,
    errors' tracebacks) that `pattern` matches."""
    found = []
    for index, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            text = output.get("text", "") + "\n".join(output.get("traceback", []))
            found += [(index, line) for line in text.splitlines() if pattern.search(line)]
    return found


# Documents a clone of the project does not have; notebooks cite papers instead.
MISSING_DOCUMENTS = ("shared/", "reference.md", "design.md", "seeds/")
CLAIM_NOTEBOOKS = [p for p in NOTEBOOKS if not p.stem.startswith("00")]


@pytest.mark.parametrize("path", NOTEBOOKS + sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_examples_cite_no_document_the_project_lacks(path):
    if path.suffix == ".ipynb":
        text = "\n".join(cell.source for cell in nbformat.read(path, as_version=4).cells)
    else:
        text = path.read_text()
    assert not [name for name in MISSING_DOCUMENTS if name in text], path.name


@pytest.mark.parametrize("path", CLAIM_NOTEBOOKS, ids=[p.stem for p in CLAIM_NOTEBOOKS])
def test_claim_notebooks_cite_their_paper_with_an_arxiv_id(path):
    first_cell = nbformat.read(path, as_version=4).cells[0]
    assert first_cell.cell_type == "markdown"
    assert re.search(r"\*\*Claim\*\* \(.*?arXiv:\d{4}\.\d{4,5}", first_cell.source, re.S), (
        first_cell.source[:300]
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_are_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    with_outputs = [
        i
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not with_outputs, (path.name, with_outputs)


@pytest.mark.slow
def test_the_kernel_starts_plain_as_a_users_does(kernel_for_this_python, capfd):
    """examples/kernelspec.py's kernel runs nothing before the first cell (no
    `_quiet.entry_point()`): the notebooks run as in the kernel a user opens them in, and its
    start leaves the stderr it shares with its caller (`make docs`) quiet."""
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("import sys\nprint('tensorflow' in sys.modules)")]
    )
    client = NotebookClient(notebook, kernel_name=kernel_for_this_python, timeout=CELL_TIMEOUT_S)
    client.execute(env=kernel_environment())
    assert notebook.cells[0].outputs[0]["text"] == "False\n"
    err = capfd.readouterr().err
    assert not [line for line in err.splitlines() if TENSORFLOW_LOG_LINE.search(line)], err


# What no cell of a notebook shows: a traceback, a logging error (a log handler left on a closed
# stream), TensorFlow's Python INFO lines (a conversion's "Assets written
# to: ..." belongs in the export report's log).
BAD_OUTPUT = re.compile(
    r"Traceback \(most recent call last\)|--- Logging error ---|I/O operation on closed file"
    r"|INFO:tensorflow:"
)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_its_checks_hold(path, kernel_for_this_python):
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name=kernel_for_this_python,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(EXAMPLES)}},  # cwd, so `import digits` works
    )
    try:
        # raises CellExecutionError on any failing cell, asserts included
        client.execute(env=kernel_environment())
    finally:
        if EXECUTED_DIR:
            pathlib.Path(EXECUTED_DIR).mkdir(parents=True, exist_ok=True)
            nbformat.write(notebook, pathlib.Path(EXECUTED_DIR) / path.name)
    assert any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")
    logged = output_lines_matching(notebook, TENSORFLOW_LOG_LINE)
    assert not logged, f"{path.name} shows TensorFlow's C++ log lines: {logged[:10]}"
    bad = output_lines_matching(notebook, BAD_OUTPUT)
    assert not bad, f"{path.name} shows: {bad[:10]}"

"""`make test`'s pytest arguments (the Makefile's PYTEST_ARGS) end a run whose xdist worker
crashes, failing it and naming the test, rather than hanging: pytest-xdist 3.8 replaces a
crashed worker, and under --dist loadgroup the run then waits forever with every worker idle."""

import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.backends("tensorflow")

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A group (as the suite's docs site and torch.distributed tests are), a test whose process dies
# as a segfaulting framework's does, and others after it.
CRASHING_SUITE = """\
import os
import signal
import time

import pytest


@pytest.mark.parametrize("i", range(4))
@pytest.mark.xdist_group("together")
def test_grouped(i):
    time.sleep(0.3)


def test_crashes():
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGSEGV)


@pytest.mark.parametrize("i", range(12))
def test_other(i):
    time.sleep(0.2)
"""


def _pytest_args():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    found = re.search(r"^PYTEST_ARGS \?= (.*)$", makefile, re.MULTILINE)
    assert found, "the Makefile sets no PYTEST_ARGS"
    return shlex.split(found.group(1))


def test_a_crashed_worker_fails_the_run_and_names_its_test(tmp_path):
    (tmp_path / "test_crash.py").write_text(CRASHING_SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's configuration
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", *_pytest_args(), "-p", "no:cacheprovider", "."],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=90,
        )
    except subprocess.TimeoutExpired as hung:
        output = hung.stdout or b""  # bytes, text=True or not
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        tail = textwrap.indent(output[-2000:], "  ")
        pytest.fail(f"the run hung after its worker crashed:\n{tail}")
    assert result.returncode == 1, result.stdout[-3000:]
    assert "crashed while running 'test_crash.py::test_crashes'" in result.stdout

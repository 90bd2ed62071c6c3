"""benchmarks/bench_export.py runs end to end at tiny sizes (no timing is asserted)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.backends("tensorflow")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_export.py")


def test_bench_export_smoke():
    result = subprocess.run(
        [sys.executable, SCRIPT, "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [
        line for line in result.stdout.splitlines() if line.startswith("| ") and "ms" not in line
    ]
    assert len(rows) == 1 + 2 * 3  # header + 2 models × 3 runtime settings
    assert "fold_batch_norms(ResNet50, 32 px)" in result.stdout
    assert "fold with int8 readiness (ResNet50, 32 px, 8-sample probe, 53 hosts" in result.stdout
    assert "# machine:" in result.stdout

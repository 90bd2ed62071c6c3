"""The dry run of `make gpu-check` (benchmarks/gpu_check.py) under one backend, in this
Python, with what every backend's dry run must show: tests/test_gpu_check.py adds each
backend's own."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [
    "bench_layer.json",
    "bench_layer.log",
    "fake_quant.json",
    "fake_quant.log",
    "gpu_check.json",
    "probe.log",
    "tests.json",
    "tests.log",
]


def run(backend, out):
    """`gpu_check.sh --dry-run --backend backend out`: (its gpu_check.json, its stdout), after
    checking that it passed every step on the CPU, one test per file, without TF32, its
    fake quantization equal bit for bit, and wrote its files into `out`."""
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--backend", backend]
        + [str(out)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads((out / "gpu_check.json").read_text())
    assert record["status"] == "passed" and record["reason"] is None and record["dry_run"]
    assert record["backend"] == backend and record["python"] == sys.executable
    assert record["device"] == "CPU (dry run)"
    assert record["setup"]["keras"] == "importable"  # here; the GPU machine installs the wheels
    probe = record[backend]
    assert probe["kind"] == "CPU" and probe["keras_backend"] == backend
    assert probe["keras_bn"]["version"] and probe["keras"]["version"]
    # One test per file of the exactness files, each run, on the CPU, at full precision.
    tests = record["tests"]
    assert tests["markers"] == "not tensorflow_side"
    assert (tests["passed"], tests["failed"], tests["errors"]) == (len(tests["files"]), 0, 0)
    assert tests["placement"]["kind"] == "CPU" and tests["tf32"] is False
    assert record["bench"]["exit_code"] == 0
    fake_quant = record["fake_quant"]
    assert fake_quant["bit_for_bit"] and fake_quant["values_compared"] > 10_000
    assert sorted(p.name for p in out.iterdir()) == FILES
    return record, result.stdout

"""`make gpu-check` under JAX, dry run (benchmarks/gpu_check.py): every step on the CPU at tiny
sizes, in this Python; in make's .venv-jax, without TensorFlow, as on the GPU machine."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow  # five steps in processes of their own: about a minute
def test_gpu_check_dry_run_under_jax_runs_every_step_and_writes_its_json(tmp_path):
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--backend", "jax"]
        + [str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["status"] == "passed" and record["reason"] is None and record["dry_run"]
    assert record["backend"] == "jax" and record["python"] == sys.executable
    assert record["device"] == "CPU (dry run)"
    assert record["setup"]["keras"] == "importable"  # here; the GPU machine installs the wheels
    probe = record["jax"]
    assert probe["kind"] == "CPU" and probe["keras_backend"] == "jax"
    assert probe["keras_bn"]["version"] and probe["keras"]["version"]
    # One test per file of the exactness files, each run, on the CPU, at full precision.
    tests = record["tests"]
    assert tests["markers"] == "not tensorflow_side"
    assert (tests["passed"], tests["failed"], tests["errors"]) == (len(tests["files"]), 0, 0)
    assert tests["placement"]["kind"] == "CPU" and tests["tf32"] is False
    # One shape: both policies × (train, inference), keras_bn and Keras BN, medians positive.
    bench = record["bench"]
    assert bench["exit_code"] == 0 and bench["device"].startswith("cpu")
    assert {(r["policy"], r["step"]) for r in bench["rows"]} == {
        (policy, step) for policy in ("float32", "mixed_float16") for step in ("train", "inference")
    }
    assert all(r["keras_bn_ms"] > 0 and r["keras_ms"] > 0 for r in bench["rows"])
    fake_quant = record["fake_quant"]
    assert fake_quant["bit_for_bit"] and fake_quant["values_compared"] > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bench_layer.json",
        "bench_layer.log",
        "fake_quant.json",
        "fake_quant.log",
        "gpu_check.json",
        "probe.log",
        "tests.json",
        "tests.log",
    ]
    assert result.stdout.splitlines()[-1].startswith("gpu_check: passed on CPU (dry run) (JAX ")

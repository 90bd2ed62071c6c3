"""`make gpu-check` under JAX, dry run (benchmarks/gpu_check.py): every step on the CPU at tiny
sizes, in this Python; in make's .venv-jax, without TensorFlow, as on the GPU machine."""

import gpu_check_dry_run
import pytest


@pytest.mark.slow  # five steps in processes of their own: about a minute
def test_gpu_check_dry_run_under_jax_runs_every_step_and_writes_its_json(tmp_path):
    record, stdout = gpu_check_dry_run.run("jax", tmp_path)
    # One shape: both policies × (train, inference), keras_bn and Keras BN, medians positive.
    bench = record["bench"]
    assert bench["device"].startswith("cpu")
    assert {(r["policy"], r["step"]) for r in bench["rows"]} == {
        (policy, step) for policy in ("float32", "mixed_float16") for step in ("train", "inference")
    }
    assert all(r["keras_bn_ms"] > 0 and r["keras_ms"] > 0 for r in bench["rows"])
    assert stdout.splitlines()[-1].startswith("gpu_check: passed on CPU (dry run) (JAX ")

"""`make gpu-check` under JAX and under PyTorch, dry run (benchmarks/gpu_check.py): every step
on the CPU at tiny sizes, in this Python; in make's .venv-jax and .venv-torch, without
TensorFlow, as on the GPU machine. tests/gpu_check_dry_run.py checks what every backend's dry
run must show; each test here adds its backend's own."""

import gpu_check_dry_run
import pytest


@pytest.mark.slow  # five steps in processes of their own: about a minute
@pytest.mark.backends("jax")
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


@pytest.mark.slow  # five steps in processes of their own: about a minute
@pytest.mark.backends("torch")
def test_gpu_check_dry_run_under_torch_runs_every_step_and_writes_its_json(tmp_path):
    record, stdout = gpu_check_dry_run.run("torch", tmp_path)
    # Keras's default device under PyTorch is the CPU here (CUDA_VISIBLE_DEVICES="").
    assert record["torch"]["default_device"] == "cpu" and not record["torch"]["gpus"]
    # One shape: three policies × (train, inference), keras_bn, Keras BN and the floor.
    bench = record["bench"]
    assert bench["device"] == "cpu"
    assert {(r["policy"], r["step"]) for r in bench["rows"]} == {
        (policy, step)
        for policy in ("float32", "autocast float16", "autocast bfloat16")
        for step in ("train", "inference")
    }
    for row in bench["rows"]:
        assert row["keras_bn_ms"] > 0 and row["keras_ms"] > 0 and row["floor_ms"] > 0
    assert stdout.splitlines()[-1].startswith("gpu_check: passed on CPU (dry run) (PyTorch ")

"""`make gpu-check` under PyTorch, dry run (benchmarks/gpu_check.py): every step on the CPU at
tiny sizes, in this Python; in make's .venv-torch, without TensorFlow, as on the GPU machine."""

import gpu_check_dry_run
import pytest


@pytest.mark.slow  # five steps in processes of their own: about a minute
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

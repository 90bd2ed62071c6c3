"""The benchmark scripts run (tiny shapes, one repetition) and print complete tables.
Timings are never asserted: CI machines are too noisy for that."""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.backends("tensorflow")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *extra):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), "--smoke", *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_bench_layer_smoke(tmp_path):
    out = _run("bench_layer.py", "--json", str(tmp_path / "layer.json"))
    assert out.startswith("machine: ")
    table, rest = out.split("| target |")
    targets, recentring = rest.split("The fused path's re-centring")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "ms" not in line]
    # 4 shapes x 2 policies x (train, inference) x (graph, XLA)
    assert len(rows) == 32
    assert all(len(row.split("|")) == 11 for row in rows)
    # XLA train on 4D and sequence shapes, XLA train in 2D, XLA inference: met or missed
    verdicts = [
        line.split("|")[-2].strip() for line in targets.splitlines()[2:] if line.startswith("| ")
    ]
    assert len(verdicts) == 3 and set(verdicts) <= {"yes", "MISSED"}
    # The JSON holds the printed rows (the docs' Performance page plots from it).
    record = json.loads((tmp_path / "layer.json").read_text())
    assert record["command"].endswith("--smoke --json " + str(tmp_path / "layer.json"))
    assert len(record["rows"]) == 32
    for row, line in zip(record["rows"], rows):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[:4] == [row["shape"], row["policy"], row["step"], row["tf_function"]]
        assert float(cells[4]) == pytest.approx(row["keras_bn_ms"], abs=0.006)
        assert float(cells[5]) == pytest.approx(row["keras_ms"], abs=0.006)
    assert [t["met"] for t in record["targets"]] == [v == "yes" for v in verdicts]
    # The re-centring table: 4 shapes x 2 policies, each with its costs, also in the JSON.
    costs = [line for line in recentring.splitlines() if line.startswith("| ") and "%" in line]
    assert len(costs) == 8 and all(len(row.split("|")) == 9 for row in costs)
    assert len(record["recentring"]) == 8
    for row, line in zip(record["recentring"], costs):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[:2] == [row["shape"], row["policy"]]
        assert float(cells[4].rstrip("%")) == pytest.approx(100 * row["shipped_cost"], abs=0.06)
    assert [p.name for p in tmp_path.iterdir()] == ["layer.json"]  # no temporary left


def _rows_and_verdicts(out):
    """A layer table's rows, and the verdicts of the targets' table after it."""
    table, targets = out.split("| target |")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "ms" not in line]
    verdicts = [
        line.split("|")[-2].strip() for line in targets.splitlines()[2:] if line.startswith("| ")
    ]
    return rows, verdicts


@pytest.mark.slow
def test_bench_layer_jax_smoke(tmp_path):
    """--backend jax: the JAX table (jitted stateless_call of each layer) and its JSON."""
    path = tmp_path / "layer_jax.json"
    out = _run("bench_layer.py", "--backend", "jax", "--json", str(path))
    assert out.startswith("machine: ") and "JAX " in out
    rows, verdicts = _rows_and_verdicts(out)
    assert len(rows) == 16  # 4 shapes x 2 policies x (train, inference)
    assert all(len(row.split("|")) == 8 for row in rows)
    assert len(verdicts) == 1 and verdicts[0] in {"yes", "MISSED"}
    record = json.loads(path.read_text())
    assert record["command"].endswith(f"bench_layer.py --smoke --backend jax --json {path}")
    assert len(record["rows"]) == 16
    for row, line in zip(record["rows"], rows, strict=True):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[:3] == [row["shape"], row["policy"], row["step"]]
        assert float(cells[3]) == pytest.approx(row["keras_bn_ms"], abs=0.006)
        assert float(cells[5]) == pytest.approx(row["ratio"], abs=0.006)
        assert row["keras_bn_ms"] > 0 and row["keras_ms"] > 0
    assert [t["met"] for t in record["targets"]] == [verdicts[0] == "yes"]
    assert [p.name for p in tmp_path.iterdir()] == ["layer_jax.json"]  # no temporary left


@pytest.mark.slow
def test_bench_layer_torch_smoke(tmp_path):
    """--backend torch: the PyTorch table (eager train step and inference of each layer and of
    F.batch_norm, float32 and autocast float16/bfloat16), the whole-model row, and the JSON."""
    pytest.importorskip("torch")
    path = tmp_path / "layer_torch.json"
    out = _run("bench_layer.py", "--backend", "torch", "--json", str(path))
    assert out.startswith("machine: ") and "PyTorch " in out
    rows, verdicts = _rows_and_verdicts(out)
    assert len(rows) == 24  # 4 shapes x 3 policies x (train, inference)
    assert all(len(row.split("|")) == 10 and "n/a" not in row for row in rows)
    assert len(verdicts) == 1 and verdicts[0] in {"yes", "MISSED"}
    assert "whole model, train_on_batch, ResNet 8x8x3, batch 8" in out
    record = json.loads(path.read_text())
    assert record["command"].endswith(f"bench_layer.py --smoke --backend torch --json {path}")
    assert record["device"] == "cpu" and record["torch_threads"] >= 1 and not record["not_run"]
    assert {r["policy"] for r in record["rows"]} == {
        "float32",
        "autocast float16",
        "autocast bfloat16",
    }
    for row, line in zip(record["rows"], rows, strict=True):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[:3] == [row["shape"], row["policy"], row["step"]]
        assert float(cells[3]) == pytest.approx(row["keras_bn_ms"], abs=0.006)
        assert float(cells[6]) == pytest.approx(row["ratio"], abs=0.006)
        assert row["keras_bn_ms"] > 0 and row["keras_ms"] > 0 and row["floor_ms"] > 0
    assert [t["met"] for t in record["targets"]] == [verdicts[0] == "yes"]
    assert record["model"]["keras_bn_ms"] > 0 and record["model"]["keras_ms"] > 0
    assert record["model"]["compiled"] is None  # --smoke: no torch.compile of the ResNet
    assert [p.name for p in tmp_path.iterdir()] == ["layer_torch.json"]  # no temporary left


@pytest.mark.slow
def test_bench_model_smoke():
    out = _run("bench_model.py")
    assert out.startswith("machine: ")
    assert "| small ResNet | graph |" in out and "| small ResNet | XLA |" in out
    assert "target: under XLA, BN's share of the step" in out


def test_bench_large_counts_smoke():
    out = _run("bench_large_counts.py")
    assert out.startswith("machine: ")
    (row,) = [line for line in out.splitlines() if line.startswith("| 64 |")]
    errors = [float(cell) for cell in row.strip("|").split("|")[-2:]]
    assert all(error < 1e-5 for error in errors)  # keras_bn's and Keras's σ², vs float64


@pytest.mark.slow
def test_bench_sync_smoke():
    out = _run("bench_sync.py")
    assert out.startswith("machine: ")
    assert "| NHWC 8x4x4x8 |" in out


def test_bench_cli_smoke():
    out = _run("bench_cli.py")
    assert out.startswith("keras-bn-export --help: median ") and "over 1 run(s)" in out


GPU_CHECK = os.path.join(ROOT, "benchmarks", "gpu_check.sh")


def _gpu_check(out, *extra, python=sys.executable):
    result = subprocess.run(
        ["bash", GPU_CHECK, *extra, str(out)],
        env={**os.environ, "PYTHON": python},
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_step_and_writes_its_json(tmp_path):
    import tensorflow as tf

    result, record = _gpu_check(tmp_path, "--dry-run")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert record["status"] == "passed" and record["reason"] is None and record["dry_run"]
    assert record["tensorflow"]["version"] == tf.__version__
    assert record["python"] and record["device"]
    tests = record["tests"]
    # One test per file of the exactness files, each run, on the CPU, TF32 off.
    assert (tests["passed"], tests["failed"], tests["errors"]) == (len(tests["files"]), 0, 0)
    assert tests["placement"]["default_device"].endswith("CPU:0") and tests["tf32"] is False
    bench = record["bench"]
    assert bench["device"].endswith("CPU:0") and bench["exit_code"] == 0
    # One shape: both policies x (train, inference) x (graph, XLA), every median positive.
    assert len(bench["rows"]) == 8
    assert {(r["policy"], r["step"], r["tf_function"]) for r in bench["rows"]} == {
        (policy, step, mode)
        for policy in ("float32", "mixed_float16")
        for step in ("train", "inference")
        for mode in ("graph", "XLA")
    }
    assert all(r["keras_bn_ms"] > 0 and r["keras_ms"] > 0 for r in bench["rows"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bench_layer.json",
        "bench_layer.log",
        "gpu_check.json",
        "probe.log",
        "tests.json",
        "tests.log",
    ]


def test_gpu_check_without_tensorflow_stops_with_one_line(tmp_path):
    # A new virtual environment of the same Python, without pip or any package.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True
    )
    result, record = _gpu_check(tmp_path / "out", python=str(tmp_path / "venv" / "bin" / "python"))
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("gpu_check: FAILED: TensorFlow is not importable by "), line
    assert "No module named 'tensorflow'" in line
    assert record["status"] == "failed" and record["reason"] in line
    assert "nvidia_smi" in record and record["tests"] is None and record["bench"] is None


@pytest.mark.slow
def test_gpu_check_without_a_gpu_stops_with_one_line(tmp_path):
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("TensorFlow sees a GPU here")
    result, record = _gpu_check(tmp_path)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"gpu_check: FAILED: TensorFlow {tf.__version__} sees no GPU"), line
    assert record["status"] == "failed" and record["tensorflow"]["gpus"] == []


@pytest.mark.slow
def test_offset_accuracy_smoke():
    """The accuracy table docs/guide/layer.md quotes: one row per path, the fused path's error
    without re-centring far above its error with it."""
    out = _run("offset_accuracy.py")
    assert out.startswith("machine: ")
    rows = {
        line.split("|")[1].strip(): [float(c) for c in line.split("|")[2:-1]]
        for line in out.splitlines()
        if line.startswith("| ") and "e-" in line
    }
    assert list(rows) == [
        "fused, re-centred",
        "fused, not re-centred",
        "XLA:CPU (jit_compile=True)",
        "composite",
    ]
    assert rows["fused, not re-centred"][0] > 100 * rows["fused, re-centred"][0]


@pytest.mark.slow
def test_bench_qat_refuses_model_without_step_cost():
    """--model chooses among --step-cost's timed models: alone it is a usage error (exit 2)
    before any work, not a full run that ignores it."""
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_qat.py"), "--model", "digits"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--model chooses among --step-cost's timed models" in result.stderr


@pytest.mark.slow
def test_bench_qat_smoke(tmp_path):
    """One seed, tiny epochs: the accuracy table (six rows, read from the runtime files), the
    targets with their verdicts and the step-time table, printed and in the JSON alike."""
    path = tmp_path / "qat.json"
    out = _run("bench_qat.py", "--json", str(path))
    assert out.startswith("# machine: ")
    record = json.loads(path.read_text())
    assert record["command"].endswith("--smoke --json " + str(path))
    assert record["seeds"] == 1 and len(record["per_seed"]) == 1
    rows = [line for line in out.splitlines() if re.match(r"\| w\da8 \|", line)]
    assert len(rows) == len(record["rows"]) == 6
    for row, line in zip(record["rows"], rows):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        granularity = "per channel" if row["per_channel"] else "per tensor"
        assert cells[:2] == [f"w{row['weight_bits']}a8", granularity]
        # rounding, QAT in Keras, in LiteRT and in onnxruntime: percentages of 450 images
        for column, name in ((2, "rounding"), (4, "qat_keras"), (5, "qat_tflite"), (6, "qat_onnx")):
            value = row[name]["median"]
            assert float(cells[column]) == pytest.approx(value, abs=0.051)
            assert 0 <= value <= 100 and round(value * 4.5, 6) == round(value * 4.5)
        # The converter's post-training int8 exists at 8 bits per channel only.
        assert (cells[3] == "—") == ((row["weight_bits"], row["per_channel"]) != (8, True))
        assert row["tflite_p99_lsb"]["max"] <= row["tflite_max_lsb"]["max"]
        assert cells[8] in {"1/1 + 1/1", "0/1 + 1/1", "1/1 + 0/1", "0/1 + 0/1"}
    verdicts = [
        line.split("|")[-2].strip() for line in out.splitlines() if "| ≤" in line or "| ≥" in line
    ]
    assert len(verdicts) == len(record["targets"]) == 7 + 3  # and one per timed train step
    assert verdicts == [
        "n/a" if t["met"] is None else "yes" if t["met"] else "MISSED" for t in record["targets"]
    ]
    assert [(t["model"].split(",")[0], t["mode"]) for t in record["step_times"]] == [
        ("digits CNN", "graph"),
        ("digits CNN", "XLA"),
        ("MobileNetV2 α=0.35", "graph"),  # --smoke: not its XLA row (a compile as long)
    ]
    for timing in record["step_times"]:
        assert timing["float_ms"] > 0 and timing["qat_ms"] > 0
        assert timing["ratio"] == pytest.approx(timing["qat_ms"] / timing["float_ms"])
    assert [p.name for p in tmp_path.iterdir()] == ["qat.json"]  # no temporary left


def test_round_weights_is_the_qat_models_inference_before_training():
    """examples/digits.py's post-training rounding of a folded model computes what
    `quantize_model`'s layers compute before any training step (no activation range yet, so
    only the weights are rounded): the fold and the QAT layers' fold, rounded alike."""
    import keras
    import numpy as np

    import digits
    import keras_bn
    from helpers import randomise_batch_norms
    from keras_bn.export import fold_batch_norms
    from keras_bn.quantize import quantize_model

    L = keras.layers
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    x = L.ReLU()(keras_bn.BatchNormalization()(L.Conv2D(8, 3, use_bias=False)(inputs)))
    x = L.ReLU(6.0)(keras_bn.BatchNormalization()(L.DepthwiseConv2D(3)(x)))
    x = keras_bn.BatchNormalization()(L.SeparableConv2D(8, 3, padding="same")(x))
    model = keras.Model(inputs, L.Dense(10)(L.GlobalAveragePooling2D()(x)))
    randomise_batch_norms(model)
    x_test = digits.load()[2][:64]
    folded, _ = fold_batch_norms(model, x_test)
    base = folded.get_weights()
    for bits, per_channel in ((8, True), (4, False), (3, True), (2, False)):
        folded.set_weights(base)
        digits.round_weights(folded, bits, per_channel)
        rounded = folded.predict(x_test, verbose=0)
        # round_weights rounds to max|w| ranges (quantize_model learns them below 4 bits)
        qat = quantize_model(model, bits, 8, per_channel, weight_range="max")
        qat = qat(x_test, training=False)
        np.testing.assert_allclose(rounded, qat, atol=1e-4 * np.abs(rounded).max())
        unrounded = model.predict(x_test, verbose=0)
        assert np.abs(rounded - unrounded).max() > 1e-3 * np.abs(unrounded).max()


@pytest.mark.slow
def test_bench_recalibrate_smoke(tmp_path):
    out = _run("bench_recalibrate.py", "--json", str(tmp_path / "recalibrate.json"))
    assert out.startswith("machine: ")
    rows = [line for line in out.splitlines() if line.startswith("| small ResNet |")]
    assert len(rows) == 1 and len(rows[0].split("|")) == 12
    assert "target: small ResNet recalibrate ≤ 1.5× one predict pass" in out
    record = json.loads((tmp_path / "recalibrate.json").read_text())
    (row,) = record["rows"]
    assert row["bn_layers"] == 16 and row["one_pass_strategy"] == "one_pass"
    # The one pass does at most one pass of work, the per-layer method one per BN layer, and
    # both give the same statistics (each statistic within 1e-5 of its scale).
    assert row["one_pass_passes"] <= 1.0 and row["per_layer_passes"] == 16.0
    assert row["max_relative_difference"] <= 1e-5
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert float(cells[4]) == pytest.approx(row["one_pass_ratio"], abs=0.006)
    assert float(cells[5]) == pytest.approx(row["one_pass_fastest_ratio"], abs=0.006)
    assert [p.name for p in tmp_path.iterdir()] == ["recalibrate.json"]

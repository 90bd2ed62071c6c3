"""The benchmark scripts run (tiny shapes, one repetition) and print complete tables.
Timings are never asserted: CI machines are too noisy for that."""

import json
import os
import subprocess
import sys

import pytest

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
    table, targets = out.split("| target |")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "ms" not in line]
    # 4 shapes x 2 policies x (train, inference) x (graph, XLA)
    assert len(rows) == 32
    assert all(len(row.split("|")) == 11 for row in rows)
    # XLA train on 4D and sequence shapes, XLA train in 2D, XLA inference: met or missed
    verdicts = [line.split("|")[-2].strip() for line in targets.splitlines()[2:]]
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
    assert [p.name for p in tmp_path.iterdir()] == ["layer.json"]  # no temporary left


@pytest.mark.slow
def test_bench_model_smoke():
    out = _run("bench_model.py")
    assert out.startswith("machine: ")
    assert "| small ResNet | graph |" in out and "| small ResNet | XLA |" in out
    assert "target: under XLA, BN's share of the step" in out


@pytest.mark.slow
def test_bench_sync_smoke():
    out = _run("bench_sync.py")
    assert out.startswith("machine: ")
    assert "| NHWC 8x4x4x8 |" in out

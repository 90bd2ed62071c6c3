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
    assert not list(tmp_path.glob("*.tmp"))


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

"""Synchronized BN under torch.distributed: two real processes on 127.0.0.1 (gloo), no
TensorFlow, against one process on the global batch (tests/torch_distributed_worker.py). The
tests whose processes live to the end share one pair of them, which runs every such job in one
process group; those where a process dies or skips a step start their own."""

import json
import os
import socket
import subprocess
import sys
import time
import warnings

import keras
import numpy as np
import pytest
import torch_distributed_worker as worker
from framework_references import array

import keras_bn

pytestmark = pytest.mark.backends("torch")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_distributed_worker.py")
# Two processes normally finish in seconds; this only catches a hang.
TIMEOUT_S = 240


def _data(path, sizes):
    """Two global batches of sum(sizes) images, and each process's first row."""
    rng = np.random.default_rng(0)
    total = sum(sizes)
    x = rng.normal(1.0, 2.0, (2, total, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(2, total, 3)).astype("float32")
    np.savez(path, x=x, y=y, splits=np.cumsum([0, *sizes[:-1]]))


def _layer_data(path, sizes, loc=2.0, scale=3.0, mode="eager"):
    """x (sum(sizes) rows, 5 channels), u, γ, β and the first row of process 1's share."""
    rng = np.random.default_rng(1)
    x = rng.normal(loc, scale, (sum(sizes), 5)).astype("float32")
    u = rng.normal(size=x.shape).astype("float32")
    gamma, beta = rng.normal(1.0, 0.5, 5).astype("float32"), rng.normal(size=5).astype("float32")
    np.savez(path, x=x, u=u, gamma=gamma, beta=beta, splits=np.cumsum([0, sizes[0]]), mode=mode)


def _shards(path, sizes):
    rng = np.random.default_rng(2)
    shards = {f"shard{i}": rng.normal(1.0, 2.0, (n, 8, 8, 3)) for i, n in enumerate(sizes)}
    np.savez(path, **{name: shard.astype("float32") for name, shard in shards.items()})


def _subclassed_shards(path):
    rng = np.random.default_rng(4)
    np.savez(
        path,
        shard0=np.zeros((0, 8, 8, 3), "float32"),
        shard1=rng.normal(size=(16, 8, 8, 3)).astype("float32"),
        subclassed=True,
    )


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(ranks, world, jobs, *extra):
    """Start one worker per rank on `jobs`, (DATA.npz, [OUT.npz per rank]) each; wait for
    all; their return codes."""
    env = dict(os.environ, KERAS_BACKEND="torch")
    port = str(_free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, WORKER, str(rank), str(world), port]
            + [str(path) for data, outs in jobs for path in (data, outs[index])]
            + list(extra),
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index, rank in enumerate(ranks)
    ]
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(TIMEOUT_S))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        if process.returncode not in (0, 3):
            raise AssertionError(process.stderr.read()[-3000:])
    return codes


# The jobs that need two live processes, by name: what each writes to its DATA.npz.
JOBS = {
    "penalty": lambda path: _layer_data(path, (7, 13), mode="penalty"),
    "train_unequal": lambda path: _data(path, (10, 14)),
    "train_equal": lambda path: _data(path, (12, 12)),
    "layer_unequal": lambda path: _layer_data(path, (7, 13)),
    "layer_empty_share": lambda path: _layer_data(path, (0, 12)),
    "layer_far_from_zero": lambda path: _layer_data(path, (9, 11), 1e4, 1e-2),
    "layer_torch_compile": lambda path: _layer_data(path, (7, 13), mode="compiled"),
    "recalibrate_unequal": lambda path: _shards(path, (40, 21)),
    "recalibrate_empty_shard": lambda path: _shards(path, (0, 21)),
    "subclassed": _subclassed_shards,
}
# The tests of JOBS run where the module's two processes ran (one xdist worker).
TWO_PROCESSES = pytest.mark.xdist_group("torch_distributed_two_processes")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Every job of JOBS run by one pair of processes, in one process group (starting a
    pair takes seconds; a fresh pair is the point only where one dies or skips): by name,
    the job's DATA.npz and the two processes' OUT.npz loaded."""
    folder = tmp_path_factory.mktemp("two_processes")
    jobs = {}
    for name, write in JOBS.items():
        write(folder / f"{name}.npz")
        jobs[name] = (folder / f"{name}.npz", [folder / f"{name}_rank{r}.npz" for r in range(2)])
    assert _run([0, 1], 2, list(jobs.values())) == [0, 0]
    return {
        name: (np.load(data), [np.load(out) for out in outs]) for name, (data, outs) in jobs.items()
    }


def _one_process(data):
    """The job on the global batch in this process (no process group): the reference. (A
    QAT copy keeps its synchronized BNs in float and says so, as in the workers, with a
    KerasBNWarning, which this suite otherwise makes an error.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_bn.KerasBNWarning)
        found = worker.run(data, 0, 1)
    return dict(zip((f"arr_{i}" for i in range(len(found))), found, strict=True))


@TWO_PROCESSES
def test_a_gradient_penalty_through_a_synchronized_layer_raises_on_both_processes(two_processes):
    """∂l/∂x with create_graph=True (a gradient penalty) through synchronized BN raises on
    each process, saying what to do, where a wrong second derivative would go unnoticed;
    neither process waits for the other."""
    _, outputs = two_processes["penalty"]
    for out in outputs:
        error = str(out["error"])
        assert "first-order gradients only" in error and "synchronized=False" in error, error


@TWO_PROCESSES
@pytest.mark.parametrize("sizes", ["unequal", "equal"])
def test_a_training_loop_on_two_processes_equals_one_process_on_the_global_batch(
    two_processes, sizes
):
    """Two processes, each on its share of every global batch (10 and 14 images, or 12 and
    12), run the documented custom loop (gradients summed by all_reduce): every weight and
    moving statistic of both equals one process's on the global batches within 1e-5, and
    the moving statistics are equal on both processes."""
    data, got = two_processes[f"train_{sizes}"]
    want = _one_process(data)
    assert sorted(got[0].files) == sorted(want)
    for name, value in want.items():
        scale = max(1.0, float(np.max(np.abs(value))))
        for result in got:
            np.testing.assert_allclose(result[name], value, rtol=0, atol=1e-5 * scale)
        np.testing.assert_array_equal(got[0][name], got[1][name])


@TWO_PROCESSES
@pytest.mark.parametrize("case", ["unequal", "empty_share", "far_from_zero", "torch_compile"])
def test_one_synchronized_layer_on_two_processes_equals_the_global_batchs_float64(
    two_processes, case
):
    """One synchronized BN on (batch, 5) shares (7 and 13 rows, 0 and 12, or 9 and 11 at
    mean 1e4, σ 1e-2), the loss Σ y·u over both processes: each process's outputs and input
    gradients are its rows of the global batch's, the γ/β gradients add up to the global
    batch's, and the moving statistics are the global batch's on both, against numpy in
    float64; eager, and called under torch.compile. An empty share (0 rows) made every
    gradient NaN, and data at mean 1e4, σ 1e-2 was 2% off, when a share's mean was summed in
    float32."""
    data, outputs = two_processes[f"layer_{case}"]
    x, u, gamma, beta = (data[name] for name in ("x", "u", "gamma", "beta"))
    got = [[out[f"arr_{i}"] for i in range(6)] for out in outputs]
    # float64: y = γ·x̂ + β, ∂l/∂x = γ/σ·(u − mean(u) − x̂·mean(u·x̂)), ∂l/∂γ = Σu·x̂, ∂l/∂β = Σu.
    x64, u64 = x.astype(np.float64), u.astype(np.float64)
    mean, variance = x64.mean(0), x64.var(0)
    x_hat = (x64 - mean) / np.sqrt(variance + 1e-3)
    want_y = gamma * x_hat + beta
    want_dx = gamma / np.sqrt(variance + 1e-3) * (u64 - u64.mean(0) - x_hat * (u64 * x_hat).mean(0))
    m = len(x)
    want_moving = (0.5 * mean, 0.5 + 0.5 * variance * m / (m - 1))
    rows = np.split(np.arange(m), [data["splits"][1]])
    for rank, (y, dx, _, _, moving_mean, moving_variance) in enumerate(got):
        np.testing.assert_allclose(y, want_y[rows[rank]], rtol=0, atol=2e-5 * np.abs(want_y).max())
        np.testing.assert_allclose(
            dx, want_dx[rows[rank]], rtol=0, atol=1e-4 * np.abs(want_dx).max()
        )
        np.testing.assert_allclose(moving_mean, want_moving[0], rtol=1e-6)
        np.testing.assert_allclose(moving_variance, want_moving[1], rtol=1e-4)
    for index, want in ((2, (u64 * x_hat).sum(0)), (3, u64.sum(0))):
        total = got[0][index] + got[1][index]
        np.testing.assert_allclose(total, want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))


@TWO_PROCESSES
@pytest.mark.parametrize("sizes", ["unequal", "empty_shard"])
def test_recalibrate_synchronized_gives_every_process_the_statistics_of_all_shards(
    two_processes, sizes
):
    """Two processes each recalibrate a CNN (three BNs, one on a residual branch) and its QAT
    copy on their own shard (40 and 21 images, or none and 21, in batches of 8): both end
    with the statistics one process gets from every shard's batches, within 1e-5, and a
    report counting every shard's batches. (An empty shard raised alone, and the other
    process waited for it in the all-reduce.)"""
    data, outputs = two_processes[f"recalibrate_{sizes}"]
    want = _one_process(data)
    assert len(want) == 2 * 7  # per model, three BNs' statistics and the batch count
    batches = sum(-(-len(data[name]) // 8) for name in ("shard0", "shard1"))
    assert want["arr_6"][0] == want["arr_13"][0] == batches
    for got in outputs:
        assert sorted(got.files) == sorted(want)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("task", ["training", "recalibrate"])
def test_a_process_that_dies_makes_the_other_raise_and_keep_its_statistics(tmp_path, task):
    """Rank 1 exits after joining the group: rank 0's first synchronized training step, or
    its recalibrate(synchronized=True), raises (gloo sees the closed connection) rather
    than waiting for it, and its BNs keep their moving statistics (the collective fails
    before any update; recalibrate puts back any layer it set)."""
    data = tmp_path / "data.npz"
    if task == "training":
        _data(data, (12, 12))
    else:
        rng = np.random.default_rng(3)
        np.savez(data, **{f"shard{i}": rng.normal(size=(16, 8, 8, 3)) for i in range(2)})
    outputs = [tmp_path / f"rank{rank}.npz" for rank in range(2)]
    start = time.monotonic()
    assert _run([0, 1], 2, [(data, outputs)], "--die", "1") == [0, 3]
    assert time.monotonic() - start < TIMEOUT_S
    result = np.load(outputs[0])
    assert str(result["error"])
    moving = [result[name] for name in result.files if name != "error"]
    assert len(moving) == 6
    for mean, variance in zip(moving[::2], moving[1::2]):
        np.testing.assert_array_equal(mean, 0.0)
        np.testing.assert_array_equal(variance, 1.0)


@TWO_PROCESSES
def test_an_empty_shard_of_a_subclassed_model_is_every_processs_error(two_processes):
    """A subclassed model (recalibrate's per-layer method traces a first batch to find the
    order of its BNs) whose shard is empty on one process: both processes raise the same
    ValueError, rather than one raising alone while the other waits for it."""
    _, outputs = two_processes["subclassed"]
    errors = [str(out["error"]) for out in outputs]
    assert errors[0] == errors[1] and "some process gave no batch" in errors[0], errors


def test_a_process_that_skips_a_synchronized_step_makes_the_other_raise_after_the_timeout(
    tmp_path, monkeypatch
):
    """Rank 1 stays alive but never calls the model: rank 0's synchronized step cannot tell
    it from a slow one, waits the process group's timeout (5 s here), then raises; its BNs
    keep their statistics. Not a deadlock."""
    monkeypatch.setenv("KERAS_BN_TEST_COLLECTIVE_TIMEOUT_S", "5")
    data = tmp_path / "data.npz"
    _data(data, (12, 12))
    outputs = [tmp_path / f"rank{rank}.npz" for rank in range(2)]
    start = time.monotonic()
    assert _run([0, 1], 2, [(data, outputs)], "--skip", "1") == [0, 3]
    assert time.monotonic() - start < 60
    result = np.load(outputs[0])
    assert str(result["error"])
    for mean, variance in zip(*[iter([result[f"arr_{i}"] for i in range(6)])] * 2):
        np.testing.assert_array_equal(mean, 0.0)
        np.testing.assert_array_equal(variance, 1.0)


def test_without_a_process_group_synchronized_is_plain_batch_norm():
    """No torch.distributed group: synchronized=True computes what synchronized=False does,
    output, gradients and moving statistics."""
    import torch

    x = np.random.default_rng(0).normal(2.0, 3.0, (6, 4, 5)).astype("float32")
    found = []
    for synchronized in (True, False):
        layer = keras_bn.BatchNormalization(synchronized=synchronized)
        layer.build(x.shape)
        t = torch.tensor(x, requires_grad=True)
        y = layer(t, training=True)
        torch.sum(y * y * torch.arange(5.0)).backward()
        found.append([array(y), array(t.grad), array(layer.moving_variance)])
    for got, want in zip(*found):
        np.testing.assert_array_equal(got, want)
    assert keras.backend.backend() == "torch"


@pytest.mark.parametrize("task", ["recalibrate", "train"])
def test_the_distributed_benchmark_runs(tmp_path, task):
    """benchmarks/bench_distributed.py --smoke: one process, then two each on half the data;
    the table's rows and the JSON's. The two-process statistics are those of one process,
    except the train step's with per-process BN, whose statistics are its share's. The
    recalibration runs one-core workers (`--threads-each 1`), the train step divides the
    cores."""
    path = tmp_path / "distributed.json"
    script = os.path.join(os.path.dirname(WORKER), "..", "benchmarks")
    threads = ["--threads-each", "1"] if task == "recalibrate" else []
    result = subprocess.run(
        [sys.executable, "bench_distributed.py", "--task", task, "--smoke", "--json", str(path)]
        + threads,
        cwd=script,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("# machine: ") and "PyTorch " in result.stdout
    rows = [line for line in result.stdout.splitlines() if line[:4] in ("| 1 ", "| 2 ")]
    record = json.loads(path.read_text())
    assert record["task"] == task and len(rows) == len(record["rows"])
    found = [(row["processes"], row["synchronized"]) for row in record["rows"]]
    if task == "recalibrate":
        assert found == [(1, True), (2, True)]
    else:
        assert found == [(1, True), (2, True), (2, False)]
    cores = os.cpu_count() or 1
    for row in record["rows"]:
        assert row["seconds"] > 0
        divided = max(1, cores // row["processes"])
        assert row["threads_each"] == (1 if threads else divided), row
        if row["synchronized"]:
            assert row["max_rel_off"] < 1e-5, row
        else:  # each process's BN normalizes its own share: other statistics
            assert row["max_rel_off"] > 1e-4, row

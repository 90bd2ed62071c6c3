"""Synchronized BN under torch.distributed: two real processes on 127.0.0.1 (gloo), no
TensorFlow, against one process on the global batch (tests/torch_distributed_worker.py)."""

import os
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(ranks, world, data, outputs, *extra):
    """Start one worker per rank; wait for all; their return codes."""
    env = dict(os.environ, KERAS_BACKEND="torch")
    port = str(_free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, WORKER, str(rank), str(world), port, str(data), str(out), *extra],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, out in zip(ranks, outputs)
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


@pytest.mark.parametrize("sizes", [(10, 14), (12, 12)], ids=["unequal", "equal"])
def test_a_training_loop_on_two_processes_equals_one_process_on_the_global_batch(tmp_path, sizes):
    """Two processes, each on its share of every global batch (10 and 14 images, or 12 and
    12), run the documented custom loop (gradients summed by all_reduce): every weight and
    moving statistic of both equals one process's on the global batches within 1e-5, and
    the moving statistics are equal on both processes."""
    data = tmp_path / "data.npz"
    _data(data, sizes)
    outputs = [tmp_path / f"rank{rank}.npz" for rank in range(2)]
    assert _run([0, 1], 2, data, outputs) == [0, 0]
    reference = tmp_path / "one.npz"
    assert _run([0], 1, data, [reference]) == [0]
    want = np.load(reference)
    got = [np.load(out) for out in outputs]
    for name in want.files:
        scale = max(1.0, float(np.max(np.abs(want[name]))))
        for result in got:
            np.testing.assert_allclose(result[name], want[name], rtol=0, atol=1e-5 * scale)
        np.testing.assert_array_equal(got[0][name], got[1][name])


def test_a_process_that_dies_makes_the_other_raise_and_keep_its_statistics(tmp_path):
    """Rank 1 exits after joining the group: rank 0's first synchronized step raises (gloo
    sees the closed connection) rather than waiting for it, and its BNs keep their moving
    statistics (the collective fails before any update)."""
    data = tmp_path / "data.npz"
    _data(data, (12, 12))
    outputs = [tmp_path / f"rank{rank}.npz" for rank in range(2)]
    start = time.monotonic()
    assert _run([0, 1], 2, data, outputs, "--die", "1") == [0, 3]
    assert time.monotonic() - start < TIMEOUT_S
    result = np.load(outputs[0])
    assert str(result["error"])
    moving = [result[name] for name in result.files if name != "error"]
    assert len(moving) == 6
    for mean, variance in zip(moving[::2], moving[1::2]):
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

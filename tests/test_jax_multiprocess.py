"""keras_bn under jax.distributed: two real JAX processes on 127.0.0.1 (CPU, gloo collectives,
two devices each), no TensorFlow, against one process on the global data
(tests/jax_multiprocess_worker.py).

Training under `keras.distribution.DataParallel` over both processes' devices, each process
feeding its own rows of every global batch, equals one process on the global batches, for a
BN with `synchronized=False` and one with `synchronized=True` alike: Keras makes each global
batch one array sharded over all four devices (jax.make_array_from_process_local_data) and the
jitted train step's batch statistics are XLA's over the whole array, so they span the processes
whatever `synchronized` says. `recalibrate(synchronized=True)` pools Algorithm 2's float64 sums
over the processes (`recalibration_processes().all_sum_array`). A process that dies makes the
other's recalibrate raise, or the coordination service terminate it, within the heartbeat
timeout: never a hang."""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

# Processes of their own, each starting JAX: left out of `make test-fast`.
pytestmark = [pytest.mark.backends("jax"), pytest.mark.slow]
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax_multiprocess_worker.py")
# Three processes normally finish in seconds; this only catches a hang.
TIMEOUT_S = 180
STEPS, BATCH, FEATURES, MOMENTUM = 3, 16, 5, 0.5
# The fault test's heartbeat timeout (JAX's default is 100 s): how long jax.distributed's
# coordination service waits for a silent process before declaring it dead.
HEARTBEAT_S = 5


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_codes(tmp_path, data, runs, *options, timeout=TIMEOUT_S):
    """The worker once per (process, count, port, name) of `runs` on `data`, `options` after
    its OUT.npz, all at once: their exit codes once all have exited (each one's output in
    NAME.log, its results in NAME.npz); subprocess.TimeoutExpired, all killed, if one still
    runs after `timeout` seconds."""
    env = dict(os.environ, KERAS_BACKEND="jax", KERAS_BN_NO_TENSORFLOW="1")
    processes, logs = [], []
    for process, count, address, name in runs:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (closed below)
        logs.append(log)
        command = [sys.executable, WORKER, process, count, address, str(data)]
        command += [str(tmp_path / f"{name}.npz"), *options]
        processes.append(subprocess.Popen(command, env=env, stderr=log, stdout=log))
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    return [process.returncode for process in processes]


def _run(tmp_path, data):
    """The two processes of jax.distributed and the one-process reference, all at once, on
    `data`: their outputs (process 0, process 1, reference) once all have exited."""
    port = str(_free_port())
    runs = [("0", "2", port, "rank0"), ("1", "2", port, "rank1"), ("0", "1", "0", "one")]
    for (*_, name), code in zip(runs, _exit_codes(tmp_path, data, runs)):
        if code != 0:
            raise AssertionError(
                f"{name} exited with {code}:\n" + (tmp_path / f"{name}.log").read_text()[-3000:]
            )
    return [np.load(tmp_path / f"{name}.npz") for *_, name in runs]


def _assert_equals_reference(got, want, names):
    """Every array of both processes within 1e-5 (relative to the array's largest value, at
    least 1) of the reference's, and the same bits on both processes."""
    for name in names:
        scale = max(1.0, float(np.max(np.abs(want[name]))))
        for result in got:
            np.testing.assert_allclose(result[name], want[name], rtol=0, atol=1e-5 * scale)
        np.testing.assert_array_equal(got[0][name], got[1][name])


def _moving_statistics(batches):
    """Algorithm 1's moving (mean, unbiased variance) of a BN (momentum 0.5) on these
    batches, float64."""
    mean, variance = np.zeros(FEATURES), np.ones(FEATURES)
    for x in batches:
        x = x.astype(np.float64)
        mean = MOMENTUM * mean + (1 - MOMENTUM) * x.mean(0)
        variance = MOMENTUM * variance + (1 - MOMENTUM) * x.var(0, ddof=1)
    return mean, variance


def test_fit_under_data_parallel_on_two_processes_equals_one_process_on_the_global_batch(
    tmp_path,
):
    """`model.fit` under DataParallel over both processes' 4 devices, each process passing
    its 8 rows of every global batch of 16: every weight and moving statistic of the
    synchronized=False BN and of the synchronized=True BN equals one process's `fit` on the
    global batches within 1e-5, and is the same on both processes. Process 0's rows have mean
    −5 and process 1's +5 (σ 3): the first BN's moving variance is the global batches' (23 to
    31 per feature), not either share's (under 1, and 5 to 16) as each process alone would
    give."""
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 1.0, (STEPS, BATCH, FEATURES))
    x[:, : BATCH // 2] -= 5.0
    x[:, BATCH // 2 :] = 3.0 * x[:, BATCH // 2 :] + 5.0
    y = rng.normal(size=(STEPS, BATCH, 1))
    data = tmp_path / "train.npz"
    np.savez(data, x=x.astype("float32"), y=y.astype("float32"))
    *got, want = _run(tmp_path, data)
    assert sorted(want.files) == sorted(got[0].files)
    assert any("/synchronized/moving_variance" in name for name in want.files)
    _assert_equals_reference(got, want, want.files)
    # The first BN's input is the data itself: its moving statistics are those of the global
    # batches, far from those of a process's share.
    mean, variance = _moving_statistics(x.astype("float32"))
    for result in got:
        found = result["sequential/unsynchronized/moving_variance"]
        np.testing.assert_allclose(found, variance, rtol=1e-5)
        np.testing.assert_allclose(result["sequential/unsynchronized/moving_mean"], mean, atol=1e-5)
        for share in (x[:, : BATCH // 2], x[:, BATCH // 2 :]):
            assert np.all(np.abs(found - _moving_statistics(share)[1]) > 10.0)


def test_recalibrate_synchronized_on_two_processes_equals_one_process_on_every_shard(tmp_path):
    """`recalibrate(synchronized=True)` with process 0 on 40 samples and process 1 on 21
    (mean −3 and +4, in batches of 8, the last of each shard shorter): every BN's moving
    statistics on both processes are those of one process recalibrating on every shard's
    batches in order, within 1e-5, and the same bits on both; `all_sum_array` adds float64
    values that float32 would round exactly."""
    rng = np.random.default_rng(2)
    shard0 = rng.normal(-3.0, 1.0, (40, FEATURES)).astype("float32")
    shard1 = rng.normal(4.0, 2.0, (21, FEATURES)).astype("float32")
    data = tmp_path / "recalibrate.npz"
    np.savez(data, shard0=shard0, shard1=shard1)
    *got, want = _run(tmp_path, data)
    assert len(want.files) == 4, want.files  # two BNs' moving mean and variance
    _assert_equals_reference(got, want, want.files)
    # The worker's probe(0) + probe(1), in float64: float32 would make them 2⁴¹, 1.0, 0.
    exact = np.array([2.0**40 + 1, 1 / 3, 1e-300]) + np.array([2.0**40 + 2, 2 / 3, 2e-300])
    for result in got:
        np.testing.assert_array_equal(result["all_sum"], exact)


@pytest.mark.parametrize("connected", [False, True], ids=["allgather-first", "after-a-collective"])
def test_a_process_that_dies_makes_the_other_raise_or_be_terminated_rather_than_hang(
    tmp_path, connected
):
    """Process 1 exits (code 3) once process 0 has started `recalibrate(synchronized=True)`.
    Gloo under JAX connects the processes at their first collective, not at
    jax.distributed.initialize. If recalibrate's allgather is that first collective, process 0
    waits in it for a peer that never comes until the coordination service misses process 1's
    heartbeats for HEARTBEAT_S (5 s) and terminates process 0 (SIGABRT, "Terminating process
    because the JAX distributed service detected fatal errors"): no Python error, no output;
    measured 4.7 to 5.6 s after the call started, 9 to 10 s for the test. After an earlier
    collective (`sync_global_devices`), the allgather raises a JaxRuntimeError at once ("Gloo
    AllGather failed: ... Connection closed by peer", 0.5 to 0.6 s after the call started,
    forward passes included), the BNs keep their moving statistics (mean 0, variance 1:
    recalibrate puts back any layer it set), and the coordination service terminates process
    0 all the same once the heartbeat timeout has passed. Either way the survivor never hangs:
    it ends within the heartbeat timeout of the death (bounded here by HEARTBEAT_S + 10 s)."""
    rng = np.random.default_rng(5)
    shards = {f"shard{i}": rng.normal(size=(16, FEATURES)).astype("float32") for i in range(2)}
    data = tmp_path / "fault.npz"
    np.savez(data, **shards, **({"connected": True} if connected else {}))
    port = str(_free_port())
    runs = [("0", "2", port, "rank0"), ("1", "2", port, "rank1")]
    # A survivor that hung would raise subprocess.TimeoutExpired here.
    codes = _exit_codes(tmp_path, data, runs, "--die", "1", str(HEARTBEAT_S), timeout=60)
    log = (tmp_path / "rank0.log").read_text()
    assert codes == [-signal.SIGABRT, 3], (codes, log[-3000:])
    assert "detected fatal errors" in log and "heartbeat" in log, log[-3000:]
    started = tmp_path / "fault.npz.started"  # process 0 created it just before the call
    assert time.time() - started.stat().st_mtime < HEARTBEAT_S + 10
    if not connected:
        assert not (tmp_path / "rank0.npz").exists()  # neither raised nor returned
        return
    result = np.load(tmp_path / "rank0.npz")
    assert "Connection closed by peer" in str(result["error"]), str(result["error"])
    assert float(result["seconds"]) < HEARTBEAT_S
    moving = [name for name in result.files if "/moving_" in name]
    assert len(moving) == 4, result.files  # two BNs' moving mean and variance
    for name in moving:
        expected = 1.0 if name.endswith("variance") else 0.0
        np.testing.assert_array_equal(result[name], expected, err_msg=name)


def test_a_process_that_skips_the_call_leaves_the_other_waiting_until_it_ends(tmp_path):
    """What distributed.md says of JAX: a process that is alive but skips
    `recalibrate(synchronized=True)` cannot be told from a slow one. The processes make one
    collective first (so gloo has connected them); process 1 then skips the call, stays alive
    SKIPPER_ALIVE_S (6 s) and exits (code 0). Process 0 waits in its call all that while, with
    no error of its own; at the skipper's exit its allgather raises ("Connection closed by
    peer"), its statistics kept, and the coordination service aborts it (SIGABRT) within the
    heartbeat timeout: no hang."""
    rng = np.random.default_rng(6)
    shards = {f"shard{i}": rng.normal(size=(16, FEATURES)).astype("float32") for i in range(2)}
    data = tmp_path / "skip.npz"
    np.savez(data, **shards, connected=True)
    port = str(_free_port())
    runs = [("0", "2", port, "rank0"), ("1", "2", port, "rank1")]
    codes = _exit_codes(tmp_path, data, runs, "--skip", "1", str(HEARTBEAT_S), timeout=60)
    log = (tmp_path / "rank0.log").read_text()
    assert codes == [-signal.SIGABRT, 0], (codes, log[-3000:])
    assert "detected fatal errors" in log, log[-3000:]
    result = np.load(tmp_path / "rank0.npz")
    assert "Connection closed by peer" in str(result["error"]), str(result["error"])
    assert 6 <= float(result["seconds"]) < 6 + HEARTBEAT_S, float(result["seconds"])
    moving = [name for name in result.files if "/moving_" in name]
    assert len(moving) == 4, result.files
    for name in moving:
        expected = 1.0 if name.endswith("variance") else 0.0
        np.testing.assert_array_equal(result[name], expected, err_msg=name)

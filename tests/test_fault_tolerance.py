"""Fault tolerance: a worker killed mid-epoch under MultiWorkerMirroredStrategy, restarted
with keras.callbacks.BackupAndRestore, ends exactly where an uninterrupted run ends; what
a restart repeats with each save_freq (Keras 3.15); and a worker that dies in
`recalibrate(synchronized=True)` makes the other's call raise at once, its statistics kept."""

import json
import time

import keras
import multiworker_worker as worker
import numpy as np
import pytest

from helpers import assert_close
from tf_helpers import mirrored_strategy

pytestmark = pytest.mark.backends("tensorflow")

HANG_AT = (1, 2)  # (epoch, batch): worker 1 is killed there, after the epoch-0 backup


def _progress(path):
    with open(path) as log:
        return [tuple(int(v) for v in line.split()) for line in log]


def _worker_args(tmp_path, init, run, index, hang_at=None):
    args = [
        "backup",
        str(init),
        str(tmp_path / f"{run}{index}.npz"),
        str(tmp_path / f"backup{index}"),
        str(tmp_path / f"{run}{index}.progress"),
    ]
    return args + (["--hang-at", f"{hang_at[0]}:{hang_at[1]}"] if hang_at else [])


def _wait_for(condition, cluster, timeout):
    deadline = time.monotonic() + timeout
    while not condition():
        cluster.check_running()
        assert time.monotonic() < deadline, f"timed out after {timeout} s"
        time.sleep(0.2)


def _uninterrupted_and_killed(tmp_path, init, attempts=3):
    """Start both workers; while they start, train the uninterrupted reference here; when
    both have finished batch HANG_AT (worker 1 then waits, worker 0 waits for it in the next
    step's all-reduce), SIGKILL worker 1, then worker 0. Fresh ports if one was taken.
    Returns the reference's weights."""
    reference = None
    for attempt in range(attempts):
        args = [
            _worker_args(tmp_path, init, "faulty", i, HANG_AT if i == 1 else None) for i in range(2)
        ]
        try:
            with worker.Cluster(args, str(tmp_path), f"faulty{attempt}") as cluster:
                if reference is None:
                    reference = worker.train_with_backup(
                        mirrored_strategy(2),
                        str(init),
                        str(tmp_path / "reference_backup"),
                        str(tmp_path / "reference.progress"),
                    )
                logs = [tmp_path / f"faulty{index}.progress" for index in range(2)]
                _wait_for(
                    lambda logs=logs: all(
                        log.exists() and HANG_AT in _progress(log) for log in logs
                    ),
                    cluster,
                    timeout=worker.CLUSTER_TIMEOUT_S,
                )
                cluster.kill(1)
                cluster.kill(0)
                return reference
        except worker.PortTaken:
            if attempt == attempts - 1:
                raise


@pytest.mark.slow
def test_worker_killed_mid_epoch_restarts_from_the_epoch_backup(tmp_path):
    """Two workers under MultiWorkerMirroredStrategy train 3 epochs with BackupAndRestore;
    worker 1 is SIGKILLed in the middle of epoch 1, after epoch 0's backup, and then both are
    restarted. The restart repeats epoch 1 from its first batch on the epoch-0 backup and
    ends with the weights, moving statistics and num_batches_tracked of an uninterrupted run
    (two MirroredStrategy replicas in this process, the same data in the same order) within
    1e-6; num_batches_tracked counts each global step once."""
    keras.utils.set_random_seed(0)
    init = tmp_path / "init.npz"
    np.savez(init, *worker.build_model(cumulative=True).get_weights())
    reference = _uninterrupted_and_killed(tmp_path, init)
    for index in range(2):  # both workers had backed up epoch 0, and nothing later
        with open(tmp_path / f"backup{index}" / "training_metadata.json") as f:
            assert json.load(f)["epoch"] == 1
    worker.run_cluster(
        [_worker_args(tmp_path, init, "restarted", i) for i in range(2)],
        str(tmp_path),
        "restarted",
        timeout=worker.CLUSTER_TIMEOUT_S,
    )

    steps = _progress(tmp_path / "reference.progress")
    assert len(steps) == worker.FIT_EPOCHS * worker.FIT_STEPS
    for index in range(2):
        # The killed run reached HANG_AT and no further; the restart ran epochs 1 and 2 whole.
        assert _progress(tmp_path / f"faulty{index}.progress")[-1] == HANG_AT
        assert _progress(tmp_path / f"restarted{index}.progress") == [s for s in steps if s[0] >= 1]

    names = [w.path for w in worker.build_model(cumulative=True).weights]
    counter = next(i for i, name in enumerate(names) if name.endswith("num_batches_tracked"))
    assert int(reference[counter]) == len(steps)  # one per global step
    for index in range(2):
        restarted = np.load(tmp_path / f"restarted{index}.npz")
        assert len(restarted.files) == len(names)
        for i, expected in enumerate(reference):
            assert_close(restarted[f"arr_{i}"], expected, 1e-6)
        # None lost to the kill, none counted twice by the restart.
        assert int(restarted[f"arr_{counter}"]) == len(steps)


class _Interrupted(Exception):
    pass


def _interrupt():
    raise _Interrupted


@pytest.mark.parametrize("save_freq,repeated", [("epoch", 0), (2, 2)])
def test_what_a_restart_repeats(tmp_path, save_freq, repeated):
    """Keras 3.15's BackupAndRestore restores its last backup's weights and restarts the epoch
    it was in from the first batch (it records the batch but never reads it back). Backed up
    at epoch ends, the restart repeats the interrupted epoch's batches on the weights from
    before them: the run ends as an uninterrupted one. Backed up every 2 batches (here after
    batch 1 of epoch 1, interrupted after batch 2), it repeats batches 0 and 1 on weights that
    already include them: num_batches_tracked counts them twice, and the statistics differ."""
    keras.utils.set_random_seed(0)
    init = tmp_path / "init.npz"
    np.savez(init, *worker.build_model(cumulative=True).get_weights())

    def train(run, **kwargs):
        return worker.train_with_backup(
            None,
            str(init),
            str(tmp_path / f"{run}_backup"),
            str(tmp_path / f"{run}.progress"),
            save_freq=save_freq,
            **kwargs,
        )

    reference = train("reference")
    with pytest.raises(_Interrupted):
        train("faulty", stop_at=HANG_AT, stop=_interrupt)
    restarted = train("faulty")

    names = [w.path for w in worker.build_model(cumulative=True).weights]
    counter = next(i for i, name in enumerate(names) if name.endswith("num_batches_tracked"))
    assert int(reference[counter]) == worker.FIT_EPOCHS * worker.FIT_STEPS
    assert int(restarted[counter]) == int(reference[counter]) + repeated
    moving_mean = names.index(next(n for n in names if n.endswith("moving_mean")))
    same = np.allclose(restarted[moving_mean], reference[moving_mean], rtol=1e-6, atol=1e-6)
    assert same == (repeated == 0)
    if repeated == 0:
        for ours, expected in zip(restarted, reference):
            assert_close(ours, expected, 1e-6)


@pytest.mark.slow
def test_a_worker_that_dies_in_recalibrate_makes_the_other_raise_with_its_statistics_put_back(
    tmp_path,
):
    """Two MultiWorkerMirroredStrategy workers on 127.0.0.1 start
    `recalibrate(synchronized=True)` on their shards; worker 1 exits (code 3, no clean
    shutdown) at the second BN's reduce, once worker 0 has set the first BN. Worker 0's
    reduce fails on the closed connection, with no timeout configured: recalibrate raises
    UnavailableError ("Collective ops is aborted by: Socket closed"), measured 0.15 to 0.26 s
    after worker 0 went into the reduce, and the model keeps every moving statistic and the
    batch counter it had before the call (the first BN, set by then, is put back). Worker 0
    then exits normally: TensorFlow does not terminate it. A survivor that hung would fail
    the cluster's timeout; one freed only by the coordination service's heartbeat timeout
    (about 9 s, measured with a frozen worker 1) fails the 5 s bound. 6.4 to 7.5 s per run
    (pytest's time, 2-core machine), nearly all of it the two workers' start-up."""
    model = worker.build_model(cumulative=True)
    rng = np.random.default_rng(3)
    for variable in model.non_trainable_variables:  # statistics no recalibration gives
        if variable.path.endswith("num_batches_tracked"):
            variable.assign(7)
        else:
            variable.assign(rng.uniform(0.5, 2.0, variable.shape))
    before = [np.asarray(v) for v in model.non_trainable_variables]
    first = np.concatenate([np.asarray(v) for v in model.layers[1].non_trainable_variables])
    init = tmp_path / "init.npz"
    np.savez(init, *model.get_weights())

    worker.run_cluster(
        [["recalibrate", str(init), str(tmp_path / f"out{i}.npz"), "--die", "1"] for i in range(2)],
        str(tmp_path),
        "fault",
        timeout=worker.CLUSTER_TIMEOUT_S,
        exit_codes=[0, 3],  # worker 0 raised in Python and went on; worker 1 died where told
    )
    result = np.load(tmp_path / "out0.npz")
    error = str(result["error"])
    assert error.startswith("UnavailableError: "), error
    assert "Collective ops is aborted" in error, error
    # The closed connection, not the coordination service's heartbeat timeout (about 9 s).
    assert float(result["after_fault"]) < 5.0, float(result["after_fault"])
    assert not np.array_equal(result["during"], first)  # the first BN had been set
    assert len(result.files) == len(before) + 3  # arr_0... and during, error, after_fault
    for i, expected in enumerate(before):
        np.testing.assert_array_equal(result[f"arr_{i}"], expected)

"""One worker of the multi-worker tests, the one-process reference they compare with, and
`Cluster`, which starts the workers on 127.0.0.1.

    TF_CONFIG=... python multiworker_worker.py loop INIT.npz OUT.npz
    TF_CONFIG=... python multiworker_worker.py recalibrate INIT.npz OUT.npz [--die WORKER]
    TF_CONFIG=... python multiworker_worker.py backup INIT.npz OUT.npz BACKUP_DIR LOG
        [--hang-at EPOCH:BATCH]

`loop` (tests/test_distributed.py) trains a small synchronized-BN model for a few SGD steps,
each worker on its slice of every global batch. `recalibrate` (the same file) recalibrates it
with synchronized=True, each worker on its own shard (`recalibration_shards`); with --die,
worker WORKER exits part way and the other saves what its call did
(tests/test_fault_tolerance.py, `recalibrated_while_one_dies`). `backup`
(tests/test_fault_tolerance.py) trains for a few epochs with
`keras.callbacks.BackupAndRestore(BACKUP_DIR, save_freq="epoch")` (see train_with_backup),
appending "epoch batch" to LOG after every batch; with --hang-at it stops after logging that
batch and waits to be killed. Both save every weight (the BN moving
statistics and num_batches_tracked included) to OUT.npz.
"""

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import keras_bn

# Only catches a hang: two workers normally finish in under a minute, but on a loaded 2-core
# machine TensorFlow's start-up alone has taken a minute per process.
CLUSTER_TIMEOUT_S = 400
GLOBAL_BATCH = 16
STEPS = 3
FIT_EPOCHS = 3
FIT_STEPS = 6  # global batches per epoch


def build_model(synchronized=True, cumulative=False):
    """Dense → BN(momentum=0.5) → ReLU → Dense(1); `cumulative` adds a Dense → BN with
    momentum=None (so num_batches_tracked) → ReLU block before the last Dense."""
    cumulative_block = (
        [
            keras.layers.Dense(4, use_bias=False),
            keras_bn.BatchNormalization(momentum=None, synchronized=synchronized),
            keras.layers.ReLU(),
        ]
        if cumulative
        else []
    )
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, use_bias=False),
            keras_bn.BatchNormalization(momentum=0.5, synchronized=synchronized),
            keras.layers.ReLU(),
            *cumulative_block,
            keras.layers.Dense(1),
        ]
    )


def load_weights(model, path):
    saved = np.load(path)
    model.set_weights([saved[f"arr_{i}"] for i in range(len(saved.files))])


def batches(steps=STEPS, seed=7):
    """`steps` global batches (x, y), the same for a given seed: fixed random arrays."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.normal(size=(GLOBAL_BATCH, 6)).astype("float32")
        x[GLOBAL_BATCH // 2 :] += 3.0  # the two workers see different distributions
        yield x, rng.normal(size=(GLOBAL_BATCH, 1)).astype("float32")


def recalibration_shards(workers=2):
    """Each worker's shard for `recalibrate`: 40 and 21 rows, the second shifted by 3."""
    rng = np.random.default_rng(11)
    sizes = (40, 21, 17, 9)[:workers]
    return [rng.normal(3.0 * i, 2.0, (n, 6)).astype("float32") for i, n in enumerate(sizes)]


def recalibrated(strategy, init_path, shards):
    """The model (cumulative too) from init_path, recalibrated with synchronized=True on
    `shards` in batches of 8 each (a list of arrays: one process's, or every shard's in
    order); its moving statistics and batch counter."""
    model = _recalibration_model(strategy, init_path)
    with _scope(strategy):
        keras_bn.recalibrate(model, _batches_of(shards), progress=False, synchronized=True)
    return [np.asarray(v) for v in model.non_trainable_variables]


def _recalibration_model(strategy, init_path):
    with _scope(strategy):  # under MWMS every worker makes the variables, together
        model = build_model(cumulative=True)
        load_weights(model, init_path)
    return model


def _batches_of(shards):
    return [s[i : i + 8] for s in shards for i in range(0, len(s), 8)]


def recalibrated_while_one_dies(strategy, init_path, index, dying, started, out_path):
    """--die DYING: both workers start the recalibrate of `recalibrated` on their shards,
    which pools the sums of one BN layer at a time, one reduce each. At the second layer's
    reduce, worker DYING waits for the file `started` and exits (code 3) as a crash would,
    without a word to the cluster; the other creates `started` there, once it has set the
    first layer, and goes into the reduce. Once its recalibrate raises or returns, it saves
    to out_path the model's moving statistics and batch counter, `during` (the first BN's
    moving mean and variance at the second reduce), `error` ("Type: message"; "" if it
    returned) and `after_fault` (seconds from creating `started` to the end of the call)."""
    model = _recalibration_model(strategy, init_path)
    tf_backend = keras_bn.backend.get()
    strategy_sum, during, fault = tf_backend.recalibration_processes, [], []

    class FaultAtSecondSum:  # the strategy's sums (keras_bn.backend.ProcessSum), one fails
        def __init__(self):
            self.sums, self.calls = strategy_sum(), 0

        def all_sum_array(self, values):
            self.calls += 1
            if self.calls == 2 and index == dying:
                deadline = time.monotonic() + CLUSTER_TIMEOUT_S
                while not os.path.exists(started) and time.monotonic() < deadline:
                    time.sleep(0.05)
                os._exit(3)  # no clean shutdown of TensorFlow's server, as in a crash
            if self.calls == 2:
                during.extend(np.asarray(v) for v in model.layers[1].non_trainable_variables)
                open(started, "w").close()
                fault.append(time.monotonic())
            return self.sums.all_sum_array(values)

    tf_backend.recalibration_processes = FaultAtSecondSum
    error = ""
    try:
        with _scope(strategy):
            batches = _batches_of([recalibration_shards()[index]])
            keras_bn.recalibrate(model, batches, progress=False, synchronized=True)
    except tf.errors.OpError as raised:  # another error fails the worker, its log says where
        error = f"{type(raised).__name__}: {raised}"
    after_fault = time.monotonic() - fault[0]
    print(f"recalibrate ended {after_fault:.2f} s after the fault: {error or 'returned'}")
    weights = [np.asarray(v) for v in model.non_trainable_variables]
    during = np.concatenate(during)
    np.savez(out_path, *weights, during=during, error=error, after_fault=after_fault)


def training_step(strategy, model, optimizer):
    """A tf.function taking one SGD step on a global batch (x, y); replica i trains on the
    i-th contiguous slice of it. strategy None means one process, no strategy."""

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            # Sum over this replica's examples / global batch: the replicas' gradients add up
            # (the optimizer all-reduces them) to the global batch's mean-loss gradient.
            loss = tf.reduce_sum(tf.square(model(x, training=True) - y)) / GLOBAL_BATCH
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def step(x, y):
        if strategy is None:
            return replica_step(x, y)
        per = GLOBAL_BATCH // strategy.num_replicas_in_sync

        def shard(context):
            i = context.replica_id_in_sync_group
            return x[i * per : (i + 1) * per], y[i * per : (i + 1) * per]

        return strategy.run(
            replica_step, args=strategy.experimental_distribute_values_from_function(shard)
        )

    return lambda x, y: step(tf.constant(x), tf.constant(y))


def _scope(strategy):
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def train(strategy, init_path):
    """Train from the weights in init_path; strategy None means one process, no strategy."""
    with _scope(strategy):
        model = build_model()
        load_weights(model, init_path)
        optimizer = keras.optimizers.SGD(0.1)
    step = training_step(strategy, model, optimizer)
    for x, y in batches():
        step(x, y)
    return [v.numpy() for v in model.weights]


def wait_to_be_killed():
    time.sleep(3600)


def train_with_backup(
    strategy,
    init_path,
    backup_dir,
    log_path,
    stop_at=None,
    stop=wait_to_be_killed,
    save_freq="epoch",
):
    """FIT_EPOCHS epochs of FIT_STEPS global batches with
    BackupAndRestore(backup_dir, save_freq), resuming from its backup if there is one. After
    each batch it appends "epoch batch" to log_path; after batch `stop_at` (epoch, batch) it
    calls `stop`. strategy None means one process, no strategy.

    The loop calls the callbacks as `model.fit` does. It is not `fit` itself because Keras
    3.15's `fit` fails under MultiWorkerMirroredStrategy with more than one worker: it reduces
    the first distributed batch, a tuple, in one `strategy.reduce` call, which the collective
    ops reject (keras-team/keras#20585). The data order is deterministic: every epoch, every
    run, the same fixed global batches in the same order, and each replica takes the same
    slice of each (training_step).
    """
    with _scope(strategy):
        model = build_model(cumulative=True)
        load_weights(model, init_path)
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
        model.optimizer.build(model.trainable_variables)  # as fit does, in the scope
    step = training_step(strategy, model, model.optimizer)
    callbacks = keras.callbacks.CallbackList(
        [
            keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq),
            _Progress(log_path, stop_at, stop),
        ],
        model=model,
    )
    callbacks.on_train_begin()  # restores the backup; fit starts from the epoch it sets:
    for epoch in range(model._initial_epoch or 0, FIT_EPOCHS):
        callbacks.on_epoch_begin(epoch)
        for batch, (x, y) in enumerate(batches(FIT_STEPS, seed=11)):
            callbacks.on_train_batch_begin(batch)
            step(x, y)
            callbacks.on_train_batch_end(batch)
        callbacks.on_epoch_end(epoch)
    callbacks.on_train_end()
    return [v.numpy() for v in model.weights]


class _Progress(keras.callbacks.Callback):
    """Appends "epoch batch" to a log after every batch; calls `stop` after batch `stop_at`."""

    def __init__(self, path, stop_at, stop):
        super().__init__()
        self.path, self.stop_at, self.stop, self.epoch = path, stop_at, stop, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        with open(self.path, "a") as log:
            log.write(f"{self.epoch} {batch}\n")
        if (self.epoch, batch) == self.stop_at:
            self.stop()


def _save(weights, out_path):
    tmp = out_path + ".tmp.npz"
    np.savez(tmp, *weights)
    os.replace(tmp, out_path)


# --------------------------------------------------------------------------- the launcher


class PortTaken(RuntimeError):
    """A worker could not bind its port: another process took it after it was picked."""


class Cluster:
    """Worker processes of this script on 127.0.0.1, one per argument list, on free ports.

    A context manager: on exit it SIGKILLs every worker still running, so a failing test
    leaves no process behind (nor does a killed test process: see _die_with_parent). Each
    worker's output goes to LOG_DIR/NAME-worker{i}.log.
    """

    def __init__(self, worker_args, log_dir, name):
        self.worker_args, self.name = worker_args, name
        self.logs = [
            os.path.join(log_dir, f"{name}-worker{i}.log") for i in range(len(worker_args))
        ]
        self.procs = []

    def __enter__(self):
        cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(len(self.worker_args))]}
        for index, (args, log) in enumerate(zip(self.worker_args, self.logs)):
            env = {
                **os.environ,
                "TF_CPP_MIN_LOG_LEVEL": "2",
                "CUDA_VISIBLE_DEVICES": "",
                "TF_CONFIG": json.dumps(
                    {"cluster": cluster, "task": {"type": "worker", "index": index}}
                ),
                _PARENT: str(os.getpid()),
            }
            with open(log, "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, os.path.abspath(__file__), *args],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        return self

    def __exit__(self, *exc):
        for index in range(len(self.procs)):
            self.kill(index)

    def kill(self, index):
        """SIGKILL worker `index` (if still running) and reap it."""
        proc = self.procs[index]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def check_running(self):
        """Raise (PortTaken, or AssertionError with its output) if any worker has exited."""
        for index, proc in enumerate(self.procs):
            if proc.poll() is not None:
                self._fail(index, f"exited with code {proc.returncode}")

    def wait(self, timeout, exit_codes=None):
        """Wait for every worker to exit; raise unless each exited with its code in
        `exit_codes` (None: all 0)."""
        deadline = time.monotonic() + timeout
        for index, proc in enumerate(self.procs):
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self._fail(index, f"still running after {timeout} s")
            if proc.returncode != (exit_codes[index] if exit_codes else 0):
                self._fail(index, f"exited with code {proc.returncode}")

    def _fail(self, index, what):
        with open(self.logs[index]) as log:
            output = log.read()
        if "Could not start gRPC server" in output:
            raise PortTaken(f"{self.name} worker {index}: {output[-500:]}")
        raise AssertionError(f"{self.name} worker {index} {what}:\n{output[-3000:]}")


_PARENT = "KERAS_BN_TEST_PARENT_PID"


def _die_with_parent():
    """In a worker started by Cluster, on Linux: be SIGKILLed when the test process dies,
    even if it is killed itself and never reaches Cluster.__exit__."""
    parent = os.environ.get(_PARENT)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # it died before the line above
        print("the test process that started this worker is gone", flush=True)
        os._exit(1)  # not sys.exit: TensorFlow's threads can hold up a normal exit


def run_cluster(worker_args, log_dir, name, timeout, attempts=3, exit_codes=None):
    """Start the workers and wait for them to finish (Cluster.wait), on fresh ports again if
    one was taken."""
    for attempt in range(attempts):
        try:
            with Cluster(worker_args, log_dir, name) as cluster:
                cluster.wait(timeout, exit_codes)
                return
        except PortTaken:
            if attempt == attempts - 1:
                raise


def _free_ports(n):
    """n ports that are free now (the OS picks them); a worker that loses one to another
    process raises PortTaken, and run_cluster retries."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("", 0))  # every interface, as the workers' gRPC servers bind
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def main():
    _die_with_parent()
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["loop", "backup", "recalibrate"])
    parser.add_argument("init")
    parser.add_argument("out")
    parser.add_argument("backup_dir", nargs="?")
    parser.add_argument("log", nargs="?")
    parser.add_argument("--hang-at", type=lambda s: tuple(int(v) for v in s.split(":")))
    parser.add_argument("--die", type=int)
    args = parser.parse_args()
    keras.config.disable_traceback_filtering()  # a failing worker's log shows where
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    if args.mode == "loop":
        weights = train(strategy, args.init)
    elif args.mode == "recalibrate":
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        if args.die is not None:
            started = f"{args.init}.started"
            recalibrated_while_one_dies(strategy, args.init, index, args.die, started, args.out)
            return
        weights = recalibrated(strategy, args.init, [recalibration_shards()[index]])
    else:
        weights = train_with_backup(strategy, args.init, args.backup_dir, args.log, args.hang_at)
    _save(weights, args.out)


if __name__ == "__main__":
    main()

"""One process of tests/test_jax_multiprocess.py, and the one-process reference it compares
with: keras_bn under jax.distributed (two CPU processes on 127.0.0.1, gloo collectives), no
TensorFlow.

    KERAS_BACKEND=jax python jax_multiprocess_worker.py PROCESS NUM_PROCESSES PORT DATA.npz OUT.npz
        [--die RANK HEARTBEAT_S | --skip RANK HEARTBEAT_S]

With NUM_PROCESSES 1 no distributed system starts: the same calls on the global data are the
reference. Each process has LOCAL_DEVICES CPU devices.
DATA.npz with `x`, `y` (the global batches, stacked) trains: a small model with one
`synchronized=False` and one `synchronized=True` BN, `model.fit` (jit, SGD, no shuffling) under
`keras.distribution.DataParallel(devices=jax.devices())` over every process's devices, each
process passing `fit` its own rows of every global batch (Keras makes the global batch with
jax.make_array_from_process_local_data); with NUM_PROCESSES 1, `fit` on the global batches
without a distribution. Every variable (the moving statistics included) goes to OUT.npz.
DATA.npz with `shard0`, `shard1`, ... recalibrates: the model (random weights) through
`keras_bn.recalibrate(..., synchronized=True)` on this process's shard in batches of 8 (its last
one shorter); with NUM_PROCESSES 1, on every shard's batches in order. Its moving statistics go
to OUT.npz, and under jax.distributed `all_sum` too: `recalibration_processes().all_sum_array`
of `probe(PROCESS)`.
With `--die RANK HEARTBEAT_S` (a fault), process RANK exits once the others have started
`recalibrate` on DATA.npz's shards, having made no collective call (with `connected` in
DATA.npz: one, `sync_global_devices`, before); the others record what their `recalibrate` does
(`recalibrated_while_one_dies`). jax.distributed's coordination service declares a process
dead after HEARTBEAT_S seconds without its heartbeats (JAX's default: 100).
With `--skip RANK HEARTBEAT_S`, process RANK skips the call instead: alive, it sleeps
SKIPPER_ALIVE_S seconds once the others have started it, then exits (code 0) without it.
"""

import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("KERAS_BN_NO_TENSORFLOW", "1")

import jax

LOCAL_DEVICES = 2
# Only catch a hang (a peer that never came, or died): JAX then raises and the process exits.
TIMEOUT_S = 60
# How long --skip's process stays alive after the others started the call it skips.
SKIPPER_ALIVE_S = 6

# Before anything runs on a device: the CPU client is made once, with these.
jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
jax.config.update("jax_cpu_collectives_implementation", "gloo")  # JAX's default; said anyway

import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import keras_bn  # noqa: E402
import keras_bn.backend  # noqa: E402

L = keras.layers
FEATURES = 5


def build_model():
    """BN (synchronized=False) on the input, Dense, ReLU, BN (synchronized=True), Dense."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras_bn.BatchNormalization(momentum=0.5, name="unsynchronized"),
            L.Dense(4, name="hidden"),
            L.ReLU(),
            keras_bn.BatchNormalization(momentum=0.5, synchronized=True, name="synchronized"),
            L.Dense(1, name="out"),
        ]
    )


def values(model, names=None):
    """Each variable (those whose path has one of `names`, else all) as this process's numpy
    copy: a replicated global array's local shard."""
    found = {}
    for variable in model.variables:
        if names is None or any(name in variable.path for name in names):
            value = variable.value
            if isinstance(value, jax.Array) and not value.is_fully_addressable:
                value = value.addressable_shards[0].data
            found[variable.path] = np.asarray(value)
    return found


def train(data, process, processes):
    """`model.fit` on this process's rows of every global batch under DataParallel over every
    process's devices (with one process: on the global batches, no distribution)."""
    x, y = data["x"], data["y"]  # (steps, global batch, ...)
    share = x.shape[1] // processes
    rows = slice(process * share, (process + 1) * share)
    if processes > 1:
        # Each process already holds its rows (no tf.data to shard): Keras asks for this.
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices(), auto_shard_dataset=False)
        )
    model = build_model()
    model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=True)
    local_x = x[:, rows].reshape(-1, *x.shape[2:])
    local_y = y[:, rows].reshape(-1, *y.shape[2:])
    model.fit(local_x, local_y, batch_size=share, epochs=1, shuffle=False, verbose=0)
    return values(model)


def recalibrated(data, process, processes):
    """`recalibrate(synchronized=True)` on this process's shard (with one process: on every
    shard's batches, in order), in batches of 8."""
    shards = [data[name] for name in sorted(data.files) if name.startswith("shard")]
    mine = [shards[process]] if processes > 1 else shards
    batches = [b for a in mine for b in np.array_split(a, range(8, len(a), 8))]
    model = build_model()
    keras_bn.recalibrate(model, batches, progress=False, synchronized=True)
    found = values(model, ["moving"])
    processes_found = keras_bn.backend.get().recalibration_processes()
    if processes_found is not None:  # float64 that float32 would round: exact sums or not
        found["all_sum"] = processes_found.all_sum_array(probe(process))
    return found


def recalibrated_while_one_dies(data, process, dying, started, out_path, skips=False):
    """--die DYING: with `connected` in DATA.npz, first one collective (gloo connects a
    process's peers at its first collective, not at jax.distributed.initialize). Then process
    DYING waits for the file `started` and exits (code 3; with `skips`, it sleeps
    SKIPPER_ALIVE_S seconds first and exits with code 0); every other one creates `started`
    and runs `recalibrate(synchronized=True)` on its shard, and, once it raises or returns,
    writes its moving statistics, `error` (the message; "" if it returned) and `seconds`
    (how long the call took) to OUT.npz."""
    if "connected" in data.files:
        multihost_utils.sync_global_devices("connected")
    if process == dying:  # dies once the others are in recalibrate, not still building
        deadline = time.monotonic() + TIMEOUT_S
        while not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        if skips:
            time.sleep(SKIPPER_ALIVE_S)
        os._exit(0 if skips else 3)
    shard = data[f"shard{process}"]
    batches = np.array_split(shard, range(8, len(shard), 8))
    model = build_model()
    open(started, "w").close()
    start, error = time.monotonic(), ""
    try:
        keras_bn.recalibrate(model, batches, progress=False, synchronized=True)
    except RuntimeError as raised:  # jax.errors.JaxRuntimeError
        error = str(raised)
    seconds = time.monotonic() - start
    np.savez(out_path, **values(model, ["moving"]), error=error, seconds=seconds)


def probe(process):
    """Values of this process whose float32 roundings differ from them (2⁴⁰ + 1, 1/3, 1e-300)."""
    return np.array([2.0**40 + 1 + process, (process + 1) / 3, 1e-300 * (process + 1)])


def main(
    process, processes, port, data_path, out_path, dies=None, heartbeat_s=TIMEOUT_S, skips=False
):
    if processes > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=processes,
            process_id=process,
            initialization_timeout=TIMEOUT_S,
            heartbeat_timeout_seconds=heartbeat_s,
            shutdown_timeout_seconds=TIMEOUT_S,
        )
        assert jax.process_count() == processes
        # Makes the CPU client, which waits for every process's devices: all have joined.
        assert len(jax.devices()) == processes * LOCAL_DEVICES
    data = np.load(data_path)
    if dies is not None:
        recalibrated_while_one_dies(data, process, dies, f"{data_path}.started", out_path, skips)
        return
    found = (recalibrated if "shard0" in data.files else train)(data, process, processes)
    np.savez(out_path, **found)
    if processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    process, processes, port = (int(v) for v in sys.argv[1:4])
    if sys.argv[6:7] in (["--die"], ["--skip"]):
        fault = int(sys.argv[7]), int(sys.argv[8]), sys.argv[6] == "--skip"
        main(process, processes, port, *sys.argv[4:6], *fault)
    else:
        main(process, processes, port, *sys.argv[4:6])

"""One process of tests/test_torch_distributed.py, and the one-process reference it compares
with: synchronized BN under torch.distributed (gloo on 127.0.0.1), no TensorFlow.

    KERAS_BACKEND=torch python torch_distributed_worker.py RANK WORLD PORT DATA.npz OUT.npz
        [DATA.npz OUT.npz ...] [--die RANK | --skip RANK]

Each (DATA.npz, OUT.npz) pair is a job, run in order in one process group: the tests that
need two processes share one pair of them (a fresh process each is the point only where one
dies or skips). DATA.npz holds the global batches and each process's share (`splits`, the
first index of each process's rows); with `u`, γ and β in it, one synchronized BN alone
(`normalize`); with `shard0`, `shard1`, ... `recalibrate(..., synchronized=True)` of each
shard (`recalibrated`). `run` is one job; with WORLD 1 (no process group, or in the test's own
process) it is the reference on the global batch.
`train` runs the custom training loop docs/guide/distributed.md shows: a small CNN with three
synchronized BNs (one on a residual branch), the loss summed over the samples, each gradient
summed over the processes (all_reduce) and an SGD step. Every variable (the moving statistics
included) goes to OUT.npz. With --die RANK that process exits after joining the group, before its
first step; the others record the error their step raises and keep their variables (OUT.npz
then holds `error` and the moving statistics), in training or in `recalibrate` (with
`shard0`, ...). With `subclassed` too, a subclassed model's recalibrate, whose error goes to
OUT.npz. With --skip RANK that process stays alive without calling: the others' calls
raise after KERAS_BN_TEST_COLLECTIVE_TIMEOUT_S (default 60) seconds.
"""

import datetime
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch
import torch.distributed as dist

import keras_bn

L = keras.layers
LEARNING_RATE = 0.05
# Only catches a hang (a peer that died or skipped a call): the collectives wait this long,
# then raise.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("KERAS_BN_TEST_COLLECTIVE_TIMEOUT_S", "60"))


def build_model():
    """Conv–BN–ReLU, a 1×1 Conv–BN residual branch added back, GAP, Dense–BN, Dense."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = L.ReLU()(
        keras_bn.BatchNormalization(synchronized=True, momentum=0.5)(
            L.Conv2D(4, 3, padding="same")(inputs)
        )
    )
    branch = keras_bn.BatchNormalization(synchronized=True, momentum=0.5)(L.Conv2D(4, 1)(h))
    h = L.GlobalAveragePooling2D()(L.Add()([h, branch]))
    h = keras_bn.BatchNormalization(synchronized=True, momentum=0.5)(L.Dense(6)(h))
    return keras.Model(inputs, L.Dense(3)(h))


def train(model, batches):
    """SGD on sum-of-squares losses, one step per (x, y) batch: the gradients summed over the
    processes where a process group runs. Returns every variable's value."""
    loss_fn = keras.losses.MeanSquaredError(reduction="sum")
    for x, y in batches:
        loss = loss_fn(torch.as_tensor(y), model(torch.as_tensor(x), training=True))
        loss.backward()
        for variable in model.trainable_variables:
            gradient = variable.value.grad
            if dist.is_initialized():
                dist.all_reduce(gradient, op=dist.ReduceOp.SUM)
            with torch.no_grad():
                variable.assign(variable.value - LEARNING_RATE * gradient)
            variable.value.grad = None
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in model.variables]


def normalize(layer_data, rank, world):
    """One synchronized BN (momentum 0.5) in training on this process's rows of x, the loss
    Σ y·u: (y, ∂/∂x, ∂/∂γ, ∂/∂β, moving mean, moving variance), as float64 arrays. With
    `mode` "compiled", the call under torch.compile; with "penalty", the message of the error
    that ∂l/∂x with create_graph=True raises."""
    starts = [*layer_data["splits"], len(layer_data["x"])]
    rows = slice(starts[rank], starts[rank + 1]) if world > 1 else slice(None)
    x = torch.tensor(layer_data["x"][rows], requires_grad=True)
    layer = keras_bn.BatchNormalization(synchronized=True, momentum=0.5)
    layer.build(layer_data["x"].shape)
    layer.gamma.assign(layer_data["gamma"])
    layer.beta.assign(layer_data["beta"])
    mode = str(layer_data["mode"]) if "mode" in layer_data.files else "eager"
    call = lambda t: layer(t, training=True)  # noqa: E731
    y = (torch.compile(call) if mode == "compiled" else call)(x)
    loss = torch.sum(y * torch.as_tensor(layer_data["u"][rows]))
    if mode == "penalty":  # a gradient penalty: the backward differentiated again
        try:
            torch.autograd.grad(loss, x, create_graph=True)
        except RuntimeError as error:
            return str(error)
        return "no error"
    loss.backward()
    found = (y, x.grad, layer.gamma.value.grad, layer.beta.value.grad)
    found += (layer.moving_mean.value, layer.moving_variance.value)
    return [t.detach().numpy().astype(np.float64) for t in found]


def recalibrated(data, rank, world):
    """The CNN (random weights) and its QAT copy (ranges set by one training call on the
    first batch of every share), recalibrated on this process's batches with
    synchronized=True; with WORLD 1, on every process's batches in one. Their moving
    statistics, in order, each model's followed by its report's batch count."""
    shards = [data[name] for name in sorted(data.files) if name.startswith("shard")]
    mine = shards[rank] if world > 1 else np.concatenate(shards)
    model = build_model()
    qat = keras_bn.quantize.quantize_model(build_model())
    qat(torch.as_tensor(np.concatenate([shard[:4] for shard in shards])), training=True)

    def batches(arrays):  # each shard in batches of 8, its last one shorter
        return [a[i : i + 8] for a in arrays for i in range(0, len(a), 8)]

    found = []
    for net in (model, qat):
        shard_batches = batches([mine] if world > 1 else shards)
        report = keras_bn.recalibrate(net, shard_batches, progress=False, synchronized=True)
        found += [
            np.asarray(keras.ops.convert_to_numpy(v)) for v in net.variables if "moving" in v.path
        ]
        found.append(np.array([report.batches]))
    return found


class Subclassed(keras.Model):
    """`build_model()` inside a subclassed model: no layer graph, so recalibrate's per-layer
    method."""

    def __init__(self):
        super().__init__()
        self.inner = build_model()

    def call(self, x, training=False):
        return self.inner(x, training=training)


def subclassed_error(data, rank):
    """`recalibrate(synchronized=True)` of a subclassed model on this process's shard: the
    ValueError's message, or "" if it returned."""
    model = Subclassed()
    model(np.zeros((1, 8, 8, 3), "float32"))
    shard = data[f"shard{rank}"]
    try:
        keras_bn.recalibrate(
            model, [shard[i : i + 8] for i in range(0, len(shard), 8)], synchronized=True
        )
    except ValueError as error:
        return str(error)
    return ""


def shares(data, rank):
    """Each global batch's rows of this process."""
    starts = list(data["splits"]) + [len(data["x"][0])]
    rows = slice(starts[rank], starts[rank + 1])
    return [(x[rows], y[rows]) for x, y in zip(data["x"], data["y"])]


def run(data, rank, world):
    """One job's arrays (or its error, as `error`) for OUT.npz."""
    if "u" in data.files:  # a layer alone
        found = normalize(data, rank, world)
        return {"error": found} if isinstance(found, str) else found
    if "subclassed" in data.files:
        return {"error": subclassed_error(data, rank)}
    if "shard0" in data.files:
        return recalibrated(data, rank, world)
    return train(
        build_model(), shares(data, rank) if world > 1 else list(zip(data["x"], data["y"]))
    )


def save(out_path, found):
    if isinstance(found, dict):
        np.savez(out_path, **found)
    else:
        np.savez(out_path, *found)


def fail(data, rank, dies, skips, out_path):
    """Process `dies` exits (or, `skips`, stays alive making no synchronized call) after
    joining the group; the others run the job's first synchronized step, and save the error
    it raises with their moving statistics."""
    model = build_model()
    if dies == rank:
        if skips:  # alive, but makes no synchronized call: the others time out
            time.sleep(COLLECTIVE_TIMEOUT_S + 3)
        os._exit(3)
    try:
        if "shard0" in data.files:
            batches = [data[f"shard{rank}"][i : i + 8] for i in range(0, 16, 8)]
            keras_bn.recalibrate(model, batches, progress=False, synchronized=True)
        else:
            train(model, shares(data, rank))
    except RuntimeError as error:
        moving = [
            np.asarray(keras.ops.convert_to_numpy(v)) for v in model.variables if "moving" in v.path
        ]
        np.savez(out_path, *moving, error=str(error))
    # Gloo's teardown of a group whose peer died can std::terminate at interpreter exit (seen
    # once in CI, after this process had raised and saved): exit without it.
    os._exit(0)


def main(rank, world, port, jobs, dies=None, skips=False):
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    for data_path, out_path in jobs:
        data = np.load(data_path)
        if dies is not None:
            fail(data, rank, dies, skips, out_path)
        save(out_path, run(data, rank, world))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, port = (int(v) for v in sys.argv[1:4])
    paths, option = sys.argv[4:], None
    if len(paths) > 2 and paths[-2] in ("--die", "--skip"):
        paths, option = paths[:-2], paths[-2:]
    jobs = list(zip(paths[::2], paths[1::2], strict=True))
    dies = int(option[1]) if option else None
    main(rank, world, port, jobs, dies=dies, skips=option is not None and option[0] == "--skip")

"""keras_bn under torch.distributed (gloo on 127.0.0.1, the PyTorch backend), at a real size:
keras.applications.ResNet50(weights=None) at 64×64 (53 BN layers), the same random weights in
every process, each process given only its share of the data. Two tasks (`--task`):

- `recalibrate`: `keras_bn.recalibrate(..., synchronized=True)` of 256 images in batches of 32,
  split evenly over 1, 2 and 4 processes: the time of the slowest process's call (the model
  built and the data loaded beforehand), which should fall with the number of processes where
  each has cores of its own.
- `train`: the train step of the custom loop docs/guide/distributed.md shows (forward,
  backward, each gradient all-reduced, an SGD step) on a global batch of 32 split over the
  processes, its BN layers keras_bn's with `synchronized=True` and with `synchronized=False`
  (each process's BN sees its share only): the median step time of the slowest process after
  warm-up steps, and so what synchronizing BN costs.

Each row is one run (a new group of processes each time; the cores are divided among the
processes with torch.set_num_threads), with the largest difference of any moving statistic
from the one-process run's (the train step's: after its first step), relative to the
statistic's scale (synchronized sums are pooled in float64; the rest is float32 arithmetic in
another order).

    python benchmarks/bench_distributed.py --task recalibrate \
        --json benchmarks/results/bench_distributed_recalibrate.json
    python benchmarks/bench_distributed.py --task train \
        --json benchmarks/results/bench_distributed_train.json
    python benchmarks/bench_distributed.py --task recalibrate --smoke   # and --task train

Where the machine has fewer cores than the largest group has processes, `--threads-each 1`
makes every process a one-core worker (the one-process run included), so that the scaling
shows up to the number of cores:

    python benchmarks/bench_distributed.py --task recalibrate --threads-each 1 --processes 1 2 \
        --json benchmarks/results/bench_distributed_recalibrate_one_core_each.json
"""

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

os.environ["KERAS_BACKEND"] = "torch"  # a torch.distributed benchmark

import keras
import numpy as np
import torch
import torch.distributed as dist
from _layer_bench import cpu_description

import keras_bn

BATCH = 32  # recalibrate's batches; the train step's global batch
WARMUP_STEPS, STEPS = 3, 10
LEARNING_RATE = 1e-4


def build(side, smoke):
    keras.utils.set_random_seed(0)
    if smoke:
        inputs = keras.Input((side, side, 3))
        x = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3)(inputs))
        x = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3)(keras.layers.ReLU()(x)))
        return keras.Model(inputs, x)
    return keras.applications.ResNet50(weights=None, input_shape=(side, side, 3), classes=10)


def worker(task, rank, world, port, data_path, out_path, threads, smoke, synchronized):
    """One process: its share of the task, timed; its times and statistics to OUT."""
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )
    images = np.load(data_path)
    shard = np.array_split(images, world)[rank]
    model = with_synchronized(build(images.shape[1], smoke), synchronized)
    if world > 1:
        dist.barrier()
    if task == "recalibrate":
        batches = [shard[i : i + BATCH] for i in range(0, len(shard), BATCH)]
        start = time.perf_counter()
        keras_bn.recalibrate(model, batches, progress=False, synchronized=True)
        seconds = [time.perf_counter() - start]
        moving = moving_statistics(model)
    else:
        # The same targets as one process's, split as the images are.
        targets = np.random.default_rng(1).normal(size=(len(images), *model.output_shape[1:]))
        share = (shard, np.array_split(targets.astype("f4"), world)[rank])
        seconds, moving = train_steps(model, share, world, WARMUP_STEPS if not smoke else 1)
    np.savez(out_path, *moving, seconds=np.array(seconds))
    if world > 1:
        dist.destroy_process_group()


def with_synchronized(model, synchronized):
    """`model` with keras_bn BN layers, all `synchronized` (its weights kept)."""
    converted = keras_bn.convert.from_keras(model)

    def clone(layer):
        config = layer.get_config()
        if isinstance(layer, keras_bn.BatchNormalization):
            config["synchronized"] = synchronized
        return layer.__class__.from_config(config)

    synchronized_model = keras.models.clone_model(converted, clone_function=clone)
    synchronized_model.set_weights(converted.get_weights())
    return synchronized_model


def moving_statistics(model):
    return [keras.ops.convert_to_numpy(v) for v in model.variables if "moving" in v.path]


def train_steps(model, share, world, warmup):
    """(seconds of each timed train step, the moving statistics after the first step) on this
    process's share (x, y) of the global batch (the same batch every step): a summed loss,
    each gradient all-reduced, SGD. After the first step, not the last: the steps after it
    amplify float32 rounding (the all-reduce adds in another order) into chaos."""
    x, y = (torch.as_tensor(a) for a in share)
    seconds, first = [], None
    for step in range(warmup + STEPS):
        start = time.perf_counter()
        loss = torch.sum(torch.square(model(x, training=True) - y))
        loss.backward()
        for variable in model.trainable_variables:
            gradient = variable.value.grad
            if world > 1:
                dist.all_reduce(gradient, op=dist.ReduceOp.SUM)
            with torch.no_grad():
                variable.assign(variable.value - LEARNING_RATE * gradient)
            variable.value.grad = None
        if step >= warmup:
            seconds.append(time.perf_counter() - start)
        if first is None:
            first = moving_statistics(model)
    return seconds, first


def run(task, world, data_path, folder, smoke, synchronized, threads):
    """(slowest process's seconds: its call, or its median step; the statistics of rank 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outputs = [os.path.join(folder, f"{world}_{rank}.npz") for rank in range(world)]
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--task", task, "--worker", str(rank), str(world)]
            + [str(port), data_path, outputs[rank], str(threads), str(int(synchronized))]
            + (["--smoke"] if smoke else [])
        )
        for rank in range(world)
    ]
    for process in processes:
        if process.wait(timeout=1800) != 0:
            raise SystemExit(f"a worker of {world} failed")
    results = [np.load(out) for out in outputs]
    statistics = [results[0][name] for name in results[0].files if name != "seconds"]
    return max(float(np.median(r["seconds"])) for r in results), statistics


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=["recalibrate", "train"], default="recalibrate")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--images", type=int, default=256, help="recalibrate's images")
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="a two-BN net, 1 and 2 processes")
    parser.add_argument(
        "--threads-each",
        type=int,
        help="each process's threads (default: the cores divided among the processes); 1 makes "
        "each process a one-core worker, so that a machine with few cores shows the scaling",
    )
    parser.add_argument("--json")
    parser.add_argument("--worker", nargs=7)
    args, _ = parser.parse_known_args()
    if args.worker:
        rank, world, port, data_path, out_path, threads, synchronized = args.worker
        worker(
            args.task,
            int(rank),
            int(world),
            port,
            data_path,
            out_path,
            int(threads),
            args.smoke,
            bool(int(synchronized)),
        )
        return
    if args.smoke:
        args.processes, args.images, args.side = [1, 2], 64, 16
    images = BATCH if args.task == "train" else args.images
    # The train step: both kinds of BN on more than one process (on one they are the same).
    runs = [
        (world, synchronized)
        for world in args.processes
        for synchronized in ((True,) if args.task == "recalibrate" or world == 1 else (True, False))
    ]
    machine = (
        f"{cpu_description()}; PyTorch {torch.__version__}, Keras {keras.__version__}, "
        f"Python {platform.python_version()}"
    )
    print(f"# machine: {machine}")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        data_path = os.path.join(folder, "images.npy")
        rng = np.random.default_rng(0)
        np.save(data_path, rng.normal(size=(images, args.side, args.side, 3)).astype("f4"))
        reference = None
        for world, synchronized in runs:
            threads = args.threads_each or max(1, (os.cpu_count() or 1) // world)
            seconds, found = run(
                args.task, world, data_path, folder, args.smoke, synchronized, threads
            )
            if reference is None:
                reference = found
            off = max(
                float(np.max(np.abs(f - r)) / max(1.0, float(np.max(np.abs(r)))))
                for f, r in zip(found, reference)
            )
            rows.append(
                {
                    "processes": world,
                    "threads_each": threads,
                    "synchronized": synchronized,
                    "images_each": images // world,
                    "seconds": seconds,
                    "speedup": rows[0]["seconds"] / seconds if rows else 1.0,
                    "max_rel_off": off,
                }
            )
    model = "a two-BN net" if args.smoke else "ResNet50(weights=None)"
    if args.task == "recalibrate":
        print(f"\n{model} at {args.side}×{args.side}, {images} images in batches of {BATCH}\n")
        print(
            "| processes | threads each | images each | recalibrate s | speedup | "
            "max rel. diff to 1 process |"
        )
        print("|---|---|---|---|---|---|")
        for row in rows:
            print(
                f"| {row['processes']} | {row['threads_each']} | {row['images_each']} | "
                f"{row['seconds']:.1f} | "
                f"{row['speedup']:.2f}× | {row['max_rel_off']:.1e} |"
            )
    else:
        print(
            f"\n{model} at {args.side}×{args.side}, a global batch of {images}; median of "
            f"{STEPS} steps after {WARMUP_STEPS if not args.smoke else 1}\n"
        )
        print(
            "| processes | BN | images each | train step ms | speedup | max rel. diff of the "
            "moving statistics to 1 process's, after the first step |"
        )
        print("|---|---|---|---|---|---|")
        for row in rows:
            kind = "synchronized" if row["synchronized"] else "per process"
            print(
                f"| {row['processes']} | {kind} | {row['images_each']} | "
                f"{1e3 * row['seconds']:.0f} | {row['speedup']:.2f}× | {row['max_rel_off']:.1e} |"
            )
    if args.json:
        record = {
            "command": " ".join(["python", *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": machine,
            "task": args.task,
            "model": model,
            "side": args.side,
            "images": images,
            "batch_size": BATCH,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()

"""`keras_bn.recalibrate(..., synchronized=True)` across 1, 2 and 4 processes under
torch.distributed (gloo on 127.0.0.1, the PyTorch backend): each process reads only its shard
of the data, so the wall time should fall with the number of processes where each has cores of
its own. keras.applications.ResNet50(weights=None) at 64×64 (53 BN layers), the same random
weights in every process, 256 images in batches of 32, split evenly.

Each row is one run per process count (a new group of processes each time; the cores are
divided among the processes with torch.set_num_threads): the time of the slowest process's
`recalibrate` call (the model built and the data loaded beforehand), and the largest
difference of any moving statistic from the one-process run's, relative to the statistic's
scale (the sums are pooled in float64; the rest is float32 arithmetic in another order).

    python benchmarks/bench_recalibrate_distributed.py \
        --json benchmarks/results/bench_recalibrate_distributed.json
    python benchmarks/bench_recalibrate_distributed.py --smoke
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

BATCH = 32


def build(side, smoke):
    keras.utils.set_random_seed(0)
    if smoke:
        inputs = keras.Input((side, side, 3))
        x = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3)(inputs))
        x = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3)(keras.layers.ReLU()(x)))
        return keras.Model(inputs, x)
    return keras.applications.ResNet50(weights=None, input_shape=(side, side, 3), classes=10)


def worker(rank, world, port, data_path, out_path, threads, smoke):
    """One process: recalibrate its shard, synchronized; its time and statistics to OUT."""
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
    batches = [shard[i : i + BATCH] for i in range(0, len(shard), BATCH)]
    model = build(images.shape[1], smoke)
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    keras_bn.recalibrate(model, batches, progress=False, synchronized=True)
    seconds = time.perf_counter() - start
    moving = [keras.ops.convert_to_numpy(v) for v in model.variables if "moving" in v.path]
    np.savez(out_path, *moving, seconds=seconds)
    if world > 1:
        dist.destroy_process_group()


def run(world, data_path, folder, smoke):
    """(slowest process's seconds, the statistics of rank 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = max(1, (os.cpu_count() or 1) // world)
    outputs = [os.path.join(folder, f"{world}_{rank}.npz") for rank in range(world)]
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(rank), str(world), str(port), data_path]
            + [outputs[rank], str(threads)]
            + (["--smoke"] if smoke else [])
        )
        for rank in range(world)
    ]
    for process in processes:
        if process.wait(timeout=1800) != 0:
            raise SystemExit(f"a worker of {world} failed")
    results = [np.load(out) for out in outputs]
    statistics = [results[0][name] for name in results[0].files if name != "seconds"]
    return max(float(r["seconds"]) for r in results), statistics


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="a two-BN net, 1 and 2 processes")
    parser.add_argument("--json")
    parser.add_argument("--worker", nargs=6)
    args, _ = parser.parse_known_args()
    if args.worker:
        rank, world, port, data_path, out_path, threads = args.worker
        worker(int(rank), int(world), port, data_path, out_path, int(threads), args.smoke)
        return
    if args.smoke:
        args.processes, args.images, args.side = [1, 2], 64, 16
    machine = (
        f"{cpu_description()}; PyTorch {torch.__version__}, Keras {keras.__version__}, "
        f"Python {platform.python_version()}"
    )
    print(f"# machine: {machine}")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        data_path = os.path.join(folder, "images.npy")
        rng = np.random.default_rng(0)
        np.save(data_path, rng.normal(size=(args.images, args.side, args.side, 3)).astype("f4"))
        reference = None
        for world in args.processes:
            seconds, found = run(world, data_path, folder, args.smoke)
            if reference is None:
                reference = found
            off = max(
                float(np.max(np.abs(f - r)) / max(1.0, float(np.max(np.abs(r)))))
                for f, r in zip(found, reference)
            )
            rows.append(
                {
                    "processes": world,
                    "images_each": args.images // world,
                    "seconds": seconds,
                    "speedup": rows[0]["seconds"] / seconds if rows else 1.0,
                    "max_rel_off": off,
                }
            )
    model = "a two-BN net" if args.smoke else "ResNet50(weights=None)"
    print(f"\n{model} at {args.side}×{args.side}, {args.images} images in batches of {BATCH}\n")
    print("| processes | images each | recalibrate s | speedup | max rel. diff to 1 process |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['processes']} | {row['images_each']} | {row['seconds']:.1f} | "
            f"{row['speedup']:.2f}× | {row['max_rel_off']:.1e} |"
        )
    if args.json:
        record = {
            "command": " ".join(["python", *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": machine,
            "model": model,
            "side": args.side,
            "images": args.images,
            "batch_size": BATCH,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()

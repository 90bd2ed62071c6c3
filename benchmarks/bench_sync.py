"""The cost of synchronized=True: a BN train step on 2 logical CPU replicas
(MirroredStrategy), synchronized against per-replica statistics, timed interleaved; medians.

    python benchmarks/bench_sync.py            # full run
    python benchmarks/bench_sync.py --smoke    # tiny shapes, one repetition: CI's check
"""

import argparse
import os
import statistics
import sys
import time

import _tf_env  # noqa: F401  (before TensorFlow: its environment)
import tensorflow as tf

# Before anything initialises TensorFlow's devices.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import numpy as np  # noqa: E402

import keras_bn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import machine_description  # noqa: E402

SHAPES = [("NHWC 64x32x32x64", (64, 32, 32, 64), -1), ("1024x1024", (1024, 1024), -1)]
SMOKE_SHAPES = [("NHWC 8x4x4x8", (8, 4, 4, 8), -1)]


def train_step(strategy, shape, axis, synchronized):
    per_replica = (shape[0] // strategy.num_replicas_in_sync,) + shape[1:]
    with strategy.scope():
        layer = keras_bn.BatchNormalization(axis=axis, synchronized=synchronized)
        layer.build(per_replica)

    def replica_step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.square(layer(x, training=True)))
        return tape.gradient(loss, [x] + layer.trainable_weights)

    return tf.function(lambda x: strategy.run(replica_step, args=(x,)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    shapes, reps = (SMOKE_SHAPES, 1) if args.smoke else (SHAPES, args.reps)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    print(f"machine: {machine_description()}")
    print("2 logical CPU replicas (MirroredStrategy); global batch split in two; medians\n")
    print(
        "| global shape | synchronized=False ms | synchronized=True ms | overhead |\n"
        "|---|---|---|---|"
    )
    for label, shape, axis in shapes:
        x = np.random.default_rng(0).normal(1.0, 2.0, shape).astype("float32")
        dist = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors(x).unbatch().batch(shape[0])
        )
        batch = next(iter(dist))
        steps = {s: train_step(strategy, shape, axis, s) for s in (False, True)}
        for step in steps.values():  # trace and warm up
            for _ in range(2):
                tf.nest.map_structure(
                    lambda t: t.numpy(), strategy.experimental_local_results(step(batch))
                )
        samples = {s: [] for s in steps}
        for _ in range(reps):
            for s, step in steps.items():
                start = time.perf_counter()
                tf.nest.map_structure(
                    lambda t: t.numpy(), strategy.experimental_local_results(step(batch))
                )
                samples[s].append(time.perf_counter() - start)
        off, on = (statistics.median(samples[s]) for s in (False, True))
        print(f"| {label} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

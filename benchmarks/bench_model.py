"""Whole-model speed and memory: a small ResNet (8 conv–BN–ReLU blocks after a stem) trained on
synthetic 32×32×3 batches of 64, with keras_bn, with keras.layers.BatchNormalization and with no
BN at all (the floor), each compiled as a tf.function graph and with jit_compile=True (XLA).

Each variant and mode runs in its own process, so that its peak resident memory (RSS) is its
own; the processes alternate for several rounds and the table gives the median step time over
all steps of all rounds, and the median of the rounds' peak RSS. BN's share of a step is
(step − no-BN step) / step: what the BN layers cost in it.

    python benchmarks/bench_model.py            # full run
    python benchmarks/bench_model.py --smoke    # tiny model, one round: CI's check
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import _tf_env  # noqa: F401  (its environment, inherited by the workers)
from _layer_bench import build_resnet

# "none" is the same network with every BN replaced by an identity: the floor that shows how much
# of a step BN takes at all, and so the best ratio any BN could reach.
VARIANTS = ("keras_bn", "keras", "none")


def worker(variant, jit, image, batch, steps):
    """Time `steps` train steps of one variant in this process; print JSON."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import keras_bn

    norm = {
        "keras_bn": keras_bn.BatchNormalization,
        "keras": keras.layers.BatchNormalization,
        "none": keras.layers.Identity,
    }[variant]
    keras.utils.set_random_seed(0)
    model = build_resnet(norm, image=image)
    model.compile(
        keras.optimizers.SGD(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit,
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, image, image, 3)).astype("float32")
    y = rng.integers(0, 10, size=(batch,))
    for _ in range(3):  # trace and warm up
        model.train_on_batch(x, y)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"variant": variant, "times": times, "peak_rss_mb": peak_kib / 1024}))


def run(rounds, image, batch, steps):
    """{(variant, jit): (median step seconds, median peak RSS MB)}."""
    cases = [(variant, jit) for jit in (False, True) for variant in VARIANTS]
    results = {case: {"times": [], "peak": []} for case in cases}
    for _ in range(rounds):
        for variant, jit in cases:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    variant,
                    "--image",
                    str(image),
                    "--batch",
                    str(batch),
                    "--steps",
                    str(steps),
                ]
                + (["--jit"] if jit else []),
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            record = json.loads(out.strip().splitlines()[-1])
            results[variant, jit]["times"] += record["times"]
            results[variant, jit]["peak"].append(record["peak_rss_mb"])
    return {
        case: (statistics.median(r["times"]), statistics.median(r["peak"]))
        for case, r in results.items()
    }


HEADER = (
    "| model | tf.function | keras_bn step ms | Keras BN step ms | no-BN step ms "
    "| keras_bn / Keras | BN share of the keras_bn step | BN share of the Keras step "
    "| share keras_bn / Keras | keras_bn peak RSS MB | Keras BN peak RSS MB "
    "| no-BN peak RSS MB |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


SHARE_TARGET = 0.5


def bn_shares(results, jit):
    """BN's share of the keras_bn step and of the Keras step: (step − no-BN step) / step."""
    none_t = results["none", jit][0]
    return tuple(1 - none_t / results[variant, jit][0] for variant in ("keras_bn", "keras"))


def share_ratio(results, jit):
    ours, theirs = bn_shares(results, jit)
    return ours / theirs


def format_row(results, jit):
    (ours_t, ours_m), (theirs_t, theirs_m), (none_t, none_m) = (
        results[variant, jit] for variant in VARIANTS
    )
    ours_share, theirs_share = bn_shares(results, jit)
    return (
        f"| small ResNet | {'XLA' if jit else 'graph'} | {ours_t * 1e3:.1f} | "
        f"{theirs_t * 1e3:.1f} | {none_t * 1e3:.1f} | {ours_t / theirs_t:.2f} | "
        f"{ours_share:.0%} | {theirs_share:.0%} | {ours_share / theirs_share:.2f} | "
        f"{ours_m:.0f} | {theirs_m:.0f} | {none_m:.0f} |"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--jit", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.jit, args.image, args.batch, args.steps)
        return 0
    if args.smoke:
        args.rounds, args.steps, args.image, args.batch = 1, 1, 8, 4
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_layer import machine_description

    print(f"machine: {machine_description()}")
    print(
        f"small ResNet, {args.image}x{args.image}x3, batch {args.batch}, "
        f"{args.rounds} rounds x {args.steps} steps; medians\n"
    )
    results = run(args.rounds, args.image, args.batch, args.steps)
    print(HEADER)
    for jit in (False, True):
        print(format_row(results, jit))
    share = share_ratio(results, jit=True)
    print(
        f"\ntarget: under XLA, BN's share of the step with keras_bn / with Keras BN = "
        f"{share:.2f} (≤ {SHARE_TARGET}: {'met' if share <= SHARE_TARGET else 'MISSED'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

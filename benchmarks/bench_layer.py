"""Per-layer speed: keras_bn.BatchNormalization against keras.layers.BatchNormalization and the
raw kernels, timed interleaved in one run; prints a table of medians.

Train step = forward, backward (to the input and the weights) and a sum-of-squares loss; the two
layers also update their moving statistics. The raw baseline for training is TensorFlow's
FusedBatchNormV3 with its registered gradient (FusedBatchNormGradV3); for inference it is
`x*a + b` on the same tensor. A second table checks the keras_bn / Keras BN targets (TARGETS)
on the same medians. A third table times the fused path's re-centring
(keras_bn/backend/tensorflow/fused.py: a tf.cond that re-runs the kernel on x minus the first
pass's per-channel mean when some channel's mean is far from zero) in the keras_bn train step:
as shipped (on this data the test says no), with the re-centring off (twice: the second is the
noise control), and with the re-run forced; each cost is the median over reps of the per-rep
ratio to the step without it.

    python benchmarks/bench_layer.py            # full table (a few minutes on 2 cores)
    python benchmarks/bench_layer.py --smoke    # tiny shapes, one repetition: CI's check
    python benchmarks/bench_layer.py --json benchmarks/results/bench_layer.json
                                                # also the rows as JSON (the docs' plot reads it)
    python benchmarks/bench_layer.py --device /GPU:0    # inputs and every contender on that
                                                # device (default: TensorFlow's placement)
    python benchmarks/bench_layer.py --recentring-only   # the third table alone
    python benchmarks/bench_layer.py --backend jax      # under JAX: bench_layer_jax.py's table
    python benchmarks/bench_layer.py --backend torch    # under PyTorch: bench_layer_torch.py's
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

import _tf_env  # noqa: F401  (before TensorFlow: its environment)
import keras
import numpy as np
import tensorflow as tf
from _layer_bench import (
    POLICIES,
    cpu_description,
    select_shapes,
    target_summary,
    time_samples,
    worst_row,
)

import keras_bn
from keras_bn.backend.tensorflow import fused
from keras_bn.export import atomic


def machine_description():
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")
    gpus = [
        tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name)
        for gpu in tf.config.list_physical_devices("GPU")
    ]
    return (
        f"{cpu_description()}; "
        + (f"GPU {', '.join(gpus)}; " if gpus else "")
        + f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"Python {platform.python_version()}; TF_ENABLE_ONEDNN_OPTS={onednn}"
    )


def _layer_train_step(layer, upstream_dtype):
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.square(tf.cast(y, upstream_dtype)))
        return tape.gradient(loss, [x] + layer.trainable_weights)

    return step


def _raw_fused_train_step(shape, axis, channels):
    scale = tf.Variable(tf.ones([channels]))
    offset = tf.Variable(tf.zeros([channels]))
    data_format = "NCHW" if axis == 1 else "NHWC"

    def view(x):  # the kernel wants 4D; a reshape is free
        if x.shape.rank == 4:
            return x
        if data_format == "NHWC":
            return tf.reshape(x, [-1, 1, 1, channels])
        return tf.reshape(x, [x.shape[0], channels, -1, 1])

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(
                view(x), scale, offset, epsilon=1e-3, data_format=data_format, is_training=True
            )
            loss = tf.reduce_sum(tf.square(tf.cast(y, tf.float32)))
        return tape.gradient(loss, [x, scale, offset])

    return step


def _raw_affine(shape, axis, channels, dtype):
    bshape = [1] * len(shape)
    bshape[axis] = channels
    a = tf.constant(np.random.default_rng(0).uniform(0.5, 1.5, bshape), dtype)
    b = tf.constant(np.random.default_rng(1).normal(size=bshape), dtype)
    return lambda x: x * a + b


def contenders(shape, axis, policy, mode):
    """{name: python function of x} for one row."""
    channels = shape[axis]
    ours = keras_bn.BatchNormalization(axis=axis, dtype=policy)
    theirs = keras.layers.BatchNormalization(axis=axis, dtype=policy)
    for layer in (ours, theirs):
        layer.build(shape)
    if mode == "train":
        return {
            "keras_bn": _layer_train_step(ours, tf.float32),
            "keras": _layer_train_step(theirs, tf.float32),
            "raw": _raw_fused_train_step(shape, axis, channels),
        }
    compute = keras.mixed_precision.Policy(policy).compute_dtype
    return {
        "keras_bn": lambda x: ours(x, training=False),
        "keras": lambda x: theirs(x, training=False),
        "raw": _raw_affine(shape, axis, channels, compute),
    }


def _traced_with_recentre_ratio(ratio, step):
    """`step`, to be traced with fused.RECENTRE_STDDEVS = ratio (read at trace time:
    None turns the re-centring off, 0 forces the subtraction)."""

    def traced(x):
        shipped = fused.RECENTRE_STDDEVS
        fused.RECENTRE_STDDEVS = ratio
        try:
            return step(x)
        finally:
            fused.RECENTRE_STDDEVS = shipped

    return traced


def recentring_contenders(shape, axis, policy):
    """{name: tf.function of x}: the keras_bn train step (graph; the fused path never runs
    under XLA) as shipped ("shipped"), without the re-centring ("off", and again as "off_again",
    the noise control), and with the subtraction forced ("forced")."""
    functions = {}
    for name, ratio in (
        ("shipped", fused.RECENTRE_STDDEVS),
        ("off", None),
        ("forced", 0.0),
        ("off_again", None),
    ):
        layer = keras_bn.BatchNormalization(axis=axis, dtype=policy)
        layer.build(shape)
        step = _layer_train_step(layer, tf.float32)
        functions[name] = tf.function(_traced_with_recentre_ratio(ratio, step))
    return functions


def run_recentring(shapes, reps, inner):
    """[(label, policy, medians, costs)]: the re-centring table's rows. A cost is the median
    over reps of (contender / off) − 1, each rep's contenders timed back to back, which a
    machine whose speed drifts between reps leaves alone."""
    rows = []
    for label, shape, axis in shapes:
        for policy in POLICIES:
            compute = keras.mixed_precision.Policy(policy).compute_dtype
            x = tf.constant(np.random.default_rng(0).normal(1.0, 2.0, shape), compute)
            samples = time_samples(
                recentring_contenders(shape, axis, policy), x, reps, inner, _wait
            )
            costs = {
                name: statistics.median(
                    t / off - 1 for t, off in zip(samples[name], samples["off"])
                )
                for name in ("shipped", "forced", "off_again")
            }
            medians = {name: statistics.median(s) for name, s in samples.items()}
            rows.append((label, policy, medians, costs))
            print(_format_recentring_row(rows[-1]), flush=True)
    return rows


RECENTRING_HEADER = (
    "| shape | policy | keras_bn train ms | re-centring off ms | test's cost "
    "| re-run's cost (forced) | off vs off (noise) |\n|---|---|---|---|---|---|---|"
)


def _format_recentring_row(row):
    label, policy, t, costs = row
    return (
        f"| {label} | {policy} | {t['shipped'] * 1e3:.2f} | {t['off'] * 1e3:.2f} | "
        f"{costs['shipped']:+.1%} | {costs['forced']:+.1%} | {costs['off_again']:+.1%} |"
    )


def _wait(out):
    """Blocks until a tf.function's outputs are computed."""
    tf.nest.map_structure(lambda t: t.numpy(), out)


def time_row(functions, x, reps, inner):
    """Median seconds per call for each function, the functions interleaved rep by rep."""
    samples = time_samples(functions, x, reps, inner, _wait)
    return {name: statistics.median(s) for name, s in samples.items()}


def run(shapes, reps, inner, jit_modes=(False, True)):
    """Time every row; the input (and so each contender's ops) on the current device."""
    rows = []
    for label, shape, axis in shapes:
        for policy in POLICIES:
            compute = keras.mixed_precision.Policy(policy).compute_dtype
            # An op's output, so that x lives on the current device (not host memory copied to
            # it at every call).
            x = tf.identity(tf.constant(np.random.default_rng(0).normal(1.0, 2.0, shape), compute))
            for mode in ("train", "inference"):
                for jit in jit_modes:
                    functions = {
                        name: tf.function(f, jit_compile=jit)
                        for name, f in contenders(shape, axis, policy, mode).items()
                    }
                    t = time_row(functions, x, reps, inner)
                    rows.append((label, policy, mode, "XLA" if jit else "graph", t))
                    print(_format_row(rows[-1]), flush=True)
    return rows


# keras_bn / Keras BN bounds, checked on this run's medians: (target, which rows, bound), the
# rows chosen by the input's rank, the step and the tf.function mode (both policies).
TARGETS = [
    (
        "XLA train step, 4D and sequence shapes",
        lambda rank, step, jit: jit == "XLA" and step == "train" and rank >= 3,
        0.8,
    ),
    (
        "XLA train step, 2D",
        lambda rank, step, jit: jit == "XLA" and step == "train" and rank == 2,
        1.0,
    ),
    ("XLA inference", lambda rank, step, jit: jit == "XLA" and step == "inference", 1.0),
]


def target_results(rows, ranks):
    """One dict per target: its bound, its worst row and keras_bn / Keras ratio, and met."""
    results = []
    for name, covers, bound in TARGETS:
        ratios = [
            (t["keras_bn"] / t["keras"], f"{label} {policy}")
            for label, policy, step, jit, t in rows
            if covers(ranks[label], step, jit)
        ]
        results += filter(None, [worst_row(name, bound, ratios)])
    return results


HEADER = (
    "| shape | policy | step | tf.function | keras_bn ms | Keras BN ms | raw ms "
    "| keras_bn / Keras | keras_bn / raw |\n|---|---|---|---|---|---|---|---|---|"
)


def _format_row(row):
    label, policy, mode, jit, t = row
    return (
        f"| {label} | {policy} | {mode} | {jit} | {t['keras_bn'] * 1e3:.2f} | "
        f"{t['keras'] * 1e3:.2f} | {t['raw'] * 1e3:.2f} | "
        f"{t['keras_bn'] / t['keras']:.2f} | {t['keras_bn'] / t['raw']:.2f} |"
    )


def write_json(path, rows, ranks, started, argv, device, recentring=()):
    """The run's rows (medians in ms), machine, command and UTC times as JSON at `path`,
    written atomically, so that an interrupted run leaves the old file."""
    record = {
        "command": "python benchmarks/bench_layer.py " + " ".join(argv),
        "machine": machine_description(),
        "device": device,
        "started_utc": started,
        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "rows": [
            {
                "shape": label,
                "policy": policy,
                "step": mode,
                "tf_function": jit,
                **{f"{name}_ms": round(t[name] * 1e3, 4) for name in t},
            }
            for label, policy, mode, jit, t in rows
        ],
        "targets": target_results(rows, ranks),
        "recentring": [
            {
                "shape": label,
                "policy": policy,
                **{f"{name}_ms": round(t[name] * 1e3, 4) for name in t},
                **{f"{name}_cost": round(cost, 4) for name, cost in costs.items()},
            }
            for label, policy, t, costs in recentring
        ],
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic.write_text(path, json.dumps(record, indent=1) + "\n")


def _run_other_backend(parser, args, argv):
    """bench_layer_jax.py or bench_layer_torch.py with this command's options (Keras fixes its
    backend at its first import, which this script has done under TensorFlow); returns its
    exit code. --device goes to PyTorch's (cpu or cuda); JAX takes its default device."""
    if args.recentring_only:
        parser.error(f"--recentring-only is TensorFlow's; drop it with --backend {args.backend}")
    if args.device and args.backend == "jax":
        parser.error("--device is a TensorFlow and PyTorch option; drop it with --backend jax")
    forwarded = ["--reps", str(args.reps), "--inner", str(args.inner)]
    forwarded += ["--smoke"] if args.smoke else []
    forwarded += ["--json", args.json] if args.json else []
    forwarded += ["--max-shapes", str(args.max_shapes)] if args.max_shapes is not None else []
    forwarded += ["--device", args.device] if args.device else []
    script = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), f"bench_layer_{args.backend}.py"
    )
    command = ["--command", "python benchmarks/bench_layer.py " + " ".join(argv)]
    return subprocess.run(
        [sys.executable, script, *forwarded, *command],
        env={**os.environ, "KERAS_BACKEND": args.backend},
    ).returncode


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one repetition")
    parser.add_argument("--reps", type=int, default=15, help="timed samples per contender")
    parser.add_argument("--inner", type=int, default=3, help="calls per sample")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument(
        "--device",
        help="run on this device, e.g. /GPU:0 (default: TensorFlow's placement); with "
        "--backend torch: cpu or cuda",
    )
    parser.add_argument(
        "--max-shapes", type=int, metavar="N", help="only the first N shapes (of 4)"
    )
    parser.add_argument("--recentring-only", action="store_true", help="only the re-centring table")
    parser.add_argument(
        "--backend",
        choices=("tensorflow", "jax", "torch"),
        default="tensorflow",
        help="jax, torch: bench_layer_jax.py's or bench_layer_torch.py's table, in a Python of "
        "its own under that KERAS_BACKEND",
    )
    args = parser.parse_args(argv)
    if args.backend != "tensorflow":
        return _run_other_backend(parser, args, argv if argv is not None else sys.argv[1:])
    if args.recentring_only and args.json:
        parser.error("--json writes every table's rows; run it without --recentring-only")
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    shapes, reps, inner = select_shapes(parser, args)
    with tf.device(args.device):  # None: TensorFlow's own placement
        device = tf.identity(0.0).device
    print(f"machine: {machine_description()}")
    print(f"device: {device}")
    rows, ranks = [], {label: len(shape) for label, shape, _ in shapes}
    with tf.device(args.device):
        if not args.recentring_only:
            print("raw = FusedBatchNormV3 + its gradient (train), x*a+b (inference); medians\n")
            print(HEADER, flush=True)
            rows = run(shapes, reps, inner)
            print("\n" + target_summary(target_results(rows, ranks)))
        print(
            "\nThe fused path's re-centring (keras_bn/backend/tensorflow/fused.py), train step, "
            "graph; costs are medians of per-rep ratios to 'off'\n"
        )
        print(RECENTRING_HEADER, flush=True)
        recentring = run_recentring(shapes, reps, inner)
    if args.json:
        argv = argv if argv is not None else sys.argv[1:]
        write_json(args.json, rows, ranks, started, argv, device, recentring)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

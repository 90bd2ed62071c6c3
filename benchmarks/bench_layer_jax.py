"""Per-layer speed under the JAX backend: keras_bn.BatchNormalization against
keras.layers.BatchNormalization, timed interleaved in one run; prints a table of medians.

Each contender is a jitted function of the layer's `stateless_call`. Train step = forward,
backward (jax.grad to the input and the weights) of a sum-of-squares loss, and the new moving
statistics (returned, as `model.fit`'s train step returns them). Inference = the forward with
the moving statistics. A row's ratio is the median over reps of the per-rep ratio keras_bn /
Keras, each rep timing the two back to back, which a machine whose speed drifts between reps
leaves alone. A second table checks the target (TARGETS) on those ratios.

    KERAS_BACKEND=jax python benchmarks/bench_layer_jax.py     # or: bench_layer.py --backend jax
    python benchmarks/bench_layer.py --backend jax --smoke     # tiny shapes, one repetition
    python benchmarks/bench_layer.py --backend jax --json benchmarks/results/bench_layer_jax.json
"""

import argparse
import os
import platform
import statistics
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import jax.numpy as jnp
import keras
import numpy as np
from _layer_bench import (
    POLICIES,
    add_arguments,
    cpu_description,
    per_rep_ratio,
    row_record,
    select_shapes,
    target_results,
    target_summary,
    time_samples,
    utc_now,
    write_record,
)

import keras_bn

CONTENDERS = ("keras_bn", "keras")
# keras_bn / Keras bounds on the per-row ratios: (target, which steps, bound).
TARGETS = [("jit train step", "train", 1.0)]


def machine_description():
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    return (
        f"{cpu_description()}; JAX {jax.__version__} on {jax.default_backend()} ({devices}), "
        f"Keras {keras.__version__}, Python {platform.python_version()}"
    )


def _train_step(layer):
    """jit(trainable, fixed, x) -> (gradients to the weights, gradient to x, new statistics)."""

    def step(trainable, fixed, x):
        def loss(trainable, x):
            y, new_fixed = layer.stateless_call(trainable, fixed, x, training=True)
            return jnp.sum(jnp.square(y.astype(jnp.float32))), new_fixed

        grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
        (d_trainable, dx), new_fixed = grad(trainable, x)
        return d_trainable, dx, new_fixed

    return jax.jit(step)


def _inference(layer):
    return jax.jit(lambda trainable, fixed, x: layer.stateless_call(trainable, fixed, x)[0])


def contenders(shape, axis, policy, mode):
    """{name: function of x} for one row: each layer's jitted step, its weights bound."""
    functions = {}
    for name, cls in zip(
        CONTENDERS, (keras_bn.BatchNormalization, keras.layers.BatchNormalization), strict=True
    ):
        layer = cls(axis=axis, dtype=policy)
        layer.build(shape)
        trainable = [v.value for v in layer.trainable_variables]
        fixed = [v.value for v in layer.non_trainable_variables]
        jitted = (_train_step if mode == "train" else _inference)(layer)
        functions[name] = (lambda f, t, n: lambda x: f(t, n, x))(jitted, trainable, fixed)
    return functions


def run(shapes, reps, inner):
    """[(label, policy, step, medians, ratio)]: every row, printed as it is measured."""
    rows = []
    for label, shape, axis in shapes:
        for policy in POLICIES:
            compute = keras.mixed_precision.Policy(policy).compute_dtype
            x = jnp.asarray(np.random.default_rng(0).normal(1.0, 2.0, shape), compute)
            for mode in ("train", "inference"):
                functions = contenders(shape, axis, policy, mode)
                samples = time_samples(functions, x, reps, inner, jax.block_until_ready)
                ratio = per_rep_ratio(samples)
                medians = {name: statistics.median(s) for name, s in samples.items()}
                rows.append((label, policy, mode, medians, ratio))
                print(_format_row(rows[-1]), flush=True)
    return rows


HEADER = (
    "| shape | policy | step | keras_bn ms | Keras BN ms | keras_bn / Keras |\n"
    "|---|---|---|---|---|---|"
)


def _format_row(row):
    label, policy, mode, t, ratio = row
    return (
        f"| {label} | {policy} | {mode} | {t['keras_bn'] * 1e3:.2f} | "
        f"{t['keras'] * 1e3:.2f} | {ratio:.2f} |"
    )


def write_json(path, rows, started, command):
    """The run's rows (medians in ms, ratios), machine, command and UTC times as JSON at
    `path`, written atomically."""
    record = {
        "command": command,
        "machine": machine_description(),
        "device": str(jax.devices()[0]),
        "started_utc": started,
        "finished_utc": utc_now(),
        "rows": [row_record(row) for row in rows],
        "targets": target_results(rows, TARGETS),
    }
    write_record(path, record)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--command", help=argparse.SUPPRESS)  # bench_layer.py's, for the JSON
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        parser.error(f"needs KERAS_BACKEND=jax; Keras is using {keras.backend.backend()!r}")
    started = utc_now()
    shapes, reps, inner = select_shapes(parser, args)
    print(f"machine: {machine_description()}")
    print(f"device: {jax.devices()[0]}")
    print("jitted stateless_call; train = forward + jax.grad + new moving statistics; medians\n")
    print(HEADER, flush=True)
    rows = run(shapes, reps, inner)
    print("\n" + target_summary(target_results(rows, TARGETS)))
    if args.json:
        argv = argv if argv is not None else sys.argv[1:]
        command = args.command or "python benchmarks/bench_layer_jax.py " + " ".join(argv)
        write_json(args.json, rows, started, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The cost of a quantization-aware train step under the JAX backend, against the float step.

bench_qat.py times the TensorFlow steps; this is its step-time table under KERAS_BACKEND=jax,
on the same two models: the digits CNN (examples/digits.py's `separable_cnn`, batch 64) and a
real-sized MobileNetV2 (α = 0.35, 96 px, batch 32, 53 BN). Each step is what Keras's JAX
trainer compiles: `stateless_call` forward, the loss, `jax.grad` to the trainable weights, an
Adam update (`optimizer.stateless_apply`) and the new non-trainable state (moving statistics,
activation ranges), jitted. The float model and its `quantize_model` copy (w8a8 per channel)
run back to back in each round; a row's ratio is the median of the per-round ratios QAT /
float, which a machine whose speed drifts between rounds leaves alone.

    python benchmarks/bench_qat_jax.py --json benchmarks/results/bench_qat_jax.json
    python benchmarks/bench_qat_jax.py --smoke    # the digits CNN, 2 rounds: CI checks it runs
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import jax
import keras
import numpy as np
from bench_layer_jax import machine_description

import digits
from keras_bn.export import atomic
from keras_bn.quantize import quantize_model

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
BOUND = 2.0  # QAT step / float step, as bench_qat.py's target on TensorFlow


def train_step(model):
    """(jitted step, its state): step(state, x, y) -> (loss, new state), as Keras's trainer."""
    optimizer = keras.optimizers.Adam(1e-4)
    optimizer.build(model.trainable_variables)

    def loss_of(trainable, fixed, x, y):
        logits, fixed = model.stateless_call(trainable, fixed, x, training=True)
        return LOSS(y, logits), fixed

    @jax.jit
    def step(state, x, y):
        trainable, fixed, optimizer_state = state
        (loss, fixed), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable, fixed, x, y)
        trainable, optimizer_state = optimizer.stateless_apply(optimizer_state, grads, trainable)
        return loss, (trainable, fixed, optimizer_state)

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    return step, state


def step_times(name, factory, x, y, rounds, inner):
    """The row of one model: median ms per step of each, and the median per-round ratio."""
    keras.utils.set_random_seed(0)
    model = factory()
    steps = {"float": train_step(model), "qat": train_step(quantize_model(model))}
    states = {}
    for key, (step, state) in steps.items():  # trace, compile and warm up
        for _ in range(2):
            loss, state = step(state, x, y)
        jax.block_until_ready(loss)
        states[key] = state
    samples = {key: [] for key in steps}
    for r in range(rounds):
        for key in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            step, state = steps[key][0], states[key]
            start = time.perf_counter()
            for _ in range(inner):
                loss, state = step(state, x, y)
            jax.block_until_ready(loss)
            samples[key].append((time.perf_counter() - start) / inner)
            states[key] = state
    ratios = [q / f for q, f in zip(samples["qat"], samples["float"], strict=True)]
    return {
        "model": name,
        "float_ms": round(1e3 * statistics.median(samples["float"]), 3),
        "qat_ms": round(1e3 * statistics.median(samples["qat"]), 3),
        "ratio": round(statistics.median(ratios), 4),
        "rounds": rounds,
        "calls_per_round": inner,
    }


def timed_models(smoke):
    """name -> (model factory, one batch of inputs, its labels)."""
    x_train, y_train, _, _ = digits.load()
    models = {"digits CNN, batch 64": (digits.separable_cnn, x_train[:64], y_train[:64])}
    if not smoke:  # compiling MobileNetV2's two steps takes a minute or two
        rng = np.random.default_rng(0)
        models["MobileNetV2 α=0.35, 96 px, batch 32"] = (
            lambda: keras.applications.MobileNetV2(
                alpha=0.35, input_shape=(96, 96, 3), weights=None, classes=10
            ),
            rng.random((32, 96, 96, 3), np.float32),
            rng.integers(0, 10, 32).astype("int32"),
        )
    return models


def table(rows):
    lines = [
        "| model | float ms | QAT ms | QAT / float (median of rounds) | ≤ 2× |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        met = "yes" if row["ratio"] <= BOUND else "MISSED"
        lines.append(
            f"| {row['model']} | {row['float_ms']:.2f} | {row['qat_ms']:.2f} | "
            f"{row['ratio']:.2f} | {met} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the digits CNN, 2 rounds")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per model")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        parser.error(f"needs KERAS_BACKEND=jax; Keras is using {keras.backend.backend()!r}")
    rounds = 2 if args.smoke else args.rounds
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    print(f"machine: {machine_description()}", flush=True)
    rows = []
    for name, (factory, x, y) in timed_models(args.smoke).items():
        inner = 10 if name.startswith("digits") and not args.smoke else 1
        rows.append(step_times(name, factory, x, y, rounds, inner))
        print(rows[-1], flush=True)
    print(table(rows))
    if args.json:
        record = {
            "command": "python benchmarks/bench_qat_jax.py " + " ".join(sys.argv[1:]),
            "machine": machine_description(),
            "started_utc": started,
            "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="minutes"
            ),
            "rows": rows,
            "bound": BOUND,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        atomic.write_text(args.json, json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

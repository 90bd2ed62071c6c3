"""`keras_bn.recalibrate`'s cost as a multiple of one inference pass (`model.predict`) over the
same data: the one pass (keras_bn/_recalibration/one_pass.py) and the per-layer method it
replaced (one pass per BN layer), on keras.applications.ResNet50(weights=None) at 64×64, on a
small residual net with 16 BN layers, and on a QAT MobileNetV2 (α 0.35, 96×96, `quantize_model`:
its BNs folded into 8-bit weights, whose first call traces more), 256 images in batches of 64.

Each warm time is the median of `--reps` interleaved rounds (predict, then the one pass, the
order alternating), and its ratio the median of the per-round ratios; "fastest ÷ fastest" is
the ratio of the fastest warm rounds, a check on the median where slow spells of the machine
hit one contender more. "cold" is the first call on a fresh model: it traces its functions, as
a first `predict` does, and compiles the BN inputs' moments with XLA once per input shape
(keras_bn/_recalibration/hooks.py), a fixed cost whatever the data's size; "warm" is a later call
(`recalibrate` keeps its compiled segments on the model, as Keras keeps `predict_function`;
the per-layer method traces again each call). Ratios are to the predict pass of the same
temperature. The per-layer method is timed once (`--per-layer-reps`): it costs tens of
predict passes.

    python benchmarks/bench_recalibrate.py --json benchmarks/results/bench_recalibrate.json
    python benchmarks/bench_recalibrate.py --smoke    # tiny models, one rep: CI's check
    python benchmarks/bench_recalibrate.py --model "QAT MobileNetV2 0.35"   # one model's row
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import _tf_env  # noqa: F401  (before TensorFlow: its environment)
import keras
import numpy as np
import tensorflow as tf
from bench_layer import machine_description

from keras_bn import population
from keras_bn._graph import bn_layers
from keras_bn._recalibration.batches import Batches
from keras_bn.export import atomic
from keras_bn.quantize import quantize_model


def small_resnet(image=32, widths=(16, 32, 64), stem=8):
    """A residual net with 16 BN layers: a stem, 3 stages of 2 blocks, a BN on each projection
    shortcut (the first block of every stage changes the width)."""

    def conv_bn(x, filters, kernel=3, strides=1, relu=True):
        x = keras.layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        return keras.layers.ReLU()(x) if relu else x

    inputs = keras.Input((image, image, 3))
    x = conv_bn(inputs, stem)
    for stage, filters in enumerate(widths):
        for block in range(2):
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            y = conv_bn(x, filters, strides=strides)
            y = conv_bn(y, filters, relu=False)
            if block == 0:
                shortcut = conv_bn(shortcut, filters, kernel=1, strides=strides, relu=False)
            x = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="small_resnet")


def qat_mobilenet_v2(image=96):
    """keras.applications.MobileNetV2 (α 0.35, 52 BN layers) made QAT by `quantize_model`
    (8-bit weights, per channel but for the per-tensor Dense head; 8-bit activations), its
    activation ranges set by one training call on 8 random images."""
    model = keras.applications.MobileNetV2(
        alpha=0.35, input_shape=(image, image, 3), weights=None, classes=10
    )
    qat = quantize_model(model, 8, 8)
    qat(np.random.default_rng(1).random((8, image, image, 3), np.float32), training=True)
    return qat


def _models(smoke):
    if smoke:
        return [("small ResNet", lambda: small_resnet(image=8, widths=(4, 4, 4), stem=4), 8)]
    return [
        (
            "ResNet50",
            lambda: keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3)),
            64,
        ),
        ("small ResNet", small_resnet, 32),
        ("QAT MobileNetV2 0.35", qat_mobilenet_v2, 96),
    ]


def _timed(function):
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def measure(name, build, image, images, batch, reps, per_layer_reps, seed=0):
    """One model's row: predict, one pass, per layer (seconds, cold and warm), the passes and
    strategies the reports give, and the largest statistic difference between the methods."""
    keras.utils.set_random_seed(seed)
    model = build()
    x = np.random.default_rng(seed).normal(size=(images, image, image, 3)).astype("float32")
    bns = len(bn_layers.in_model(model))

    def predict():
        return model.predict(x, batch_size=batch, verbose=0)

    def statistics_now():
        return [
            (bn.moving_mean.numpy(), bn.moving_variance.numpy())
            for bn in map(bn_layers.statistics_of, bn_layers.in_model(model))
        ]

    start_statistics = statistics_now()

    def restore():
        batch_norms = map(bn_layers.statistics_of, bn_layers.in_model(model))
        for bn, (mean, variance) in zip(batch_norms, start_statistics):
            bn.moving_mean.assign(mean)
            bn.moving_variance.assign(variance)

    def one_pass():
        restore()
        return population.recalibrate(model, x, batch_size=batch, progress=False)

    def per_layer():
        restore()
        layers = bn_layers.in_model(model)
        return population.recalibrate_per_layer(model, layers, Batches(x, None, batch), False)

    predict_cold, _ = _timed(predict)
    one_cold, report = _timed(one_pass)
    # Interleaved rounds, the order alternating, so that a slow spell of a shared machine hits
    # both; the ratio is the median of the per-round ratios.
    warm: dict[str, list[float]] = {"predict": [], "one_pass": []}
    contenders = [("predict", predict), ("one_pass", one_pass)]
    for round_ in range(reps):
        for contender, function in contenders if round_ % 2 == 0 else contenders[::-1]:
            warm[contender].append(_timed(function)[0])
    predict_warm = statistics.median(warm["predict"])
    one_warm = statistics.median(warm["one_pass"])
    one_ratio = statistics.median(o / p for o, p in zip(warm["one_pass"], warm["predict"]))
    # This 2-core machine has slow spells in which a predict pass takes twice as long (seen
    # with every other job stopped, 2026-11-26); the fastest rounds' ratio checks that the
    # median ratio does not come from them.
    fastest_ratio = min(warm["one_pass"]) / min(warm["predict"])
    one_pass_statistics = statistics_now()
    per_layer_times = [_timed(per_layer) for _ in range(per_layer_reps)]
    per_layer_time = statistics.median(t for t, _ in per_layer_times)
    reference = per_layer_times[0][1]
    # As the tests compare: each statistic's largest difference over its largest value.
    difference = max(
        float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
        for one, reference_layer in zip(one_pass_statistics, statistics_now())
        for a, b in zip(one, reference_layer)
    )
    return {
        "model": name,
        "bn_layers": bns,
        "images": images,
        "image": image,
        "batch": batch,
        "predict_cold_s": round(predict_cold, 4),
        "predict_s": round(predict_warm, 4),
        "one_pass_cold_s": round(one_cold, 4),
        "one_pass_s": round(one_warm, 4),
        "per_layer_s": round(per_layer_time, 4),
        "one_pass_cold_ratio": round(one_cold / predict_cold, 3),
        "one_pass_ratio": round(one_ratio, 3),
        "one_pass_fastest_ratio": round(fastest_ratio, 3),
        "per_layer_ratio": round(per_layer_time / predict_warm, 3),
        "one_pass_strategy": report.strategy,
        "one_pass_passes": round(report.passes, 3),
        "per_layer_passes": reference.passes,
        "peak_frontier_mib": round(report.peak_frontier_bytes / 2**20, 2),
        "max_relative_difference": difference,
    }


HEADER = (
    "| model | BNs | predict (s) | one pass (s) | × predict | fastest ÷ fastest | cold × predict "
    "| per layer (s) | × predict | max diff / scale |\n|---|---|---|---|---|---|---|---|---|---|"
)


def row_line(row):
    return (
        f"| {row['model']} | {row['bn_layers']} | {row['predict_s']:.3f} | "
        f"{row['one_pass_s']:.3f} | {row['one_pass_ratio']:.2f} | "
        f"{row['one_pass_fastest_ratio']:.2f} | "
        f"{row['one_pass_cold_ratio']:.2f} | {row['per_layer_s']:.3f} | "
        f"{row['per_layer_ratio']:.1f} | {row['max_relative_difference']:.1e} |"
    )


# The targets, recalibrate ÷ one predict pass (warm).
TARGETS = {"ResNet50": 2.0, "small ResNet": 1.5}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, one rep")
    parser.add_argument(
        "--reps", type=int, default=7, help="interleaved timed rounds of predict and one pass"
    )
    parser.add_argument(
        "--per-layer-reps", type=int, default=1, help="runs of the per-layer method"
    )
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument(
        "--model", action="append", metavar="NAME", help="only this model's row (repeatable)"
    )
    args = parser.parse_args(argv)
    for flag in ("reps", "per_layer_reps", "images", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    images, batch, reps = (16, 8, 1) if args.smoke else (args.images, args.batch, args.reps)
    device = tf.identity(0.0).device
    print(f"machine: {machine_description()}")
    print(f"device: {device}")
    print(f"{images} images in batches of {batch}; {reps} interleaved round(s), medians\n")
    print(HEADER, flush=True)
    rows = []
    models = _models(args.smoke)
    unknown = set(args.model or []) - {name for name, _, _ in models}
    if unknown:
        parser.error(
            f"--model: no model named {sorted(unknown)}; the models are "
            f"{[name for name, _, _ in models]}"
        )
    for name, build, image in models:
        if args.model and name not in args.model:
            continue
        row = measure(name, build, image, images, batch, reps, args.per_layer_reps)
        rows.append(row)
        print(row_line(row), flush=True)
    print()
    for row in rows:
        if row["model"] in TARGETS:
            target = TARGETS[row["model"]]
            met = "yes" if row["one_pass_ratio"] <= target else "MISSED"
            print(
                f"target: {row['model']} recalibrate ≤ {target}× one predict pass: "
                f"{row['one_pass_ratio']:.2f}× → {met}"
            )
    if args.json:
        argv = argv if argv is not None else sys.argv[1:]
        record = {
            "command": "python benchmarks/bench_recalibrate.py " + " ".join(argv),
            "machine": machine_description(),
            "device": device,
            "started_utc": started,
            "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="minutes"
            ),
            "rows": rows,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        atomic.write_text(args.json, json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

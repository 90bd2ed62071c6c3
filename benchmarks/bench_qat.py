"""Quantization-aware training against post-training quantization, on digits, read from the files.

A depthwise-separable BN CNN (Conv2D+BN+ReLU, DepthwiseConv2D+BN+ReLU6, a 1×1 Conv2D+BN+ReLU,
max pooling, SeparableConv2D+BN+ReLU, GlobalAveragePooling, Dense logits) is trained in float
on sklearn's 8×8 digits (examples/digits.py, its fixed split: 1,347 training and 450 test
images), once per seed. For each seed, and at w8a8, w4a8 and w3a8, per channel and per tensor:

- float: the Keras model's test accuracy, and its float32 TFLite file's (LiteRT);
- rounding: the BN folded (`fold_batch_norms`), every kernel rounded to the k-bit symmetric
  narrow-range grid (`keras_bn.quantize.fake_quant.weight_grid`; a separable convolution's
  depthwise and pointwise kernels both; Dense always per tensor, as `quantize_model` makes it),
  activations and biases left in float: the Keras folded model's accuracy;
- PTQ int8: the TFLite converter's post-training full-integer quantization
  (`export_tflite(model, quantization="int8", representative_data=x_train)`, per channel as
  TFLite does; 8 bits only), accuracy read from the LiteRT file;
- QAT: `quantize_model` of the trained float model, fine-tuned with `FreezeBatchNorm`, exported
  with `export_tflite` and `export_onnx`; accuracy read from the files (LiteRT's signature
  runner, onnxruntime with its optimiser on), beside the Keras QAT model's, and the export's
  own verification in output steps (max and 99th-percentile LSB of the logits, on the 450 test
  images as the probe).

The seed sets the initial weights and the batch order, not the split. Accuracies are in
percent, median [min–max] over the seeds; each target is judged on the median over seeds of
the paired per-seed difference. The QAT train step is timed against the float model's: the
same tf.function step (forward, loss, gradients, Adam update), same batch, interleaved, medians
of `--rounds` samples after warm-up, in graph mode and under XLA.

    python benchmarks/bench_qat.py --json benchmarks/results/bench_qat.json   # docs/guide/qat.md
    python benchmarks/bench_qat.py --smoke    # one seed, tiny epochs: CI checks it runs

Low bit widths (the QAT page's low-bit tables): 3 and 2 bits, per channel and per tensor, plain
`fit` with and without `recalibrate`, the recipe with and without re-estimation at the freeze,
with the weight ranges `quantize_model` picks (learned below 4 bits) or `--weight-range max`:

    python benchmarks/bench_qat.py --reestimation --qat-epochs 15 --qat-learning-rate 1e-3 \
        --json benchmarks/results/bench_qat_lowbit.json

Dense weights per channel (`quantize_model(per_channel="all")`) against per tensor
(`per_channel=True`, the default), the convolutions per channel in both, at 8, 4, 3 and 2
bits, read from both files:

    python benchmarks/bench_qat.py --dense-granularity \
        --json benchmarks/results/bench_qat_dense_per_channel.json

The QAT train step's cost against the float step's, at 8 bits (max|w| ranges) and 3 bits
(learned ranges), on the digits CNN and MobileNetV2:

    python benchmarks/bench_qat.py --step-cost --json benchmarks/results/bench_qat_step_cost.json
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import _tf_env  # noqa: F401  (before TensorFlow: its environment)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import keras
import numpy as np
import tensorflow as tf
from bench_layer import machine_description

import digits
import keras_bn
from keras_bn.export import atomic, export_onnx, export_tflite, fold_batch_norms
from keras_bn.export import onnx as onnx_export
from keras_bn.export import tflite as tflite_export
from keras_bn.quantize import FreezeBatchNorm, quantize_model

BATCH = 64
MOBILENET_SIDE, MOBILENET_BATCH = 96, 32
CONFIGS = [(8, True), (8, False), (4, True), (4, False), (3, True), (3, False)]
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def machine():
    """The CPU, the versions of TensorFlow, Keras and the two runtimes."""
    from importlib import metadata

    runtimes = ", ".join(
        f"{name} {metadata.version(name)}" for name in ("ai-edge-litert", "onnxruntime")
    )
    return f"{machine_description()}; {runtimes}"


def accuracy(logits, labels):
    """Top-1 accuracy in percent."""
    return float(100.0 * np.mean(np.asarray(logits).argmax(-1) == labels))


def only_output(outputs):
    """The one output array of a runtime's {name: array}."""
    (value,) = outputs.values()
    return value


def fine_tune(model, bits, per_channel, seed, recipe, data):
    """`quantize_model(model)` fine-tuned with FreezeBatchNorm per `recipe`; with
    `recipe["plain"]` a plain `fit` (no callback), with `recipe["reestimate"]` the freeze
    re-estimates the statistics from the training images first."""
    x_train, y_train, _, _ = data
    keras.utils.set_random_seed(seed + 1000)
    qat = quantize_model(model, bits, 8, per_channel, weight_range=recipe.get("weight_range"))
    steps_per_epoch = len(x_train) // BATCH
    total = recipe["epochs"] * steps_per_epoch
    schedule = keras.optimizers.schedules.CosineDecay(recipe["learning_rate"], total)
    qat.compile(keras.optimizers.Adam(schedule), LOSS, jit_compile=False)
    qat.fit(
        digits.batches(x_train, y_train, BATCH, seed=seed + 1000),
        steps_per_epoch=steps_per_epoch,
        epochs=recipe["epochs"],
        shuffle=False,  # the stream is shuffled already
        verbose=0,
        callbacks=[]
        if recipe.get("plain")
        else [
            FreezeBatchNorm(
                round(recipe["freeze_batch_norm"] * total),
                freeze_ranges_after_steps=max(1, round(recipe["freeze_ranges"] * total)),
                data=x_train if recipe.get("reestimate") else None,
                batch_size=BATCH,
            )
        ],
    )
    return qat


# --reestimation: the low-bit configurations and how their QAT models were trained.
LOW_BIT_CONFIGS = [(3, True), (3, False), (2, True), (2, False)]
REESTIMATION_VARIANTS = {
    "plain fit": {"plain": True},
    "plain fit + recalibrate": {"plain": True, "recalibrate": True},
    "recipe": {},
    "recipe, re-estimated at the freeze": {"reestimate": True},
}


def reestimation_seed(seed, recipe, float_epochs, data):
    """One seed of --reestimation: the float model's accuracy, and per low-bit configuration
    its rounding's and each variant's QAT model's (Keras, `training=False`: what the files
    compute, within their LSB bounds)."""
    x_train, _, x_test, y_test = data
    model, _ = digits.train_separable(float_epochs, seed=seed)
    result = {"seed": seed, "float_keras": accuracy(model.predict(x_test, verbose=0), y_test)}
    folded, _ = fold_batch_norms(model, x_test)
    base = folded.get_weights()
    configs = {}
    for bits, per_channel in LOW_BIT_CONFIGS:
        folded.set_weights(base)
        digits.round_weights(folded, bits, per_channel)
        row = {"rounding": accuracy(folded.predict(x_test, verbose=0), y_test)}
        for name, variant in REESTIMATION_VARIANTS.items():
            qat = fine_tune(model, bits, per_channel, seed, {**recipe, **variant}, data)
            if variant.get("recalibrate"):
                keras_bn.recalibrate(qat, x_train, batch_size=BATCH, progress=False)
            row[name] = accuracy(qat.predict(x_test, verbose=0), y_test)
        configs[config_key(bits, per_channel)] = row
        print(
            f"#   seed {seed} {config_key(bits, per_channel)}: {row}", file=sys.stderr, flush=True
        )
    result["configs"] = configs
    return result


def reestimation_table(results):
    """Markdown rows: per configuration, float, rounding and each variant, median [min–max]
    over the seeds, and each variant's median paired drop from float."""
    lines = [
        "| weights | float | rounding | "
        + " | ".join(f"{name} (drop)" for name in REESTIMATION_VARIANTS)
        + " |",
        "|---" * (3 + len(REESTIMATION_VARIANTS)) + "|",
    ]
    for bits, per_channel in LOW_BIT_CONFIGS:
        key = config_key(bits, per_channel)
        cells = [cell(summary([s["float_keras"] for s in results]))]
        cells.append(cell(summary([s["configs"][key]["rounding"] for s in results])))
        for name in REESTIMATION_VARIANTS:
            drop = paired(
                results, key, lambda s, _: s["float_keras"], lambda _, r, name=name: r[name]
            )
            got = summary([s["configs"][key][name] for s in results])
            cells.append(f"{cell(got)} ({drop:.1f})")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


# --dense-granularity: the weight bits compared, and quantize_model's per_channel for each
# granularity of the Dense hosts (the convolutions per channel in both).
DENSE_BITS = (8, 4, 3, 2)
DENSE_GRANULARITIES = {"Dense per tensor": True, "Dense per channel": "all"}


def dense_granularity_seed(seed, recipe, float_epochs, data, folder):
    """One seed of --dense-granularity: per weight bits and Dense granularity, the QAT
    model's accuracy in Keras, LiteRT and onnxruntime, and each file's verification."""
    _, _, x_test, y_test = data
    model, _ = digits.train_separable(float_epochs, seed=seed)
    result = {"seed": seed, "float_keras": accuracy(model.predict(x_test, verbose=0), y_test)}
    configs = {}
    for bits in DENSE_BITS:
        for name, per_channel in DENSE_GRANULARITIES.items():
            qat = fine_tune(model, bits, per_channel, seed, recipe, data)
            row = {"qat_keras": accuracy(qat.predict(x_test, verbose=0), y_test)}
            for fmt in EXPORTS:
                path = os.path.join(folder, f"w{bits}_{per_channel}.{fmt}")
                row.update(qat_file_entries(qat, fmt, path, x_test, y_test))
            configs[f"w{bits}a8 {name}"] = row
            print(f"#   seed {seed} w{bits}a8 {name}: {row}", file=sys.stderr, flush=True)
    result["configs"] = configs
    return result


def dense_granularity_table(results):
    """Markdown rows: per weight bits, each granularity's accuracy in both files, median
    [min–max] over the seeds, the median paired gain of per channel, and the files passed."""
    names = list(DENSE_GRANULARITIES)
    lines = [
        "| weights | runtime | "
        + " | ".join(names)
        + " | per channel − per tensor (median paired) | files passed |",
        "|---|---|---|---|---|---|",
    ]
    for bits in DENSE_BITS:
        keys = [f"w{bits}a8 {name}" for name in names]
        for fmt, runtime in (("tflite", "LiteRT"), ("onnx", "onnxruntime")):
            found = [summary([s["configs"][key][f"qat_{fmt}"] for s in results]) for key in keys]
            gain = statistics.median(
                s["configs"][keys[1]][f"qat_{fmt}"] - s["configs"][keys[0]][f"qat_{fmt}"]
                for s in results
            )
            passed = sum(s["configs"][key][f"{fmt}_passed"] for s in results for key in keys)
            lines.append(
                f"| w{bits}a8 | {runtime} | {cell(found[0])} | {cell(found[1])} | "
                f"{gain:+.2f} | {passed}/{len(results) * len(keys)} |"
            )
    return lines


def dense_granularity_main(args, argv, started, seeds, float_epochs, recipe, data):
    """--dense-granularity: its table, and its JSON, rewritten after each seed."""
    command = command_line(argv)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(seeds):
            results.append(dense_granularity_seed(seed, recipe, float_epochs, data, folder))
            if args.json:
                table = dense_granularity_table(results)
                write_record(
                    args.json, command, started, float_epochs, recipe, results, table=table
                )
    print_header(command, started, seeds, float_epochs, recipe)
    print("test accuracy (%) of the QAT files, median [min-max] over seeds")
    print("\n".join(dense_granularity_table(results)))
    return 0


# Format → (exporter, what runs its file).
EXPORTS = {"tflite": (export_tflite, tflite_export.run), "onnx": (export_onnx, onnx_export.run)}


def qat_file_entries(qat, fmt, path, x_test, y_test):
    """Write `qat` as a `fmt` file at `path`; its accuracy there and its verification's LSB
    errors and verdict, as a config row's `qat_<fmt>` and `<fmt>_...` entries."""
    export, run = EXPORTS[fmt]
    report = export(qat, path, probe=x_test, strict=False)
    return {
        f"qat_{fmt}": accuracy(only_output(run(path, x_test)), y_test),
        f"{fmt}_max_lsb": report.max_lsb_error,
        f"{fmt}_p99_lsb": report.percentile_lsb_error,
        f"{fmt}_passed": report.passed,
    }


def run_seed(seed, recipe, float_epochs, onnx_bits, data, folder):
    """Every accuracy and verification number of one seed, as a dict."""
    x_train, _, x_test, y_test = data
    model, _ = digits.train_separable(float_epochs, seed=seed)
    result = {"seed": seed, "float_keras": accuracy(model.predict(x_test, verbose=0), y_test)}
    path = os.path.join(folder, "float.tflite")
    export_tflite(model, path, probe=x_test)
    result["float_tflite"] = accuracy(only_output(tflite_export.run(path, x_test)), y_test)
    path = os.path.join(folder, "ptq_int8.tflite")
    ptq = export_tflite(model, path, quantization="int8", representative_data=x_train, strict=False)
    result["ptq_int8_tflite"] = accuracy(only_output(tflite_export.run(path, x_test)), y_test)
    result["ptq_int8_passed"] = ptq.passed

    folded, _ = fold_batch_norms(model, x_test)
    base = folded.get_weights()
    configs = {}
    for bits, per_channel in CONFIGS:
        key = config_key(bits, per_channel)
        folded.set_weights(base)
        digits.round_weights(folded, bits, per_channel)
        row = {"rounding": accuracy(folded.predict(x_test, verbose=0), y_test)}
        qat = fine_tune(model, bits, per_channel, seed, recipe, data)
        row["qat_keras"] = accuracy(qat.predict(x_test, verbose=0), y_test)
        for fmt in ("tflite", "onnx") if bits in onnx_bits else ("tflite",):
            path = os.path.join(folder, f"{key}.{fmt}")
            row.update(qat_file_entries(qat, fmt, path, x_test, y_test))
        configs[key] = row
        print(f"#   seed {seed} {key}: {row}", file=sys.stderr, flush=True)
    result["configs"] = configs
    return result


def config_key(bits, per_channel):
    return f"w{bits}a8 {'per channel' if per_channel else 'per tensor'}"


def train_step(model, jit_compile):
    """One compiled train step of `model`: forward, loss, gradients, an Adam update."""
    optimizer = keras.optimizers.Adam(1e-4)
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=jit_compile)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        return loss

    return step


def pyramid(side, width=32):
    """A feature-pyramid classifier: four Conv–BN–ReLU stages (strides 2, 2, 2, 2), each
    output brought to `width` channels by a 1×1 Conv–BN, the coarser three upsampled
    (bilinear) to the finest one's grid and summed there in one 4-input Add, then
    Conv–BN–ReLU, global average pooling and a Dense head. In its QAT copy the Add rounds each
    partial sum and each upsampling rounds onto its input's grid, as their int8 files do."""
    layers = keras.layers

    def conv_bn(x, filters, kernel, strides=1, relu=True):
        x = layers.Conv2D(filters, kernel, strides, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        return layers.ReLU()(x) if relu else x

    inputs = keras.Input((side, side, 3))
    x, laterals = inputs, []
    for stage, filters in enumerate((width, 2 * width, 4 * width, 8 * width)):
        x = conv_bn(x, filters, 3, strides=2)
        lateral = conv_bn(x, width, 1, relu=False)
        if stage:
            lateral = layers.UpSampling2D(2**stage, interpolation="bilinear")(lateral)
        laterals.append(lateral)
    x = conv_bn(layers.Add()(laterals), width, 3)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x), name="pyramid")


# The train steps timed: the digits CNN on its batch, a real-sized MobileNetV2 (53 BN) and,
# out of --smoke, a real-sized feature pyramid (`pyramid`: bilinear upsampling and a 4-input
# Add): name → (model factory, inputs of one batch, labels).
def timed_models(data, smoke):
    x_train, y_train, _, _ = data
    side, batch = (32, 4) if smoke else (MOBILENET_SIDE, MOBILENET_BATCH)
    rng = np.random.default_rng(0)
    models = {
        "digits CNN": (digits.separable_cnn, x_train[:BATCH], y_train[:BATCH]),
        f"MobileNetV2 α=0.35, {side} px, batch {batch}": (
            lambda: keras.applications.MobileNetV2(
                alpha=0.35, input_shape=(side, side, 3), weights=None, classes=10
            ),
            rng.random((batch, side, side, 3), np.float32),
            rng.integers(0, 10, batch),
        ),
    }
    if not smoke:
        models[f"pyramid (bilinear upsampling, 4-input Add), {side} px, batch {batch}"] = (
            lambda: pyramid(side),
            rng.random((batch, side, side, 3), np.float32),
            rng.integers(0, 10, batch),
        )
    return models


def step_times(
    jit_compile, rounds, warmup, inner, model_name, factory, x, y, config=(8, True), export=False
):
    """Median seconds per train step of a float model and of its QAT copy (`config`: weight
    bits and per channel, activations 8 bits, the default weight range of those bits), timed
    interleaved on the same batch, and the median of the per-round ratios; with `export`,
    also what `exported` finds of the QAT copy."""
    keras.utils.set_random_seed(0)
    model = factory()
    steps = {"float": train_step(model, jit_compile)}
    qat = quantize_model(model, config[0], 8, config[1])
    steps["qat"] = train_step(qat, jit_compile)
    x, y = tf.constant(x), tf.constant(y)
    for step in steps.values():
        for _ in range(warmup):
            step(x, y).numpy()
    samples = {name: [] for name in steps}
    for r in range(rounds):
        for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            start = time.perf_counter()
            for _ in range(inner):
                loss = steps[name](x, y)
            loss.numpy()
            samples[name].append((time.perf_counter() - start) / inner)
    ratios = [q / f for q, f in zip(samples["qat"], samples["float"])]
    (weight_range,) = {layer.weight_range for layer in qat.layers if hasattr(layer, "weight_range")}
    exports = exported(qat, x.numpy()) if export else None
    return {
        "model": model_name,
        "qat": f"{config_key(*config)}, {weight_range} weight ranges",
        "mode": "XLA" if jit_compile else "graph",
        "float_ms": 1e3 * statistics.median(samples["float"]),
        "qat_ms": 1e3 * statistics.median(samples["qat"]),
        "ratio": statistics.median(samples["qat"]) / statistics.median(samples["float"]),
        "median_round_ratio": statistics.median(ratios),
        "rounds": rounds,
        "calls_per_round": inner,
        **({"exports": exports} if exports is not None else {}),
    }


def exported(qat, x):
    """The QAT model after its timed steps (ranges and statistics moved by them), written to
    int8 TFLite and ONNX, each verified against the Keras model on `x`: per format whether it
    passed, its largest error in output steps (LSB) and the export's seconds."""
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, export in (("tflite", export_tflite), ("onnx", export_onnx)):
            start = time.perf_counter()
            report = export(qat, os.path.join(folder, f"qat.{name}"), probe=x, strict=False)
            found[name] = {
                "passed": report.passed,
                "max_lsb_error": report.max_lsb_error,
                "float_ops": report.float_ops,
                "seconds": round(time.perf_counter() - start, 1),
            }
    return found


def summary(values):
    """{median, min, max, values} of a list of numbers (None when empty)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def cell(stats, digits_after=1):
    """'median [min–max]', or '—'."""
    if stats is None:
        return "—"
    if stats["min"] == stats["max"]:
        return f"{stats['median']:.{digits_after}f}"
    return (
        f"{stats['median']:.{digits_after}f} [{stats['min']:.{digits_after}f}–"
        f"{stats['max']:.{digits_after}f}]"
    )


def aggregate(seeds):
    """The table's rows from the per-seed results."""
    rows = []
    for bits, per_channel in CONFIGS:
        key = config_key(bits, per_channel)
        per_seed = [s["configs"][key] for s in seeds]
        row = {"config": key, "weight_bits": bits, "per_channel": per_channel}
        for name in ("rounding", "qat_keras", "qat_tflite", "qat_onnx"):
            row[name] = summary([r.get(name) for r in per_seed])
        row["ptq_int8_tflite"] = (
            summary([s["ptq_int8_tflite"] for s in seeds])
            if (bits, per_channel) == (8, True)
            else None
        )
        for runtime in ("tflite", "onnx"):
            row[f"{runtime}_max_lsb"] = summary([r.get(f"{runtime}_max_lsb") for r in per_seed])
            row[f"{runtime}_p99_lsb"] = summary([r.get(f"{runtime}_p99_lsb") for r in per_seed])
            passed = [r[f"{runtime}_passed"] for r in per_seed if f"{runtime}_passed" in r]
            row[f"{runtime}_files_passed"] = f"{sum(passed)}/{len(passed)}" if passed else None
        rows.append(row)
    return rows


def paired(seeds, key, minuend, subtrahend):
    """Median over seeds of minuend − subtrahend, each a function of (seed, config row)."""
    return statistics.median(
        minuend(s, s["configs"][key]) - subtrahend(s, s["configs"][key]) for s in seeds
    )


def targets(seeds, timings):
    """The issue's targets, judged on medians over seeds of the paired differences."""

    def float_(s, _):
        return s["float_keras"]

    def field(name):
        return lambda _, r: r[name]

    found = []
    for per_channel in (True, False):
        granularity = "per channel" if per_channel else "per tensor"
        drop = paired(seeds, config_key(8, per_channel), float_, field("qat_tflite"))
        found.append(
            {
                "target": f"w8a8 {granularity}: float − QAT TFLite",
                "bound": "≤ 0.5 points",
                "measured": round(drop, 3),
                "met": drop <= 0.5,
            }
        )
    for per_channel in (True, False):
        granularity = "per channel" if per_channel else "per tensor"
        key = config_key(4, per_channel)
        rounding_drop = paired(seeds, key, float_, field("rounding"))
        drop = paired(seeds, key, float_, field("qat_tflite"))
        applies = rounding_drop > 1.0
        found.append(
            {
                "target": f"w4a8 {granularity}: float − QAT TFLite, where rounding loses > 1 "
                f"point (rounding loses {rounding_drop:.2f})",
                "bound": "≤ 1 point",
                "measured": round(drop, 3),
                "met": drop <= 1.0 if applies else None,
            }
        )
    for per_channel in (True, False):
        granularity = "per channel" if per_channel else "per tensor"
        gain = paired(seeds, config_key(3, per_channel), field("qat_tflite"), field("rounding"))
        found.append(
            {
                "target": f"w3a8 {granularity}: QAT TFLite − rounding",
                "bound": "≥ 5 points",
                "measured": round(gain, 3),
                "met": gain >= 5.0,
            }
        )
    worst = max(r["tflite_p99_lsb"] for s in seeds for r in s["configs"].values())
    found.append(
        {
            "target": "TFLite against the Keras QAT model, 99th percentile, worst file",
            "bound": "≤ 2 LSB",
            "measured": round(worst, 3),
            # The errors are whole steps up to float rounding (2 LSB reads 2.0000006).
            "met": worst <= 2.0 + 1e-3,
        }
    )
    for timing in timings:
        found.append(
            {
                "target": f"QAT train step / float train step, {timing['model']}, {timing['mode']}",
                "bound": "≤ 2×",
                "measured": round(timing["ratio"], 3),
                "met": timing["ratio"] <= 2.0,
            }
        )
    return found


ROW_HEADER = (
    "| weights | weight ranges | rounding (Keras) | PTQ int8 (LiteRT) | QAT (Keras) | "
    "QAT (LiteRT) | QAT (onnxruntime) | LiteRT max / p99 LSB | files verified |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def format_row(row):
    bits = f"w{row['weight_bits']}a8"
    granularity = "per channel" if row["per_channel"] else "per tensor"
    lsb = "—"
    if row["tflite_max_lsb"] is not None:
        lsb = f"{row['tflite_max_lsb']['max']:.0f} / {row['tflite_p99_lsb']['max']:.0f}"
    files = [row["tflite_files_passed"], row["onnx_files_passed"]]
    return (
        f"| {bits} | {granularity} | {cell(row['rounding'])} | {cell(row['ptq_int8_tflite'])} | "
        f"{cell(row['qat_keras'])} | {cell(row['qat_tflite'])} | {cell(row['qat_onnx'])} | "
        f"{lsb} | {' + '.join(f for f in files if f)} |"
    )


def verdict(met):
    return "n/a" if met is None else "yes" if met else "MISSED"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one seed, tiny epochs (CI)")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--float-epochs", type=int, default=30)
    parser.add_argument("--qat-epochs", type=int, default=5)
    parser.add_argument("--qat-learning-rate", type=float, default=3e-4)
    parser.add_argument(
        "--freeze-batch-norm", type=float, default=0.5, help="fraction of the QAT steps"
    )
    parser.add_argument(
        "--freeze-ranges", type=float, default=0.75, help="fraction of the QAT steps"
    )
    parser.add_argument(
        "--onnx-bits",
        default="8,4,3",
        help="the weight bits whose QAT models are also exported to ONNX (comma-separated)",
    )
    parser.add_argument("--rounds", type=int, default=21, help="timed samples per model")
    parser.add_argument(
        "--dense-granularity",
        action="store_true",
        help="only Dense weights per channel against per tensor, at 8, 4, 3 and 2 bits",
    )
    parser.add_argument(
        "--reestimation",
        action="store_true",
        help="only the low-bit table: plain fit with and without recalibrate, the recipe "
        "with and without re-estimation at the freeze",
    )
    parser.add_argument(
        "--weight-range",
        choices=["max", "learned"],
        help="the QAT models' weight ranges (default: quantize_model's for the bits)",
    )
    parser.add_argument(
        "--step-cost",
        action="store_true",
        help="only the train step's cost, QAT against float, at w8a8 per channel (max|w| "
        "ranges) and w3a8 per channel and per tensor (learned ranges)",
    )
    parser.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help="with --step-cost, only the timed model whose name starts with NAME (repeatable)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    argv = argv if argv is not None else sys.argv[1:]
    if args.model and not args.step_cost:
        parser.error("--model chooses among --step-cost's timed models: give --step-cost too")
    if args.json:
        atomic.target(args.json)  # refuse a folder or device before the run, not after
    started = datetime.datetime.now(datetime.timezone.utc)
    seeds, float_epochs = (1, 2) if args.smoke else (args.seeds, args.float_epochs)
    recipe = {
        "epochs": 1 if args.smoke else args.qat_epochs,
        "learning_rate": args.qat_learning_rate,
        "freeze_batch_norm": args.freeze_batch_norm,
        "freeze_ranges": args.freeze_ranges,
        "optimizer": "Adam, cosine decay to 0",
        "batch_size": BATCH,
        "weight_range": args.weight_range,
    }
    rounds, warmup, inner = (2, 1, 1) if args.smoke else (args.rounds, 5, 10)
    onnx_bits = {int(b) for b in args.onnx_bits.split(",") if b}
    data = digits.load()
    if args.dense_granularity:
        return dense_granularity_main(args, argv, started, seeds, float_epochs, recipe, data)
    if args.reestimation:
        return reestimation_main(args, argv, started, seeds, float_epochs, recipe, data)
    if args.step_cost:
        command = command_line(argv)
        names = list(timed_models(data, args.smoke))
        only = [n for n in names if any(n.startswith(m) for m in args.model or [])]
        if args.model and not only:
            parser.error(f"--model {args.model}: no timed model starts so; they are {names}")
        timings = timed_steps(
            data, args.smoke, (rounds, warmup, inner), STEP_COST_CONFIGS, only=only
        )
        print(f"# machine: {machine()}\n# command: {command}\n# {started:%Y-%m-%d %H:%M} UTC")
        print_timings(timings)
        if args.json:
            write_record(args.json, command, started, None, None, [], step_times=timings)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        results = [
            run_seed(seed, recipe, float_epochs, onnx_bits, data, folder) for seed in range(seeds)
        ]
    timings = timed_steps(data, args.smoke, (rounds, warmup, inner), [(8, True)])
    rows = aggregate(results)
    found = targets(results, timings)

    command = command_line(argv)
    print_header(command, started, seeds, float_epochs, recipe)
    floats = [summary([s[name] for s in results]) for name in ("float_keras", "float_tflite")]
    ptq_passed = sum(s["ptq_int8_passed"] for s in results)
    print(
        f"float test accuracy (%): Keras {cell(floats[0])}, float32 TFLite (LiteRT) "
        f"{cell(floats[1])}; PTQ int8 files within the export's tolerance: "
        f"{ptq_passed}/{len(results)}"
    )
    print()
    print(ROW_HEADER)
    for row in rows:
        print(format_row(row))
    print()
    print("| target | bound | measured (median over seeds) | met |\n|---|---|---|---|")
    for target in found:
        print(
            f"| {target['target']} | {target['bound']} | {target['measured']:g} | "
            f"{verdict(target['met'])} |"
        )
    print()
    print_timings(timings)
    if args.json:
        write_record(
            args.json,
            command,
            started,
            float_epochs,
            recipe,
            results,
            float_keras=floats[0],
            float_tflite=floats[1],
            rows=rows,
            targets=found,
            step_times=timings,
        )
    return 0


# --step-cost: the QAT configurations timed (weight bits, per channel), each with the default
# weight range of its bits.
STEP_COST_CONFIGS = [(8, True), (3, True), (3, False)]


def timed_steps(data, smoke, shape, configs, only=None):
    """`step_times` of each timed model (or those named in `only`), QAT configuration and
    mode (graph, XLA); the pyramid's QAT copies are exported too (`exported`), after their
    XLA steps."""
    rounds, warmup, inner = shape
    timings = []
    for name, model in timed_models(data, smoke).items():
        if only and name not in only:
            continue
        # MobileNetV2's steps take ~0.2–3 s on 2 cores: fewer, single-call rounds.
        small = name.startswith("digits")
        shape = (rounds, warmup, inner) if small else (max(3, rounds // 3), min(warmup, 2), 1)
        # --smoke: MobileNetV2 in graph mode only (tracing its QAT step takes ~30 s on 2 cores,
        # the XLA compile as much again; the digits CNN's rows run both modes).
        modes = (False,) if smoke and not small else (False, True)
        export = name.startswith("pyramid")
        for config in configs:
            timings += [
                step_times(jit, *shape, name, *model, config, export=export and jit)
                for jit in modes
            ]
    return timings


def print_timings(timings):
    """The train-step table."""
    print("| model | QAT | train step | float ms | QAT ms | QAT / float | median round ratio |")
    print("|---|---|---|---|---|---|---|")
    for t in timings:
        print(
            f"| {t['model']} | {t['qat']} | {t['mode']} | {t['float_ms']:.2f} | "
            f"{t['qat_ms']:.2f} | {t['ratio']:.2f} | {t['median_round_ratio']:.2f} |"
        )
    for t in timings:
        for fmt, found in t.get("exports", {}).items():
            print(
                f"{t['model']}, {t['qat']}: {fmt} {'passed' if found['passed'] else 'FAILED'}, "
                f"at most {found['max_lsb_error']:.0f} LSB from Keras, float ops "
                f"{found['float_ops'] or 'none'}, {found['seconds']} s"
            )


def command_line(argv):
    """The command that ran, as the tables and the JSON record it."""
    return " ".join(["python benchmarks/bench_qat.py", *argv])


def print_header(command, started, seeds, float_epochs, recipe):
    """What ran, where and when, as the table's first lines."""
    print(f"# machine: {machine()}")
    print(f"# command: {command}")
    print(f"# {started:%Y-%m-%d %H:%M} UTC; {seeds} seed(s), float {float_epochs} epochs")
    print(f"# QAT recipe: {recipe}")


def write_record(path, command, started, float_epochs, recipe, results, **found):
    """The run's JSON at `path`: what ran, where and when, what it `found`, every seed."""
    record = {
        "command": command,
        "machine": machine(),
        "started_utc": started.isoformat(timespec="minutes"),
        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "seeds": len(results),
        "float_epochs": float_epochs,
        "qat_recipe": recipe,
        **found,
        "per_seed": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic.write_text(path, json.dumps(record, indent=1) + "\n")


def reestimation_main(args, argv, started, seeds, float_epochs, recipe, data):
    """--reestimation: its table, and its JSON, rewritten after each seed (a run cut short
    keeps the seeds it finished)."""
    command = command_line(argv)
    results = []
    for seed in range(seeds):
        results.append(reestimation_seed(seed, recipe, float_epochs, data))
        if args.json:
            write_record(
                args.json,
                command,
                started,
                float_epochs,
                recipe,
                results,
                variants=REESTIMATION_VARIANTS,
                table=reestimation_table(results),
            )
    print_header(command, started, seeds, float_epochs, recipe)
    print("test accuracy (%), median [min-max] over seeds; (drop): median paired drop from float")
    print("\n".join(reestimation_table(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

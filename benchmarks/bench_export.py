"""Latency of exported models: BN folded vs unfolded vs the same architecture with no BN at all.

Runtimes: LiteRT (default XNNPACK delegate), onnxruntime with graph optimisation disabled and
enabled; one thread each. Runs are interleaved (one call of each variant per round) and the
table shows medians, so drift on a shared machine hits every variant alike. Also times
fold_batch_norms on ResNet50 (64 px, weights=None), verification run included, and the same
with int8_readiness=True on a 64-sample probe ("fold with int8 readiness").

    python benchmarks/bench_export.py            # the table of docs/guide/performance.md
    python benchmarks/bench_export.py --smoke    # tiny sizes, one round: CI checks it runs
    python benchmarks/bench_export.py --fold-only  # the fold timings only
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import _tf_env  # noqa: F401  (before TensorFlow: its environment)
import keras
import numpy as np
import onnxruntime as ort
from ai_edge_litert.interpreter import Interpreter

import keras_bn
from keras_bn.export import export_onnx, export_tflite, fold_batch_norms

L = keras.layers


def convnet(size, width, with_bn):
    """A MobileNet-style net: conv, depthwise-separable blocks, Dense→BN head.

    with_bn=False is the floor: the same layers with biases and no BN at all.
    """

    def norm(x):
        return keras_bn.BatchNormalization()(x) if with_bn else x

    inputs = keras.Input((size, size, 3))
    x = L.ReLU(6.0)(
        norm(L.Conv2D(width, 3, strides=2, padding="same", use_bias=not with_bn)(inputs))
    )
    for filters, stride in [(2 * width, 1), (2 * width, 2), (4 * width, 1), (4 * width, 2)]:
        x = L.ReLU(6.0)(
            norm(L.DepthwiseConv2D(3, strides=stride, padding="same", use_bias=not with_bn)(x))
        )
        x = L.ReLU(6.0)(norm(L.Conv2D(filters, 1, use_bias=not with_bn)(x)))
    x = L.GlobalAveragePooling2D()(x)
    x = L.ReLU()(norm(L.Dense(4 * width, use_bias=not with_bn)(x)))
    return keras.Model(inputs, L.Dense(10)(x))


def mlp(features, width, with_bn):
    """4 × (Dense→BN): the case where tf2onnx leaves a Mul per BN and ORT does not fuse it."""
    layers = [keras.Input((features,))]
    for _ in range(4):
        layers.append(L.Dense(width, use_bias=not with_bn))
        if with_bn:
            layers.append(keras_bn.BatchNormalization())
    return keras.Sequential(layers)


def randomise(model, seed=0):
    """Random BN statistics, and non-zero biases: a converter constant-folds an all-zero bias
    away, which would make the no-BN floor lighter than the architecture it stands for."""
    rng = np.random.default_rng(seed)
    for layer in model._flatten_layers(include_self=False):
        if getattr(layer, "bias", None) is not None:
            layer.bias.assign(rng.normal(0, 0.1, layer.bias.shape).astype("float32"))
        if isinstance(layer, keras_bn.BatchNormalization):
            n = layer.moving_mean.shape
            layer.set_weights(
                [
                    rng.uniform(0.5, 1.5, n),
                    rng.normal(0, 0.2, n),
                    rng.normal(0, 0.2, n),
                    rng.uniform(0.5, 1.5, n),
                ]
            )
    return model


def litert_runner(path, x):
    interpreter = Interpreter(model_path=path, num_threads=1)
    (detail,) = interpreter.get_input_details()
    interpreter.resize_tensor_input(detail["index"], x.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(detail["index"], x)

    def run():
        interpreter.invoke()

    return run


def ort_runner(path, x, level):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x}
    return lambda: session.run(None, feed)


SETTINGS = {
    "litert": litert_runner,
    "ort disabled": lambda p, x: ort_runner(p, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
    "ort enabled": lambda p, x: ort_runner(p, x, ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
}
VARIANTS = ("unfolded", "folded", "no BN")


def export_variants(name, with_bn_model, floor_model, folder):
    """{variant: {"tflite": path, "onnx": path}}, each file verified by its exporter."""
    sources = {
        "unfolded": (with_bn_model, False),
        "folded": (with_bn_model, True),
        "no BN": (floor_model, False),
    }
    files = {}
    for variant, (model, fold) in sources.items():
        stem = os.path.join(folder, f"{name}_{variant.replace(' ', '_')}")
        export_tflite(model, stem + ".tflite", fold=fold)
        export_onnx(model, stem + ".onnx", fold=fold)
        files[variant] = {"tflite": stem + ".tflite", "onnx": stem + ".onnx"}
    return files


def time_interleaved(files, x, rounds, warmup, seed=0):
    """{setting: {variant: median seconds}}: each round calls every variant once, in a
    shuffled order, so no variant always runs in the cache state another one left."""
    rng = np.random.default_rng(seed)
    medians = {}
    for setting, make in SETTINGS.items():
        kind = "tflite" if setting == "litert" else "onnx"
        runners = {v: make(files[v][kind], x) for v in VARIANTS}
        for _ in range(warmup):
            for run in runners.values():
                run()
        samples = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            for variant in rng.permutation(VARIANTS):
                run = runners[variant]
                start = time.perf_counter()
                run()
                samples[variant].append(time.perf_counter() - start)
        medians[setting] = {v: statistics.median(s) for v, s in samples.items()}
    return medians


def fold_times(size, repeats, samples):
    """Median seconds of fold_batch_norms on ResNet50 (`size` px, weights=None): on the default
    probe; on `samples` random images; and on those with int8_readiness=True (one forward pass
    per folded host and rounding). Returns (default, probe, readiness, folded host count)."""
    model = randomise(
        keras.applications.ResNet50(
            input_shape=(size, size, 3), weights=None, classifier_activation=None
        )
    )
    probe = np.random.default_rng(0).normal(size=(samples, size, size, 3)).astype("float32")
    runs = {
        "default": lambda: fold_batch_norms(model),
        "probe": lambda: fold_batch_norms(model, probe),
        "readiness": lambda: fold_batch_norms(model, probe, int8_readiness=True),
    }
    times = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved: drift on a shared machine hits all three alike
        for name, run in runs.items():
            start = time.perf_counter()
            _, report = run()
            times[name].append(time.perf_counter() - start)
    medians = [statistics.median(times[name]) for name in runs]
    return (*medians, len(report.channel_spreads))


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(s.split(":", 1)[1].strip() for s in info if s.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores visible, {platform.system()} {platform.release()}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round (CI)")
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument(
        "--fold-only", action="store_true", help="only the fold timings on ResNet50, no latency"
    )
    args = parser.parse_args(argv)
    rounds, warmup = (1, 0) if args.smoke else (args.rounds, 20)
    keras.utils.set_random_seed(0)
    cases = {
        "convnet": (
            lambda bn: convnet(16 if args.smoke else 96, 4 if args.smoke else 32, bn),
            (1, 16 if args.smoke else 96, 16 if args.smoke else 96, 3),
        ),
        "mlp 4x(Dense->BN)": (lambda bn: mlp(16, 8 if args.smoke else 256, bn), (32, 16)),
    }
    print(f"# bench_export — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(f"# machine: {machine()}")
    command = ["python benchmarks/bench_export.py", *(argv or sys.argv[1:])]
    print(f"# command: {' '.join(command)}")
    if not args.fold_only:
        latency_table(cases, rounds, warmup)
    size, samples = (32, 8) if args.smoke else (64, 64)
    default, probe, readiness, hosts = fold_times(size, 1 if args.smoke else 3, samples)
    print(f"\nfold_batch_norms(ResNet50, {size} px), verification included: {default:.2f} s")
    print(
        f"fold with int8 readiness (ResNet50, {size} px, {samples}-sample probe, {hosts} "
        f"hosts × 2 roundings): {readiness:.2f} s; without, on that probe: {probe:.2f} s"
    )
    return 0


def latency_table(cases, rounds, warmup):
    """Print the latency table: each case's three variants in each runtime setting."""
    print(f"# median of {rounds} interleaved runs, one thread, latency in ms")
    header = ("model", "runtime", *VARIANTS, "folded/unfolded", "folded/no BN")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as folder:
        for name, (build, shape) in cases.items():
            files = export_variants(
                name.split()[0], randomise(build(True)), randomise(build(False)), folder
            )
            x = np.random.default_rng(0).normal(size=shape).astype("float32")
            for setting, m in time_interleaved(files, x, rounds, warmup).items():
                cells = [f"{m[v] * 1e3:.3f}" for v in VARIANTS]
                ratios = [f"{m['folded'] / m['unfolded']:.2f}", f"{m['folded'] / m['no BN']:.2f}"]
                print(f"| {name} | {setting} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    sys.exit(main())

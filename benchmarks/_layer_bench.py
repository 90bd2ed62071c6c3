"""What bench_layer.py (TensorFlow), bench_layer_jax.py and bench_layer_torch.py share: the rows,
the CPU's name, the options, the interleaved timing, the targets' check, the JSON, and
bench_model.py's small ResNet (timed whole under PyTorch by bench_layer_torch.py)."""

import datetime
import json
import os
import platform
import statistics
import time

# name, shape, axis
SHAPES = [
    ("NHWC 64x32x32x64", (64, 32, 32, 64), -1),
    ("NCHW 64x64x32x32", (64, 64, 32, 32), 1),
    ("1024x1024", (1024, 1024), -1),
    ("seq 256x128x512", (256, 128, 512), -1),
]
SMOKE_SHAPES = [
    ("NHWC 4x4x4x8", (4, 4, 4, 8), -1),
    ("NCHW 4x8x4x4", (4, 8, 4, 4), 1),
    ("16x32", (16, 32), -1),
    ("seq 4x6x8", (4, 6, 8), -1),
]
POLICIES = ["float32", "mixed_float16"]


def cpu_description():
    """The CPU's model name (from /proc/cpuinfo where there is one) and its core count."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def select_shapes(parser, args):
    """(shapes, reps, inner) of the shared options: SMOKE_SHAPES at one repetition of one call
    under --smoke, and only the first --max-shapes shapes."""
    shapes, reps, inner = (SMOKE_SHAPES, 1, 1) if args.smoke else (SHAPES, args.reps, args.inner)
    if args.max_shapes is not None:
        if args.max_shapes < 1:
            parser.error(f"--max-shapes must be at least 1; received {args.max_shapes}")
        shapes = shapes[: args.max_shapes]
    return shapes, reps, inner


def add_arguments(parser):
    """The options bench_layer_jax.py and bench_layer_torch.py share with bench_layer.py."""
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one repetition")
    parser.add_argument("--reps", type=int, default=15, help="timed samples per contender")
    parser.add_argument("--inner", type=int, default=3, help="calls per sample")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument(
        "--max-shapes", type=int, metavar="N", help="only the first N shapes (of 4)"
    )


def time_samples(functions, x, reps, inner, wait):
    """{name: [seconds per call, one per rep]}, the functions interleaved rep by rep; `wait`
    blocks until a function's output is computed (an asynchronous device's work)."""
    for f in functions.values():  # trace, compile and warm up
        for _ in range(2):
            wait(f(x))
    samples = {name: [] for name in functions}
    for _ in range(reps):
        for name, f in functions.items():
            start = time.perf_counter()
            for _ in range(inner):
                out = f(x)
            wait(out)
            samples[name].append((time.perf_counter() - start) / inner)
    return samples


def per_rep_ratio(samples, ours="keras_bn", theirs="keras"):
    """The median over reps of ours / theirs, each rep's pair timed back to back, which a
    machine whose speed drifts between reps leaves alone; None if either did not run."""
    if ours not in samples or theirs not in samples:
        return None
    return statistics.median(a / b for a, b in zip(samples[ours], samples[theirs], strict=True))


def worst_row(target, bound, ratios):
    """A target's result: its bound, its worst (ratio, row) of `ratios` and whether that ratio
    meets the bound; a ratio of None (a contender that cannot run the row) counts as missed.
    None where no row is covered."""
    if not ratios:
        return None
    ratio, row = max(ratios, key=lambda pair: float("inf") if pair[0] is None else pair[0])
    return {
        "target": target,
        "bound": bound,
        "worst_row": row,
        "ratio": None if ratio is None else round(ratio, 4),
        "met": ratio is not None and ratio <= bound,
    }


def target_results(rows, targets):
    """One result (`worst_row`) per target (name, step, bound) over the rows (label, policy,
    step, medians, ratio) of that step."""
    results = []
    for name, step, bound in targets:
        ratios = [(ratio, f"{label} {policy}") for label, policy, s, _, ratio in rows if s == step]
        results += filter(None, [worst_row(name, bound, ratios)])
    return results


def target_summary(results):
    """A table with one line per target: its worst keras_bn / Keras ratio, met or missed."""
    lines = ["| target | bound | worst row | keras_bn / Keras | met |", "|---|---|---|---|---|"]
    for r in results:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['target']} | ≤ {r['bound']:.2f} | {r['worst_row']} | {ratio} | "
            f"{'yes' if r['met'] else 'MISSED'} |"
        )
    return "\n".join(lines)


def row_record(row):
    """One row (label, policy, step, medians in seconds, ratio) as JSON: medians in ms."""
    label, policy, mode, t, ratio = row
    return {
        "shape": label,
        "policy": policy,
        "step": mode,
        **{f"{name}_ms": round(t[name] * 1e3, 4) for name in t},
        "ratio": None if ratio is None else round(ratio, 4),
    }


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")


def write_record(path, record):
    """`record` as JSON at `path`, written atomically, so that an interrupted run leaves the
    old file."""
    from keras_bn.export import atomic  # after the script has set its backend

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic.write_text(path, json.dumps(record, indent=1) + "\n")


def build_resnet(norm, image=32, width=32, classes=10):
    """A small ResNet (a stem and four residual blocks of two conv–BN(–ReLU), GAP, Dense) with
    `norm()` as every BN: bench_model.py's, and bench_layer_torch.py's whole-model row."""
    import keras  # after the caller has set its backend

    def conv_bn_relu(x, filters, strides=1, relu=True):
        x = keras.layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False)(x)
        x = norm()(x)
        return keras.layers.ReLU()(x) if relu else x

    inputs = keras.Input((image, image, 3))
    x = conv_bn_relu(inputs, width)
    for stage, filters in enumerate((width, width, 2 * width, 2 * width)):
        strides = 2 if stage == 2 else 1
        shortcut = x
        y = conv_bn_relu(x, filters, strides)
        y = conv_bn_relu(y, filters, relu=False)
        if strides != 1 or shortcut.shape[-1] != filters:
            shortcut = keras.layers.Conv2D(filters, 1, strides=strides, use_bias=False)(shortcut)
        x = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(classes)(x))

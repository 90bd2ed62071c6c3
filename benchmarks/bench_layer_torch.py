"""Per-layer speed under the PyTorch backend: keras_bn.BatchNormalization against
keras.layers.BatchNormalization, with torch.nn.functional.batch_norm as the floor, timed
interleaved in one run; prints a table of medians, the targets, and a whole-model row.

Each contender runs eagerly, as Keras runs under PyTorch (`fit` included). Train step = the
forward in training mode (the moving statistics updated in place: the layers' variables, the
floor's running_mean and running_var buffers), a sum-of-squares loss in float32, and
torch.autograd.grad to the input and the weights (γ, β). Inference = the forward with the
moving statistics, under torch.no_grad. The floor is torch's own kernel on the same tensor:
`F.batch_norm(training=True)` with running-stat buffers and autograd's backward for the
train step, `training=False` for inference, channels-last inputs viewed as (values, channels),
a free reshape, and NCHW as it is. A row's ratio is the median over reps of the per-rep ratio
keras_bn / Keras, each rep timing the contenders back to back, which a machine whose speed
drifts between reps leaves alone. A second table checks the target (TARGETS) on those ratios.

Policies: "float32", the layers' default policy on a float32 input; "autocast float16" and
"autocast bfloat16", the same layers (float32 policy) on an input of that dtype, called inside
`torch.autocast(device_type, dtype)`, as a BN after a conv under autocast is (the conv's output
is in that dtype). Both layers then normalize in float32 and output float32 (Keras casts the
input to the layer's compute dtype); the floor keeps the input's dtype (torch's batch_norm
takes a 16-bit input with float32 weights and statistics). The backward runs outside
autocast, as torch's recipe has it. Each contender's first output is checked finite; one that
cannot run a row (an op without a kernel for that dtype on that device) is "n/a" in the
table, with the error in the JSON, rather than stopping the run.

The whole-model row: bench_model.py's small ResNet (stem and four residual blocks of
conv–BN(–ReLU), then GAP and Dense; 32×32×3 synthetic images, batch 64, SGD,
sparse categorical cross-entropy), built twice with the same seed, one with keras_bn's BN and
one with Keras's, `model.train_on_batch` on the same fixed batch, interleaved per rep; and
each model compiled (`jit_compile=True`: torch.compile), whose step should take no longer
than its eager one, with the first step's time (tracing and compiling). A compiled model is
timed in a Python of its own, interleaved with the same model eager (`run_compiled_model`
says why). The same ResNet without any BN (`keras.layers.Identity` in its place), eager and
compiled, gives what compiling does to the rest of the model: on a CPU inductor's step can be
slower than eager with no BN at all, so keras_bn's compiled/eager is also judged against that
model's. --smoke leaves the compiled models out: compiling the ResNet takes minutes on a CPU.

    KERAS_BACKEND=torch python benchmarks/bench_layer_torch.py  # or bench_layer.py --backend torch
    python benchmarks/bench_layer.py --backend torch --smoke      # tiny shapes, one repetition
    python benchmarks/bench_layer.py --backend torch \
        --json benchmarks/results/bench_layer_torch.json          # also the rows as JSON
    python benchmarks/bench_layer.py --backend torch --device cuda  # on the GPU (autocast "cuda")
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import _layer_bench as shared
import keras
import numpy as np
import torch
import torch.nn.functional as F

import keras_bn

CONTENDERS = ("keras_bn", "keras", "floor")
# policy name: the input's dtype, autocast to it (None: no autocast).
POLICIES = {
    "float32": None,
    "autocast float16": torch.float16,
    "autocast bfloat16": torch.bfloat16,
}
# keras_bn / Keras bounds on the per-row ratios: (target, which steps, bound).
TARGETS = [("train step", "train", 1.0)]
EPSILON, MOMENTUM = 1e-3, 0.99  # both layers' defaults; torch's momentum is 1 − Keras's
MODEL_SHAPE = {"image": 32, "batch": 64, "width": 32}
SMOKE_MODEL_SHAPE = {"image": 8, "batch": 8, "width": 8}


def machine_description(device):
    gpu = f"GPU {torch.cuda.get_device_name(device)}; " if device.type == "cuda" else ""
    return (
        f"{shared.cpu_description()}; {gpu}PyTorch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Keras {keras.__version__}, "
        f"Python {platform.python_version()}"
    )


def _autocast(device, dtype):
    """torch.autocast on the device's type to `dtype`, or nothing for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _loss(y):
    return torch.sum(torch.square(y.to(torch.float32)))


def _layer_steps(layer, device, dtype):
    """(train step, inference) of a built Keras layer: functions of x."""
    weights = [v.value for v in layer.trainable_weights]

    def train(x):
        with _autocast(device, dtype):
            y = layer(x, training=True)
        return torch.autograd.grad(_loss(y), [x, *weights])

    def inference(x):
        with torch.no_grad(), _autocast(device, dtype):
            return layer(x, training=False)

    return train, inference


def _floor_steps(axis, channels, device, dtype):
    """(train step, inference) of F.batch_norm with its own weights and running buffers."""
    weight = torch.ones(channels, device=device, requires_grad=True)
    bias = torch.zeros(channels, device=device, requires_grad=True)
    running_mean = torch.zeros(channels, device=device)
    running_var = torch.ones(channels, device=device)

    def view(x):  # batch_norm wants the channels at axis 1; (values, channels) is a free view
        return x if axis == 1 else x.reshape(-1, channels)

    def norm(x, training):
        with _autocast(device, dtype):
            return F.batch_norm(
                view(x),
                running_mean,
                running_var,
                weight,
                bias,
                training=training,
                momentum=1.0 - MOMENTUM,
                eps=EPSILON,
            )

    def train(x):
        return torch.autograd.grad(_loss(norm(x, True)), [x, weight, bias])

    def inference(x):
        with torch.no_grad():
            return norm(x, False)

    return train, inference


def contenders(shape, axis, dtype, device):
    """{name: {"train": function of x, "inference": function of x}} for one shape."""
    found = {}
    for name, cls in (
        ("keras_bn", keras_bn.BatchNormalization),
        ("keras", keras.layers.BatchNormalization),
    ):
        with keras.device(device.type):
            layer = cls(axis=axis, epsilon=EPSILON, momentum=MOMENTUM)
            layer.build(shape)
        found[name] = dict(zip(("train", "inference"), _layer_steps(layer, device, dtype)))
    steps = _floor_steps(axis, shape[axis], device, dtype)
    found["floor"] = dict(zip(("train", "inference"), steps))
    return found


def _runnable(functions, x):
    """The functions that run on x with finite outputs; {name: error} for the others."""
    kept, errors = {}, {}
    for name, f in functions.items():
        try:
            out = f(x)
        except (RuntimeError, TypeError, NotImplementedError) as error:
            errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            continue
        outputs = out if isinstance(out, tuple) else (out,)
        if not all(bool(torch.isfinite(t).all()) for t in outputs):
            errors[name] = "non-finite output"
            continue
        kept[name] = f
    return kept, errors


def _wait(device):
    """Blocks until the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        return lambda out: torch.cuda.synchronize(device)
    return lambda out: None


def run(shapes, reps, inner, device, errors):
    """[(label, policy, step, medians, ratio)]: every row, printed as it is measured; the
    contenders that cannot run a row go into `errors` ({row: {name: error}})."""
    rows = []
    for label, shape, axis in shapes:
        for policy, dtype in POLICIES.items():
            x = torch.tensor(
                np.random.default_rng(0).normal(1.0, 2.0, shape),
                dtype=dtype or torch.float32,
                device=device,
            )
            steps = contenders(shape, axis, dtype, device)
            for mode in ("train", "inference"):
                functions = {name: steps[name][mode] for name in CONTENDERS}
                functions, failed = _runnable(functions, x.requires_grad_(mode == "train"))
                if failed:
                    errors[f"{label} {policy} {mode}"] = failed
                samples = shared.time_samples(functions, x, reps, inner, _wait(device))
                medians = {name: statistics.median(s) for name, s in samples.items()}
                rows.append((label, policy, mode, medians, shared.per_rep_ratio(samples)))
                print(_format_row(rows[-1]), flush=True)
    return rows


NORMS = {
    "keras_bn": keras_bn.BatchNormalization,
    "keras": keras.layers.BatchNormalization,
    "no_bn": keras.layers.Identity,
}
MODEL_LABELS = {"keras_bn": "keras_bn", "keras": "Keras BN", "no_bn": "no BN"}


def _model_steps(names, device, image, batch, width, compiled):
    """({key: function of nothing, one train_on_batch}, {key: first step's seconds}) of the
    small ResNet with each norm of `names`, eager ("keras_bn") and, where `compiled`, with
    `jit_compile=True` (torch.compile: "keras_bn compiled"), all from the same initial weights."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, image, image, 3)).astype("float32")
    y = rng.integers(0, 10, size=(batch,))
    steps, first = {}, {}
    for name in names:
        for jit_compile in (False, True) if compiled else (False,):
            keras.utils.set_random_seed(0)  # the same initial weights for all
            with keras.device(device.type):
                model = shared.build_resnet(NORMS[name], image=image, width=width)
                model.compile(
                    keras.optimizers.SGD(0.01),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    jit_compile=jit_compile,
                )
            key = f"{name} compiled" if jit_compile else name
            start = time.perf_counter()
            model.train_on_batch(x, y)  # builds the optimizer's variables; traces, compiles
            first[key] = time.perf_counter() - start
            for _ in range(2):  # warm up
                model.train_on_batch(x, y)
            steps[key] = (lambda m: lambda _: m.train_on_batch(x, y))(model)
    return steps, first


def run_model(reps, device, image, batch, width):
    """(medians {name: seconds per train_on_batch}, samples) of the small ResNet with keras_bn's
    BN and with Keras's, eager, interleaved in this process."""
    steps, _ = _model_steps(("keras_bn", "keras"), device, image, batch, width, compiled=False)
    samples = shared.time_samples(steps, None, reps, 1, _wait(device))
    return {name: statistics.median(s) for name, s in samples.items()}, samples


def run_compiled_model(name, reps, device, image, batch, width):
    """{eager_ms, compiled_ms, compiled_over_eager, first_step_s} of the small ResNet with the
    norm `name`, eager and compiled interleaved, in a Python of its own. Dynamo keeps what it
    compiles per code object, and Keras's own frames (its functional call, the trainer's step
    and the optimizer's, around their graph breaks) are the same code for every model: in one
    process, the models compiled there share those frames' caches, and a model's compiled step
    then depends on which were compiled before it (keras_bn's measured 0.88x eager alone, 1.15x
    compiled first of the three and 1.38x compiled last, 2026-11-30). A process per model is
    also what a user training one model has."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--compiled-model",
        name,
        "--reps",
        str(reps),
        "--device",
        str(device),
        "--model-shape",
        json.dumps([image, batch, width]),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name}'s compiled model failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compiled_model_main(name, reps, device, image, batch, width):
    """`run_compiled_model`'s child: prints its result as one JSON line."""
    # Keras's frames recompile a few times even for one model (each past a graph break of
    # its own code); past dynamo's default limit of 8 a frame would run eagerly.
    torch._dynamo.config.recompile_limit = 64
    steps, first = _model_steps((name,), device, image, batch, width, compiled=True)
    samples = shared.time_samples(steps, None, reps, 1, _wait(device))
    key = f"{name} compiled"
    result = {
        "eager_ms": round(statistics.median(samples[name]) * 1e3, 4),
        "compiled_ms": round(statistics.median(samples[key]) * 1e3, 4),
        "compiled_over_eager": round(shared.per_rep_ratio(samples, key, name), 4),
        "first_step_s": round(first[key], 1),
    }
    print(json.dumps(result))


HEADER = (
    "| shape | policy | step | keras_bn ms | Keras BN ms | floor ms | keras_bn / Keras "
    "| keras_bn / floor |\n|---|---|---|---|---|---|---|---|"
)


def _ms(t, name):
    return f"{t[name] * 1e3:.2f}" if name in t else "n/a"


def _format_row(row):
    label, policy, mode, t, ratio = row
    floor = f"{t['keras_bn'] / t['floor']:.2f}" if "keras_bn" in t and "floor" in t else "n/a"
    return (
        f"| {label} | {policy} | {mode} | {_ms(t, 'keras_bn')} | {_ms(t, 'keras')} | "
        f"{_ms(t, 'floor')} | {'n/a' if ratio is None else f'{ratio:.2f}'} | {floor} |"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shared.add_arguments(parser)
    parser.add_argument(
        "--device", help="cpu or cuda (default: Keras's device under PyTorch, cuda if it sees one)"
    )
    parser.add_argument("--command", help=argparse.SUPPRESS)  # bench_layer.py's, for the JSON
    # run_compiled_model's child: one model's eager and compiled steps, as a JSON line.
    parser.add_argument("--compiled-model", choices=sorted(NORMS), help=argparse.SUPPRESS)
    parser.add_argument("--model-shape", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if keras.backend.backend() != "torch":
        parser.error(f"needs KERAS_BACKEND=torch; Keras is using {keras.backend.backend()!r}")
    try:
        device = torch.device(args.device or keras.src.backend.torch.core.get_device())
    except RuntimeError as error:
        parser.error(f"--device {args.device!r} is not a torch device: {error}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda; received {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device!r}: PyTorch sees no CUDA device")
    if args.compiled_model:
        _compiled_model_main(args.compiled_model, args.reps, device, *args.model_shape)
        return 0
    started = shared.utc_now()
    shapes, reps, inner = shared.select_shapes(parser, args)
    model_shape = SMOKE_MODEL_SHAPE if args.smoke else MODEL_SHAPE
    machine = machine_description(device)
    print(f"machine: {machine}")
    print(f"device: {device}")
    print(
        "eager; train = forward + autograd.grad to x and the weights + moving statistics; "
        "floor = torch.nn.functional.batch_norm; medians\n"
    )
    print(HEADER, flush=True)
    errors = {}
    rows = run(shapes, reps, inner, device, errors)
    targets = shared.target_results(rows, TARGETS)
    print("\n" + shared.target_summary(targets))
    model_times, model_samples = run_model(reps, device, **model_shape)
    model_ratio = shared.per_rep_ratio(model_samples)
    model_label = (
        f"ResNet {model_shape['image']}x{model_shape['image']}x3, batch {model_shape['batch']}, "
        f"width {model_shape['width']}"
    )
    ours, theirs = (model_times[name] * 1e3 for name in ("keras_bn", "keras"))
    print(
        f"\nwhole model, train_on_batch, {model_label}: keras_bn {ours:.1f} ms, Keras BN "
        f"{theirs:.1f} ms, keras_bn / Keras {model_ratio:.2f}"
    )
    compiled_record = None
    if not args.smoke:  # torch.compile of the ResNet takes minutes on a CPU
        compiled_record = {
            "step": "train_on_batch, jit_compile=True (torch.compile), each model eager and "
            "compiled interleaved in a Python of its own",
            **{name: run_compiled_model(name, reps, device, **model_shape) for name in NORMS},
        }
        ratios = {name: compiled_record[name]["compiled_over_eager"] for name in NORMS}
        compiled_record["met"] = ratios["keras_bn"] <= 1.0
        # What compiling costs the model without BN bounds what BN can be asked for.
        compiled_record["met_against_no_bn"] = ratios["keras_bn"] <= ratios["no_bn"]
        print(
            "compiled (jit_compile=True, torch.compile; a process per model): "
            + "; ".join(
                f"{label} {compiled_record[name]['compiled_ms']:.1f} ms, {ratios[name]:.2f}x its "
                f"eager step (first step {compiled_record[name]['first_step_s']:.0f} s)"
                for name, label in MODEL_LABELS.items()
            )
            + f"; target: keras_bn compiled ≤ eager: "
            f"{'met' if compiled_record['met'] else 'MISSED'}; keras_bn's compiled/eager ≤ the "
            f"model's without BN: {'met' if compiled_record['met_against_no_bn'] else 'MISSED'}"
        )
    for row, failed in errors.items():
        print(f"n/a in {row}: {failed}")
    if args.json:
        argv = argv if argv is not None else sys.argv[1:]
        record = {
            "command": args.command or "python benchmarks/bench_layer_torch.py " + " ".join(argv),
            "machine": machine,
            "device": str(device),
            "torch_threads": torch.get_num_threads(),
            "started_utc": started,
            "finished_utc": shared.utc_now(),
            "rows": [shared.row_record(row) for row in rows],
            "targets": targets,
            "model": {
                "model": model_label,
                "step": "train_on_batch",
                **{f"{name}_ms": round(t * 1e3, 4) for name, t in model_times.items()},
                "ratio": round(model_ratio, 4),
                "compiled": compiled_record,
            },
            "not_run": errors,
        }
        shared.write_record(args.json, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What gpu_fake_quant.py (JAX) and gpu_fake_quant_torch.py (PyTorch) share: the QAT weights'
and bias's inputs, the bit-for-bit comparison of two devices' outputs, and the JSON record."""

import argparse
import datetime
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent


def put_tests_on_path():
    """tests/, for the sweep (fake_quant_cases.py) and the helpers it imports, first on
    sys.path, as pyproject's pytest pythonpath gives them."""
    sys.path[:0] = [str(ROOT / "tests")]


def parser(description, device, against):
    """The scripts' options: --device, --against (their defaults given), --json, --every."""
    found = argparse.ArgumentParser(description=description)
    found.add_argument("--device", default=device, help=f"the device checked ({device})")
    found.add_argument("--against", default=against, help=f"the device it must equal ({against})")
    found.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH")
    found.add_argument(
        "--every", type=int, default=1, metavar="N", help="every Nth case only (a dry run's)"
    )
    return found


def fake_quant_op(backend_ops, per_channel, bits, narrow):
    """The backend's FakeQuant op (its fake_quant module), per tensor or per channel, as a
    function of (x, min, max)."""
    op = (
        backend_ops.fake_quant_with_min_max_vars_per_channel
        if per_channel
        else backend_ops.fake_quant_with_min_max_vars
    )
    return lambda x, lo, hi: op(x, lo, hi, bits, narrow)


def weights_grid(quantize_ops, bits, per_channel):
    """keras_bn.quantize.fake_quant's weight grid as a function of the kernel."""
    return lambda kernel: quantize_ops.fake_quant_weights(
        kernel, quantize_ops.weight_max_abs(kernel, per_channel), bits
    )


# (kernel shape, bit widths): a conv kernel and a Dense one.
WEIGHT_SHAPES = (((3, 3, 8, 16), (2, 4, 8)), ((64, 32), (8,)))


def weight_kernels(rng):
    """[(shape, bits, kernel)]: float32 kernels with weights on the half steps of the grid of ±1
    (the largest weight of each channel is 1), and a third of them anywhere in [-1, 1]."""
    found = []
    for shape, all_bits in WEIGHT_SHAPES:
        for bits in all_bits:
            q_max = 2 ** (bits - 1) - 1
            q = rng.integers(-q_max, q_max, shape)
            kernel = np.where(
                rng.random(shape) < 0.3, rng.uniform(-1.0, 1.0, shape), (q + 0.5) / q_max
            ).astype(np.float32)
            kernel.reshape(-1, shape[-1])[0] = 1.0
            found.append((shape, bits, kernel))
    return found


def weight_case_name(shape, bits, per_channel):
    return f"weights{'x'.join(map(str, shape))}/{bits}bit/" + (
        "per_channel" if per_channel else "per_tensor"
    )


def bias_inputs(rng):
    """((bias, step) with the ties of the rounding appended, (bias, step)): round_bias's
    outputs, then its gradient."""
    bias = rng.normal(0, 0.1, 64).astype(np.float32)
    step = np.float32(2.0**-9) * rng.uniform(0.5, 2.0, 64).astype(np.float32)
    halves = ((np.round(bias / step) + 0.5) * step).astype(np.float32)  # ties of the rounding
    return (np.concatenate([bias, halves]), np.tile(step, 2)), (bias, step)


def compare(cases, run, device, against, modes):
    """Every case (name, function, args) in each of `modes(name)` (compiled or not) on both
    devices, `run(function, args, device, compiled)` giving a flat list of numpy arrays:
    (values compared, mismatches)."""
    compared, mismatches = 0, []
    for name, function, args in cases:
        for compiled in modes(name):
            mine = run(function, args, device, compiled)
            theirs = run(function, args, against, compiled)
            for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                if a.shape != b.shape:
                    mismatches.append({"case": name, "jit": compiled, "output": index})
                    continue
                a, b = np.ravel(a).astype(np.float32), np.ravel(b).astype(np.float32)
                compared += a.size
                (differ,) = np.nonzero(a.view(np.int32) != b.view(np.int32))
                if differ.size:
                    mismatches.append(
                        {
                            "case": name,
                            "jit": compiled,
                            "output": index,
                            "count": int(differ.size),
                            "first": [[float(a[i]), float(b[i])] for i in differ[:3]],
                        }
                    )
    return compared, mismatches


def report(json_path, header, cases, compared, mismatches, started, modes_text):
    """Write the record (to `json_path` if given, atomically), print the verdict; the exit
    code: 0 equal bit for bit, 1 some value differs. `header` holds device, against and the
    framework's version."""
    from keras_bn.export import atomic  # after the script has set its backend

    record = {
        **header,
        "cases": cases,
        "values_compared": compared,
        "mismatches": mismatches[:20],
        "mismatched_cases": len(mismatches),
        "bit_for_bit": not mismatches,
        "seconds": round(time.monotonic() - started, 1),
        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if json_path:
        atomic.write_text(json_path, json.dumps(record, indent=1) + "\n")
    verdict = "equal bit for bit" if not mismatches else f"{len(mismatches)} outputs DIFFER"
    print(
        f"gpu_fake_quant: {cases} cases, {modes_text}, {compared} values: {verdict} "
        f"({record['seconds']} s)"
    )
    return 0 if not mismatches else 1

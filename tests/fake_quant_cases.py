"""The fake-quantization cases of tests/test_quantize_backends.py (under JAX and PyTorch) and
benchmarks/gpu_fake_quant*.py, and TensorFlow's answers to them: every case's
`tf.quantization.fake_quant_with_min_max_vars(_per_channel)` output (and gradients), run in a
TensorFlow Python (tensorflow_side) in one process. It lives in tests/, on pyproject's
pythonpath, so that both suites import it."""

import json

import numpy as np
import tensorflow_side


def nudged(low, high, bits, narrow):
    """(scale, nudged_min) of TensorFlow's nudged grid, in numpy float32: only to place the
    test values on and around the rounding boundaries (TensorFlow's outputs are the
    reference)."""
    f = np.float32
    q_lo, q_hi = f(1 if narrow else 0), f(2**bits - 1)
    scale = f(f(high) - f(low)) / f(q_hi - q_lo)
    zero_from_min = q_lo - f(low) / scale
    zero = np.clip(np.sign(zero_from_min) * np.floor(np.abs(zero_from_min) + f(0.5)), q_lo, q_hi)
    return scale, f((q_lo - zero) * scale)


def ranges():
    """(bits, narrow, min, max): symmetric, asymmetric, min = 0, tiny and wide ranges."""
    rng = np.random.default_rng(7)
    found = []
    for trial in range(60):
        bits = int(rng.integers(2, 9))
        narrow = bool(trial % 2)
        low = np.float32(-abs(rng.normal()) * rng.choice([1e-3, 1.0, 10.0]))
        high = np.float32(abs(rng.normal()) * rng.choice([1e-3, 1.0, 10.0]))
        if trial % 3 == 0:
            high = -low
        if trial % 7 == 0:
            low = np.float32(0.0)
        found.append((bits, narrow, low, high))
    return found


def _values(bits, narrow, low, high, rng):
    """Random values in and around the range, every grid value, every half between two grid
    values and the floats either side of each half (the rounding boundaries)."""
    scale, nudged_min = nudged(low, high, bits, narrow)
    k = np.arange(-3, 2**bits + 3, dtype=np.float32)
    halves = (nudged_min + (k + 0.5) * scale).astype(np.float32)
    return np.concatenate(
        [
            rng.uniform(low * 1.2 - 0.1, high * 1.2 + 0.1, 100).astype(np.float32),
            (nudged_min + k * scale).astype(np.float32),
            halves,
            np.nextafter(halves, np.float32(np.inf)),
            np.nextafter(halves, np.float32(-np.inf)),
        ]
    )


def sweep():
    """The bit-for-bit cases: (bits, narrow, min, max, values) per range."""
    rng = np.random.default_rng(0)
    return [
        (bits, narrow, low, high, _values(bits, narrow, low, high, rng))
        for bits, narrow, low, high in ranges()
    ]


def gradient_case(per_channel):
    """(x, min, max, upstream): values inside and outside three ranges (or the first)."""
    rng = np.random.default_rng(2)
    x = rng.uniform(-2.0, 3.0, size=(50, 3)).astype(np.float32)
    upstream = rng.normal(size=x.shape).astype(np.float32)
    low = np.array([-1.0, -0.5, -1.5], np.float32)
    high = np.array([1.0, 2.0, 1.5], np.float32)
    if not per_channel:
        low, high = low[0], high[0]
    return x, low, high, upstream


def shared_cases():
    """The cases both suites run: name -> (op, bits, narrow, arrays); arrays holds x, min and
    max, and upstream where the case wants the gradients too. Per range of `sweep()` its
    values per tensor ("sweep{i}") and as one channel ("sweep{i}_channel"); the gradient cases
    ("gradient_per_tensor", "gradient_per_channel")."""
    cases = {}
    for i, (bits, narrow, low, high, x) in enumerate(sweep()):
        cases[f"sweep{i}"] = ("per_tensor", bits, narrow, {"x": x, "min": low, "max": high})
        column = {"x": x[:, None], "min": np.array([low]), "max": np.array([high])}
        cases[f"sweep{i}_channel"] = ("per_channel", bits, narrow, column)
    for per_channel in (False, True):
        x, low, high, upstream = gradient_case(per_channel)
        op = "per_channel" if per_channel else "per_tensor"
        arrays = {"x": x, "min": low, "max": high, "upstream": upstream}
        cases[f"gradient_{op}"] = (op, 8, False, arrays)
    return cases


# TensorFlow's side: each case's FakeQuant output (and, for a case with an upstream, the
# gradients to x, min and max), run eagerly as the ops are, into outputs.npz.
_TENSORFLOW_FAKE_QUANT = """
import json, sys
import numpy as np
import tensorflow as tf

folder = sys.argv[1]
with open(folder + "/cases.json") as file:
    cases = json.load(file)
arrays = np.load(folder + "/inputs.npz")
ops = {
    "per_tensor": tf.quantization.fake_quant_with_min_max_vars,
    "per_channel": tf.quantization.fake_quant_with_min_max_vars_per_channel,
}
found = {}
for name, (op, bits, narrow) in cases.items():
    tensors = [tf.constant(arrays[name + "/" + key]) for key in ("x", "min", "max")]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        y = ops[op](*tensors, num_bits=bits, narrow_range=narrow)
        if name + "/upstream" in arrays:
            loss = tf.reduce_sum(y * arrays[name + "/upstream"])
    found[name + "/y"] = y.numpy()
    if name + "/upstream" in arrays:
        for key, gradient in zip(("x", "min", "max"), tape.gradient(loss, tensors)):
            found[name + "/d_" + key] = gradient.numpy()
np.savez(folder + "/outputs.npz", **found)
print("{}")
"""


def tensorflow_outputs(cases, folder):
    """TensorFlow's outputs for `cases` (as `shared_cases`'s), from one process: {case/y,
    and case/d_x, case/d_min, case/d_max for a case with an upstream: numpy array}."""
    with open(folder / "cases.json", "w") as file:
        json.dump({name: case[:3] for name, case in cases.items()}, file)
    np.savez(
        folder / "inputs.npz",
        **{
            f"{name}/{key}": np.asarray(value, np.float32)
            for name, (*_, arrays) in cases.items()
            for key, value in arrays.items()
        },
    )
    tensorflow_side.run(_TENSORFLOW_FAKE_QUANT, folder, backend="tensorflow")
    with np.load(folder / "outputs.npz") as outputs:
        return dict(outputs)


def assert_bits_equal(actual, expected):
    """The two float32 arrays hold the same bits (NaN payloads and signed zeros included)."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    differ = np.nonzero(actual.view(np.int32) != expected.view(np.int32))
    assert differ[0].size == 0, (actual[differ][:5], expected[differ][:5])

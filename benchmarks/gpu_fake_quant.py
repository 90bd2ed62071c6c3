"""QAT fake quantization on a GPU against the CPU, bit for bit (gpu_check.py's step under JAX).

keras_bn's fake quantization under the JAX backend runs on two JAX devices, the GPU and the
CPU, on the same inputs, and every output and gradient must have the same bits:

- the FakeQuant ops (keras_bn/backend/jax/fake_quant.py), per tensor and per channel, over the
  60 ranges of tests/fake_quant_cases.py with values on, beside and between every rounding
  boundary (the tests' sweep, imported), under jit (and every fourth range eagerly too), with their
  straight-through gradients to x, min and max;
- keras_bn.quantize.fake_quant's weight grid (weight_max_abs, fake_quant_weights: per channel
  and per tensor, a conv kernel at 2, 4 and 8 bits and a Dense one at 8, with weights on the
  half steps) and activation grid (fake_quant_activations over the same ranges), with the
  gradients to the kernel and x (those under jit only, as `fit` takes them);
- round_bias, and the steps (weight_step, activation_step).

    KERAS_BACKEND=jax python benchmarks/gpu_fake_quant.py [--device gpu] [--against cpu]
        [--json PATH] [--every N]

gpu_check.py's dry run compares the CPU with itself (--device cpu), on every 8th case
(--every 8): the script's check, not the GPU's. Exit code 0 equal, 1 some value differs (the
JSON lists the first ones), 2 no such device.
"""

import functools
import os
import re
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import _fake_quant_check as check
import jax
import jax.numpy as jnp
import numpy as np

from keras_bn.backend.jax import fake_quant as jfq
from keras_bn.quantize import fake_quant as fq

check.put_tests_on_path()
from fake_quant_cases import sweep  # noqa: E402  the bit-for-bit sweep of the tests


@functools.cache
def _gradient(function, argnums):
    """The gradient of sum(function(*args) · u) for a fixed pseudo-random u, to `argnums`."""

    def loss(*args):
        y = function(*args)
        u = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
        return jnp.sum(y * u)

    return jax.grad(loss, argnums=argnums)


# One function object per kind and static arguments, so that jit compiles once per input shape.
@functools.cache
def _fake_quant(per_channel, bits, narrow):
    return check.fake_quant_op(jfq, per_channel, bits, narrow)


@functools.cache
def _activations(bits):
    return lambda x, lo, hi: fq.fake_quant_activations(x, lo, hi, bits)


@functools.cache
def _activation_step(bits):
    return lambda lo, hi: fq.activation_step(lo, hi, bits)


@functools.cache
def _weights(bits, per_channel):
    return check.weights_grid(fq, bits, per_channel)


@functools.cache
def _weight_step(bits, per_channel):
    return lambda kernel: fq.weight_step(fq.weight_max_abs(kernel, per_channel), bits)


def cases():
    """(name, function, args): every call compared; `function` takes the args as arrays."""
    found = []
    for i, (bits, narrow, low, high, x) in enumerate(sweep()):
        scalars = (x, np.float32(low), np.float32(high))
        column = (x[:, None], np.array([low]), np.array([high]))
        per_tensor, per_channel = _fake_quant(False, bits, narrow), _fake_quant(True, bits, narrow)
        found += [
            (f"range{i}/per_tensor", per_tensor, scalars),
            (f"range{i}/per_tensor/gradient", _gradient(per_tensor, (0, 1, 2)), scalars),
            (f"range{i}/per_channel", per_channel, column),
            (f"range{i}/per_channel/gradient", _gradient(per_channel, (0, 1, 2)), column),
            (f"range{i}/activations", _activations(bits), scalars),
            (f"range{i}/activations/gradient", _gradient(_activations(bits), 0), scalars),
            (f"range{i}/activation_step", _activation_step(bits), scalars[1:]),
        ]
    rng = np.random.default_rng(3)
    for shape, bits, kernel in check.weight_kernels(rng):
        for per_channel in (True, False):
            weights = _weights(bits, per_channel)
            name = check.weight_case_name(shape, bits, per_channel)
            found += [
                (name, weights, (kernel,)),
                (name + "/gradient", _gradient(weights, 0), (kernel,)),
                (name + "/step", _weight_step(bits, per_channel), (kernel,)),
            ]
    ties, plain = check.bias_inputs(rng)
    found.append(("round_bias", fq.round_bias, ties))
    found.append(("round_bias/gradient", _gradient(fq.round_bias, 0), plain))
    return found


@functools.cache
def _jit(function):
    return jax.jit(function)


def run(function, args, device, compiled):
    """function(*args) on `device` (its inputs committed there), eagerly or under jit, as a
    flat list of numpy arrays."""
    args = jax.device_put(args, device)
    outputs = (_jit(function) if compiled else function)(*args)
    leaves = jax.tree_util.tree_leaves(outputs)
    assert all(device in leaf.devices() for leaf in leaves), (device, leaves)
    return [np.asarray(leaf) for leaf in leaves]


def _eager(name):
    """Whether a case also runs eagerly: not a gradient, and not in three ranges of four."""
    if name.endswith("gradient"):
        return False
    found = re.match(r"range(\d+)/", name)
    return found is None or int(found.group(1)) % 4 == 0


def compare(device, against, every=1):
    """Every case under jit, and eagerly too but for the gradients (which `fit` always takes
    under jit) and for three ranges in four (op by op, the slowest part), on both devices:
    (values compared, mismatches)."""
    return check.compare(
        cases()[::every],
        run,
        device,
        against,
        lambda name: (False, True) if _eager(name) else (True,),
    )


def main(argv=None):
    parser = check.parser(__doc__.splitlines()[0], "gpu", "cpu")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        device, against = jax.devices(args.device)[0], jax.devices(args.against)[0]
    except RuntimeError as error:
        print(f"gpu_fake_quant: no {args.device} or {args.against} device: {error}")
        return 2
    print(f"gpu_fake_quant: {device} ({device.device_kind}) against {against}", flush=True)
    compared, mismatches = compare(device, against, args.every)
    header = {
        "device": f"{device} ({device.device_kind})",
        "against": f"{against} ({against.device_kind})",
        "jax": jax.__version__,
    }
    count = len(cases()[:: args.every])
    return check.report(args.json, header, count, compared, mismatches, started, "jit and eager")


if __name__ == "__main__":
    raise SystemExit(main())

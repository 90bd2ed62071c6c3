"""QAT fake quantization on a GPU against the CPU, bit for bit, under PyTorch (gpu_check.py's
step under torch; gpu_fake_quant.py is JAX's).

keras_bn's fake quantization under the PyTorch backend runs on two torch devices, the GPU and
the CPU, on the same inputs, and every output and gradient must have the same bits:

- the FakeQuant ops (keras_bn/backend/torch/fake_quant.py), per tensor and per channel, over the
  60 ranges of tests/test_quantize_backends.py with values on, beside and between every
  rounding boundary (its sweep, imported), with their straight-through gradients to x, min and
  max (autograd, of the sum of the output times a fixed pseudo-random tensor);
- keras_bn.quantize.fake_quant's weight grid (weight_max_abs, fake_quant_weights: per channel
  and per tensor, a conv kernel at 2, 4 and 8 bits and a Dense one at 8, with weights on the
  half steps) and activation grid (fake_quant_activations over the same ranges), with the
  gradients to the kernel and x;
- round_bias, and the steps (weight_step, activation_step).

PyTorch runs eagerly (as Keras's PyTorch backend does, `fit` included): each case runs once per
device, op by op. Options, dry run and exit codes as gpu_fake_quant.py's, the devices being
torch's:

    KERAS_BACKEND=torch python benchmarks/gpu_fake_quant_torch.py [--device cuda] [--against cpu]
"""

import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import _fake_quant_check as check
import numpy as np
import torch

from keras_bn.backend.torch import fake_quant as tfq
from keras_bn.quantize import fake_quant as fq

check.put_tests_on_path()
from fake_quant_cases import sweep  # noqa: E402  the bit-for-bit sweep of the tests


def _gradient(function, argnums):
    """The gradient of sum(function(*args) · u) for a fixed pseudo-random u, to `argnums`."""

    def gradient(*args):
        args = [a.clone().requires_grad_(i in argnums) for i, a in enumerate(args)]
        y = function(*args)
        u = torch.cos(torch.arange(y.numel(), dtype=torch.float32, device=y.device))
        return torch.autograd.grad(torch.sum(y * u.reshape(y.shape)), [args[i] for i in argnums])

    return gradient


def cases():
    """(name, function, args): every call compared; `function` takes the args as tensors."""
    found = []
    for i, (bits, narrow, low, high, x) in enumerate(sweep()):
        scalars = (x, np.float32(low), np.float32(high))
        column = (x[:, None], np.array([low]), np.array([high]))
        per_tensor = check.fake_quant_op(tfq, False, bits, narrow)
        per_channel = check.fake_quant_op(tfq, True, bits, narrow)
        activations = (lambda b: lambda x, lo, hi: fq.fake_quant_activations(x, lo, hi, b))(bits)
        found += [
            (f"range{i}/per_tensor", per_tensor, scalars),
            (f"range{i}/per_tensor/gradient", _gradient(per_tensor, (0, 1, 2)), scalars),
            (f"range{i}/per_channel", per_channel, column),
            (f"range{i}/per_channel/gradient", _gradient(per_channel, (0, 1, 2)), column),
            (f"range{i}/activations", activations, scalars),
            (f"range{i}/activations/gradient", _gradient(activations, (0,)), scalars),
            (
                f"range{i}/activation_step",
                (lambda b: lambda lo, hi: fq.activation_step(lo, hi, b))(bits),
                scalars[1:],
            ),
        ]
    rng = np.random.default_rng(3)
    for shape, bits, kernel in check.weight_kernels(rng):
        for per_channel in (True, False):
            weights = check.weights_grid(fq, bits, per_channel)
            step = (lambda b, c: lambda k: fq.weight_step(fq.weight_max_abs(k, c), b))(
                bits, per_channel
            )
            name = check.weight_case_name(shape, bits, per_channel)
            found += [
                (name, weights, (kernel,)),
                (name + "/gradient", _gradient(weights, (0,)), (kernel,)),
                (name + "/step", step, (kernel,)),
            ]
    ties, plain = check.bias_inputs(rng)
    found.append(("round_bias", fq.round_bias, ties))
    found.append(("round_bias/gradient", _gradient(fq.round_bias, (0,)), plain))
    return found


def run(function, args, device, compiled):
    """function(*args) on `device` (its inputs made there), eagerly (`compiled` is False: no
    jit under PyTorch), as a flat list of numpy arrays."""
    del compiled
    tensors = [torch.as_tensor(np.asarray(a, np.float32), device=device) for a in args]
    outputs = function(*tensors)
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    assert all(out.device == device for out in outputs), (device, outputs)
    return [out.detach().cpu().numpy() for out in outputs]


def main(argv=None):
    parser = check.parser(__doc__.splitlines()[0], "cuda", "cpu")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        # A tensor's device: "cuda" as "cuda:0", what the outputs' devices are compared with.
        device, against = (torch.zeros(1, device=d).device for d in (args.device, args.against))
    except (RuntimeError, AssertionError) as error:  # AssertionError: torch without CUDA
        print(f"gpu_fake_quant: no {args.device} or {args.against} device: {error}")
        return 2
    names = {
        d: torch.cuda.get_device_name(d) if d.type == "cuda" else "CPU" for d in (device, against)
    }
    print(f"gpu_fake_quant: {device} ({names[device]}) against {against}", flush=True)
    chosen = cases()[:: args.every]
    compared, mismatches = check.compare(chosen, run, device, against, lambda name: (False,))
    header = {
        "device": f"{device} ({names[device]})",
        "against": f"{against} ({names[against]})",
        "torch": torch.__version__,
    }
    return check.report(args.json, header, len(chosen), compared, mismatches, started, "eager")


if __name__ == "__main__":
    raise SystemExit(main())

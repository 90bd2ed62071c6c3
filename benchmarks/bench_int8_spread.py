"""int8 readiness: a folded host's channel spread and its measured rounding error, against the
errors of real int8 files.

The digits MLP (examples/digits.py `train_mlp`: Dense → BN → ReLU → Dense) in two families of
variants:

- "γ×s": one BN channel's γ and β scaled by s and the head's row for it by 1/s
  (`scale_hidden_channel`): the same function, whose folded hidden kernel has that channel s
  times larger than the others, which carry as much as before;
- "γ=1e-4 ×k": k BN channels' γ set to 1e-4 after training, as network slimming (L1 on γ)
  leaves them: the folded kernel's spread is huge, but those channels carry next to nothing.

Each variant is folded with int8_readiness=True on 64 test samples (the hidden kernel's
per-tensor and per-channel rounding errors, measured), then converted to TFLite four ways and
run in LiteRT on the test split:

- int8, dynamic: what export_tflite writes (TF 2.21: every weight one scale per output channel);
- the same with the converter's `_experimental_disable_per_channel`: one scale per weight
  tensor, as a per-tensor runtime would quantize. "dynamic" quantizes the weights to int8 ahead
  of time and the activations per batch at run time, so its columns are close to the weights'
  own share of the error, which is what the measurement rounds.

Every error is judged as the export's verification judges a file (`report.compare`): the worst
output channel's max |error| as a fraction of that channel's scale. The files are compared with
the Keras model on the test split, the measurement with the unrounded folded model on its 64
samples.

    python benchmarks/bench_int8_spread.py            # the table of docs/guide/export.md
    python benchmarks/bench_int8_spread.py --smoke    # two variants, one epoch: CI checks it runs
"""

import argparse
import datetime
import os
import sys
import tempfile

import _tf_env  # noqa: F401  (before TensorFlow: its environment)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import numpy as np
from bench_export import machine

import digits
from keras_bn.export import fold_batch_norms, report, tflite, trace

CHANNEL = 5  # the channel γ×s scales
SLIM_GAMMA = 1e-4


class _PerTensor(tflite._TFLite):
    """export_tflite's conversion, with one int8 scale per weight tensor."""

    def _configure(self, converter, sig):
        super()._configure(converter, sig)
        converter._experimental_disable_per_channel = True


def file_error(model, fmt, x, labels):
    """(relative error, accuracy) of `model` folded, converted by `fmt`, run in LiteRT on x; the
    error is the worst output channel's, relative to its scale (`report.compare`)."""
    sig = trace.signature(model)
    folded, _ = fold_batch_norms(model, x[:64])
    content = fmt.convert(folded, sig)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "m.tflite")
        with open(path, "wb") as file:
            file.write(content)
        actual = tflite.run(path, x)
    expected = trace.outputs(model, sig, trace.feed(sig, x))
    _, _, channels = report.compare(expected, {"litert": actual}, report.INT8_READINESS_TOLERANCE)
    (worst,) = channels.values()
    (output,) = actual.values()
    return worst.relative_error, float(np.mean(output.argmax(-1) == labels))


def slim(model, channels):
    """Set the γ of `channels` of the model's BN to SLIM_GAMMA, in place."""
    bn = model.get_layer(index=1)
    gamma = bn.gamma.numpy()
    gamma[list(channels)] = SLIM_GAMMA
    bn.gamma.assign(gamma)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="two variants, one epoch (CI)")
    args = parser.parse_args(argv)
    model, x_train = digits.train_mlp(epochs=1 if args.smoke else 15)
    _, _, x_test, y_test = digits.load(flat=True)
    base = model.get_weights()
    # The channels slimmed away: every 4th (8 of 32) and every 2nd (16 of 32).
    variants = {"γ×1": (1.0, ()), "γ×1000": (1000.0, ())}
    if not args.smoke:
        variants = {f"γ×{s}": (float(s), ()) for s in (1, 4, 8, 16, 64, 256, 1000)}
        variants.update({f"γ=1e-4 ×{k}": (1.0, range(0, 32, 32 // k)) for k in (1, 8, 16)})
    formats = {
        "int8 per channel": tflite._TFLite("int8", x_train),
        "int8 per tensor": _PerTensor("int8", x_train),
        "dynamic per channel": tflite._TFLite("dynamic", None),
        "dynamic per tensor": _PerTensor("dynamic", None),
    }
    print(f"# machine: {machine()}")
    command = ["python benchmarks/bench_int8_spread.py", *(argv or sys.argv[1:])]
    print(f"# command: {' '.join(command)}")
    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; keras "
        f"test accuracy {np.mean(model.predict(x_test, verbose=0).argmax(-1) == y_test):.3f}"
    )
    header = ["variant", "spread", "measured per tensor", "measured per channel", *formats]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, (s, slimmed) in variants.items():
        model.set_weights(base)
        digits.scale_hidden_channel(model, CHANNEL, s)
        slim(model, slimmed)
        _, fold_report = fold_batch_norms(model, x_test, int8_readiness=True)
        (spread,) = fold_report.channel_spreads
        cells = [
            f"{spread.output_spread:.4g}",
            f"{spread.per_tensor_error:.3g}",
            f"{spread.per_channel_error:.3g}",
        ]
        cells += [
            f"{error:.3g} ({accuracy:.3f})"
            for error, accuracy in (
                file_error(model, fmt, x_test, y_test) for fmt in formats.values()
            )
        ]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print("error of each output channel's scale, worst channel (test accuracy)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

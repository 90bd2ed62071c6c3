"""int8 error against the spread of a folded host's per-channel weight ranges.

The digits MLP (examples/digits.py `train_mlp`: Dense → BN → ReLU → Dense) gets one BN channel
scaled by s and the head's row for it by 1/s (`scale_hidden_channel`): the same function, whose
folded hidden kernel has that channel s times larger. Each variant is folded and converted to
TFLite four ways, and run in LiteRT on the test split:

- int8, dynamic: what export_tflite writes (TF 2.21: every weight one scale per output channel);
- the same with the converter's `_experimental_disable_per_channel`: one scale per weight
  tensor, as a per-tensor runtime would quantize. "dynamic" quantizes only the weights, so its
  column is the weights' own share of the error.

Errors are max |LiteRT − Keras| over the test split, as a fraction of max |Keras output|.

    python benchmarks/bench_int8_spread.py            # the table of docs/guide/export.md
    python benchmarks/bench_int8_spread.py --smoke    # two scales, one epoch: CI checks it runs
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
from keras_bn.export import fold_batch_norms, tflite, trace

CHANNEL = 5


class _PerTensor(tflite._TFLite):
    """export_tflite's conversion, with one int8 scale per weight tensor."""

    def _configure(self, converter, sig):
        super()._configure(converter, sig)
        converter._experimental_disable_per_channel = True


def litert_error(model, fmt, x, labels):
    """(relative error, accuracy) of `model` folded, converted by `fmt`, run in LiteRT on x."""
    folded, _ = fold_batch_norms(model, x[:64])
    content = fmt.convert(folded, trace.signature(model))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "m.tflite")
        with open(path, "wb") as file:
            file.write(content)
        (actual,) = tflite.run(path, x).values()
    expected = model.predict(x, verbose=0)
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    return float(error), float(np.mean(actual.argmax(-1) == labels))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="two scales, one epoch (CI)")
    args = parser.parse_args(argv)
    scales = (1, 1000) if args.smoke else (1, 4, 8, 16, 64, 256, 1000)
    model, x_train = digits.train_mlp(epochs=1 if args.smoke else 15)
    _, _, x_test, y_test = digits.load(flat=True)
    base = model.get_weights()
    formats = {
        "int8 per channel": tflite._TFLite("int8", x_train),
        "int8 per tensor": _PerTensor("int8", x_train),
        "dynamic per channel": tflite._TFLite("dynamic", None),
        "dynamic per tensor": _PerTensor("dynamic", None),
    }
    print(f"# machine: {machine()}")
    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; keras "
        f"test accuracy {np.mean(model.predict(x_test, verbose=0).argmax(-1) == y_test):.3f}"
    )
    print("| s | spread | " + " | ".join(formats) + " |")
    print("|---|---|" + "---|" * len(formats))
    for s in scales:
        model.set_weights(base)
        digits.scale_hidden_channel(model, CHANNEL, float(s))
        _, report = fold_batch_norms(model, x_train[:64])
        (spread,) = report.channel_spreads
        cells = [
            f"{error:.3g} ({accuracy:.3f})"
            for error, accuracy in (
                litert_error(model, fmt, x_test, y_test) for fmt in formats.values()
            )
        ]
        print(f"| {s} | {spread.output_spread:.1f} | " + " | ".join(cells) + " |", flush=True)
    print("error of the output scale (test accuracy)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

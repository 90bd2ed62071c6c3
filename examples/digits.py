"""The bundled digits data set and a small keras_bn CNN: shared by `make demo`, tests and notebooks.

Run as a script (`make demo`) it trains the CNN and prints the test accuracy; it can also save
the model and its training inputs (for int8 calibration), score an exported .tflite file, and
print the table `make demo` ends with (`--summary FOLDER`: each file written there, its size and
format, its verification from keras-bn-export's JSON reports, and its test accuracy).
"""

import argparse
import glob
import json
import os

from keras_bn import _quiet

if __name__ == "__main__":  # the demo: quiet TensorFlow start-up, as every entry point's
    _quiet.entry_point()

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import keras_bn


def load(test_size=0.25, seed=0, flat=False):
    """sklearn's 8×8 digits as NHWC float32 in [0, 1]: (x_train, y_train, x_test, y_test).

    flat=True gives 64-vectors instead, for MLPs.
    """
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")
    x = x.reshape(len(x), -1) if flat else x[..., None]
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_size, random_state=seed, stratify=y
    )
    return x_train, y_train, x_test, y_test


def batches(x, y, batch_size, seed=0):
    """An endless, shuffled tf.data stream of full batches, for `fit(..., steps_per_epoch=k)`.

    The remainder is dropped: a last batch of one example would give BN m = 1.
    """
    import tensorflow as tf  # here, so that the rest of the module imports under any backend

    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=seed)
        .repeat()
        .batch(batch_size, drop_remainder=True)
    )


def small_cnn(norm=keras_bn.BatchNormalization, momentum=0.9):
    """Conv–BN–ReLU ×2, pool, Dense–BN–ReLU, softmax. `norm` is the BN layer class.

    momentum=0.9 rather than Keras's 0.99: a run of a few hundred steps is too short for a
    0.99 moving average to forget its initial value (0.99**220 ≈ 0.11 of it is left).
    """
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
            norm(momentum=momentum),
            keras.layers.ReLU(),
            keras.layers.Conv2D(32, 3, padding="same", use_bias=False),
            norm(momentum=momentum),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, use_bias=False),
            norm(momentum=momentum),
            keras.layers.ReLU(),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def train(epochs=10, batch_size=64, jit_compile=False, seed=0, verbose=0):
    """Train `small_cnn` on digits; return (model, test accuracy)."""
    keras.utils.set_random_seed(seed)
    x_train, y_train, x_test, y_test = load(seed=seed)
    model = small_cnn()
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    model.fit(x_train, y_train, epochs=epochs, batch_size=batch_size, verbose=verbose)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return model, float(accuracy)


def separable_cnn(momentum=0.9):
    """A depthwise-separable BN CNN with logits out: Conv2D–BN–ReLU, DepthwiseConv2D–BN–ReLU6,
    1×1 Conv2D–BN–ReLU, max pooling, SeparableConv2D–BN–ReLU, global average pooling, Dense.

    Its depthwise layers make one weight range per layer costly when it is quantized, as in
    MobileNet (benchmarks/bench_qat.py, examples/07_qat.ipynb).
    """

    def block(x, host, activation):
        return activation(keras_bn.BatchNormalization(momentum=momentum)(host(x)))

    inputs = keras.Input((8, 8, 1), name="image")
    x = block(
        inputs, keras.layers.Conv2D(16, 3, padding="same", use_bias=False), keras.layers.ReLU()
    )
    x = block(
        x, keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False), keras.layers.ReLU(6.0)
    )
    x = block(x, keras.layers.Conv2D(32, 1, use_bias=False), keras.layers.ReLU())
    x = keras.layers.MaxPooling2D()(x)
    x = block(
        x, keras.layers.SeparableConv2D(64, 3, padding="same", use_bias=False), keras.layers.ReLU()
    )
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(x), name="separable_cnn")


def train_separable(epochs=30, batch_size=64, seed=0):
    """Train `separable_cnn` on digits from `seed` (Adam 3e-3, the shuffled stream of full
    batches); return (model, test accuracy). The seed sets the weights and the batch order; the
    split is `load()`'s."""
    keras.utils.set_random_seed(seed)
    x_train, y_train, x_test, y_test = load()
    model = separable_cnn()
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    model.fit(
        batches(x_train, y_train, batch_size, seed=seed),
        steps_per_epoch=len(x_train) // batch_size,
        epochs=epochs,
        shuffle=False,  # the stream is shuffled already
        verbose=0,
    )
    logits = model.predict(x_test, verbose=0)
    return model, float(np.mean(logits.argmax(-1) == y_test))


def train_mlp(epochs=5, seed=0):
    """Dense(32, "hidden") → BN → ReLU → Dense(10, "head", logits) on the 64 pixels, trained
    with Adam; returns (model, x_train)."""
    keras.utils.set_random_seed(seed)
    x_train, y_train, _, _ = load(seed=seed, flat=True)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, use_bias=False, name="hidden"),
            keras_bn.BatchNormalization(momentum=0.9),
            keras.layers.ReLU(),
            keras.layers.Dense(10, name="head"),
        ]
    )
    model.compile(
        keras.optimizers.Adam(3e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x_train, y_train, epochs=epochs, batch_size=64, verbose=0)
    return model, x_train


def scale_hidden_channel(model, channel, factor):
    """Scale one channel of a `train_mlp` model's BN by `factor` (γ and β) and the head's row
    for it by 1/factor, in place: the same function (ReLU(a·x) = a·ReLU(x) for a > 0), whose
    folded hidden kernel has that channel `factor` times larger."""
    if not factor > 0:
        raise ValueError(f"factor must be positive (ReLU keeps only that); received {factor}.")
    bn, head = model.get_layer(index=1), model.get_layer("head")
    for variable in (bn.gamma, bn.beta):
        value = variable.numpy()
        value[channel] *= factor
        variable.assign(value)
    kernel = head.kernel.numpy()
    kernel[channel] /= factor
    head.kernel.assign(kernel)


def round_weights(model, bits, per_channel=True):
    """Round every Dense and convolution kernel of `model` to `bits` bits, in place: post-training
    rounding of a folded model (`fold_batch_norms`), biases and activations left in float.

    The grid is the one keras_bn.quantize's QAT layers round to (`fake_quant.weight_grid`:
    symmetric, narrow range, the kernel viewed with its output channels last); a separable
    convolution's depthwise and pointwise kernels are both rounded, and Dense kernels get one
    range per tensor whatever `per_channel` says, as `quantize_model` makes them.
    """
    from keras_bn.quantize import fake_quant, hosts

    for layer in model._flatten_layers(include_self=False):
        kind = hosts.KINDS.get(type(layer))
        if kind is None:
            continue
        if kind == hosts.SEPARABLE:
            kernels = [
                (layer.depthwise_kernel, hosts.DEPTHWISE),
                (layer.pointwise_kernel, hosts.CONV),
            ]
        else:
            kernels = [(layer.kernel, kind)]
        for variable, layout in kernels:
            view = np.asarray(hosts.channels_last(variable.numpy(), layout))
            q, scale = fake_quant.weight_grid(view, bits, per_channel and kind != hosts.DENSE)
            rounded = q.astype(np.float32) * scale
            variable.assign(np.asarray(hosts.from_channels_last(rounded, variable.shape)))


def tflite_accuracy(path):
    """Test accuracy of a digits classifier exported to .tflite, run in LiteRT."""
    from keras_bn.export.tflite import run

    _, _, x_test, y_test = load()
    (predictions,) = run(path, x_test).values()
    return float(np.mean(predictions.argmax(-1) == y_test))


def file_accuracy(path):
    """Test accuracy of a digits classifier saved as .keras, .tflite or .onnx, each run in its
    own runtime (Keras, LiteRT, onnxruntime); None for any other file."""
    _, _, x_test, y_test = load()
    if path.endswith(".keras"):
        predictions = keras.saving.load_model(path, compile=False).predict(x_test, verbose=0)
    elif path.endswith(".tflite"):
        return tflite_accuracy(path)
    elif path.endswith(".onnx"):
        from keras_bn.export.onnx import run

        (predictions,) = run(path, x_test).values()
    else:
        return None
    return float(np.mean(np.asarray(predictions).argmax(-1) == y_test))


def summary(folder):
    """The lines of the table `make demo` ends with: every file in `folder`, its size, its
    format, its verification (from the keras-bn-export JSON reports there: passed or FAILED,
    with the error as a fraction of the output's scale and the tolerance) and the digits test
    accuracy of the models."""
    verified = {}  # absolute path → the report's entry for it
    for report_path in glob.glob(os.path.join(folder, "*.json")):
        with open(report_path, encoding="utf-8") as file:
            report = json.load(file)
        for export in report.get("exports", []):
            verified[os.path.abspath(export["path"])] = export
    rows = [("file", "size", "format", "verification", "test accuracy")]
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        export = verified.get(os.path.abspath(path))
        with _quiet.captured([]):  # LiteRT's "Created TensorFlow Lite XNNPACK delegate"
            accuracy = file_accuracy(path)
        rows.append(
            (
                path,
                _size(os.path.getsize(path)),
                _format(path, export),
                _verification(path, export),
                "" if accuracy is None else f"{accuracy:.4f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _size(size):
    return f"{size / 1024:.1f} KiB" if size >= 1024 else f"{size} B"


def _format(path, export):
    if export is not None:
        name = {"tflite": "TFLite", "onnx": "ONNX"}[export["format"]]
        return f"{name} {export['quantization'] or 'float32'}"
    extension = os.path.splitext(path)[1]
    return {".keras": "Keras model", ".npy": "NumPy array", ".json": "export report"}.get(
        extension, extension.lstrip(".") or "?"
    )


def _verification(path, export):
    if export is None:
        return "" if path.endswith(".keras") else "-"
    verdict = "passed" if export["passed"] else "FAILED"
    if export["unverified"]:
        verdict = f"{verdict}, UNVERIFIED"
    if export["scale_tolerance"] is None:  # a quantization-aware model's file: output steps
        return f"{verdict} ({export['max_lsb_error']:.3g} LSB)"
    error = export["relative_error"]
    shown = "nan" if error is None else f"{error:.1e}"
    return f"{verdict} ({shown} of scale, tolerance {export['scale_tolerance']:g})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--jit-compile", action="store_true")
    parser.add_argument("--save", metavar="MODEL.keras", help="save the trained model here")
    parser.add_argument(
        "--save-inputs",
        metavar="X.npy",
        help="save the training inputs here (int8 calibration data)",
    )
    parser.add_argument(
        "--score-tflite",
        metavar="MODEL.tflite",
        help="only print the test accuracy of this exported model",
    )
    parser.add_argument(
        "--summary",
        metavar="FOLDER",
        help="only print a table of the files in FOLDER: size, format, verification (from "
        "keras-bn-export's JSON reports there) and test accuracy",
    )
    args = parser.parse_args(argv)
    if args.summary:
        print(f"Written to {args.summary}/ (test accuracy on the digits test set):")
        print("\n".join(summary(args.summary)))
        return 0
    if args.score_tflite:
        accuracy = tflite_accuracy(args.score_tflite)
        print(f"digits test accuracy ({args.score_tflite}, LiteRT): {accuracy:.4f}")
        return 0
    model, accuracy = train(epochs=args.epochs, jit_compile=args.jit_compile, verbose=2)
    print(f"digits test accuracy (keras_bn CNN, {args.epochs} epochs): {accuracy:.4f}")
    from keras_bn.export import atomic

    if args.save:
        with atomic.replacing(args.save) as temporary:
            model.save(temporary)
    if args.save_inputs:
        with atomic.replacing(args.save_inputs) as temporary:
            np.save(temporary, load()[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Large feature maps: the keras_bn train step and its batch variance's float32 error at 2¹⁶,
2¹⁸ and 2²⁰ values per channel, against keras.layers.BatchNormalization; prints a table of
medians.

Each row is an NHWC batch (B, 32, 32, 16). Its data is the worst case for the shifted sums:
N(0, 1) with each channel's first 8 samples at 2.9σ, so that the shift (their mean) sits just
under the 3σ redo. The contenders, timed interleaved in one process (graph mode):

- keras_bn with the batch size known when traced (the path `train_path` picks for the shape);
- keras_bn with the batch size known only at run time, as `fit` traces it (the fused path then
  chooses between the kernel and the composite ops by a tf.cond on the count);
- keras.layers.BatchNormalization, batch size known.

The error is the batch variance's largest relative error over the channels against float64
numpy, read from the moving variance after one call with momentum 0 (the unbiased estimate,
rescaled by (m − 1)/m), for keras_bn (run-time batch size) and Keras.

    python benchmarks/bench_large_counts.py            # full table (about a minute on 2 cores)
    python benchmarks/bench_large_counts.py --smoke    # one small row, one repetition
"""

import argparse
import statistics
import sys

import _tf_env  # noqa: F401  (before TensorFlow: its environment)
import keras
import numpy as np
import tensorflow as tf
from _layer_bench import time_samples

import keras_bn

CHANNELS = 16
BATCHES = (64, 256, 1024)  # 2¹⁶, 2¹⁸ and 2²⁰ values per channel at 32×32
SIDE = 32


def data(batch, side=SIDE):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, side, side, CHANNELS)).astype(np.float32)
    x[:8, 0, 0, :] = 2.9
    return x


def _train_step(layer, shape):
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.square(y))
        return tape.gradient(loss, [x] + layer.trainable_weights)

    return tf.function(step, input_signature=[tf.TensorSpec(shape, tf.float32)])


def contenders(shape):
    """{name: traced train step}."""
    run_time = (None,) + shape[1:]
    layers = {
        "keras_bn": keras_bn.BatchNormalization(),
        "keras_bn_run_time": keras_bn.BatchNormalization(),
        "keras": keras.layers.BatchNormalization(),
    }
    for layer in layers.values():
        layer.build(shape)
    return {
        name: _train_step(layer, run_time if name.endswith("run_time") else shape)
        for name, layer in layers.items()
    }


def variance_error(layer_class, x, batch_known):
    layer = layer_class(momentum=0.0)
    layer.build(x.shape)
    shape = x.shape if batch_known else (None,) + x.shape[1:]
    call = tf.function(
        lambda x: layer(x, training=True), input_signature=[tf.TensorSpec(shape, tf.float32)]
    )
    call(tf.constant(x))
    m = x.size // x.shape[-1]
    got = layer.moving_variance.numpy().astype(np.float64)
    if layer_class is keras_bn.BatchNormalization:  # the unbiased m/(m−1)·σ²
        got *= (m - 1) / m
    reference = x.astype(np.float64).var(axis=(0, 1, 2))
    return float(np.max(np.abs(got / reference - 1)))


def time_row(functions, x, reps, inner):
    """Median seconds per call for each function, the functions interleaved rep by rep."""
    samples = time_samples(functions, x, reps, inner, lambda out: [t.numpy() for t in out])
    return {name: statistics.median(s) for name, s in samples.items()}


HEADER = (
    "| values per channel | keras_bn ms (batch known) | keras_bn ms (batch at run time) "
    "| Keras BN ms | run time / known | keras_bn / Keras | keras_bn σ² error | Keras σ² error |"
    "\n|---|---|---|---|---|---|---|---|"
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one small row, one repetition")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--inner", type=int, default=3)
    args = parser.parse_args(argv)
    batches, side, reps, inner = (
        ((4,), 4, 1, 1) if args.smoke else (BATCHES, SIDE, args.reps, args.inner)
    )
    from bench_layer import machine_description

    print(f"machine: {machine_description()}")
    print(f"NHWC (B, {side}, {side}, {CHANNELS}), shift at 2.9σ; train step medians\n")
    print(HEADER)
    for batch in batches:
        x_np = data(batch, side)
        x = tf.constant(x_np)
        t = time_row(contenders(x_np.shape), x, reps, inner)
        ours = variance_error(keras_bn.BatchNormalization, x_np, batch_known=False)
        theirs = variance_error(keras.layers.BatchNormalization, x_np, batch_known=True)
        print(
            f"| {batch * side * side:,} | {t['keras_bn'] * 1e3:.2f} | "
            f"{t['keras_bn_run_time'] * 1e3:.2f} | {t['keras'] * 1e3:.2f} | "
            f"{t['keras_bn_run_time'] / t['keras_bn']:.2f} | {t['keras_bn'] / t['keras']:.2f} | "
            f"{ours:.1e} | {theirs:.1e} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

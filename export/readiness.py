"""int8 readiness, measured: how far rounding one folded host's kernel to int8 moves the folded
model's outputs.

A channel spread (`fold.channel_spread`) says how coarse per-tensor int8 is for a kernel's
smallest channel, not whether that channel matters: a network-slimming model (L1 on γ) has
near-zero channels with spreads of 1e4 to 1e6 that carry almost nothing to the output. So each
folded host is measured instead: its folded kernel is replaced by its int8 rounding (the
symmetric narrow-range grid of `keras_bn.quantize.fake_quant.weight_grid`: one scale for the
whole tensor, or one per output channel as TFLite's int8 has it), the folded model is run on
the probe, and its outputs are judged against the unrounded folded model's as an int8 file's
are judged (`report.compare`: each output channel against its own scale, with its floor). Only
that host's weights are rounded: the error is its own share, not a whole int8 file's
(activations, and every other host, also round there).

Cost: one forward pass of the folded model per host and mode, on up to
`defaults.PROBE_SAMPLES` samples of the probe, through one traced function whose kernels are
variables assigned in place (no model is rebuilt): a tf.function on TensorFlow, Keras's
compiled `predict` on JAX (which passes the variables' current values to each call). ResNet50
at 64 px (53 hosts) takes about 19 times its fold (benchmarks/bench_export.py --fold-only),
which is why `fold_batch_norms` measures only with int8_readiness=True (the int8 exporters turn
it on).
"""

import dataclasses
import typing

import keras
import numpy as np
import numpy.typing as npt

from keras_bn import backend
from keras_bn.export import defaults, fold, report, trace
from keras_bn.quantize import fake_quant

BITS = 8


class Host(typing.NamedTuple):
    """A folded host of the folded model, as the measurement needs it.

    Attributes:
        spread: its ChannelSpread.
        kernel: the variable holding its folded kernel in the folded model (a SeparableConv's
            pointwise kernel).
        layout: where the kernel's output channels lie (`fold.LAST`, `fold.TRANSPOSE`,
            `fold.DEPTHWISE`).
    """

    spread: report.ChannelSpread
    kernel: typing.Any
    layout: str


def round_kernel(kernel: npt.ArrayLike, layout: str, per_channel: bool) -> np.ndarray:
    """`kernel` rounded to the symmetric narrow-range int8 grid, as a runtime quantizes it.

    Args:
        kernel: a finite float kernel.
        layout: where its output channels lie, as for `fold.output_channel_ranges`.
        per_channel: one scale per output channel (TFLite's int8) rather than one for the
            whole tensor.

    Returns:
        float32 array of the kernel's shape: q·scale, |q| ≤ 127, scale = max |w| / 127 of
        the tensor or of each output channel.

    Raises:
        ValueError: an unknown layout.
    """
    kernel = np.asarray(kernel, np.float32)
    if not per_channel:
        q, scale = fake_quant.weight_grid(kernel, BITS, per_channel=False)
        return q * scale
    # weight_grid takes the output channels on the last axis: move them there and back.
    if layout == fold.LAST:
        to_last, back = (lambda k: k), (lambda k: k)
    elif layout == fold.TRANSPOSE:
        to_last, back = (lambda k: np.moveaxis(k, -2, -1)), (lambda k: np.moveaxis(k, -1, -2))
    elif layout == fold.DEPTHWISE:  # (*k, C, M): channel c·M + m
        to_last = lambda k: k.reshape(*k.shape[:-2], -1)  # noqa: E731
        back = lambda k: k.reshape(kernel.shape)  # noqa: E731
    else:
        raise ValueError(
            f"layout must be one of {(fold.LAST, fold.TRANSPOSE, fold.DEPTHWISE)}; received "
            f"layout={layout!r}."
        )
    q, scale = fake_quant.weight_grid(to_last(kernel), BITS, per_channel=True)
    return back(q * scale)


def measure(
    folded_model: keras.Model, sig: trace.Signature, inputs: trace.Feed, hosts: list[Host]
) -> list[report.ChannelSpread]:
    """Each host's ChannelSpread with its measured rounding errors.

    Args:
        folded_model: the folded model whose variables `hosts` hold; its kernels are assigned
            the rounded values one at a time and restored (bit for bit) before this returns.
        sig: the model's Signature.
        inputs: the probe, a Feed; up to `defaults.PROBE_SAMPLES` of its samples, spread
            evenly, are run.
        hosts: a Host per folded host.

    Returns:
        list of ChannelSpread, one per host in order, with `per_tensor_error` and
        `per_channel_error` set: the worst output channel's error relative to its scale
        (`report.compare`), NaN for a kernel with a non-finite weight (int8 cannot hold it)
        or a non-finite output.
    """
    if not hosts:
        return []
    inputs = trace.spread_samples(inputs, defaults.PROBE_SAMPLES)
    if backend.get().traced_functions_read_weights():
        infer = trace.inference_function(folded_model, sig)
        tensors = [inputs[name] for name in sig.input_names]

        def run() -> dict[str, np.ndarray]:
            return {name: np.asarray(v, np.float64) for name, v in infer(*tensors).items()}
    else:  # a JAX function traced once would keep the kernels it saw as constants

        def run() -> dict[str, np.ndarray]:
            results = folded_model.predict(sig.pack(inputs), batch_size=inputs.samples, verbose=0)
            flat = keras.tree.flatten(results)
            return {name: np.asarray(v, np.float64) for name, v in zip(sig.output_names, flat)}

    reference = run()
    measured = []
    for host in hosts:
        original = host.kernel.numpy()
        errors: dict[bool, float] = {}
        for per_channel in (False, True):
            if not np.all(np.isfinite(original)):
                errors[per_channel] = float("nan")
                continue
            rounded = round_kernel(original, host.layout, per_channel)
            host.kernel.assign(rounded.astype(original.dtype))
            try:
                actual = run()
            finally:
                host.kernel.assign(original)
            _, _, channels = report.compare(
                reference, {"rounded": actual}, report.INT8_READINESS_TOLERANCE
            )
            errors[per_channel] = report.worst(c.relative_error for c in channels.values())
        measured.append(
            dataclasses.replace(
                host.spread, per_tensor_error=errors[False], per_channel_error=errors[True]
            )
        )
    return measured

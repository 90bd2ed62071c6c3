"""export_onnx: the ONNX steps of the export pipeline (tf2onnx, onnx.checker, onnxruntime).

Keras runs a grouped Conv1D/2D (and a channels_first Conv3D) on TensorFlow inside an
XLA-compiled function, since TensorFlow's CPU kernels lack them; tf2onnx cannot convert that
function ("No Op registered for StatefulPartitionedCall"). The model is therefore traced with
those layers as one plain TensorFlow convolution op each (`plain_convolutions`), which tf2onnx
converts to an ONNX Conv with its `group` attribute. A grouped Conv3D is refused: tf2onnx
(1.17) writes it without its groups.

A quantization-aware (QAT) model is written in QDQ form: its export form (export/qat.py) holds
every activation range as an 8-bit FakeQuant op, which tf2onnx writes as a QuantizeLinear /
DequantizeLinear pair, and its kernels as inputs of the traced function, which export/qdq.py
then makes int8 initializers read by per-channel DequantizeLinear nodes. The ops that compute
in float are read from the written graph (`qdq.float_ops`).
"""

import os
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from keras_bn.backend import guard

# The writer converts TensorFlow functions: a file from another backend is loaded under
# TensorFlow. Checked before the converters' imports, so that their absence is named.
guard.require_writers("keras_bn.export.export_onnx")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from keras_bn._errors import UnsupportedModelError, one_line  # noqa: E402
from keras_bn._graph import models  # noqa: E402
from keras_bn.export import pipeline, qat, qdq, report, trace  # noqa: E402
from keras_bn.quantize import hosts  # noqa: E402

# Both ends of onnxruntime's optimiser: what the file says, and what ORT makes of it.
SESSION_SETTINGS = {
    "ort_disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "ort_enabled": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
# An ONNX graph's inputs and outputs are values of one namespace; any string names them.
NAMES = trace.NameRules(format="ONNX", one_namespace=True)
L = keras.layers
# The QAT hosts a file can hold, and each kernel's ONNX layout from its grid's channels-last
# view, with the axis of its output channels: Conv (O, I/g, kh, kw) from (kh, kw, I/g, O), a
# depthwise one (C·M, 1, kh, kw) from (kh, kw, 1, C·M); MatMul (in, out) as it is.
QAT_HOSTS = (L.Dense, L.Conv2D, L.DepthwiseConv2D, L.SeparableConv2D)
QAT_LAYOUTS = {
    hosts.CONV: ((3, 2, 0, 1), 0),
    hosts.DEPTHWISE: ((3, 2, 0, 1), 0),
    hosts.DENSE: ((0, 1), 1),
}
# Per-axis DequantizeLinear.
QAT_MIN_OPSET = 13


def export_onnx(
    model: keras.Model,
    path: str | os.PathLike[str],
    opset: int = 17,
    fold: bool = True,
    probe: trace.ModelInput | None = None,
    scale_tolerance: float | None = None,
    strict: bool = True,
    on_stage: Callable[[str], None] | None = None,
    *,
    atol: float | None = None,
    allow_unverified: bool = False,
) -> report.ExportReport:
    """Write `model` as an .onnx file at `path`, once it matches the Keras model in onnxruntime.

    A quantization-aware model (one holding keras_bn.quantize layers, from `quantize_model`)
    is written in QDQ form from its own weights and ranges: each kernel an int8 initializer
    (the integers its layer rounds to) read by a DequantizeLinear, per output channel where
    its weights are, and each activation a per-tensor uint8 QuantizeLinear/DequantizeLinear
    pair on its range's grid. It is judged in units of each output's quantization step (the
    report's `lsb_errors`: at most `defaults.QAT_MAX_LSB` steps on every value and
    `defaults.QAT_PERCENTILE_LSB` on 99% of them), its int8 weights are read back and must
    equal that grid (`weights`), and no op may compute in float (`float_ops`: an op outside a
    DequantizeLinear → op → QuantizeLinear unit, as a Lambda(t·3 + 1) between QAT layers
    writes its multiply; the TFLite file refuses the same ops).

    Args:
        model: a built Sequential or Functional Keras model; any number of inputs and outputs
            (lists, dicts), of any dtypes.
        path: the .onnx file to write. It is written to a temporary file in the same folder,
            validated with onnx.checker, run and compared, and only then renamed to `path`.
        opset: the ONNX opset (13 or more for a quantization-aware model: per-axis
            DequantizeLinear).
        fold: fold the batch norms first (`fold_batch_norms`); a quantization-aware model's
            layers hold theirs folded already, and it is not folded again.
        probe: inputs on which the file is compared with `model`, in any structure
            `model.predict` takes, whose outputs differ between samples; seeded random by
            default (64 samples for a quantization-aware model).
        scale_tolerance: the largest error allowed, as a fraction of each output channel's
            scale (max abs(output) in that channel on the probe); default 1e-4
            (`defaults.FLOAT32_SCALE_TOLERANCE`), or 1e-2 for a model that computes in
            float16 or bfloat16 (a mixed-precision policy). Not for a quantization-aware
            model, judged in output steps.
        strict: raise VerificationError (and write nothing) when the file is over
            `scale_tolerance`; False writes it anyway and returns the report (`report.passed`
            is False).
        on_stage: optional callback, called with "fold", "convert" and "verify" as each
            stage starts (the CLI's progress display).
        atol: the deprecated name of `scale_tolerance` (a DeprecationWarning).
        allow_unverified: for a smoke test of a model whose own outputs are the same for
            every probe sample (untrained, or dead: every unit before the output off), which
            no probe can verify: write its file anyway, with `report.unverified` saying why.
            Off by default: such a model is refused (ValueError). A probe whose samples are
            all alike is refused either way.

    Returns:
        ExportReport: the error of each output (and its worst channel) in onnxruntime with
        graph optimisation disabled and enabled, the file's op histogram and its size; for a
        quantization-aware model also the errors in output steps, the weights read back and
        the float ops.

    Raises:
        VerificationError: the file is over `scale_tolerance` (or not finite) and strict is
            True (for a quantization-aware model: over its tolerance in output steps, a kernel
            off its grid, or an op that computes in float); any file at `path` is unchanged.
        UnsupportedModelError: a model structure the export cannot take (a subclassed or
            unbuilt model, a layer whose config does not round-trip, an input and an output
            dict key with the same name); for a quantization-aware model, a layer kept in
            float, a QAT layer with float weights or output, a host other than Dense, Conv2D
            (ungrouped), DepthwiseConv2D or SeparableConv2D, or an output no quantizer
            rounds; named; a TypeError and a ValueError.
        ValueError: a bad argument (both `scale_tolerance` and `atol`, say), a probe that does
            not fit the model or on which an output is the same for every sample (for a model
            whose own outputs are, unless allow_unverified), or a file that onnx.checker
            rejects; for a quantization-aware model, a scale_tolerance, an
            opset under 13, or an activation quantizer that never saw a training batch.
        OSError: `path` cannot be written, or is a folder, FIFO or device (refused before
            converting).
    """
    scale_tolerance = pipeline.scale_tolerance_argument(scale_tolerance, atol)
    return pipeline.export(
        model,
        path,
        (_QuantizedONNX if qat.is_quantized(model) else _ONNX)(opset),
        scale_tolerance=scale_tolerance,
        strict=strict,
        fold=fold,
        probe=probe,
        on_stage=on_stage,
        allow_unverified=allow_unverified,
    )


class _ONNX(pipeline.Format):
    name = "onnx"
    names = NAMES

    def __init__(self, opset: int) -> None:
        if isinstance(opset, bool) or not isinstance(opset, int) or opset < 1:
            raise ValueError(f"opset must be a positive int; received opset={opset!r}.")
        self.opset = opset

    def check_model(self, model: keras.Model) -> None:
        for layer in model._flatten_layers(include_self=False):
            if type(layer) is L.Conv3D and layer.groups > 1:
                raise UnsupportedModelError(
                    f"ONNX export cannot convert layer '{layer.name}' (Conv3D with "
                    f"groups={layer.groups}): tf2onnx writes a grouped 3-D convolution without "
                    f"its groups. Build it as {layer.groups} Conv3D layers on slices of the "
                    f"channels, concatenated."
                )

    def convert(self, model: keras.Model, sig: trace.Signature) -> bytes:
        import tf2onnx  # imports TensorFlow: the writer's own (backend.guard.require_writers)

        function = trace.inference_function(plain_convolutions(model), sig)
        proto, _ = tf2onnx.convert.from_function(
            function, input_signature=function.input_signature, opset=self.opset
        )
        return proto.SerializeToString()

    def check_file(self, written: str, target: str | os.PathLike[str]) -> None:
        check(written, name=target)

    def run(self, path: str, inputs: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
        return {setting: run(path, inputs, level) for setting, level in SESSION_SETTINGS.items()}

    def op_names(self, path: str) -> list[str]:
        return [node.op_type for node in onnx.load(path).graph.node]


class _QuantizedONNX(pipeline.QuantizedFormat, _ONNX):
    """A QAT model's file: QDQ from its export form, with int8 kernel initializers."""

    quantization = "int8"

    def __init__(self, opset: int) -> None:
        super().__init__(opset)
        if opset < QAT_MIN_OPSET:
            raise ValueError(
                f"A quantization-aware model's ONNX file needs opset {QAT_MIN_OPSET} or more "
                f"(per-channel DequantizeLinear); received opset={opset!r}."
            )

    def host_refusal(self, layer: keras.layers.Layer) -> str | None:
        host = layer.host
        if type(host) in QAT_HOSTS and getattr(host, "groups", 1) == 1:
            return None
        return (
            f"ONNX export of a quantization-aware model takes Dense, Conv2D (ungrouped), "
            f"DepthwiseConv2D and SeparableConv2D hosts; '{layer.name}' hosts a "
            f"{type(host).__name__}"
            f"{f' with groups={host.groups}' if type(host) in QAT_HOSTS else ''}."
        )

    def convert(self, model: keras.Model, sig: trace.Signature) -> bytes:
        """The export form traced with each kernel an input named by its tag (tf2onnx keeps
        input names, not constants'), then the kernels made int8 (export/qdq.py)."""
        self.take_weights(model, sig)
        import tensorflow as tf  # the writer's own (keras_bn.backend.guard.require_writers)
        import tf2onnx

        kernels: dict[str, Any] = {}  # tag → the traced function's input, while traced
        traced = qat.export_model(
            model, self._weights, lambda weight: kernels[weight.tag], halves_as_ops=True
        )
        specs = [
            *trace.tensor_specs(sig),
            *(tf.TensorSpec(w.grid.q.shape, tf.float32, name=w.tag) for w in self._weights),
        ]
        count = len(sig.input_names)

        def infer(*tensors: Any) -> dict[str, Any]:
            kernels.update(zip((w.tag for w in self._weights), tensors[count:]))
            feed = dict(zip(sig.input_names, tensors[:count]))
            results = traced(sig.pack(feed), training=False)
            return dict(zip(sig.output_names, keras.tree.flatten(results)))

        function = tf.function(infer, input_signature=specs)
        proto, _ = tf2onnx.convert.from_function(function, input_signature=specs, opset=self.opset)
        qdq.int8_weights(proto, self._weights)
        return proto.SerializeToString()

    def check_weights(self, path: str) -> list[report.WeightCheck]:
        graph = onnx.load(path).graph
        initializers = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
        producers = {name: node for node in graph.node for name in node.output}
        consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in graph.node:
            for index, name in enumerate(node.input):
                consumers.setdefault(name, []).append((node, index))
        return [
            _weight_check(weight, initializers, producers, consumers) for weight in self._weights
        ]

    def float_ops(self, path: str) -> dict[str, int]:
        """The file's ops that compute in float (`qdq.float_ops`): found in the graph, by
        the rule the TFLite file's are, since each format writes a Keras op as its own ops."""
        return report.histogram(qdq.float_ops(onnx.load(path)))


def _weight_check(
    weight: qat.HostWeight,
    initializers: dict[str, np.ndarray],
    producers: dict[str, onnx.NodeProto],
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]],
) -> report.WeightCheck:
    """The report.WeightCheck of one kernel: its int8 initializer, read by a DequantizeLinear
    whose output is input 1 of a Conv, MatMul or Gemm and nothing else, in that op's layout."""
    names = qdq.kernel_names(weight)
    q = initializers.get(names["quantized"])
    if q is None:
        return report.WeightCheck(
            weight.host, weight.kernel, weight.grid.bits, None, None, None, False
        )
    layout, axis = QAT_LAYOUTS[weight.layout_kind]
    dequantize = producers.get(names["dequantized"])
    readers = consumers.get(names["dequantized"], [])
    matches = (
        dequantize is not None
        and dequantize.op_type == "DequantizeLinear"
        and list(dequantize.input) == [names["quantized"], names["scale"], names["zero_point"]]
        and len(readers) == 1
        and readers[0][1] == 1
        and readers[0][0].op_type in qdq.WEIGHT_CONSUMERS
    )
    if matches and dequantize is not None:
        expected = weight.grid.q.transpose(layout)
        transposed = any(
            a.name == "transB" and a.i for a in readers[0][0].attribute
        )  # a Gemm reading (out, in)
        if transposed:
            expected, axis = expected.T, 1 - axis
        attributes = {a.name: a.i for a in dequantize.attribute}
        scale = initializers[names["scale"]]
        matches = bool(
            q.dtype == np.int8
            and q.shape == expected.shape
            and np.array_equal(q, expected)
            and not np.any(initializers[names["zero_point"]])
            and np.array_equal(scale, np.asarray(weight.grid.scale, np.float32))
            and (not weight.grid.per_channel or attributes.get("axis", 1) == axis)
        )
    return report.WeightCheck(
        weight.host,
        weight.kernel,
        weight.grid.bits,
        names["quantized"],
        q.dtype.name,
        int(np.abs(q.astype(np.int64)).max(initial=0)),
        matches,
    )


def _plain_convolution(layer: keras.layers.Layer, inputs: Any, kernel: Any) -> Any:
    """A Conv1D/2D/3D's convolution as one TensorFlow op, never an XLA-compiled function.

    TensorFlow cannot run a grouped one on a CPU: it is only traced, for tf2onnx.
    """
    import tensorflow as tf  # the writer's own (keras_bn.backend.guard.require_writers)

    spatial = "DHW"[-layer.rank :]  # NWC, NHWC, NDHWC; NCW, NCHW, NCDHW
    first = layer.data_format == "channels_first"
    return tf.nn.convolution(
        inputs,
        kernel,
        strides=list(layer.strides),
        padding="VALID" if layer.padding == "causal" else layer.padding.upper(),
        data_format=f"NC{spatial}" if first else f"N{spatial}C",
        dilations=list(layer.dilation_rate),
    )


class _PlainConv1D(keras.layers.Conv1D):
    def call(self, inputs: Any) -> Any:
        # Conv1D's own call pads a causal input, then calls ops.conv directly; BaseConv's call
        # goes through convolution_op.
        if self.padding == "causal":
            inputs = keras.ops.pad(inputs, self._compute_causal_padding())
        return super(keras.layers.Conv1D, self).call(inputs)

    def convolution_op(self, inputs: Any, kernel: Any) -> Any:
        return _plain_convolution(self, inputs, kernel)


class _PlainConv2D(keras.layers.Conv2D):
    def convolution_op(self, inputs: Any, kernel: Any) -> Any:
        return _plain_convolution(self, inputs, kernel)


class _PlainConv3D(keras.layers.Conv3D):
    def convolution_op(self, inputs: Any, kernel: Any) -> Any:
        return _plain_convolution(self, inputs, kernel)


PLAIN_CONVOLUTIONS: dict[type, type[keras.layers.Layer]] = {
    L.Conv1D: _PlainConv1D,
    L.Conv2D: _PlainConv2D,
    L.Conv3D: _PlainConv3D,
}


def _needs_xla(layer: keras.layers.Layer) -> bool:
    """Keras's own test (its TensorFlow `conv`): grouped, or a channels_first Conv3D."""
    return type(layer) in PLAIN_CONVOLUTIONS and (
        layer.groups > 1 or (layer.rank == 3 and layer.data_format == "channels_first")
    )


def plain_convolutions(model: keras.Model) -> keras.Model:
    """`model`, or a copy for tracing whose grouped convolutions (and channels_first Conv3Ds)
    are one plain TensorFlow convolution op each; the copy shares every other layer.

    Args:
        model: a built Sequential or Functional model (nested models allowed).

    Returns:
        The model itself when it has no such layer, else the copy.
    """
    if not any(_needs_xla(layer) for layer in model._flatten_layers()):
        return model

    def plain(layer: keras.layers.Layer) -> keras.layers.Layer | None:
        if not _needs_xla(layer):
            return None
        return PLAIN_CONVOLUTIONS[type(layer)].from_config(layer.get_config())

    return models.clone_replacing(model, plain)


def check(path: str | os.PathLike[str], name: str | os.PathLike[str] | None = None) -> None:
    """onnx.checker.check_model with full shape inference; a ValueError naming `name` (default
    `path`) if the file is not a valid ONNX model."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise ValueError(
            f"{path if name is None else name} is not a valid ONNX model: {one_line(error)}"
        ) from error


def run(
    path: str | os.PathLike[str],
    inputs: np.ndarray | dict[str, np.ndarray],
    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
) -> dict[str, np.ndarray]:
    """Run an .onnx file in onnxruntime (CPU).

    Args:
        path: the file.
        inputs: {input name: array}, or one array for a single-input file; any batch size.
        level: onnxruntime's graph optimisation level.

    Returns:
        {output name: array}.

    Raises:
        ValueError: one array for a file with several inputs.
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    inputs = trace.by_input_name(inputs, names, path)
    types = {i.name: i.type for i in session.get_inputs()}
    feed = {name: np.asarray(inputs[name], _ORT_TYPES.get(types[name])) for name in names}
    outputs = session.run(None, feed)
    return dict(zip([o.name for o in session.get_outputs()], outputs))


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(bool)": np.bool_,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
}

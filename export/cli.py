"""keras-bn-export: fold a saved Keras model's batch norms, write TFLite/ONNX, verify, report.

Exit codes: 0 success; 1 a converted file differs from the Keras model by more than its
tolerance (--atol, else the default for its quantization), in which case it is not written and
any file at its path is unchanged; 2 bad usage or input (missing or corrupt file, unsupported
model), said in one line, without a traceback.
"""

import argparse
import json
import math
import os
import sys
import zipfile

USAGE_ERROR, TOLERANCE_EXCEEDED = 2, 1
PROBE_SAMPLES = 64


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def _parser():
    parser = _Parser(
        prog="keras-bn-export",
        description="Fold batch norms, export to TFLite and/or ONNX, and verify the files.",
    )
    parser.add_argument("model", metavar="MODEL.keras", help="a saved Keras model")
    parser.add_argument("--tflite", metavar="OUT", help="write a .tflite file here")
    parser.add_argument("--onnx", metavar="OUT", help="write an .onnx file here")
    parser.add_argument(
        "--quantize",
        choices=["float16", "dynamic", "int8"],
        help="TFLite quantization (int8 needs --representative-data)",
    )
    parser.add_argument(
        "--representative-data",
        metavar="X.npy|X.npz",
        help="inputs (first axis: samples) to calibrate int8 and to verify on: "
        ".npy for a single-input model, .npz with one array per input "
        "name otherwise",
    )
    parser.add_argument(
        "--report",
        metavar="REPORT.json",
        help="also write the report as JSON (a NaN or infinite error as null)",
    )
    parser.add_argument("--no-fold", action="store_true", help="export without folding")
    parser.add_argument(
        "--unsafe",
        action="store_true",
        help="load with safe_mode=False (allows Lambda layers' code)",
    )
    parser.add_argument(
        "--atol",
        type=float,
        default=None,
        help="largest error allowed, relative to each output's scale (default "
        "per file: 1e-4 float32, 1e-3 float16, 2e-2 dynamic, 5e-2 int8; "
        "at least 1e-2 for a mixed-precision model)",
    )
    return parser


def _check_arguments(args):
    if args.quantize and not args.tflite:
        raise _UsageError("--quantize applies to TFLite: give --tflite OUT too")
    if args.quantize == "int8" and not args.representative_data:
        raise _UsageError("--quantize int8 needs --representative-data X.npy to calibrate")
    if args.atol is not None and not (math.isfinite(args.atol) and args.atol > 0):
        raise _UsageError(f"--atol must be a positive number; received {args.atol}")
    if not os.path.isfile(args.model):
        raise _UsageError(f"cannot read model file {args.model}: no such file")
    if args.model.endswith(".keras") and not zipfile.is_zipfile(args.model):
        raise _UsageError(f"{args.model} is not a valid .keras file (not a zip archive)")
    if args.representative_data and not os.path.isfile(args.representative_data):
        raise _UsageError(
            f"cannot read representative data {args.representative_data}: no such file"
        )


def main(argv=None):
    try:
        args = _parser().parse_args(argv)
        _check_arguments(args)
    except _UsageError as error:
        print(f"keras-bn-export: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    try:
        summary = _run(args)
    except Exception as error:  # bad input surfaces as many types: one line, no traceback
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"keras-bn-export: error: {type(error).__name__}: {message}", file=sys.stderr)
        return USAGE_ERROR
    print(_human_summary(summary))
    return 0 if summary["passed"] else TOLERANCE_EXCEEDED


def _run(args):
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    with progress:
        current = {}

        def stage(name):
            if "task" in current:
                progress.update(current["task"], completed=1)
            current["task"] = progress.add_task(name, total=1)

        summary = _export(args, stage)
        progress.update(current["task"], completed=1)
    return summary


def _export(args, stage):
    stage("load")
    import keras
    import numpy as np

    import keras_bn  # noqa: F401  (registers keras_bn>BatchNormalization for loading)
    from keras_bn.export import (
        VerificationError,
        atomic,
        export_onnx,
        export_tflite,
        fold_batch_norms,
        pipeline,
    )

    for output in (args.tflite, args.onnx, args.report):
        if output:
            atomic.target(output)  # a folder or a device (/dev/stdout): refused before any work
    model = keras.saving.load_model(args.model, compile=False, safe_mode=not args.unsafe)
    data = probe = None
    if args.representative_data:
        data = np.load(args.representative_data, allow_pickle=False)
        if hasattr(data, "files"):  # .npz: one array per input name
            data = {name: data[name] for name in data.files}
        probe = (
            {name: array[:PROBE_SAMPLES] for name, array in data.items()}
            if isinstance(data, dict)
            else data[:PROBE_SAMPLES]
        )
    exporters = []
    if args.tflite:
        exporters.append(
            (
                "tflite",
                lambda on_stage: export_tflite(
                    model,
                    args.tflite,
                    quantization=args.quantize,
                    representative_data=data,
                    fold=not args.no_fold,
                    probe=probe,
                    atol=args.atol,
                    on_stage=on_stage,
                ),
            )
        )
    if args.onnx:
        exporters.append(
            (
                "onnx",
                lambda on_stage: export_onnx(
                    model,
                    args.onnx,
                    fold=not args.no_fold,
                    probe=probe,
                    atol=args.atol,
                    on_stage=on_stage,
                ),
            )
        )
    exports = []
    for name, exporter in exporters:
        try:
            exports.append(exporter(lambda stage_name, name=name: stage(f"{name}: {stage_name}")))
        except VerificationError as error:  # not written; its report still goes in ours
            exports.append(error.report)
    fold_report = None
    if exports:
        fold_report = exports[0].fold
    elif not args.no_fold:
        stage("fold")
        fold_report = fold_batch_norms(model, probe)[1]

    # The folded model is judged like a float32 file: a mixed-precision one rounds as its
    # exports do, so it gets their default too.
    fold_atol = pipeline.default_atol(model) if args.atol is None else args.atol
    summary = {
        "model": os.path.abspath(args.model),
        "fold": None if fold_report is None else fold_report.to_dict(),
        "fold_atol": fold_atol,
        "exports": [report.to_dict() for report in exports],
    }
    summary["passed"] = all(report.passed for report in exports) and (
        fold_report is None or bool(fold_report.relative_error <= fold_atol)
    )
    if args.report:
        atomic.write_text(
            args.report, json.dumps(_finite_json(summary), indent=2, allow_nan=False) + "\n"
        )
    return summary


def _finite_json(value):
    """`value` with every NaN or infinite float as None: JSON has no such numbers (Python's
    NaN/Infinity tokens are rejected by strict parsers), and `passed` already says it failed."""
    if isinstance(value, dict):
        return {key: _finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _human_summary(summary):
    lines = [f"model: {summary['model']}"]
    fold = summary["fold"]
    if fold is None:
        lines.append("batch norms: not folded (--no-fold)")
    else:
        lines.append(
            f"batch norms: {len(fold['folded'])} folded, {len(fold['kept'])} kept; "
            f"folded model error {fold['relative_error']:.2e} of output scale"
        )
        lines += [f"  folded {f['bn']} -> {f['host']} ({f['direction']})" for f in fold["folded"]]
        lines += [f"  kept   {k['bn']}: {k['reason']}" for k in fold["kept"]]
        lines += _int8_readiness(fold)
    for report in summary["exports"]:
        quantization = report["quantization"] or "float32"
        ops = ", ".join(f"{name}×{count}" for name, count in report["op_histogram"].items())
        lines.append(
            f"{report['format']} ({quantization}): {report['path']}, {report['size_bytes']:,} bytes"
        )
        for output, relative in report["relative_errors"].items():
            settings = ", ".join(f"{k} {v:.2e}" for k, v in report["errors"][output].items())
            lines.append(
                f"  output {output}: error {relative:.2e} of its scale (max abs: {settings})"
            )
        lines.append(f"  ops: {ops}")
        if report["passed"]:
            lines.append(f"  passed (tolerance {report['atol']:g} of output scale)")
        else:
            lines.append(
                f"  FAILED (tolerance {report['atol']:g} of output scale): not "
                f"written; any existing file at the path is unchanged"
            )
    verdict = "passed" if summary["passed"] else "FAILED"
    lines.append(f"verification {verdict}")
    return "\n".join(lines)


def _int8_readiness(fold):
    """The summary lines for the hosts whose channel ranges spread over the threshold."""
    threshold = fold["int8_spread_threshold"]
    spreads = fold["channel_spreads"]
    if not spreads:
        return []
    risks = [spread for spread in spreads if spread["int8_risk"]]
    if not risks:
        largest = max(
            value
            for spread in spreads
            for value in (spread["output_spread"], spread["input_spread"])
            if value is not None
        )
        return [
            f"int8 readiness: every folded host's channel ranges are within {threshold:g}x "
            f"(largest spread {largest:.3g}x)"
        ]
    lines = [
        f"int8 risk: {len(risks)} folded host(s) with channel ranges over {threshold:g}x "
        f"apart lose precision where int8 weights are quantized per tensor"
    ]
    for spread in risks:
        parts = [_apart("output", spread["output_spread"])]
        if spread["input_spread"] is not None:
            parts.append(_apart("input", spread["input_spread"]))
        where = (
            "per-channel int8 too (TFLite's)"
            if spread["per_channel_int8_risk"]
            else "per-tensor int8 only (TFLite's int8 is per channel)"
        )
        lines.append(f"  {spread['host']} ({spread['layer']}): {', '.join(parts)}: {where}")
    return lines


def _apart(channels, spread):
    if math.isnan(spread):
        return f"{channels} channels: a weight is NaN"
    return f"{channels} channels {spread:.3g}x apart"


if __name__ == "__main__":
    sys.exit(main())

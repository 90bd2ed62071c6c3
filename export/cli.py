"""keras-bn-export: fold a saved Keras model's batch norms, write TFLite/ONNX, verify, report.

Exit codes:

- 0: success.
- 1: a converted file differs from the Keras model by more than its tolerance
  (--scale-tolerance, else the default for its quantization); it is not written, and any file
  at its path is unchanged.
- 2: bad usage or bad input: an argparse error, a missing, corrupt or unloadable model file,
  bad representative data, a model the export cannot take (UnsupportedModelError, a
  converter's refusal), another ValueError about the inputs, or an OSError (an unwritable
  path). Said in one line, without a traceback.
- 3: an internal error of keras-bn-export (any other exception: a bug). It says so, prints
  the traceback and asks for a report.

Everything that answers without exporting (--help, --version, a usage error) does so before
TensorFlow, Keras, tf2onnx or LiteRT are imported, so it is fast, and the environment defaults
(keras_bn/_quiet.py: quiet TensorFlow logs, the TensorFlow Keras backend) are set before
TensorFlow reads them. The lines TensorFlow prints as it loads are dropped (any line not known
to be one still prints; TF_CPP_MIN_LOG_LEVEL=0 or 1 keeps them all), and what the converters
and the runtimes print goes into each export's `log` in the report (--report), not the
terminal, unless the export fails on it.

A quantization-aware model (a `.keras` file holding keras_bn.quantize layers) is exported as
the API exports it: its own int8 (TFLite full integer, ONNX QDQ), not folded, with no
calibration (`--representative-data` is then only the probe, and `--quantize` may only be
int8), judged in units of each output's quantization step, so `--scale-tolerance` does not
apply.
"""

import argparse
import json
import math
import os
import sys
import textwrap
import traceback
import types
import typing
import zipfile
from collections.abc import Callable
from typing import Any

from keras_bn import _quiet
from keras_bn._errors import one_line
from keras_bn._version import __version__
from keras_bn.export import defaults

if typing.TYPE_CHECKING:  # imported where used, after a fast usage check
    import keras
    import numpy as np

    from keras_bn.export.trace import Feed

OK, TOLERANCE_EXCEEDED, USAGE_ERROR, INTERNAL_ERROR = 0, 1, 2, 3
EXIT_CODES = {
    OK: "success",
    TOLERANCE_EXCEEDED: "a file differs from the Keras model by more than its tolerance (it is "
    "not written; an existing file at its path is unchanged)",
    USAGE_ERROR: "bad usage or bad input (a missing, corrupt or unloadable model file, bad "
    "representative data, a model the export cannot take, an unwritable path), in one line",
    INTERNAL_ERROR: "an internal error of keras-bn-export (a bug): the traceback, to report",
}
# Set before TensorFlow is imported, unless the caller set them: quiet logs, the TensorFlow
# Keras backend (the only one the writers run on).
ENVIRONMENT_DEFAULTS = _quiet.ENVIRONMENT
# Bad input: what the user can fix. Anything else is a bug of keras-bn-export.
BAD_INPUT = (ValueError, OSError)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, not argparse's usage block
        raise _UsageError(message)


class _UsageError(Exception):
    """Bad usage or input, in words for the user; exit code 2."""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="keras-bn-export",
        description="Fold batch norms, export to TFLite and/or ONNX, and verify the files.",
        epilog="exit codes:\n"
        + "\n".join(
            textwrap.fill(meaning, 78, initial_indent=f"  {code}  ", subsequent_indent=" " * 5)
            for code, meaning in EXIT_CODES.items()
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL.keras", help="a saved Keras model")
    parser.add_argument("--tflite", metavar="OUT", help="write a .tflite file here")
    parser.add_argument("--onnx", metavar="OUT", help="write an .onnx file here")
    parser.add_argument(
        "--quantize",
        choices=[q for q in defaults.SCALE_TOLERANCES if q is not None],
        help="TFLite quantization (int8 needs --representative-data); a quantization-aware "
        "model is always its own int8, from its own ranges",
    )
    parser.add_argument(
        "--representative-data",
        metavar="X.npy|X.npz",
        help="inputs (first axis: samples) to verify on and to calibrate int8: .npy for a "
        "single-input model, .npz with one array per input name otherwise. Files are "
        f"verified on {defaults.PROBE_SAMPLES} samples spread over them; int8 holds out a "
        f"quarter (at most {defaults.PROBE_SAMPLES}) to verify on, calibrates on up to "
        f"{defaults.CALIBRATION_SAMPLES} of the rest, and needs {defaults.INT8_MIN_SAMPLES} "
        "or more; a quantization-aware model is verified on them, not calibrated",
    )
    parser.add_argument(
        "--report",
        metavar="REPORT.json",
        help="also write the report as JSON (a NaN or infinite error as null)",
    )
    parser.add_argument("--no-fold", action="store_true", help="export without folding")
    parser.add_argument(
        "--int8-readiness",
        action="store_true",
        help="measure each folded host's int8 readiness: the outputs' error with its weights "
        "alone rounded to int8 (one forward pass per host, per tensor and per channel, on the "
        "probe); on with --quantize int8",
    )
    parser.add_argument(
        "--unsafe",
        action="store_true",
        help="load with safe_mode=False (allows Lambda layers' code)",
    )
    parser.add_argument(
        "--scale-tolerance",
        type=float,
        metavar="TOL",
        help="largest error allowed, as a fraction of each output's scale (max |output| on "
        f"the probe); default per file: {defaults.describe_scale_tolerances()}. A "
        f"quantization-aware model's files are judged in output steps instead (at most "
        f"{defaults.QAT_MAX_LSB:g} on every value, {defaults.QAT_PERCENTILE_LSB:g} on "
        f"{defaults.QAT_PERCENTILE:g}%%)",
    )
    parser.add_argument(
        "--allow-unverified",
        action="store_true",
        help="for a smoke test: write the files of a model whose own outputs are the same for "
        "every probe sample (untrained or dead), which no probe can verify; they are marked "
        "UNVERIFIED in the summary and the report",
    )
    parser.add_argument(
        "--atol", type=float, metavar="TOL", help="deprecated: the old name of --scale-tolerance"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    """The parsed arguments, checked without importing anything heavy; _UsageError if bad."""
    args = _parser().parse_args(argv)
    tolerance_flag = "--scale-tolerance"
    if args.atol is not None:
        if args.scale_tolerance is not None:
            raise _UsageError("give --scale-tolerance only (--atol is its deprecated name)")
        print(
            "keras-bn-export: warning: --atol is deprecated; use --scale-tolerance (the same "
            "value)",
            file=sys.stderr,
        )
        args.scale_tolerance, tolerance_flag = args.atol, "--atol"
    if args.scale_tolerance is not None:
        try:
            defaults.check_scale_tolerance(args.scale_tolerance, tolerance_flag)
        except ValueError as error:
            raise _UsageError(str(error)) from None
    if args.int8_readiness and args.no_fold:
        raise _UsageError("--int8-readiness measures the folded hosts: drop --no-fold")
    if args.quantize and not args.tflite:
        raise _UsageError("--quantize applies to TFLite: give --tflite OUT too")
    if (
        args.quantize == "int8"
        and not args.representative_data
        and not _quantization_aware_file(args.model)
    ):
        raise _UsageError(
            "--quantize int8 needs --representative-data X.npy (X.npz for several inputs) to "
            "calibrate"
        )
    if not os.path.isfile(args.model):
        raise _UsageError(f"cannot read model file {args.model}: no such file")
    if args.model.endswith(".keras") and not zipfile.is_zipfile(args.model):
        raise _UsageError(f"{args.model} is not a valid .keras file (not a zip archive)")
    if args.representative_data and not os.path.isfile(args.representative_data):
        raise _UsageError(
            f"cannot read --representative-data {args.representative_data}: no such file"
        )
    backend = os.environ["KERAS_BACKEND"]
    if backend != "tensorflow" and "keras" not in sys.modules:
        raise _UsageError(
            f"KERAS_BACKEND is {backend!r}: keras-bn-export runs on the TensorFlow Keras "
            f"backend; unset it or set KERAS_BACKEND=tensorflow"
        )
    return args


def _quantization_aware_file(path: str) -> bool:
    """Whether a `.keras` file holds keras_bn.quantize layers, read from its config without
    loading it (so that usage errors stay fast); False for anything unreadable, which the
    load then reports."""
    try:
        with zipfile.ZipFile(path) as archive:
            config = archive.read("config.json").decode("utf-8")
    except (OSError, KeyError, zipfile.BadZipFile, UnicodeDecodeError):
        return False
    return f'"{QAT_PACKAGE}>' in config


# The package the QAT layers are registered under (keras_bn.quantize's layers).
QAT_PACKAGE = "keras_bn.quantize"


def main(argv: list[str] | None = None) -> int:
    """Run keras-bn-export on `argv` (default: the command line); return the exit code."""
    for name, value in ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        args = _arguments(argv)
    except _UsageError as error:
        print(f"keras-bn-export: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as done:  # --help and --version print, then exit
        return done.code if isinstance(done.code, int) else OK
    try:
        summary = _run(args)
    except _UsageError as error:
        print(f"keras-bn-export: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except BAD_INPUT as error:
        print(f"keras-bn-export: error: {type(error).__name__}: {one_line(error)}", file=sys.stderr)
        return USAGE_ERROR
    except Exception as error:  # noqa: BLE001  (anything else is a bug: said, with its traceback)
        traceback.print_exc()
        print(
            f"keras-bn-export: internal error: {type(error).__name__}: {one_line(error)}\n"
            f"This is a bug in keras-bn-export {__version__}, not in your model or "
            f"arguments: please report it with the traceback above and the command line.",
            file=sys.stderr,
        )
        return INTERNAL_ERROR
    print(_human_summary(summary))
    return OK if summary["passed"] else TOLERANCE_EXCEEDED


def _run(args: argparse.Namespace) -> dict[str, Any]:
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
        current: dict[str, Any] = {}  # the task of the stage under way

        def stage(name: str) -> None:
            if "task" in current:
                progress.update(current["task"], completed=1)
            current["task"] = progress.add_task(name, total=1)

        summary = _export(args, stage)
        progress.update(current["task"], completed=1)
    return summary


def _export(args: argparse.Namespace, stage: Callable[[str], None]) -> dict[str, Any]:
    stage("load")
    _quiet.entry_point()  # imports TensorFlow, its start-up lines dropped
    import keras
    import numpy as np
    from tensorflow.lite.python.convert import ConverterError

    from keras_bn.export import atomic, pipeline, qat, trace
    from keras_bn.export.graph import fold_batch_norms
    from keras_bn.export.onnx import export_onnx
    from keras_bn.export.report import VerificationError
    from keras_bn.export.tflite import export_tflite

    for output in (args.tflite, args.onnx, args.report):
        if output:
            atomic.target(output)  # a folder or a device (/dev/stdout): refused before any work
    try:
        model = keras.saving.load_model(args.model, compile=False, safe_mode=not args.unsafe)
    except LOAD_ERRORS as error:
        raise _UsageError(f"cannot load model file {args.model}: {_told(error)}") from error
    quantization_aware = qat.is_quantized(model)
    if quantization_aware:
        if args.scale_tolerance is not None:
            raise _UsageError(
                f"{args.model} is a quantization-aware model: its files are judged in units of "
                f"each output's quantization step, not at a fraction of its scale; leave out "
                f"--scale-tolerance"
            )
        if args.quantize not in (None, "int8"):
            raise _UsageError(
                f"{args.model} is a quantization-aware model: its TFLite file is its own int8 "
                f"(--quantize int8, the default for it); --quantize {args.quantize} applies to "
                f"a float model"
            )
    data = probe = None
    if args.representative_data:
        path = args.representative_data
        data = _representative(trace, model, _load_arrays(np, path), path)
        probe = trace.spread_samples(data, defaults.PROBE_SAMPLES)
    exporters = []
    if args.tflite:
        exporters.append(
            (
                "tflite",
                lambda on_stage: export_tflite(
                    model,
                    args.tflite,
                    quantization=args.quantize,
                    representative_data=data,  # the probe comes from it (held out, int8)
                    fold=not args.no_fold,
                    scale_tolerance=args.scale_tolerance,
                    on_stage=on_stage,
                    allow_unverified=args.allow_unverified,
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
                    scale_tolerance=args.scale_tolerance,
                    on_stage=on_stage,
                    allow_unverified=args.allow_unverified,
                ),
            )
        )
    exports = []
    for name, exporter in exporters:
        try:
            exports.append(exporter(lambda stage_name, name=name: stage(f"{name}: {stage_name}")))
        except VerificationError as error:  # not written; its report still goes in ours
            exports.append(error.report)
        except ConverterError as error:  # an op the TFLite converter cannot take: the model's
            raise _UsageError(
                f"the TFLite converter cannot convert {args.model}: {_told(error)}"
            ) from error
    # The fold report of an export that measured int8 readiness (int8 TFLite), else the first.
    folds = [report.fold for report in exports if report.fold is not None]
    measured = [fold for fold in folds if fold.int8_readiness_measured]
    fold_report = next(iter(measured or folds), None)
    if (
        not args.no_fold
        and not quantization_aware
        and (fold_report is None or (args.int8_readiness and not measured))
    ):
        stage("fold")
        fold_report = fold_batch_norms(
            model,
            probe,
            int8_readiness=args.int8_readiness,
            allow_unverified=args.allow_unverified,
        )[1]

    # The folded model is judged like a float32 file: a mixed-precision one rounds as its
    # exports do, so it gets their default too.
    fold_tolerance = (
        pipeline.default_scale_tolerance(model)
        if args.scale_tolerance is None
        else args.scale_tolerance
    )
    summary = {
        "model": os.path.abspath(args.model),
        "quantization_aware": quantization_aware,
        "fold": None if fold_report is None else fold_report.to_dict(),
        "fold_scale_tolerance": fold_tolerance,
        "exports": [report.to_dict() for report in exports],
    }
    summary["passed"] = all(report.passed for report in exports) and (
        fold_report is None or bool(fold_report.relative_error <= fold_tolerance)
    )
    if args.report:
        atomic.write_text(
            args.report, json.dumps(_finite_json(summary), indent=2, allow_nan=False) + "\n"
        )
    return summary


# What loading a bad file raises (Keras, zipfile, h5py and numpy): a config that is not JSON
# (ValueError), a class Keras cannot locate or build (TypeError), a member missing from the
# archive (KeyError), an unreadable or truncated file (OSError, EOFError, BadZipFile).
LOAD_ERRORS = (ValueError, TypeError, KeyError, OSError, EOFError, zipfile.BadZipFile)


def _told(error: BaseException) -> str:
    return f"{type(error).__name__}: {one_line(error)}"


def _load_arrays(np: types.ModuleType, path: str) -> "np.ndarray | dict[str, np.ndarray]":
    """The array of a .npy file, or {name: array} of an .npz; _UsageError if unreadable."""
    try:
        data = np.load(path, allow_pickle=False)
        if hasattr(data, "files"):  # .npz: one array per input name
            data = {name: data[name] for name in data.files}
    except LOAD_ERRORS as error:
        raise _UsageError(f"cannot read --representative-data {path}: {_told(error)}") from error
    return data


def _representative(
    trace: types.ModuleType,
    model: "keras.Model",
    data: "np.ndarray | dict[str, np.ndarray]",
    path: str,
) -> "Feed":
    """--representative-data `path` (its `data`) as a Feed for `model`, named by the flag in
    every message about it (the exporters' too); _UsageError, suggesting the file the model
    needs, if it does not fit."""
    sig = trace.signature(model)
    flag = f"--representative-data {path}"
    names = list(sig.input_keys)
    if len(names) > 1:
        needed = f"an .npz with one array per input name: {', '.join(names)}"
    else:
        needed = f"an .npy of the samples, or an .npz with one array named {names[0]}"
    if not isinstance(data, dict) and len(names) > 1:
        raise _UsageError(
            f"{flag} is one array (.npy), but the model has {len(names)} inputs: give {needed}"
        )
    try:
        return trace.feed(sig, data, flag)
    except ValueError as error:
        raise _UsageError(f"{one_line(error)} --representative-data takes {needed}") from error


def _finite_json(value: Any) -> Any:
    """`value` with every NaN or infinite float as None: JSON has no such numbers (Python's
    NaN/Infinity tokens are rejected by strict parsers), and `passed` already says it failed."""
    if isinstance(value, dict):
        return {key: _finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _human_summary(summary: dict[str, Any]) -> str:
    lines = [f"model: {summary['model']}"]
    fold = summary["fold"]
    if summary["quantization_aware"]:
        lines.append(
            "quantization-aware model: its batch norms are folded in its QAT layers; its files "
            "are its own int8, from its own ranges (nothing calibrated), judged in output steps"
        )
    elif fold is None:
        lines.append("batch norms: not folded (--no-fold)")
    else:
        lines.append(
            f"batch norms: {len(fold['folded'])} folded, {len(fold['kept'])} kept; "
            f"folded model error {fold['relative_error']:.2e} of output scale (worst channel)"
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
        if report["lsb_tolerance"] is None:
            lines += _scale_lines(report)
        else:
            lines += _lsb_lines(report)
        lines.append(_samples_line(report))
        lines.append(f"  ops: {ops}")
        if report["lsb_tolerance"] is None:
            tolerance = f"tolerance {report['scale_tolerance']:g} of each channel's scale"
        else:
            bounds = report["lsb_tolerance"]
            tolerance = (
                f"tolerance: max {bounds['max_lsb']:g} LSB, {bounds['percentile']:g}th "
                f"percentile {bounds['percentile_lsb']:g} LSB of each output's step"
            )
        if report["unverified"]:
            lines.append(f"  UNVERIFIED: {report['unverified']}")
        if report["passed"]:
            lines.append(f"  passed ({tolerance})")
        else:
            lines.append(
                f"  FAILED ({tolerance}): not written; any existing file at the path is unchanged"
            )
    verdict = "passed" if summary["passed"] else "FAILED"
    if any(report["unverified"] for report in summary["exports"]):
        verdict += " (UNVERIFIED: the model's own output is the same for every probe sample)"
    lines.append(f"verification {verdict}")
    return "\n".join(lines)


def _scale_lines(report: dict[str, Any]) -> list[str]:
    """Each output's error as a fraction of its scale, per runtime setting."""
    lines = []
    for output, relative in report["relative_errors"].items():
        settings = ", ".join(f"{k} {v:.2e}" for k, v in report["errors"][output].items())
        channel = report["worst_channels"].get(output)
        where = "" if channel is None else f", worst in channel {channel['channel']}"
        lines.append(
            f"  output {output}: error {relative:.2e} of its scale{where} (max abs: {settings})"
        )
    return lines


def _lsb_lines(report: dict[str, Any]) -> list[str]:
    """A QAT model's file: each output's error in its steps, the int8 weights read back and
    the ops left in float."""
    lines = []
    for output, by_setting in report["lsb_errors"].items():
        step = next(iter(by_setting.values()))["step"]
        settings = ", ".join(
            f"{setting} {error['max_lsb']:.3g} / {error['percentile_lsb']:.3g}"
            for setting, error in by_setting.items()
        )
        lines.append(
            f"  output {output}: error in LSB of its step {step:.3g}, max / "
            f"{next(iter(by_setting.values()))['percentile']:g}th percentile: {settings}"
        )
    weights = report["weights"]
    wrong = [w for w in weights if not w["matches"]]
    bits = sorted({w["bits"] for w in weights})
    lines.append(
        f"  weights: {len(weights) - len(wrong)} of {len(weights)} kernels int8 on their "
        f"{'/'.join(map(str, bits))}-bit grids in the file"
    )
    lines += [
        f"    NOT its grid: {w['kernel']} of {w['host']} ({w['tensor'] or 'no int8 tensor'})"
        for w in wrong
    ]
    if report["float_ops"] is not None:
        floating = ", ".join(f"{name}×{count}" for name, count in report["float_ops"].items())
        lines.append(f"  float ops: {floating or 'none (full integer)'}")
    return lines


def _samples_line(report: dict[str, Any]) -> str:
    """Which samples a file was verified on (and, for int8, its error on calibration ones)."""
    if report["unverified"]:
        return f"  run on {report['probe_samples']} probe samples, not verified (UNVERIFIED below)"
    if report["calibration_samples"] is None or not report["probe_held_out"]:
        return f"  verified on {report['probe_samples']} samples"
    return (
        f"  verified on {report['probe_samples']} samples held out from calibration "
        f"({report['calibration_samples']} calibrated); on calibration samples: error "
        f"{report['in_sample_relative_error']:.2e} of scale"
    )


def _int8_readiness(fold: dict[str, Any]) -> list[str]:
    """The summary lines on the folded hosts' int8 readiness: those whose int8 weights alone
    move the outputs by more than the tolerance, or the worst errors when none does, or the
    largest channel spread when it was not measured."""
    spreads = fold["channel_spreads"]
    if not spreads:
        return []
    host, spread = _worst(spreads, "output_spread", "input_spread")
    spread_note = f"largest channel spread {_number(spread)}x ({host})"
    if not fold["int8_readiness_measured"]:
        return [
            f"int8 readiness: not measured (--int8-readiness or --quantize int8 measures it); "
            f"{spread_note}"
        ]
    tolerance = fold["int8_readiness_tolerance"]
    risks = [s for s in spreads if s["int8_risk"] or s["per_channel_int8_risk"]]
    if not risks:
        tensor_host, per_tensor = _worst(spreads, "per_tensor_error")
        channel_host, per_channel = _worst(spreads, "per_channel_error")
        return [
            f"int8 readiness: rounding any one folded host's weights to int8 moves the outputs "
            f"by at most {per_tensor:.2e} of their scale per tensor ({tensor_host}), "
            f"{per_channel:.2e} per channel ({channel_host}): within {tolerance:g}; "
            f"{spread_note}"
        ]
    lines = [
        f"int8 risk: {len(risks)} folded host(s) whose weights alone, rounded to int8, move the "
        f"outputs by more than {tolerance:g} of their scale"
    ]
    for spread in risks:
        parts = [_apart("output", spread["output_spread"])]
        if spread["input_spread"] is not None:
            parts.append(_apart("input", spread["input_spread"]))
        where = {
            (True, True): "per tensor and per channel (TFLite's int8)",
            (True, False): "per-tensor int8 only (TFLite's int8 is per channel)",
            (False, True): "per-channel int8 (TFLite's), not per tensor",
        }[spread["int8_risk"], spread["per_channel_int8_risk"]]
        lines.append(
            f"  {spread['host']} ({spread['layer']}): error {spread['per_tensor_error']:.2e} "
            f"per tensor, {spread['per_channel_error']:.2e} per channel ({', '.join(parts)}): "
            f"{where}"
        )
    return lines


def _worst(spreads: list[dict[str, Any]], *keys: str) -> tuple[str, float]:
    """(host, value): the largest value under `keys` over the entries, and its host; NaN is
    the largest, None no value."""
    values = [
        (spread["host"], spread[key])
        for spread in spreads
        for key in keys
        if spread[key] is not None
    ]
    return max(values, key=lambda pair: math.inf if math.isnan(pair[1]) else pair[1])


def _number(value: float) -> str:
    return "NaN" if math.isnan(value) else f"{value:.3g}"


def _apart(channels: str, spread: float) -> str:
    if math.isnan(spread):
        return f"{channels} channels: a weight is NaN"
    return f"{channels} channels {spread:.3g}x apart"


if __name__ == "__main__":
    sys.exit(main())

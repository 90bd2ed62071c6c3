"""keras-bn-export end to end: through a subprocess running the installed console script where
the installed command is the point (a whole export as a user runs it, its stderr, the README's
line, --help), or a small script that calls `keras_bn.export.cli.main` where a test must reach
inside; the tests of what it does with its arguments and files call `main` in this process
(helpers.cli_in_process: the same exit code, stdout and stderr, without a new Python importing
TensorFlow for each call)."""

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import zipfile

import keras
import numpy as np
import pytest
from test_notebooks import TENSORFLOW_LOG_LINE

import digits
from helpers import cli_in_process, docs_page, randomise_batch_norms, run_cli
from keras_bn.export import defaults

pytestmark = pytest.mark.backends("tensorflow")

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    randomise_batch_norms(digits.small_cnn()).save(folder / "cnn.keras")
    np.save(folder / "x.npy", digits.load()[0][:64])
    return folder


def test_success_writes_both_files_and_the_json_report(saved, tmp_path):
    result = run_cli(
        saved / "cnn.keras",
        "--tflite",
        tmp_path / "m.tflite",
        "--onnx",
        tmp_path / "m.onnx",
        "--report",
        tmp_path / "r.json",
    )
    assert result.returncode == 0, result.stderr
    assert "batch norms: 3 folded, 0 kept" in result.stdout
    assert "verification passed" in result.stdout and "ops: CONV_2D×2" in result.stdout
    for stage in ("load", "tflite: fold", "tflite: convert", "tflite: verify", "onnx: verify"):
        assert stage in result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] is True
    assert [f["direction"] for f in report["fold"]["folded"]] == ["backward"] * 3
    tflite, onnx = report["exports"]
    assert tflite["format"] == "tflite" and onnx["format"] == "onnx"
    assert (
        tflite["scale_tolerance"] == onnx["scale_tolerance"] == 1e-4
        and tflite["passed"]
        and onnx["passed"]
    )
    assert tflite["size_bytes"] == os.path.getsize(tmp_path / "m.tflite")
    assert onnx["size_bytes"] == os.path.getsize(tmp_path / "m.onnx")
    (output,) = onnx["errors"]
    assert set(onnx["errors"][output]) == {"ort_disabled", "ort_enabled"}
    assert max(tflite["relative_error"], onnx["relative_error"]) <= 1e-4
    assert tflite["op_histogram"]["CONV_2D"] == 2 and "MUL" not in tflite["op_histogram"]

    # The table `make demo` ends with (examples/digits.py --summary) reads these reports.
    shutil.copy(saved / "cnn.keras", tmp_path / "cnn.keras")
    header, *rows = digits.summary(str(tmp_path))
    assert header.split() == ["file", "size", "format", "verification", "test", "accuracy"]
    by_name = {os.path.basename(row.split()[0]): row for row in rows}
    assert sorted(by_name) == ["cnn.keras", "m.onnx", "m.tflite", "r.json"]
    for name, kind in [("m.tflite", "TFLite float32"), ("m.onnx", "ONNX float32")]:
        size = f"{os.path.getsize(tmp_path / name) / 1024:.1f} KiB"
        assert re.search(rf"\s{size}\s+{kind}\s+passed \(", by_name[name]), by_name[name]
        assert re.search(r"tolerance 0\.0001\)\s+[01]\.\d{4}$", by_name[name]), by_name[name]
    assert re.search(r"Keras model\s+[01]\.\d{4}$", by_name["cnn.keras"])
    assert "export report" in by_name["r.json"]


def test_stderr_holds_the_progress_only_and_the_converters_lines_go_to_the_report(saved, tmp_path):
    """Run as a user runs it (no TF_CPP_MIN_LOG_LEVEL), an int8 export prints no TensorFlow
    line: its start-up lines are dropped, and the converter's raw "fully_quantize: 0, ..."
    and its calibrator's "tf.lite.Interpreter is deprecated" go into the report's `log`."""
    env = {key: value for key, value in os.environ.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    result = run_cli(
        saved / "cnn.keras",
        "--tflite",
        tmp_path / "q.tflite",
        "--quantize",
        "int8",
        "--representative-data",
        saved / "x.npy",
        "--report",
        tmp_path / "r.json",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert [line for line in lines if not re.search(r"\d:\d\d:\d\d$", line)] == [], lines
    assert not [line for line in lines if TENSORFLOW_LOG_LINE.search(line)]
    (export,) = json.loads((tmp_path / "r.json").read_text())["exports"]
    log = "\n".join(export["log"])
    assert "fully_quantize: 0" in log and "tf.lite.Interpreter is deprecated" in log


def test_the_readme_command_line_runs_as_written_on_the_demos_file(saved, tmp_path):
    """README.md's command line, run as written in the folder `make demo` ran in, on the
    .keras file the demo saves (here an untrained model of the same architecture)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## A tour\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    (line,) = block.strip().splitlines()
    program, model, *args = shlex.split(line)
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    demo = re.search(r"^DEMO := (\S+)$", makefile, re.M).group(1)
    assert "--save $(DEMO)/digits.keras" in makefile
    assert program == "keras-bn-export" and model == f"{demo}/digits.keras"
    (tmp_path / demo).mkdir(parents=True)
    shutil.copy(saved / "cnn.keras", tmp_path / model)
    result = run_cli(model, *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "verification passed" in result.stdout
    written = [args[i + 1] for i, flag in enumerate(args) if flag in ("--tflite", "--onnx")]
    assert written and all((tmp_path / name).is_file() for name in written)


def test_int8_passes_its_default_tolerance(saved, tmp_path, capfd):
    result = cli_in_process(
        capfd,
        saved / "cnn.keras",
        "--tflite",
        tmp_path / "q.tflite",
        "--quantize",
        "int8",
        "--representative-data",
        saved / "x.npy",
        "--report",
        tmp_path / "r.json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    (export,) = report["exports"]
    assert (
        export["scale_tolerance"] == 1e-1 and export["passed"] and export["relative_error"] > 1e-4
    )
    # int8 measures each folded host's int8 readiness.
    assert report["fold"]["int8_readiness_measured"] is True
    assert all(s["per_tensor_error"] is not None for s in report["fold"]["channel_spreads"])
    assert "int8 readiness: not measured" not in result.stdout


def test_int8_readiness_is_measured_on_request_and_said_when_not(saved, tmp_path, capfd):
    """A float export measures nothing unless --int8-readiness asks; the summary and the
    JSON say which, and the flags are the measured errors over the tolerance."""
    for flag in ([], ["--int8-readiness"]):
        result = cli_in_process(
            capfd,
            saved / "cnn.keras",
            "--onnx",
            tmp_path / "m.onnx",
            "--representative-data",
            saved / "x.npy",
            "--report",
            tmp_path / "r.json",
            *flag,
        )
        assert result.returncode == 0, result.stderr
        fold = json.loads((tmp_path / "r.json").read_text())["fold"]
        spreads = fold["channel_spreads"]
        assert len(spreads) == 3 and fold["int8_readiness_tolerance"] == 1e-1
        if not flag:
            assert fold["int8_readiness_measured"] is False and fold["int8_risks"] is None
            assert all(s["per_tensor_error"] is None and s["int8_risk"] is None for s in spreads)
            assert "int8 readiness: not measured (--int8-readiness or --quantize int8" in (
                result.stdout
            )
            continue
        assert fold["int8_readiness_measured"] is True
        for spread in spreads:
            assert spread["int8_risk"] == (spread["per_tensor_error"] > 1e-1)
            assert spread["per_channel_int8_risk"] == (spread["per_channel_error"] > 1e-1)
        at_risk = [s["host"] for s in spreads if s["int8_risk"] or s["per_channel_int8_risk"]]
        assert fold["int8_risks"] == at_risk
        assert ("int8 risk:" if at_risk else "int8 readiness: rounding any one") in result.stdout


def test_error_over_tolerance_exits_1_keeps_the_old_file_and_still_reports(saved, tmp_path, capfd):
    target = tmp_path / "q.tflite"
    target.write_bytes(b"previous export")
    result = cli_in_process(
        capfd,
        saved / "cnn.keras",
        "--tflite",
        target,
        "--quantize",
        "int8",
        "--representative-data",
        saved / "x.npy",
        "--scale-tolerance",
        "1e-6",
        "--report",
        tmp_path / "r.json",
    )
    assert result.returncode == 1, result.stderr
    assert "verification FAILED" in result.stdout and "not written" in result.stdout
    assert target.read_bytes() == b"previous export"
    assert sorted(os.listdir(tmp_path)) == ["q.tflite", "r.json"]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] is False and report["exports"][0]["quantization"] == "int8"
    assert report["exports"][0]["relative_error"] > 1e-6 and not report["exports"][0]["passed"]


def _multi_input_model():
    features = keras.Input((6,), name="features")
    ids = keras.Input((3,), dtype="int32", name="ids")
    h = keras.layers.BatchNormalization()(keras.layers.Dense(8, use_bias=False)(features))
    h = keras.layers.Concatenate()([h, keras.layers.Flatten()(keras.layers.Embedding(5, 2)(ids))])
    return randomise_batch_norms(
        keras.Model(
            {"features": features, "ids": ids},
            {"label": keras.layers.Dense(3)(h), "score": keras.layers.Dense(1)(h)},
        )
    )


def test_several_inputs_from_an_npz_with_one_array_per_input(tmp_path, capfd):
    _multi_input_model().save(tmp_path / "m.keras")
    rng = np.random.default_rng(0)
    features = rng.normal(size=(80, 6)).astype("float32")
    np.savez(tmp_path / "x.npz", features=features, ids=rng.integers(0, 5, (80, 3)))
    # The .npz is the probe here (int8 calibration from a dict: tests/test_export.py).
    result = cli_in_process(
        capfd,
        tmp_path / "m.keras",
        "--tflite",
        tmp_path / "m.tflite",
        "--onnx",
        tmp_path / "m.onnx",
        "--representative-data",
        tmp_path / "x.npz",
        "--report",
        tmp_path / "r.json",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "output label:" in result.stdout and "output score:" in result.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    for export in report["exports"]:
        assert set(export["relative_errors"]) == {"label", "score"} and export["passed"]

    np.savez(tmp_path / "bad.npz", features=features)
    result = cli_in_process(
        capfd,
        tmp_path / "m.keras",
        "--onnx",
        tmp_path / "bad.onnx",
        "--representative-data",
        tmp_path / "bad.npz",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "missing ['ids']" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "bad.onnx").exists()


@pytest.mark.parametrize("corruption", ["truncated", "junk_inside_zip"])
def test_corrupt_model_exits_2_in_one_line_without_output(saved, tmp_path, corruption, capfd):
    bad = tmp_path / "bad.keras"
    if corruption == "truncated":
        data = (saved / "cnn.keras").read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    else:
        with zipfile.ZipFile(bad, "w") as archive:
            archive.writestr("config.json", "{not json")
    result = cli_in_process(
        capfd, bad, "--tflite", tmp_path / "out.tflite", "--report", tmp_path / "r.json"
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    errors = _error_lines(result)
    assert len(errors) == 1, result.stderr
    if corruption == "truncated":
        assert "bad.keras is not a valid .keras file" in errors[0]
    else:  # Keras's own complaint, on one line
        assert "JSONDecodeError" in errors[0] or "ValueError" in errors[0], errors[0]
    assert sorted(os.listdir(tmp_path)) == ["bad.keras"]


def test_lambda_layer_loads_only_with_unsafe(tmp_path, capfd):
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras.layers.BatchNormalization(),
            keras.layers.Lambda(lambda x: x * 2.0),
        ]
    )
    model.save(tmp_path / "lambda.keras")
    safe = cli_in_process(capfd, tmp_path / "lambda.keras", "--onnx", tmp_path / "m.onnx")
    assert safe.returncode == 2 and "Traceback" not in safe.stderr
    assert "safe_mode" in safe.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "m.onnx").exists()
    unsafe = cli_in_process(
        capfd, tmp_path / "lambda.keras", "--onnx", tmp_path / "m.onnx", "--unsafe"
    )
    assert unsafe.returncode == 0, unsafe.stderr
    assert "batch norms: 1 folded, 0 kept" in unsafe.stdout and (tmp_path / "m.onnx").exists()


def test_bad_usage_exits_2_in_one_line(tmp_path):
    result = run_cli(tmp_path / "missing.keras", "--onnx", tmp_path / "m.onnx")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"keras-bn-export: error: cannot read model file {tmp_path / 'missing.keras'}: no such file"
    )
    result = run_cli(tmp_path / "m.keras", "--quantize", "int4")
    assert result.returncode == 2
    assert "argument --quantize: invalid choice: 'int4'" in result.stderr.splitlines()[-1]


def test_mixed_precision_model_is_judged_at_its_default_tolerance(tmp_path, capfd):
    """The folded mixed-precision model rounds to float16 as its ONNX file does: it gets the
    same 1e-2 default (with 1e-4 the CLI exited 1, "FAILED", yet wrote the file)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inputs = keras.Input((6, 6, 3))
        y = keras.layers.Conv2D(6, 3, padding="same", use_bias=False)(inputs)
        y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
        y = keras.layers.Dense(4)(keras.layers.Flatten()(y))
        y = keras.layers.BatchNormalization()(y)
        outputs = keras.layers.Activation("linear", dtype="float32")(y)
        model = randomise_batch_norms(keras.Model(inputs, outputs))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.save(tmp_path / "mixed.keras")
    result = cli_in_process(
        capfd,
        tmp_path / "mixed.keras",
        "--onnx",
        tmp_path / "m.onnx",
        "--report",
        tmp_path / "r.json",
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["fold"]["relative_error"] > 1e-4  # 16-bit rounding, over the float32 default
    assert result.returncode == 0, result.stdout + result.stderr
    assert report["fold_scale_tolerance"] == report["exports"][0]["scale_tolerance"] == 1e-2
    assert report["passed"]
    assert (tmp_path / "m.onnx").exists() and "verification passed" in result.stdout


def test_report_is_strict_json_when_an_output_is_nan(tmp_path, capfd):
    """A NaN error is written as null (Python's json writes the token NaN, which strict JSON
    parsers reject); the report still says the file failed."""
    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(4)(inputs))
    head = keras.layers.Dense(2, name="nan_head")
    model = keras.Model(inputs, [keras.layers.Dense(2, name="fine")(hidden), head(hidden)])
    kernel, bias = head.get_weights()
    kernel[0, 0] = np.nan
    head.set_weights([kernel, bias])
    model.save(tmp_path / "nan.keras")
    result = cli_in_process(
        capfd,
        tmp_path / "nan.keras",
        "--onnx",
        tmp_path / "m.onnx",
        "--report",
        tmp_path / "r.json",
    )
    assert result.returncode == 1, result.stdout + result.stderr

    def reject(token):
        raise ValueError(f"not JSON: {token}")

    report = json.loads((tmp_path / "r.json").read_text(), parse_constant=reject)
    (export,) = report["exports"]
    assert export["relative_errors"] == {
        "fine": export["relative_errors"]["fine"],
        "nan_head": None,
    }
    assert export["relative_error"] is None and not export["passed"] and not report["passed"]
    assert report["fold"]["errors"]["nan_head"] is None
    assert not (tmp_path / "m.onnx").exists()


def _error_lines(result):
    lines = result.stderr.splitlines()
    return [line for line in lines if line.startswith("keras-bn-export: error:")]


def _run_script(tmp_path, source, *args):
    """Run `source` as a fresh Python process (this venv's interpreter) with `args`."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


# --------------------------------------------------------------------------- exit codes


def test_deprecated_atol_still_works_with_a_one_line_note(saved, tmp_path, capfd):
    result = cli_in_process(
        capfd,
        saved / "cnn.keras",
        "--onnx",
        tmp_path / "m.onnx",
        "--atol",
        "1e-3",
        "--report",
        tmp_path / "r.json",
    )
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "--atol" in line]
    assert notes == [
        "keras-bn-export: warning: --atol is deprecated; use --scale-tolerance (the same value)"
    ]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["fold_scale_tolerance"] == report["exports"][0]["scale_tolerance"] == 1e-3


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--scale-tolerance", "0"],
            "--scale-tolerance must be a positive finite number; received --scale-tolerance=0.0.",
        ),
        (["--scale-tolerance", "nan"], "--scale-tolerance must be a positive finite number"),
        (["--atol", "-1"], "--atol must be a positive finite number; received --atol=-1.0."),
        (["--atol", "1e-3", "--scale-tolerance", "1e-3"], "give --scale-tolerance only"),
        (["--quantize", "int8", "--tflite", "q.tflite"], "needs --representative-data"),
        (["--int8-readiness", "--no-fold"], "--int8-readiness measures the folded hosts"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_usage_errors_exit_2_in_one_line(saved, args, message):
    result = run_cli(saved / "cnn.keras", *args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (error,) = _error_lines(result)
    assert message in error


def test_bad_representative_data_and_an_unwritable_path_exit_2(saved, tmp_path, capfd):
    (tmp_path / "x.npy").write_bytes(b"\x93NUMPY not really")
    result = cli_in_process(
        capfd,
        saved / "cnn.keras",
        "--onnx",
        tmp_path / "m.onnx",
        "--representative-data",
        tmp_path / "x.npy",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (error,) = _error_lines(result)
    assert error.startswith(f"keras-bn-export: error: cannot read --representative-data {tmp_path}")
    result = cli_in_process(
        capfd, saved / "cnn.keras", "--onnx", tmp_path
    )  # a folder: OSError, up front
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (error,) = _error_lines(result)
    assert "IsADirectoryError" in error and str(tmp_path) in error
    assert os.listdir(tmp_path) == ["x.npy"]


def test_a_model_the_export_cannot_take_exits_2(tmp_path):
    """A subclassed model that loads (its class is registered in the process) reaches the
    exporter, whose UnsupportedModelError is bad input: one line, exit 2."""
    result = _run_script(
        tmp_path,
        """
        import sys

        import keras

        from keras_bn.export import cli

        @keras.saving.register_keras_serializable(package="cli_test")
        class Net(keras.Model):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.dense = keras.layers.Dense(3)

            def call(self, x):
                return self.dense(x)

        net = Net(name="net")
        net(keras.ops.zeros((2, 4)))
        net.save(sys.argv[1])
        sys.exit(cli.main([sys.argv[1], "--onnx", sys.argv[2]]))
        """,
        tmp_path / "net.keras",
        tmp_path / "net.onnx",
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (error,) = _error_lines(result)
    assert error == (
        "keras-bn-export: error: UnsupportedModelError: Cannot export 'net', a subclassed Net: "
        "it has no layer graph to inspect. Build it as a Sequential or Functional model."
    )
    assert not (tmp_path / "net.onnx").exists()


def test_an_internal_error_exits_3_with_its_traceback(saved, tmp_path):
    """A bug (here a KeyError raised inside the export, where none is expected) is not blamed
    on the input: exit 3, the traceback, and a request to report it."""
    result = _run_script(
        tmp_path,
        """
        import sys

        from keras_bn.export import cli, trace

        def signature(model, rules=None):
            raise KeyError("a bug")

        trace.signature = signature
        sys.exit(cli.main(sys.argv[1:]))
        """,
        saved / "cnn.keras",
        "--onnx",
        tmp_path / "m.onnx",
    )
    assert result.returncode == 3, result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    assert 'in signature\n    raise KeyError("a bug")' in result.stderr
    assert "keras-bn-export: internal error: KeyError: 'a bug'" in result.stderr
    assert "This is a bug in keras-bn-export" in result.stderr and "please report it" in (
        result.stderr
    )
    assert not _error_lines(result) and not (tmp_path / "m.onnx").exists()


# --------------------------------------------------------------------------- a fast CLI

HEAVY = ("tensorflow", "keras", "tf2onnx", "ai_edge_litert", "onnxruntime", "onnx")


@pytest.mark.parametrize(
    "argv,code", [(["--help"], 0), (["--version"], 0), (["m.keras", "--quantize", "int4"], 2)]
)
def test_help_version_and_usage_errors_import_nothing_heavy(tmp_path, argv, code):
    """They answer before TensorFlow, Keras, tf2onnx or LiteRT are imported, and the command's
    environment defaults are set by then."""
    result = _run_script(
        tmp_path,
        f"""
        import contextlib, io, json, os, sys

        os.environ.pop("KERAS_BACKEND", None)
        from keras_bn.export import cli

        with contextlib.redirect_stdout(io.StringIO()) as out:
            code = cli.main({argv!r})
        heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)
        print(json.dumps([code, heavy, os.environ.get("KERAS_BACKEND"), out.getvalue()]))
        """,
    )
    assert result.returncode == 0, result.stderr
    returned, heavy, backend, output = json.loads(result.stdout)
    assert returned == code and heavy == [] and backend == "tensorflow"
    if argv == ["--help"]:
        assert "--scale-tolerance" in output and "exit codes:" in output
    if argv == ["--version"]:
        assert output.strip() == "keras-bn-export 0.1.0"


def test_help_shows_the_defaults_and_the_exit_codes():
    result = run_cli("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert defaults.describe_scale_tolerances() in text
    assert "1e-4 float32, 1e-3 float16, 2e-2 dynamic, 1e-1 int8; at least 1e-2" in text
    assert f"verified on {defaults.PROBE_SAMPLES} samples spread over them" in text
    assert f"holds out a quarter (at most {defaults.PROBE_SAMPLES})" in text
    assert f"up to {defaults.CALIBRATION_SAMPLES} of the rest" in text
    assert f"needs {defaults.INT8_MIN_SAMPLES} or more" in text
    for code in ("0 success", "1 a file differs", "2 bad usage or bad input", "3 an internal"):
        assert code in text


def test_the_docs_state_the_defaults_and_the_exit_codes():
    """docs/guide/export.md, the exporters' docstrings and the CLI's docstring say what
    keras_bn/export/defaults.py and cli.py hold."""
    from keras_bn.export import cli, export_onnx, export_tflite

    page = " ".join(docs_page("guide/export.md").split())
    short = defaults.short
    tolerances = defaults.SCALE_TOLERANCES
    stated = (
        f"`scale_tolerance` defaults to {short(tolerances[None])} for float32 (both formats) "
        f'and, for TFLite, to {short(tolerances["float16"])} for `"float16"`, '
        f'{short(tolerances["dynamic"])} for `"dynamic"` and {short(tolerances["int8"])} for '
        f'`"int8"`',
        f"gets at least {short(defaults.HALF_PRECISION_SCALE_TOLERANCE)}",
        f"needs at least {defaults.INT8_MIN_SAMPLES} `representative_data` samples: a quarter "
        f"of them, at most {defaults.PROBE_SAMPLES}, are held out to verify on, and up to "
        f"{defaults.CALIBRATION_SAMPLES} of the rest calibrate",
        f"Files of the other quantizations are verified on {defaults.PROBE_SAMPLES} samples",
        f"less than `{short(defaults.FLOAT32_SCALE_TOLERANCE)} / scale_tolerance` of its output",
    )
    assert defaults.HELD_OUT_FRACTION == 0.25  # "a quarter", in the docs and the help
    for sentence in stated:
        assert sentence in page, sentence
    segment = page.split("Exit codes: ")[1].split("`--no-fold`")[0]
    codes = re.findall(r"(?:^|; )(\d) [a-z]", segment)
    assert [int(code) for code in codes] == sorted(cli.EXIT_CODES)
    docstring = " ".join(export_tflite.__doc__.split())
    for quantization, tolerance in tolerances.items():
        assert f"{short(tolerance)} for {quantization or 'float32'}" in docstring
    assert f"up to {defaults.CALIBRATION_SAMPLES} (`defaults.CALIBRATION_SAMPLES`)" in docstring
    assert f"at most {defaults.PROBE_SAMPLES} (`defaults.PROBE_SAMPLES`)" in docstring
    assert f"at least {defaults.INT8_MIN_SAMPLES}" in docstring
    assert f"default {short(tolerances[None])}" in " ".join(export_onnx.__doc__.split())
    module_doc = " ".join(cli.__doc__.split())
    for code in cli.EXIT_CODES:
        assert f"- {code}: " in module_doc

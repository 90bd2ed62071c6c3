"""keras-bn-export end to end, through a subprocess running the installed console script."""

import json
import os
import zipfile

import keras
import numpy as np
import pytest

import digits
from helpers import randomise_batch_norms, run_cli


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
    assert tflite["atol"] == onnx["atol"] == 1e-4 and tflite["passed"] and onnx["passed"]
    assert tflite["size_bytes"] == os.path.getsize(tmp_path / "m.tflite")
    assert onnx["size_bytes"] == os.path.getsize(tmp_path / "m.onnx")
    (output,) = onnx["errors"]
    assert set(onnx["errors"][output]) == {"ort_disabled", "ort_enabled"}
    assert max(tflite["relative_error"], onnx["relative_error"]) <= 1e-4
    assert tflite["op_histogram"]["CONV_2D"] == 2 and "MUL" not in tflite["op_histogram"]


def test_int8_passes_its_default_tolerance(saved, tmp_path):
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
    )
    assert result.returncode == 0, result.stderr
    (export,) = json.loads((tmp_path / "r.json").read_text())["exports"]
    assert export["atol"] == 5e-2 and export["passed"] and export["relative_error"] > 1e-4


def test_error_over_tolerance_exits_1_keeps_the_old_file_and_still_reports(saved, tmp_path):
    target = tmp_path / "q.tflite"
    target.write_bytes(b"previous export")
    result = run_cli(
        saved / "cnn.keras",
        "--tflite",
        target,
        "--quantize",
        "int8",
        "--representative-data",
        saved / "x.npy",
        "--atol",
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


def test_several_inputs_from_an_npz_with_one_array_per_input(tmp_path):
    _multi_input_model().save(tmp_path / "m.keras")
    rng = np.random.default_rng(0)
    features = rng.normal(size=(80, 6)).astype("float32")
    np.savez(tmp_path / "x.npz", features=features, ids=rng.integers(0, 5, (80, 3)))
    # The .npz is the probe here (int8 calibration from a dict: tests/test_export.py).
    result = run_cli(
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
    result = run_cli(
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
def test_corrupt_model_exits_2_in_one_line_without_output(saved, tmp_path, corruption):
    bad = tmp_path / "bad.keras"
    if corruption == "truncated":
        data = (saved / "cnn.keras").read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    else:
        with zipfile.ZipFile(bad, "w") as archive:
            archive.writestr("config.json", "{not json")
    result = run_cli(bad, "--tflite", tmp_path / "out.tflite", "--report", tmp_path / "r.json")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    errors = [l for l in result.stderr.splitlines() if l.startswith("keras-bn-export: error:")]
    assert len(errors) == 1, result.stderr
    if corruption == "truncated":
        assert "bad.keras is not a valid .keras file" in errors[0]
    else:  # Keras's own complaint, on one line
        assert "JSONDecodeError" in errors[0] or "ValueError" in errors[0], errors[0]
    assert sorted(os.listdir(tmp_path)) == ["bad.keras"]


def test_lambda_layer_loads_only_with_unsafe(tmp_path):
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras.layers.BatchNormalization(),
            keras.layers.Lambda(lambda x: x * 2.0),
        ]
    )
    model.save(tmp_path / "lambda.keras")
    safe = run_cli(tmp_path / "lambda.keras", "--onnx", tmp_path / "m.onnx")
    assert safe.returncode == 2 and "Traceback" not in safe.stderr
    assert "safe_mode" in safe.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "m.onnx").exists()
    unsafe = run_cli(tmp_path / "lambda.keras", "--onnx", tmp_path / "m.onnx", "--unsafe")
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


def test_mixed_precision_model_is_judged_at_its_default_tolerance(tmp_path):
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
    result = run_cli(
        tmp_path / "mixed.keras", "--onnx", tmp_path / "m.onnx", "--report", tmp_path / "r.json"
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["fold"]["relative_error"] > 1e-4  # 16-bit rounding, over the float32 default
    assert result.returncode == 0, result.stdout + result.stderr
    assert report["fold_atol"] == report["exports"][0]["atol"] == 1e-2 and report["passed"]
    assert (tmp_path / "m.onnx").exists() and "verification passed" in result.stdout


def test_report_is_strict_json_when_an_output_is_nan(tmp_path):
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
    result = run_cli(
        tmp_path / "nan.keras", "--onnx", tmp_path / "m.onnx", "--report", tmp_path / "r.json"
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

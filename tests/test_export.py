"""export_tflite and export_onnx on small models: the files run in LiteRT / onnxruntime and match
the unfolded Keras model; folding removes the BN ops the converters would otherwise leave; a
file over its tolerance never replaces anything; models with several inputs and outputs."""

import os
import re
import sys
import warnings

import keras
import numpy as np
import onnx
import pytest

import digits
import keras_bn
from helpers import assert_close, randomise_batch_norms
from keras_bn.export import (
    ExportReport,
    FoldReport,
    UnsupportedModelError,
    VerificationError,
    defaults,
    export_onnx,
    export_tflite,
    fold_batch_norms,
)
from keras_bn.export import onnx as onnx_export
from keras_bn.export import tflite as tflite_export
from tf_helpers import EXPORTERS, RUNNERS

pytestmark = pytest.mark.backends("tensorflow")

L = keras.layers


@pytest.fixture(scope="module")
def cnn():
    keras.utils.set_random_seed(0)
    return randomise_batch_norms(digits.small_cnn())


def _probe(n=16):
    return np.random.default_rng(1).uniform(size=(n, 8, 8, 1)).astype("float32")


def test_tflite_float32_matches_keras_with_no_bn_ops(cnn, tmp_path):
    path = tmp_path / "cnn.tflite"
    probe = _probe()
    report = export_tflite(cnn, path, probe=probe)
    assert report.relative_error <= 1e-4 and report.passed and report.scale_tolerance == 1e-4
    assert report.path == str(path) and report.size_bytes == os.path.getsize(path)
    assert "MUL" not in report.op_histogram and report.op_histogram["CONV_2D"] == 2
    assert not any(op.startswith("Flex") or op == "CUSTOM" for op in report.op_histogram)
    assert len(report.fold.folded) == 3 and report.fold.kept == []
    # Independently re-run the file on the disk against the unfolded model.
    (actual,) = tflite_export.run(path, probe).values()
    expected = np.asarray(cnn(probe, training=False))
    np.testing.assert_allclose(actual, expected, atol=1e-4 * np.abs(expected).max())


def test_tflite_without_fold_converts_the_model_as_is(cnn, tmp_path):
    report = export_tflite(cnn, tmp_path / "raw.tflite", fold=False, probe=_probe())
    assert report.fold is None and report.relative_error <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["float16", "dynamic", "int8"])
def test_quantized_files_meet_their_default_tolerance(cnn, tmp_path, quantization):
    data = _probe(64)
    report = export_tflite(
        cnn, tmp_path / "q.tflite", quantization=quantization, representative_data=data
    )  # raises VerificationError if over
    assert report.scale_tolerance == defaults.SCALE_TOLERANCES[quantization]
    assert report.quantization == quantization
    assert 0 < report.relative_error <= report.scale_tolerance
    float_size = export_tflite(cnn, tmp_path / "f.tflite", probe=data).size_bytes
    assert report.size_bytes < 0.6 * float_size
    if quantization == "int8":
        assert report.op_histogram["QUANTIZE"] >= 1
        # The converter's raw line and its calibrator's deprecation warning: in the report.
        log = "\n".join(report.log)
        assert "fully_quantize: 0" in log and "tf.lite.Interpreter is deprecated" in log


@pytest.mark.slow
def test_mobilenet_v2_int8_report_matches_litert(tmp_path):
    """MobileNetV2 (random weights and BN statistics) converts to int8 and its report is what
    LiteRT gives on the held-out samples. Its logits ignore the input (they vary by 2.4e-7 of
    their scale), so the near-zero ones, lost to int8's one scale per tensor, fail the
    per-channel check: the default tolerance is not asserted, the whole output's error is."""
    keras.utils.set_random_seed(0)
    model = randomise_batch_norms(
        keras.applications.MobileNetV2(
            input_shape=(96, 96, 3), alpha=0.35, weights=None, classifier_activation=None
        )
    )
    data = np.random.default_rng(0).uniform(-1, 1, (64, 96, 96, 3)).astype("float32")
    path = tmp_path / "m.tflite"
    report = export_tflite(model, path, quantization="int8", representative_data=data, strict=False)
    assert report.op_histogram["QUANTIZE"] >= 1 and path.exists()
    (output,) = report.errors
    assert report.errors[output]["litert"] / report.output_scales[output] <= 5e-2 / 3
    held_out = np.linspace(0, 63, 16).round().astype(int)  # a quarter, spread evenly
    (actual,) = tflite_export.run(path, data[held_out]).values()
    expected = np.asarray(model(data[held_out], training=False), np.float64)
    floor = np.abs(expected).max() * defaults.FLOAT32_SCALE_TOLERANCE / report.scale_tolerance
    by_channel = np.abs(actual - expected).max(0) / np.maximum(np.abs(expected).max(0), floor)
    assert report.relative_error == pytest.approx(by_channel.max(), rel=1e-6)
    assert report.worst_channels[output].channel == by_channel.argmax()


def test_bad_arguments_raise_naming_them(cnn, tmp_path):
    with pytest.raises(ValueError, match=r"quantization must be one of .* received 'int4'"):
        export_tflite(cnn, tmp_path / "x.tflite", quantization="int4")
    with pytest.raises(ValueError, match="needs representative_data"):
        export_tflite(cnn, tmp_path / "x.tflite", quantization="int8")
    for tolerance in (0.0, -1e-3, float("nan"), "1e-4", True):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"scale_tolerance must be a positive finite number; received "
                f"scale_tolerance={tolerance!r}."
            ),
        ):
            export_onnx(cnn, tmp_path / "x.onnx", scale_tolerance=tolerance)
    with pytest.raises(ValueError, match="strict must be True or False; received strict=1"):
        export_onnx(cnn, tmp_path / "x.onnx", strict=1)
    with pytest.raises(ValueError, match=r"probe for input '.*' has shape \(2, 8, 8\)"):
        export_onnx(cnn, tmp_path / "x.onnx", probe=np.zeros((2, 8, 8), "float32"))
    assert os.listdir(tmp_path) == []


def test_kept_bn_becomes_one_mul_and_one_add(tmp_path):
    inputs = keras.Input((6, 6, 2))
    y = L.Conv2D(4, 3, activation="relu")(inputs)
    y = L.BatchNormalization(name="kept")(y)  # after a ReLU, before a Flatten: cannot fold
    outputs = L.Flatten()(y)
    model = randomise_batch_norms(keras.Model(inputs, outputs))
    x = np.random.default_rng(2).normal(size=(3, 6, 6, 2)).astype("float32")
    tfl = export_tflite(model, tmp_path / "k.tflite", probe=x)
    onnx_report = export_onnx(model, tmp_path / "k.onnx", probe=x)
    assert [k.bn for k in tfl.fold.kept] == ["kept"]
    assert tfl.relative_error <= 1e-5 and onnx_report.relative_error <= 1e-5
    assert (tfl.op_histogram["MUL"], tfl.op_histogram["ADD"]) == (1, 1)
    assert (onnx_report.op_histogram["Mul"], onnx_report.op_histogram.get("Add", 0)) == (1, 1)


def test_onnx_matches_keras_with_optimisation_off_and_on(cnn, tmp_path):
    path = tmp_path / "cnn.onnx"
    probe = _probe()
    report = export_onnx(cnn, path, probe=probe)
    (output,) = report.errors
    assert set(report.errors[output]) == {"ort_disabled", "ort_enabled"}
    assert report.relative_error <= 1e-4
    assert "BatchNormalization" not in report.op_histogram and "Mul" not in report.op_histogram
    assert report.size_bytes == os.path.getsize(path)
    onnx.checker.check_model(str(path), full_check=True)
    # Any batch size: the batch dim is dynamic.
    for batch in (1, 7):
        x = _probe(batch)
        assert_close(onnx_export.run(path, x)[output], cnn(x, training=False), 1e-4)


def test_onnx_mlp_bn_residue_without_fold_and_none_with_it(tmp_path):
    """tf2onnx leaves a Mul per Dense→BN (ORT does not fuse MatMul→Mul); folding removes it."""
    layers = [layer for _ in range(4) for layer in (L.Dense(16), L.BatchNormalization())]
    model = randomise_batch_norms(keras.Sequential([keras.Input((12,)), *layers]))
    raw = export_onnx(model, tmp_path / "raw.onnx", fold=False)
    folded = export_onnx(model, tmp_path / "folded.onnx")
    assert raw.fold is None and raw.op_histogram["Mul"] == 4
    assert folded.op_histogram == {"MatMul": 4, "Add": 4}
    assert max(raw.relative_error, folded.relative_error) <= 1e-4


def test_invalid_onnx_file_is_refused_naming_it(tmp_path):
    """onnx.checker runs on every written file; a graph that reads an undefined tensor fails."""
    node = onnx.helper.make_node("Relu", ["undefined"], ["y"])
    graph = onnx.helper.make_graph(
        [node],
        "bad",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    path = tmp_path / "bad.onnx"
    onnx.save(onnx.helper.make_model(graph), path)
    with pytest.raises(ValueError, match=f"{path} is not a valid ONNX model"):
        onnx_export.check(path)


# --------------------------------------------------------------------------- verification


def _nan_head_model():
    """Two outputs; the second is log of a signed value, NaN on about half the probe."""
    inputs = keras.Input((5,))
    h = keras_bn.BatchNormalization()(L.Dense(4, use_bias=False)(inputs))
    good = L.Dense(3, name="good")(h)
    bad = L.Lambda(lambda t: keras.ops.log(t), name="log")(L.Dense(2)(h))
    return randomise_batch_norms(keras.Model(inputs, [good, bad]))


def test_a_nan_error_that_is_not_first_never_passes():
    """Python's max drops a NaN that is not first: max(1e-7, nan) is 1e-7."""
    fold_report = FoldReport(
        [], [], errors={"a": 1e-7, "b": float("nan")}, output_scales={"a": 1.0, "b": 1.0}
    )
    export_report = ExportReport(
        "onnx",
        "m.onnx",
        1,
        errors={"a": {"ort_disabled": 1e-7, "ort_enabled": float("nan")}},
        output_scales={"a": 1.0},
        scale_tolerance=1e-4,
        op_histogram={},
    )
    assert np.isnan(fold_report.relative_error) and np.isnan(fold_report.max_abs_error)
    assert np.isnan(export_report.relative_error) and not export_report.passed
    infinite = ExportReport(
        "onnx",
        "m.onnx",
        1,
        errors={"a": {"ort_enabled": 1e-7}},
        output_scales={"a": float("inf")},
        scale_tolerance=1e-4,
        op_histogram={},
    )
    assert not infinite.passed


def test_fold_report_shows_a_nan_output():
    _, report = fold_batch_norms(_nan_head_model())
    assert report.errors["good"] < 1e-5 and np.isnan(report.errors["log"])
    assert np.isnan(report.relative_error)


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_file_over_tolerance_never_replaces_the_existing_file(fmt, tmp_path):
    target = tmp_path / f"model.{fmt}"
    target.write_bytes(b"previous export")
    with pytest.raises(VerificationError, match="output 'log' is off by nan") as info:
        EXPORTERS[fmt](_nan_head_model(), target)
    report = info.value.report
    assert not report.passed and report.path == str(target)
    assert report.relative_errors["good"] <= 1e-4 and np.isnan(report.relative_errors["log"])
    assert target.read_bytes() == b"previous export"
    assert os.listdir(tmp_path) == [target.name]

    written = EXPORTERS[fmt](_nan_head_model(), target, strict=False)
    assert not written.passed and target.read_bytes() != b"previous export"
    assert written.size_bytes == os.path.getsize(target)
    assert os.listdir(tmp_path) == [target.name]


def test_what_a_converter_prints_goes_into_the_log_unless_it_fails(capfd):
    """keras_bn/_quiet.captured, around the converters and runtimes: what is written to file
    descriptor 2 (C++) and the converter's known warnings go into the log; Python's own
    sys.stderr still reaches the terminal, other warnings are raised as they were, and on an
    exception everything captured is written back before it propagates."""
    from keras_bn import _quiet

    log = []
    with pytest.warns(UserWarning, match="not the converter's") as raised, _quiet.captured(log):
        os.write(2, b"I0000 a line from C++\n")
        print("Python's stderr", file=sys.stderr)
        warnings.warn("Warning: tf.lite.Interpreter is deprecated and ...", stacklevel=1)
        warnings.warn("not the converter's", stacklevel=1)
    assert len(raised) == 1
    assert log == [
        "I0000 a line from C++",
        "UserWarning: Warning: tf.lite.Interpreter is deprecated and ...",
    ]
    assert capfd.readouterr().err == "Python's stderr\n"
    with pytest.raises(RuntimeError, match="failed"), _quiet.captured(log):
        os.write(2, b"the converter's complaint\n")
        raise RuntimeError("failed")
    assert capfd.readouterr().err == "the converter's complaint\n"
    assert len(log) == 2


def test_tolerance_is_the_callers(cnn, tmp_path):
    """A float32 file is off by about 1e-7 of the output scale: scale_tolerance=1e-12 refuses
    it, and the error names the argument."""
    with pytest.raises(VerificationError, match=r"over scale_tolerance=1e-12") as info:
        export_tflite(cnn, tmp_path / "m.tflite", probe=_probe(), scale_tolerance=1e-12)
    assert 0 < info.value.report.relative_error <= 1e-4
    assert os.listdir(tmp_path) == []


def test_mixed_precision_model_exports_to_onnx_and_gets_a_clear_tflite_refusal(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")  # conftest restores float32
    model = randomise_batch_norms(
        keras.Sequential(
            [
                keras.Input((8, 8, 3)),
                L.Conv2D(4, 3, use_bias=False, name="conv"),
                keras_bn.BatchNormalization(),
                L.ReLU(),
                L.Flatten(),
                L.Dense(3),
            ]
        )
    )
    report = export_onnx(model, tmp_path / "m.onnx")  # float16 rounding: about 5e-4
    assert report.scale_tolerance == 1e-2 and 0 < report.relative_error <= 1e-2
    with pytest.raises(
        UnsupportedModelError, match="TFLite cannot convert layer 'conv', which computes in float16"
    ):
        export_tflite(model, tmp_path / "m.tflite")
    assert os.listdir(tmp_path) == ["m.onnx"]


# --------------------------------------------------------------------------- channels_first


def _channels_first_conv(input_shape, use_bias=False):
    """The case that folded wrong: a channels_first host that gains a bias, its last output
    dim (4) equal to its filter count (4) at a 6×6 input."""
    inputs = keras.Input(input_shape)
    y = L.Conv2D(4, 3, data_format="channels_first", use_bias=use_bias, name="conv")(inputs)
    y = L.BatchNormalization(axis=1, name="bn")(y)
    return randomise_batch_norms(keras.Model(inputs, y))


@pytest.mark.parametrize("input_shape", [(3, 6, 6), (3, None, None)], ids=["static", "dynamic"])
@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_channels_first_host_folds_and_exports_at_the_size_keras_guesses_wrong(
    fmt, input_shape, tmp_path
):
    model = _channels_first_conv(input_shape)
    x = np.random.default_rng(0).normal(size=(2, 3, 6, 6)).astype("float32")
    folded, fold_report = fold_batch_norms(model)  # dynamic: probed at 8×8
    assert [f.host for f in fold_report.folded] == ["conv"]
    assert fold_report.relative_error <= 1e-5
    assert_close(folded(x), model(x, training=False), 1e-5)
    report = EXPORTERS[fmt](model, tmp_path / f"m.{fmt}", probe=x)
    assert report.relative_error <= 1e-4 and report.fold.relative_error <= 1e-5
    (actual,) = RUNNERS[fmt](tmp_path / f"m.{fmt}", x).values()
    assert_close(actual, model(x, training=False), 1e-4)


@pytest.mark.parametrize(
    "layer",
    [
        L.Conv1D(4, 3, data_format="channels_first", name="conv"),
        L.Conv1D(4, 3, data_format="channels_first", use_bias=False, name="conv"),
        L.Conv2DTranspose(4, 3, data_format="channels_first", name="conv"),
    ],
    ids=["Conv1D", "Conv1D_no_bias", "Conv2DTranspose"],
)
def test_channels_first_layers_tflite_cannot_convert_are_refused_in_one_line(layer, tmp_path):
    shape = (2, 7) if isinstance(layer, L.Conv1D) else (2, 5, 5)
    inputs = keras.Input(shape)
    model = randomise_batch_norms(keras.Model(inputs, L.BatchNormalization(axis=1)(layer(inputs))))
    target = tmp_path / "m.tflite"
    target.write_bytes(b"previous export")
    with pytest.raises(ValueError) as info:
        export_tflite(model, target)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"TFLite cannot convert layer 'conv' ({type(layer).__name__} "
        f"with data_format='channels_first')"
    )
    assert target.read_bytes() == b"previous export" and os.listdir(tmp_path) == ["m.tflite"]
    report = export_onnx(model, tmp_path / "m.onnx")  # ONNX is channels_first-native
    assert report.relative_error <= 1e-4


# --------------------------------------------------------------------------- several inputs


def _multi_io_model(as_dict):
    """Float features beside int32 ids; two heads of different scales."""
    features = keras.Input((6,), name="features")
    ids = keras.Input((3,), dtype="int32", name="ids")
    h = L.BatchNormalization()(L.Dense(8, use_bias=False)(features))
    h = L.Concatenate()([h, L.Flatten()(L.Embedding(5, 2)(ids))])
    # Named layers make the output names of a list model "label" and "score" too.
    label = keras_bn.BatchNormalization(name="label")(L.Dense(3)(h))
    score = L.Rescaling(100.0, name="score")(L.Dense(1)(L.ReLU()(L.Dense(4)(h))))
    inputs = {"features": features, "ids": ids} if as_dict else [features, ids]
    outputs = {"label": label, "score": score} if as_dict else [label, score]
    return randomise_batch_norms(keras.Model(inputs, outputs))


def _multi_io_data(n, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "features": rng.normal(size=(n, 6)).astype("float32"),
        "ids": rng.integers(0, 5, size=(n, 3)).astype("int32"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("as_dict", [False, True], ids=["lists", "dicts"])
@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_several_inputs_and_outputs_export_and_each_output_is_verified(fmt, as_dict, tmp_path):
    model = _multi_io_model(as_dict)
    data = _multi_io_data(32)
    probe = data if as_dict else [data["features"], data["ids"]]  # as model.predict takes
    path = tmp_path / f"m.{fmt}"
    report = EXPORTERS[fmt](model, path, probe=probe)
    assert list(report.errors) == ["label", "score"] and report.passed
    assert set(report.errors["label"]) == (
        {"litert"} if fmt == "tflite" else {"ort_disabled", "ort_enabled"}
    )
    assert len(report.fold.folded) == 2 and report.fold.kept == []
    assert report.output_scales["score"] > 10 * report.output_scales["label"]
    # Every output, from the file on the disk, against the Keras model.
    label, score = keras.tree.flatten(model(probe, training=False))
    actual = RUNNERS[fmt](path, data)
    assert_close(actual["label"], label, 1e-4)
    assert_close(actual["score"], score, 1e-4)


def test_several_inputs_int8_calibrates_from_a_dict_of_arrays(tmp_path):
    model = _multi_io_model(as_dict=True)
    report = export_tflite(
        model, tmp_path / "m.tflite", quantization="int8", representative_data=_multi_io_data(100)
    )
    assert report.passed and set(report.relative_errors) == {"label", "score"}
    assert report.op_histogram["QUANTIZE"] >= 1


def test_probe_that_does_not_fit_the_inputs_is_named(tmp_path):
    model = _multi_io_model(as_dict=True)
    data = _multi_io_data(4)
    with pytest.raises(ValueError, match=r"missing \['ids'\], unknown \['idz'\]"):
        export_onnx(
            model, tmp_path / "m.onnx", probe={"features": data["features"], "idz": data["ids"]}
        )
    with pytest.raises(ValueError, match="is float32, but the input is int32"):
        export_onnx(
            model,
            tmp_path / "m.onnx",
            probe={"features": data["features"]} | {"ids": data["features"][:, :3]},
        )
    with pytest.raises(ValueError, match="one array, but the model has 2 inputs"):
        fold_batch_norms(model, data["features"])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_an_output_named_like_an_input_keeps_its_name(fmt, tmp_path):
    """A model that also returns its inputs, with a dict output keyed like an input: the
    user's output names are kept; in ONNX, whose inputs and outputs share one namespace
    (tf2onnx failed "graph input 'ids' not exist"), the input, named after its layer, yields."""
    features = keras.Input((6,), name="features")
    ids = keras.Input((3,), dtype="int32", name="ids")
    h = L.BatchNormalization()(L.Dense(4, use_bias=False)(features))
    model = randomise_batch_norms(keras.Model([features, ids], {"ids": h, "echo": ids}))
    data = _multi_io_data(8)
    report = EXPORTERS[fmt](model, tmp_path / f"m.{fmt}", probe=data)
    assert list(report.errors) == ["echo", "ids"] and report.passed
    ids_input = "ids" if fmt == "tflite" else "ids_1"
    actual = RUNNERS[fmt](
        tmp_path / f"m.{fmt}", {"features": data["features"], ids_input: data["ids"]}
    )
    np.testing.assert_array_equal(actual["echo"], data["ids"])
    assert_close(actual["ids"], model(data, training=False)["ids"], 1e-4)


def test_onnx_file_the_checker_rejects_is_named_by_its_target_path(tmp_path):
    """bfloat16 has no ONNX Conv: the checker's error names the path the caller gave, not the
    temporary file (gone by then)."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")  # conftest restores float32
    model = keras.Sequential([keras.Input((6, 6, 2)), L.Conv2D(3, 3)])
    target = tmp_path / "m.onnx"
    with pytest.raises(ValueError, match=f"^{target} is not a valid ONNX model: .*bfloat16"):
        export_onnx(model, target)
    assert os.listdir(tmp_path) == []


def test_input_keys_tensorflow_cannot_name_an_argument_are_refused_in_tflite_kept_in_onnx(
    tmp_path,
):
    """A signature argument must start with a letter, digit or '.': dict keys "_private" and
    "-offset" failed the TFLite export ("non-flat/non-unique argument names"). TFLite refuses
    them by name (renaming a key the user chose could hand it to another tensor); ONNX takes
    any name and keeps them. A probe takes the model's own keys."""
    private, offset = keras.Input((4,), name="_private"), keras.Input((4,), name="-offset")
    h = L.BatchNormalization()(L.Dense(4)(private))
    model = randomise_batch_norms(
        keras.Model({"_private": private, "-offset": offset}, L.Add()([h, offset]))
    )
    rng = np.random.default_rng(0)
    data = {
        "_private": rng.normal(size=(8, 4)).astype("float32"),
        "-offset": rng.normal(size=(8, 4)).astype("float32"),
    }
    with pytest.raises(
        UnsupportedModelError,
        match=r"TFLite cannot name an input '-offset' \(the model's input dict key\): its input "
        r"names must start with a letter, a digit or '\.'",
    ):
        export_tflite(model, tmp_path / "m.tflite", probe=data)
    report = export_onnx(model, tmp_path / "m.onnx", probe=data)
    assert report.passed
    actual = onnx_export.run(tmp_path / "m.onnx", data)
    assert_close(next(iter(actual.values())), model(data, training=False), 1e-4)
    with pytest.raises(
        ValueError,
        match=r"inputs are \['-offset', '_private'\] \(missing "
        r"\['-offset'\], unknown \['offzet'\]",
    ):
        fold_batch_norms(model, {"_private": data["_private"], "offzet": data["-offset"]})
    assert os.listdir(tmp_path) == ["m.onnx"]


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_a_probe_without_samples_is_refused(fmt, tmp_path):
    """Zero samples compare nothing: the file "passed" even at scale_tolerance=1e-30."""
    model = randomise_batch_norms(
        keras.Sequential([keras.Input((4,)), L.Dense(3), keras_bn.BatchNormalization()])
    )
    empty = np.zeros((0, 4), "float32")
    with pytest.raises(ValueError, match=r"probe has no samples \(shapes \[\(0, 4\)\]\)"):
        EXPORTERS[fmt](model, tmp_path / "m.out", probe=empty, scale_tolerance=1e-30)
    with pytest.raises(ValueError, match="representative_data has no samples"):
        export_tflite(model, tmp_path / "m.out", representative_data=empty)
    with pytest.raises(ValueError, match="probe has no samples"):
        fold_batch_norms(model, empty)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("nesting", ["dict", "list"])
def test_a_probe_in_the_models_own_nested_structure(nesting, tmp_path):
    """model.predict takes {"x": …, "meta": {"a": …, "b": …}} (or [x, [a, b]]) for a model built
    on that structure; the probe was refused ("unknown ['meta']", "2 arrays … 3 inputs")."""
    x, a, b = (keras.Input((n,), name=name) for n, name in ((4, "x"), (2, "a"), (3, "b")))
    h = L.BatchNormalization()(L.Dense(4)(L.Concatenate()([x, a, b])))
    rng = np.random.default_rng(0)
    xs, as_, bs = (rng.normal(size=(5, n)).astype("float32") for n in (4, 2, 3))
    if nesting == "dict":
        inputs, probe = {"x": x, "meta": {"a": a, "b": b}}, {"x": xs, "meta": {"a": as_, "b": bs}}
    else:
        inputs, probe = [x, [a, b]], [xs, [as_, bs]]
    model = randomise_batch_norms(keras.Model(inputs, h))
    folded, report = fold_batch_norms(model, probe)
    assert report.relative_error <= 1e-5
    assert_close(folded(probe), model(probe, training=False), 1e-5)
    assert export_onnx(model, tmp_path / "m.onnx", probe=probe).passed


def _ours(caught, text):
    """The warnings of `caught` whose message contains `text` (TF and tf2onnx warn too)."""
    return [w for w in caught if text in str(w.message)]


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_atol_is_a_deprecated_name_of_scale_tolerance(fmt, cnn, tmp_path):
    """atol= still works, with a DeprecationWarning at the caller's line that names the new
    argument; ExportReport.atol reads scale_tolerance the same way; both at once is an error."""
    with pytest.warns(DeprecationWarning) as caught:
        report = EXPORTERS[fmt](cnn, tmp_path / "m.out", probe=_probe(), atol=2e-4)
    (warning,) = _ours(caught, "atol is deprecated: pass scale_tolerance instead")
    assert warning.filename == __file__  # the stack level points at this call
    assert report.scale_tolerance == 2e-4 and report.to_dict()["scale_tolerance"] == 2e-4
    assert "atol" not in report.to_dict()

    with pytest.warns(DeprecationWarning) as caught:
        assert report.atol == 2e-4
    (warning,) = _ours(caught, "ExportReport.atol is deprecated: read ExportReport.scale_tol")
    assert warning.filename == __file__
    with pytest.raises(AttributeError):
        report.atol = 1.0  # read-only

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any warning
        with pytest.raises(
            ValueError,
            match=r"Pass scale_tolerance only: .* received scale_tolerance=0.001 and atol=0.002",
        ):
            EXPORTERS[fmt](cnn, tmp_path / "x.out", scale_tolerance=1e-3, atol=2e-3)
    assert os.listdir(tmp_path) == ["m.out"]

"""What the export's verification checks, each case checked in the runtime (LiteRT,
onnxruntime) against the Keras model or numpy (issue 25): inputs are taken exactly as
model.predict takes them; user-chosen names keep their tensors; int8 is judged on samples held
out from calibration; every output channel on its own scale; a probe whose outputs do not vary
is refused; grouped convolutions convert; CLI messages name --representative-data."""

import json
import os
import re

import keras
import numpy as np
import onnx
import pytest

from helpers import assert_close, cli_in_process, randomise_batch_norms
from keras_bn.export import (
    UnsupportedModelError,
    VerificationError,
    defaults,
    export_onnx,
    export_tflite,
    fold_batch_norms,
    report,
    trace,
)
from keras_bn.export import onnx as onnx_export
from keras_bn.export import tflite as tflite_export
from tf_helpers import EXPORTERS, RUNNERS

pytestmark = pytest.mark.backends("tensorflow")

L = keras.layers


def _file_outputs(fmt, path, inputs):
    """The file's outputs by name, run in its runtime (onnxruntime: optimisation on)."""
    return RUNNERS[fmt](path, inputs)


# --------------------------------------------------------------------------- 1: input order


def _price_ratio_model():
    """Inputs keyed {"z_price", "a_ratio"}: insertion order is not sorted order, so a list
    [price, ratio] is ambiguous (the exporter mapped it in sorted-key order: price → a_ratio)."""
    price, ratio = keras.Input((1,), name="z_price"), keras.Input((1,), name="a_ratio")
    scaled = L.Rescaling(1e-3)(price)
    h = L.BatchNormalization()(L.Dense(8, use_bias=False)(L.Concatenate()([scaled, ratio])))
    y = L.Dense(1, name="y")(L.ReLU()(h))
    return randomise_batch_norms(keras.Model({"z_price": price, "a_ratio": ratio}, y))


def _price_ratio_data(n, seed):
    rng = np.random.default_rng(seed)
    return {
        "z_price": rng.uniform(500, 1500, (n, 1)).astype("float32"),
        "a_ratio": rng.uniform(0, 1, (n, 1)).astype("float32"),
    }


def test_a_list_for_a_dict_of_inputs_is_refused_and_a_dict_is_right_in_litert(tmp_path):
    model = _price_ratio_model()
    data = _price_ratio_data(256, seed=0)
    as_list = [data["z_price"], data["a_ratio"]]
    with pytest.raises(ValueError):  # the reference: model.predict refuses the list too
        model.predict(as_list, verbose=0)
    message = (
        r"is a list of 2 arrays, but the model takes a dict of inputs \['a_ratio', 'z_price'\]: "
        r"the order of a list is ambiguous .* Pass a dict keyed by the input names\."
    )
    with pytest.raises(ValueError, match="^representative_data " + message):
        export_tflite(
            model, tmp_path / "m.tflite", quantization="int8", representative_data=as_list
        )
    with pytest.raises(ValueError, match="^probe " + message):
        export_onnx(model, tmp_path / "m.onnx", probe=as_list)
    with pytest.raises(ValueError, match="^probe " + message):
        fold_batch_norms(model, as_list)
    assert os.listdir(tmp_path) == []

    # The same samples as a dict: the int8 file is right on data it never saw, in LiteRT.
    result = export_tflite(
        model, tmp_path / "m.tflite", quantization="int8", representative_data=data
    )
    fresh = _price_ratio_data(128, seed=1)
    (actual,) = tflite_export.run(tmp_path / "m.tflite", fresh).values()
    expected = model.predict(fresh, verbose=0)
    assert result.passed
    assert np.abs(actual - expected).max() <= 0.1 * np.abs(expected).max()


def test_a_single_input_dict_model_takes_one_array_or_a_list_of_one(tmp_path):
    """Unambiguous: what model.predict takes for a dict of one input."""
    x = keras.Input((3,), name="x")
    model = randomise_batch_norms(keras.Model({"x": x}, L.BatchNormalization()(L.Dense(2)(x))))
    probe = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    for given in (probe, [probe], {"x": probe}):
        assert export_onnx(model, tmp_path / "m.onnx", probe=given).passed


# --------------------------------------------------------------------------- 2: names


def _two_heads(keys):
    """Outputs under `keys`: a small head and one ~100 times larger."""
    x = keras.Input((4,), name="x")
    h = L.BatchNormalization()(L.Dense(8, use_bias=False)(x))
    small = L.Dense(2)(h)
    big = L.Rescaling(100.0)(L.Dense(2)(h))
    return randomise_batch_norms(keras.Model(x, dict(zip(keys, (small, big)))))


def _check_outputs_by_name(fmt, model, path, probe, file_name_of):
    """The file's output under each name equals the Keras output under that name."""
    expected = model(probe, training=False)
    actual = _file_outputs(fmt, path, probe)
    assert set(actual) == set(file_name_of.values())
    for keras_name, file_name in file_name_of.items():
        value = expected
        for part in keras_name:
            value = value[part]
        assert_close(actual[file_name], value, 1e-4)


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_output_names_the_user_chose_keep_their_tensors(fmt, tmp_path):
    """{"head_out": small, "head/out": big}: the file's head_out held head/out's tensor (off by
    139, scale 2.22). Both formats hold any output name: both keys are kept as they are."""
    model = _two_heads(["head_out", "head/out"])
    probe = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    result = EXPORTERS[fmt](model, tmp_path / f"m.{fmt}", probe=probe)
    assert set(result.errors) == {"head_out", "head/out"} and result.passed
    assert result.output_scales["head/out"] > 20 * result.output_scales["head_out"]
    _check_outputs_by_name(
        fmt,
        model,
        tmp_path / f"m.{fmt}",
        probe,
        {("head_out",): "head_out", ("head/out",): "head/out"},
    )


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_generated_names_avoid_the_names_the_user_chose(fmt, tmp_path):
    """{"z": [big, big*2], "z_1": small}: the file's z_1 held z[1] (off by 280). The list's
    elements get generated names (z, then z_2: z_1 is the user's)."""
    x = keras.Input((4,), name="x")
    h = L.BatchNormalization()(L.Dense(8, use_bias=False)(x))
    big = L.Rescaling(100.0)(L.Dense(2)(h))
    model = randomise_batch_norms(
        keras.Model(x, {"z": [big, L.Rescaling(2.0)(big)], "z_1": L.Dense(2)(h)})
    )
    probe = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    result = EXPORTERS[fmt](model, tmp_path / f"m.{fmt}", probe=probe)
    assert set(result.errors) == {"z", "z_1", "z_2"} and result.passed
    _check_outputs_by_name(
        fmt, model, tmp_path / f"m.{fmt}", probe, {("z", 0): "z", ("z", 1): "z_2", ("z_1",): "z_1"}
    )


def test_input_names_the_user_chose_are_kept_or_refused_naming_them(tmp_path):
    """{"feat_x": a, "feat/x": b} crashed the fold ("the same input twice"). The fold and ONNX
    keep both names; a TFLite signature cannot hold "feat/x" (its archive turns '/' into '_',
    the other input's name): refused, by name, not renamed."""
    a, b = keras.Input((3,), name="feat_x"), keras.Input((3,), name="feat_slash_x")
    y = L.BatchNormalization()(L.Dense(2)(L.Concatenate()([a, L.Rescaling(10.0)(b)])))
    model = randomise_batch_norms(keras.Model({"feat_x": a, "feat/x": b}, y))
    rng = np.random.default_rng(0)
    probe = {key: rng.normal(size=(16, 3)).astype("float32") for key in ("feat_x", "feat/x")}
    _, fold_report = fold_batch_norms(model, probe)
    assert fold_report.relative_error <= 1e-5
    assert export_onnx(model, tmp_path / "m.onnx", probe=probe).passed
    (actual,) = onnx_export.run(tmp_path / "m.onnx", probe).values()
    assert_close(actual, model(probe, training=False), 1e-4)
    swapped = {"feat_x": probe["feat/x"], "feat/x": probe["feat_x"]}
    assert not np.allclose(actual, model(swapped, training=False), atol=1e-2)
    with pytest.raises(
        UnsupportedModelError,
        match=r"^TFLite cannot name an input 'feat/x' .* letters, digits, '_', '\.' and '-' only",
    ):
        export_tflite(model, tmp_path / "m.tflite", probe=probe)
    assert os.listdir(tmp_path) == ["m.onnx"]


def test_a_generated_input_name_yields_without_taking_another_inputs_name(tmp_path):
    """ONNX: inputs named by their layers "x" and "x_1", and a user output "x". The input "x"
    yields to the user's name, and takes "x_2", not "x_1" (the other input's own name)."""
    x, x1 = keras.Input((3,), name="x"), keras.Input((3,), name="x_1")
    h = L.BatchNormalization()(L.Dense(2)(L.Concatenate()([x, L.Rescaling(10.0)(x1)])))
    model = randomise_batch_norms(keras.Model([x, x1], {"x": h}))
    sig = trace.signature(model, onnx_export.NAMES)
    assert sig.input_names == ("x_2", "x_1") and sig.output_names == ("x",)
    assert trace.signature(model, tflite_export.NAMES).input_names == ("x", "x_1")
    rng = np.random.default_rng(0)
    probe = [rng.normal(size=(8, 3)).astype("float32") for _ in range(2)]
    assert export_onnx(model, tmp_path / "m.onnx", probe=probe).passed
    actual = onnx_export.run(tmp_path / "m.onnx", {"x_2": probe[0], "x_1": probe[1]})
    assert_close(actual["x"], model(probe, training=False)["x"], 1e-4)


def test_a_name_a_format_cannot_hold_is_refused_naming_it(tmp_path):
    """An ONNX graph's inputs and outputs share one namespace: an input and an output both
    keyed "x" by the user are refused (TFLite, whose signature keeps them apart, takes them)."""
    x = keras.Input((3,), name="x")
    model = randomise_batch_norms(keras.Model({"x": x}, {"x": L.BatchNormalization()(x)}))
    probe = {"x": np.random.default_rng(0).normal(size=(8, 3)).astype("float32")}
    with pytest.raises(
        UnsupportedModelError, match="ONNX cannot name both an input and an output 'x'"
    ):
        export_onnx(model, tmp_path / "m.onnx", probe=probe)
    assert export_tflite(model, tmp_path / "m.tflite", probe=probe).passed
    assert_close(
        tflite_export.run(tmp_path / "m.tflite", probe)["x"],
        model(probe, training=False)["x"],
        1e-4,
    )


# --------------------------------------------------------------------------- 3: held out


def test_the_split_holds_out_a_quarter_spread_over_the_samples():
    def split(n):
        index = trace.Feed({"i": np.arange(n)}, "representative_data")
        calibration, held_out = trace.held_out_split(index)
        return calibration["i"], held_out["i"]

    calibration, held_out = split(64)
    assert len(held_out) == 16 and len(calibration) == 48
    assert set(calibration).isdisjoint(held_out) and held_out[0] == 0 and held_out[-1] == 63
    calibration, held_out = split(1000)
    assert len(held_out) == defaults.PROBE_SAMPLES
    assert len(calibration) == defaults.CALIBRATION_SAMPLES
    assert set(calibration).isdisjoint(held_out) and calibration.max() > 900
    with pytest.raises(
        ValueError, match=r"^representative_data has 15 samples; int8 needs at least 16"
    ):
        split(15)


def _single_output_model():
    x = keras.Input((8,), name="x")
    h = L.ReLU()(L.BatchNormalization()(L.Dense(16, use_bias=False)(x)))
    return randomise_batch_norms(keras.Model(x, L.Dense(3, name="y")(h)))


@pytest.mark.slow
def test_int8_is_judged_on_held_out_samples_where_it_fails_though_it_passes_in_sample(
    tmp_path,
):
    """The audit: the default probe was the first calibration samples, where the int8 file
    passed (0.0094) though it was off by 0.196 on other samples. Here the calibration samples
    span a quarter of the range of the held-out ones: the file passes in sample and fails
    held out, in the report and independently in LiteRT."""
    model = _single_output_model()
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    index = trace.Feed({"x": np.arange(64)}, "representative_data")
    calibration_rows, held_out_rows = (f["x"] for f in trace.held_out_split(index))
    x[held_out_rows] *= 4.0
    path = tmp_path / "m.tflite"
    with pytest.raises(
        VerificationError,
        match=r"output 'y' is off by .* on 16 held-out samples \(on calibration samples: ",
    ) as info:
        export_tflite(model, path, quantization="int8", representative_data=x)
    rejected = info.value.report
    assert not path.exists()
    tolerance = defaults.SCALE_TOLERANCES["int8"]
    assert rejected.in_sample_relative_error <= tolerance < rejected.relative_error
    assert (rejected.probe_samples, rejected.calibration_samples) == (16, 48)

    written = export_tflite(model, path, quantization="int8", representative_data=x, strict=False)

    def litert_error(rows):
        (actual,) = tflite_export.run(path, x[rows]).values()
        expected = np.asarray(model(x[rows], training=False), np.float64)
        scales = np.maximum(np.abs(expected).max(0), 1e-3 * np.abs(expected).max())
        return (np.abs(actual - expected).max(0) / scales).max()

    assert litert_error(held_out_rows) == pytest.approx(written.relative_error, rel=1e-6)
    assert litert_error(held_out_rows) > tolerance
    assert litert_error(calibration_rows) <= tolerance


def test_int8_fails_on_held_out_samples_of_the_same_distribution(tmp_path):
    """The audit's single-output case, on normal samples: calibrated on 200, the file is off
    by 0.012 of the scale on calibration samples and by 0.19 on held-out ones (one of them has
    a hidden activation beyond its calibrated range, and is clipped)."""
    model = _single_output_model()
    x = np.random.default_rng(0).normal(size=(300, 8)).astype("float32")
    with pytest.raises(VerificationError, match="on 64 held-out samples") as info:
        export_tflite(model, tmp_path / "q.tflite", quantization="int8", representative_data=x)
    rejected = info.value.report
    assert rejected.in_sample_relative_error < 0.02 and rejected.relative_error > 0.15
    assert rejected.probe_held_out and rejected.to_dict()["probe_held_out"] is True
    # With the caller's probe (here every sample, calibration ones included), the message
    # does not call them held out: it said "on 300 held-out samples".
    with pytest.raises(VerificationError, match=r"on 300 samples of `probe` \(on calib") as info:
        export_tflite(
            model, tmp_path / "q.tflite", quantization="int8", representative_data=x, probe=x
        )
    assert "held-out" not in str(info.value) and not info.value.report.probe_held_out


def test_the_report_gives_in_sample_errors_for_int8_only(tmp_path):
    model = _single_output_model()
    x = np.random.default_rng(0).uniform(-1, 1, (300, 8)).astype("float32")
    int8 = export_tflite(model, tmp_path / "q.tflite", quantization="int8", representative_data=x)
    assert (int8.probe_samples, int8.calibration_samples) == (64, 200)
    assert set(int8.in_sample_errors["y"]) == {"litert"}
    assert int8.in_sample_relative_error == int8.in_sample_worst_channels["y"].relative_error
    data = int8.to_dict()
    assert data["in_sample_relative_errors"] == {"y": int8.in_sample_relative_error}
    assert data["worst_channels"]["y"]["channel"] == int8.worst_channels["y"].channel
    json.dumps(data)
    plain = export_tflite(model, tmp_path / "f.tflite", representative_data=x)
    assert plain.in_sample_errors is None and plain.in_sample_relative_error is None
    assert (plain.probe_samples, plain.calibration_samples) == (64, None)


# --------------------------------------------------------------------------- 4: per channel


def _quote_model():
    """One output concatenating a price column (~2000) and a probability column (≤ 1)."""
    x = keras.Input((4,), name="x")
    h = L.BatchNormalization()(L.Dense(8, use_bias=False)(x))
    price = L.Rescaling(1000.0)(L.Dense(1, activation="softplus")(h))
    probability = L.Dense(1, activation="sigmoid")(h)
    return randomise_batch_norms(keras.Model(x, L.Concatenate(name="quote")([price, probability])))


@pytest.mark.slow
def test_a_wrong_small_channel_is_not_hidden_by_a_large_one(tmp_path):
    """int8 gives the concatenation one scale: every probability becomes 0. Measured against
    the output's scale the file passed (0.034); its probability channel is off by all of its
    own scale."""
    model = _quote_model()
    x = np.random.default_rng(0).normal(size=(300, 4)).astype("float32")
    path = tmp_path / "q.tflite"
    with pytest.raises(VerificationError, match=r"output 'quote' is off by .* \(channel 1\)"):
        export_tflite(model, path, quantization="int8", representative_data=x)
    written = export_tflite(model, path, quantization="int8", representative_data=x, strict=False)
    (actual,) = tflite_export.run(path, x).values()
    expected = np.asarray(model(x, training=False))
    assert np.all(actual[:, 1] == 0) and expected[:, 1].max() > 0.5  # LiteRT, independently
    whole = written.errors["quote"]["litert"] / written.output_scales["quote"]
    assert whole < defaults.SCALE_TOLERANCES["int8"] < written.relative_error
    _, held_out = trace.held_out_split(trace.Feed({"x": np.arange(len(x))}, "rows"))
    worst = written.worst_channels["quote"]
    assert worst.channel == 1 and worst.max_abs_error == pytest.approx(
        expected[held_out["x"], 1].max(), rel=1e-5
    )
    # float32 keeps both channels: it passes, each channel on its own scale.
    assert export_onnx(model, tmp_path / "q.onnx", probe=x[:64]).passed


def test_the_worst_channel_against_numpy():
    rng = np.random.default_rng(0)
    expected = np.stack([rng.uniform(-1000, 1000, 50), rng.uniform(0, 1, 50), np.zeros(50)], -1)
    off = expected.copy()
    off[:, 1] += 0.02  # 2% of its own scale, 1e-5 of the output's
    off[:, 2] += 0.05  # a constant-zero channel: judged against the floor
    worst = report.worst_channel(expected, [expected, off], 1e-1)
    floor = np.abs(expected).max() * 1e-3  # FLOAT32_SCALE_TOLERANCE / 1e-1 of the output
    assert worst == report.WorstChannel(2, pytest.approx(0.05 / floor), pytest.approx(0.05), floor)
    assert report.channel_scale_floor(1e-4) == 1.0 and report.channel_scale_floor(1e-6) == 1.0
    only_small = expected.copy()
    only_small[:, 1] += 0.02
    assert report.worst_channel(expected, [only_small], 1e-1).relative_error == pytest.approx(
        0.02 / np.abs(expected[:, 1]).max()
    )
    nan = off.copy()
    nan[3, 0] = np.nan
    assert report.worst_channel(expected, [nan], 1e-1).channel == 0
    assert np.isnan(report.worst_channel(expected, [nan], 1e-1).relative_error)
    assert report.worst_channel(expected, [None], 1e-1).relative_error == np.inf
    assert report.worst_channel(expected[:, 0], [expected[:, 0] + 1], 1e-1).channel == 0


def test_a_dead_channel_passes_where_the_file_is_right(tmp_path):
    """A constant-zero channel (a ReLU unit that never fires) has no own scale: judged against
    the floor, a right float32 file passes."""
    x = keras.Input((4,), name="x")
    h = L.BatchNormalization()(L.Dense(3, use_bias=False, name="dense")(x))
    model = randomise_batch_norms(keras.Model(x, L.ReLU(name="relu")(h)))
    dense, bn = model.get_layer("dense"), model.layers[2]
    kernel = dense.get_weights()[0]
    kernel[:, 2] = 0.0
    dense.set_weights([kernel])
    bn.beta.assign(np.array([0.0, 0.0, -1.0]))  # channel 2: ReLU of a negative constant
    probe = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    assert np.all(np.asarray(model(probe, training=False))[:, 2] == 0)
    for fmt in sorted(EXPORTERS):
        assert EXPORTERS[fmt](model, tmp_path / f"m.{fmt}", probe=probe).passed


# --------------------------------------------------------------------------- 5: variety


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_a_probe_whose_outputs_do_not_vary_is_refused(fmt, tmp_path):
    """All-zero samples gave passed=True at output scale 0, and one zero row passed the same
    way: neither can tell a file that ignores its input from a right one."""
    model = _single_output_model()
    zeros = np.zeros((64, 8), "float32")
    with pytest.raises(ValueError, match=r"^Output 'y' is the same for all 64 samples of probe"):
        EXPORTERS[fmt](model, tmp_path / "m.out", probe=zeros)
    with pytest.raises(ValueError, match=r"^probe has 1 sample: .* output 'y' cannot vary"):
        EXPORTERS[fmt](model, tmp_path / "m.out", probe=zeros[:1])
    with pytest.raises(ValueError, match=r"^Output 'y' is the same for all 64 samples of probe"):
        fold_batch_norms(model, zeros)
    assert os.listdir(tmp_path) == []


def _dead_model():
    """Its output is the same for every input: every ReLU before the head is off."""
    x = keras.Input((8,), name="x")
    h = L.ReLU()(L.BatchNormalization()(L.Dense(16, use_bias=False)(x)))
    model = keras.Model(x, L.Dense(3, name="y")(h))
    bn = model.layers[2]
    bn.beta.assign(np.full(16, -1e3))  # every channel far below 0: all ReLUs off
    model.layers[-1].bias.assign(np.array([0.5, -1.0, 2.0]))
    return model


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_a_model_whose_own_output_is_constant_is_exported_unverified_only_when_asked(fmt, tmp_path):
    """Issue 32, item 8: a model that gives the same output for every (varied) probe sample
    (untrained, dead) is refused with a message that says it is the model, names probe= and
    the option allow_unverified=True; with it the file is written and its report marked
    unverified, never by default. A constant probe is still the probe's fault: refused."""
    model = _dead_model()
    probe = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    out = tmp_path / f"m.{fmt}"
    with pytest.raises(ValueError) as refused:
        EXPORTERS[fmt](model, out, probe=probe)
    message = str(refused.value)
    assert "the model itself gives the same output for every probe sample" in message
    assert "probe=" in message and "allow_unverified=True" in message
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="the model itself"):
        EXPORTERS[fmt](model, out, probe=probe, strict=False)  # strict=False is no way through
    assert os.listdir(tmp_path) == []
    result = EXPORTERS[fmt](model, out, probe=probe, allow_unverified=True)
    assert result.unverified is not None and "'y'" in result.unverified
    assert result.to_dict()["unverified"] == result.unverified
    # The file is the model's constant, run in its own runtime; numpy gives the reference.
    assert_close(RUNNERS[fmt](out, {"x": probe})["y"], np.tile([0.5, -1.0, 2.0], (64, 1)), 1e-6)
    # A constant probe is refused as before, even with the option: a real probe fixes it.
    with pytest.raises(ValueError, match=r"^Output 'y' is the same for all 64 samples of probe"):
        EXPORTERS[fmt](
            _single_output_model(),
            tmp_path / "n.out",
            probe=probe[:1].repeat(64, 0),
            allow_unverified=True,
        )
    # A model that works is verified as ever.
    assert EXPORTERS[fmt](_single_output_model(), out, probe=probe).unverified is None


def test_a_constant_output_with_a_constant_input_names_that_input(tmp_path):
    """A two-input model whose output reads only `a`, on a probe whose `a` is the same for
    every sample (only the unused `b` varies): the refusal names `a` (the probe may be at
    fault, not the model), and allow_unverified=True, the user's call for an input that is
    constant in all real data (a flag), writes the file marked unverified, naming `a` too."""
    a, b = keras.Input((8,), name="a"), keras.Input((8,), name="b")
    model = keras.Model([a, b], L.Dense(3, name="y")(a))
    rng = np.random.default_rng(0)
    probe = {"a": np.ones((64, 8), "float32"), "b": rng.normal(size=(64, 8)).astype("float32")}
    with pytest.raises(ValueError, match=r"input\(s\) \['a'\] are the same for every sample"):
        export_onnx(model, tmp_path / "m.onnx", probe=probe)
    assert os.listdir(tmp_path) == []
    result = export_onnx(model, tmp_path / "m.onnx", probe=probe, allow_unverified=True)
    assert "input(s) ['a'] the same for every sample" in result.unverified
    both = {"a": probe["a"], "b": np.ones((64, 8), "float32")}  # every input constant
    with pytest.raises(ValueError, match=r"a file that ignores its input would match it"):
        export_onnx(model, tmp_path / "n.onnx", probe=both, allow_unverified=True)


def test_constant_representative_data_is_refused_for_int8(tmp_path):
    model = _single_output_model()
    with pytest.raises(
        ValueError,
        match=r"^Output 'y' is the same for all 16 samples of representative_data \(held-out",
    ):
        export_tflite(
            model,
            tmp_path / "m.tflite",
            quantization="int8",
            representative_data=np.zeros((64, 8), "float32"),
        )
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- 6: grouped conv


def _grouped(forward):
    """Conv2D(groups=2) → BN (a backward fold), or BN → Conv2D(groups=2, padding="valid") (a
    forward fold, whose per-input-channel scales follow the groups)."""
    x = keras.Input((8, 8, 4), name="x")
    conv = L.Conv2D(6, 3, groups=2, use_bias=False, name="grouped")
    y = conv(L.BatchNormalization()(x)) if forward else L.BatchNormalization()(conv(x))
    return randomise_batch_norms(keras.Model(x, y))


@pytest.mark.slow
@pytest.mark.parametrize("forward", [False, True], ids=["backward", "forward"])
@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_a_grouped_conv_and_its_folded_bn_export_and_run(fmt, forward, tmp_path):
    """ONNX failed ("No Op registered for StatefulPartitionedCall", no layer named): Keras
    runs a grouped conv in an XLA function. It is traced as one TensorFlow conv op, which
    tf2onnx writes as a Conv with group=2."""
    model = _grouped(forward)
    probe = np.random.default_rng(0).normal(size=(8, 8, 8, 4)).astype("float32")
    path = tmp_path / f"m.{fmt}"
    result = EXPORTERS[fmt](model, path, probe=probe)
    (folded,) = result.fold.folded
    assert folded.host == "grouped" and folded.direction == ("forward" if forward else "backward")
    assert result.passed and result.relative_error <= 1e-5
    (actual,) = _file_outputs(fmt, path, probe).values()
    assert_close(actual, model(probe, training=False), 1e-5)
    if fmt == "onnx":
        (conv,) = [node for node in onnx.load(path).graph.node if node.op_type == "Conv"]
        assert {a.name: a.i for a in conv.attribute}["group"] == 2
    else:
        assert result.op_histogram["CONV_2D"] == 1


def test_a_grouped_causal_conv1d_exports_to_onnx(tmp_path):
    x = keras.Input((9, 4), name="x")
    conv = L.Conv1D(6, 3, groups=2, padding="causal", dilation_rate=2, use_bias=False)
    model = randomise_batch_norms(keras.Model(x, L.BatchNormalization()(conv(x))))
    probe = np.random.default_rng(0).normal(size=(8, 9, 4)).astype("float32")
    assert export_onnx(model, tmp_path / "m.onnx", probe=probe).passed
    (actual,) = onnx_export.run(tmp_path / "m.onnx", probe).values()
    assert_close(actual, model(probe, training=False), 1e-5)


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_a_grouped_conv3d_is_refused_naming_the_layer(fmt, tmp_path):
    """Neither converter writes it right: LiteRT's CONV_3D has no groups, tf2onnx drops them."""
    x = keras.Input((5, 5, 5, 4), name="x")
    model = keras.Model(x, L.Conv3D(4, 3, groups=2, name="volume")(x))
    with pytest.raises(UnsupportedModelError, match=r"layer 'volume' \(Conv3D with groups=2\)"):
        EXPORTERS[fmt](model, tmp_path / "m.out")
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- 7: the CLI


def _two_input_model():
    features = keras.Input((6,), name="features")
    ids = keras.Input((3,), dtype="int32", name="ids")
    h = L.BatchNormalization()(L.Dense(8, use_bias=False)(features))
    h = L.Concatenate()([h, L.Flatten()(L.Embedding(5, 2)(ids))])
    return randomise_batch_norms(keras.Model({"features": features, "ids": ids}, L.Dense(3)(h)))


def _last_error(result):
    lines = result.stderr.splitlines()
    (line,) = [line for line in lines if line.startswith("keras-bn-export: error:")]
    return line


@pytest.mark.slow
def test_cli_messages_about_the_representative_data_name_the_flag(tmp_path, capfd):
    _two_input_model().save(tmp_path / "m.keras")
    rng = np.random.default_rng(0)
    features = rng.normal(size=(40, 6)).astype("float32")
    ids = rng.integers(0, 5, (40, 3))
    suggestion = "an .npz with one array per input name: features, ids"

    def onnx_export_with(data):
        return cli_in_process(
            capfd,
            tmp_path / "m.keras",
            "--onnx",
            tmp_path / "m.onnx",
            "--representative-data",
            data,
        )

    np.save(tmp_path / "x.npy", features)
    result = onnx_export_with(tmp_path / "x.npy")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    error = _last_error(result)
    assert f"--representative-data {tmp_path / 'x.npy'} is one array (.npy)" in error
    assert suggestion in error and "probe" not in error and "list" not in error

    np.savez(tmp_path / "missing.npz", features=features)
    result = onnx_export_with(tmp_path / "missing.npz")
    error = _last_error(result)
    assert result.returncode == 2 and "missing ['ids']" in error
    assert error.startswith(f"keras-bn-export: error: --representative-data {tmp_path}")
    assert suggestion in error and "probe" not in error

    np.savez(tmp_path / "zeros.npz", features=np.zeros_like(features), ids=np.zeros_like(ids))
    result = onnx_export_with(tmp_path / "zeros.npz")
    error = _last_error(result)
    assert result.returncode == 2 and "is the same for all 40 samples of --representative" in error
    assert "probe" not in error

    np.savez(tmp_path / "few.npz", features=features[:10], ids=ids[:10])
    result = cli_in_process(
        capfd,
        tmp_path / "m.keras",
        "--tflite",
        tmp_path / "q.tflite",
        "--quantize",
        "int8",
        "--representative-data",
        tmp_path / "few.npz",
    )
    error = _last_error(result)
    assert result.returncode == 2
    assert re.search(r"--representative-data \S+few\.npz has 10 samples; int8 needs", error)
    assert sorted(os.listdir(tmp_path)) == [
        "few.npz",
        "m.keras",
        "missing.npz",
        "x.npy",
        "zeros.npz",
    ]


@pytest.mark.slow
def test_cli_summary_shows_the_worst_channel_and_the_held_out_samples(tmp_path, capfd):
    _quote_model().save(tmp_path / "q.keras")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(300, 4)).astype("float32"))
    result = cli_in_process(
        capfd,
        tmp_path / "q.keras",
        "--tflite",
        tmp_path / "q.tflite",
        "--quantize",
        "int8",
        "--representative-data",
        tmp_path / "x.npy",
        "--report",
        tmp_path / "r.json",
    )
    assert result.returncode == 1, result.stderr
    assert re.search(r"output quote: error \S+ of its scale, worst in channel 1", result.stdout)
    assert "verified on 64 samples held out from calibration (200 calibrated)" in result.stdout
    (export,) = json.loads((tmp_path / "r.json").read_text())["exports"]
    assert export["worst_channels"]["quote"]["channel"] == 1 and not export["passed"]
    assert export["in_sample_relative_error"] is not None
    assert not (tmp_path / "q.tflite").exists()


@pytest.mark.slow
def test_cli_exports_a_model_whose_own_output_is_constant_only_with_allow_unverified(
    tmp_path, capfd
):
    """Issue 32, item 8, in the CLI: the same refusal names --allow-unverified; with it the
    file is written and the summary and the JSON report say UNVERIFIED."""
    _dead_model().save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(64, 8)).astype("float32"))
    args = [tmp_path / "m.keras", "--onnx", tmp_path / "m.onnx"]
    args += ["--representative-data", tmp_path / "x.npy", "--report", tmp_path / "r.json"]
    result = cli_in_process(capfd, *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    error = _last_error(result)
    assert "the model itself gives the same output" in error and "--allow-unverified" in error
    assert "--representative-data" in error  # the CLI's name for probe=
    assert not (tmp_path / "m.onnx").exists()
    result = cli_in_process(capfd, *args, "--allow-unverified")
    assert result.returncode == 0, result.stderr
    assert "UNVERIFIED" in result.stdout and (tmp_path / "m.onnx").exists()
    assert "verified on" not in result.stdout  # the samples line says it is not
    assert "run on 64 probe samples, not verified" in result.stdout
    written = json.loads((tmp_path / "r.json").read_text())["exports"][0]
    assert "'y'" in written["unverified"]

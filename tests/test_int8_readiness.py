"""int8 readiness: the spread of each folded host's per-channel weight ranges, and the error of
the folded model with that host's kernel alone rounded to int8, measured.

The pure functions are checked against explicit loops over channel indices, and the rounding
against numpy's own rounding to the grid; fold_batch_norms against the same loops run on the
folded layers' own weights, with one BN channel scaled ×1000 (a wrong channel axis puts that
channel among others and the spread stays small, and per-channel rounding rounds the small
channels away); the measured error against the same rounding done by hand on a copy of the
folded model. The flags are checked where the spread heuristic raised false alarms (a
network-slimming model: γ ≈ 0 channels, huge spreads, harmless), against real files: TFLite
with one int8 weight scale per tensor, and export_tflite's int8 (per channel), in LiteRT. The
claim that TFLite quantizes every host per channel is read from a converted file; the CLI is
run end to end.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter

import digits
import keras_bn
from helpers import cli_in_process, docs_page
from keras_bn.export import (
    ChannelSpread,
    export_tflite,
    fold,
    fold_batch_norms,
    readiness,
    report,
    tflite,
    trace,
)

pytestmark = pytest.mark.backends("tensorflow")

TOLERANCE = report.INT8_READINESS_TOLERANCE

L = keras.layers


def _loop_ranges(kernel, channel_of):
    """max |w| per channel, by visiting every weight: `channel_of(index)` names its channel."""
    ranges = {}
    for index in np.ndindex(kernel.shape):
        channel = channel_of(index)
        ranges[channel] = max(ranges.get(channel, 0.0), abs(float(kernel[index])))
    return np.array([ranges[c] for c in sorted(ranges)])


LAYOUTS = {  # layout: (kernel shape, the output channel of a weight's index)
    fold.LAST: ((3, 3, 4, 5), lambda i: i[-1]),
    fold.TRANSPOSE: ((3, 2, 5, 4), lambda i: i[-2]),
    fold.DEPTHWISE: ((3, 3, 4, 3), lambda i: i[-2] * 3 + i[-1]),  # channel c·M + m, M = 3
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_output_channel_ranges_match_a_loop_over_every_weight(layout):
    shape, channel_of = LAYOUTS[layout]
    kernel = np.random.default_rng(0).normal(size=shape).astype("float32")
    expected = _loop_ranges(kernel, channel_of)
    np.testing.assert_array_equal(fold.output_channel_ranges(kernel, layout), expected)


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_input_channel_ranges_follow_the_groups_layout(groups):
    per_group_in, out = 2, 6
    kernel = np.random.default_rng(1).normal(size=(3, per_group_in, out))
    # Output channel o belongs to group o // (out / groups), which reads input channels
    # group·per_group_in + j.
    expected = _loop_ranges(kernel, lambda i: (i[-1] // (out // groups)) * per_group_in + i[-2])
    np.testing.assert_array_equal(fold.input_channel_ranges(kernel, groups), expected)


def test_spread_is_largest_over_smallest_channel_range():
    kernel = np.ones((4, 3))
    kernel[:, 1] *= 1000.0
    kernel[2, 2] = -0.5  # the largest |w| counts, whatever its sign
    assert fold.channel_spread(fold.output_channel_ranges(kernel)) == 1000.0


@pytest.mark.parametrize(
    "ranges, expected",
    [
        ([2.0, 0.0, 1.0], 2.0),  # an all-zero channel is exact in int8: left out, not inf
        ([0.0, 0.0], 1.0),  # nothing to lose
        ([3.0], 1.0),
        ([], 1.0),
        ([0.25, 1.0, 2.0**-100], 2.0**100),  # tiny, not zero: per-tensor int8 rounds it to 0
        ([np.inf, 1.0], np.inf),
        ([np.inf, np.inf], np.inf),  # not inf/inf = NaN
    ],
)
def test_spread_edge_cases(ranges, expected):
    assert fold.channel_spread(ranges) == expected


def test_nan_weight_gives_nan_spread_and_nan_errors_which_are_risks():
    kernel = np.ones((4, 3))
    kernel[1, 2] = np.nan
    assert np.isnan(fold.output_channel_ranges(kernel)[2])
    assert np.isnan(fold.channel_spread(fold.output_channel_ranges(kernel)))
    # fold_batch_norms on a host with a NaN weight: int8 cannot hold it, NaN errors, flagged.
    model = keras.Sequential([keras.Input((4,)), L.Dense(3), keras_bn.BatchNormalization()])
    host_kernel = model.layers[0].kernel.numpy()
    host_kernel[1, 2] = np.nan
    model.layers[0].kernel.assign(host_kernel)
    _, fold_report = fold_batch_norms(model, int8_readiness=True)
    (entry,) = fold_report.channel_spreads
    assert np.isnan(entry.output_spread)
    assert np.isnan(entry.per_tensor_error) and np.isnan(entry.per_channel_error)
    assert entry.int8_risk is True and entry.per_channel_int8_risk is True
    assert fold_report.int8_risks == [entry]


def test_flags_are_the_measured_errors_over_the_int8_tolerance():
    assert TOLERANCE == 0.1  # the int8 file's default tolerance (export/defaults.py)
    at = ChannelSpread("h", "Dense", 1e6, None, TOLERANCE, TOLERANCE)
    assert at.int8_risk is False and at.per_channel_int8_risk is False  # a huge spread: info
    over = np.nextafter(TOLERANCE, np.inf)
    assert ChannelSpread("h", "Dense", 1.0, None, over, 0.0).int8_risk is True
    both = ChannelSpread("h", "Dense", 1.0, 1.0, 0.0, over)
    assert both.per_channel_int8_risk is True and both.int8_risk is False
    unmeasured = ChannelSpread("h", "Dense", 1e6)
    assert unmeasured.int8_risk is None and unmeasured.per_channel_int8_risk is None
    fold_report = report.FoldReport([], [], {}, {}, [unmeasured, at])
    assert fold_report.int8_readiness_measured is False and fold_report.int8_risks is None
    assert fold_report.to_dict()["int8_risks"] is None  # not measured is not "no risk"
    measured = report.FoldReport([], [], {}, {}, [at, both])
    assert measured.int8_risks == [both]
    assert measured.to_dict()["int8_risks"] == ["h"]
    assert report.FoldReport([], [], {}, {}, []).int8_risks == []  # nothing folded


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_kernel_is_numpys_rounding_to_each_grid(layout):
    shape, channel_of = LAYOUTS[layout]
    kernel = np.random.default_rng(2).normal(size=shape).astype("float32")
    channel = np.zeros(shape, int)
    for index in np.ndindex(shape):
        channel[index] = channel_of(index)
    kernel[channel == 1] *= 50.0  # one output channel 50x larger: the two grids differ
    for per_channel in (False, True):
        if per_channel:  # each weight's own channel's max |w|, found by the loop
            largest = _loop_ranges(kernel, channel_of)[channel]
        else:
            largest = np.abs(kernel).max()
        step = largest.astype(np.float64) / 127
        expected = np.round(kernel / step) * step
        rounded = readiness.round_kernel(kernel, layout, per_channel)
        assert rounded.shape == kernel.shape and rounded.dtype == np.float32
        np.testing.assert_allclose(rounded, expected, rtol=1e-6, atol=1e-6 * largest.max())
        assert np.all(np.abs(rounded - kernel) <= step / 2 * (1 + 1e-5))
    small = channel != 1
    per_tensor = readiness.round_kernel(kernel, layout, False)
    per_channel = readiness.round_kernel(kernel, layout, True)
    # The small channels keep ~127/50 levels per tensor, all 127 per channel.
    assert np.abs(per_tensor - kernel)[small].max() > 10 * np.abs(per_channel - kernel)[small].max()


def test_bad_layout_and_shapes_raise_naming_them():
    with pytest.raises(ValueError, match="layout='first'"):
        fold.output_channel_ranges(np.ones((2, 2)), "first")
    with pytest.raises(ValueError, match=r"received shape \(3,\)"):
        fold.output_channel_ranges(np.ones(3))
    with pytest.raises(ValueError, match="groups=4 does not divide"):
        fold.input_channel_ranges(np.ones((3, 2, 6)), groups=4)
    with pytest.raises(ValueError, match="layout='first'"):
        readiness.round_kernel(np.ones((2, 2)), "first", per_channel=True)
    model = keras.Sequential([keras.Input((4,)), L.Dense(3), keras_bn.BatchNormalization()])
    with pytest.raises(ValueError, match="received int8_readiness='yes'"):
        fold_batch_norms(model, int8_readiness="yes")


HOSTS = {  # kind: (input shape, host, the output channel of a folded weight's index)
    "Dense": ((16,), lambda: L.Dense(6), lambda i: i[-1]),
    "Conv2D": ((6, 6, 4), lambda: L.Conv2D(6, 3), lambda i: i[-1]),
    "DepthwiseConv2D": (
        (6, 6, 3),
        lambda: L.DepthwiseConv2D(3, depth_multiplier=2),
        lambda i: i[-2] * 2 + i[-1],
    ),
    "SeparableConv2D": (
        (6, 6, 4),
        lambda: L.SeparableConv2D(6, 3, depth_multiplier=2),
        lambda i: i[-1],
    ),
    "Conv2DTranspose": ((4, 4, 4), lambda: L.Conv2DTranspose(6, 3), lambda i: i[-2]),
    "Conv1DTranspose": ((5, 4), lambda: L.Conv1DTranspose(6, 3), lambda i: i[-2]),
}
SCALED = 3  # the BN channel scaled ×1000; as a depthwise channel c·M + m, it is (1, 1)


def _host_then_bn(kind, scaled):
    shape, make, _ = HOSTS[kind]
    bn = keras_bn.BatchNormalization()
    model = keras.Sequential([keras.Input(shape), make(), bn], name=kind)
    if scaled:
        gamma = bn.gamma.numpy()
        gamma[SCALED] *= 1000.0
        bn.gamma.assign(gamma)
    return model


@pytest.mark.parametrize("kind", sorted(HOSTS))
def test_fold_report_spread_is_the_folded_kernels_and_flags_a_channel_scaled_1000x(kind):
    _, _, channel_of = HOSTS[kind]
    folded, fold_report = fold_batch_norms(_host_then_bn(kind, scaled=True), int8_readiness=True)
    (entry,) = fold_report.channel_spreads
    kernel = folded.layers[0].get_weights()[1 if kind == "SeparableConv2D" else 0]
    ranges = _loop_ranges(kernel, channel_of)
    assert np.argmax(ranges) == SCALED
    assert entry.output_spread == pytest.approx(ranges.max() / ranges.min(), rel=1e-12)
    assert entry.output_spread > 500
    assert (entry.host, entry.layer, entry.input_spread) == (folded.layers[0].name, kind, None)
    # The BN's outputs are the model's: per tensor, the 1000x smaller channels round to a few
    # levels, and each is judged against its own scale; per channel (the right axis), they
    # keep all 127.
    assert entry.per_tensor_error > 5 * TOLERANCE and entry.int8_risk
    assert entry.per_channel_error < TOLERANCE / 5 and not entry.per_channel_int8_risk
    assert fold_report.int8_risks == [entry]
    _, healthy = fold_batch_norms(_host_then_bn(kind, scaled=False), int8_readiness=True)
    (healthy_entry,) = healthy.channel_spreads
    assert healthy_entry.per_tensor_error < TOLERANCE / 5 and healthy.int8_risks == []
    _, unmeasured = fold_batch_norms(_host_then_bn(kind, scaled=True))
    assert unmeasured.channel_spreads[0].per_tensor_error is None
    assert unmeasured.int8_risks is None


def test_measured_error_is_the_folded_model_with_the_kernel_rounded_by_hand():
    """The same rounding done independently (numpy's, on a copy of the folded model), judged
    by an explicit per-channel formula; and the folded model's kernels are left as folded."""
    model = _host_then_bn("Conv2D", scaled=True)
    probe = np.random.default_rng(3).normal(size=(16, 6, 6, 4)).astype("float32")
    folded, fold_report = fold_batch_norms(model, probe, int8_readiness=True)
    plain, _ = fold_batch_norms(model, probe)
    for got, expected in zip(folded.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(got, expected)  # restored bit for bit
    (entry,) = fold_report.channel_spreads
    reference = folded.predict(probe, verbose=0).astype(np.float64)
    kernel, bias = folded.layers[0].get_weights()
    for per_channel, measured in ((False, entry.per_tensor_error), (True, entry.per_channel_error)):
        largest = np.abs(kernel).max(axis=(0, 1, 2)) if per_channel else np.abs(kernel).max()
        step = largest / 127
        copy = keras.models.clone_model(folded)
        copy.set_weights([np.round(kernel / step) * step, bias])
        rounded = copy.predict(probe, verbose=0).astype(np.float64)
        by_channel = reference.reshape(-1, reference.shape[-1])
        floor = np.abs(reference).max() * 1e-4 / TOLERANCE  # report.channel_scale_floor
        scales = np.maximum(np.abs(by_channel).max(axis=0), floor)
        errors = np.abs(rounded.reshape(by_channel.shape) - by_channel).max(axis=0)
        assert measured == pytest.approx((errors / scales).max(), rel=1e-3)


def test_forward_fold_reports_the_input_spread_and_nested_hosts_by_path():
    """A BN on raw inputs in different units (feature 2 is 100x smaller): folded forward, the
    next kernel's row for it is 100x larger, and each output channel's one scale spans it, so
    even per-channel int8 rounds the other rows away."""
    inner = keras.Sequential(
        [keras.Input((6,)), keras_bn.BatchNormalization(epsilon=1e-6), L.Dense(5)], name="inner"
    )
    x = np.random.default_rng(4).normal(size=(64, 6)).astype("float32")
    x[:, 2] *= 1e-2
    bn = inner.layers[0]
    bn.set_weights([np.ones(6), np.zeros(6), x.mean(0), x.var(0)])  # standardizes the features
    outer = keras.Sequential([keras.Input((6,)), inner, L.Dense(3)])
    folded, fold_report = fold_batch_norms(outer, x, int8_readiness=True)
    assert [f.direction for f in fold_report.folded] == ["forward"]
    (entry,) = fold_report.channel_spreads
    kernel = folded.layers[0].layers[0].get_weights()[0]
    ranges = _loop_ranges(kernel, lambda i: i[0])
    assert entry.host == "inner/" + folded.layers[0].layers[0].name
    assert np.argmax(ranges) == 2
    assert entry.input_spread == pytest.approx(ranges.max() / ranges.min(), rel=1e-12)
    assert entry.input_spread > 20
    assert entry.per_channel_error > TOLERANCE and entry.per_channel_int8_risk
    assert entry.int8_risk and fold_report.int8_risks == [entry]
    as_dict = fold_report.to_dict()
    assert as_dict["int8_risks"] == [entry.host]
    assert as_dict["channel_spreads"][0]["per_channel_int8_risk"] is True
    assert as_dict["channel_spreads"][0]["per_channel_error"] == entry.per_channel_error
    assert as_dict["int8_readiness_tolerance"] == TOLERANCE
    assert as_dict["int8_readiness_measured"] is True


def test_tflite_int8_quantizes_every_host_per_output_channel(tmp_path):
    """What the docs say of TFLite's int8 converter: one scale per output channel for Dense
    (FULLY_CONNECTED), Conv, Depthwise, Separable (both kernels) and ConvTranspose."""
    image = keras.Input((6, 6, 3), name="image")
    x = L.Conv2D(8, 3, padding="same")(image)
    x = L.DepthwiseConv2D(3, depth_multiplier=2, padding="same")(x)
    x = L.SeparableConv2D(5, 3, padding="same")(x)
    x = L.Conv2DTranspose(7, 3, padding="same")(x)
    x = L.Dense(9)(L.Flatten()(x))
    model = keras.Model(image, x)
    data = np.random.default_rng(0).normal(size=(16, 6, 6, 3)).astype("float32")
    path = tmp_path / "hosts.tflite"
    export_tflite(model, path, quantization="int8", representative_data=data, strict=False)
    interpreter = Interpreter(model_path=str(path))
    tensors = {t["index"]: t for t in interpreter.get_tensor_details()}
    weights = {}  # op → [(int8 weight shape, scale count, quantized dimension)]
    for op in interpreter._get_ops_details():
        if op["op_name"] in ("FULLY_CONNECTED", "CONV_2D", "DEPTHWISE_CONV_2D", "TRANSPOSE_CONV"):
            weight = tensors[op["inputs"][1]]
            q = weight["quantization_parameters"]
            assert weight["dtype"] == np.int8, op
            weights.setdefault(op["op_name"], []).append(
                (tuple(weight["shape"]), len(q["scales"]), q["quantized_dimension"])
            )
    # TFLite's layouts: output channel first (OHWI), last for depthwise (1HW(C·M)).
    assert weights == {
        "CONV_2D": [((8, 3, 3, 3), 8, 0), ((5, 1, 1, 16), 5, 0)],
        "DEPTHWISE_CONV_2D": [((1, 3, 3, 16), 16, 3), ((1, 3, 3, 16), 16, 3)],
        "TRANSPOSE_CONV": [((7, 3, 3, 5), 7, 0)],
        "FULLY_CONNECTED": [((9, 252), 9, 0)],
    }


class _PerTensorWeights(tflite._TFLite):
    """export_tflite's conversion with one int8 scale per weight tensor (the converter's
    per-channel quantization off), as a per-tensor runtime quantizes."""

    def _configure(self, converter, sig):
        super()._configure(converter, sig)
        converter._experimental_disable_per_channel = True


# Real files whose weights are int8 and whose activations stay float between ops ("dynamic":
# quantized per batch inside each op): the weights' own error, which the measurement rounds.
# The converter leaves weight tensors under 1024 elements float, so in these models the only
# int8 weights are the measured host's (64 x 32).
WEIGHT_FILES = {
    "per tensor": lambda: _PerTensorWeights("dynamic", None),
    "per channel": lambda: tflite._TFLite("dynamic", None),
}


def _file_error(model, fmt, probe, folder):
    """The worst channel's error of `model` folded, converted by `fmt` and run in LiteRT on
    `probe`, relative to its scale: as the export's verification judges a file."""
    sig = trace.signature(model)
    path = os.path.join(folder, "m.tflite")
    with open(path, "wb") as file:
        file.write(fmt.convert(fold_batch_norms(model, probe)[0], sig))
    expected = trace.outputs(model, sig, trace.feed(sig, probe))
    _, _, channels = report.compare(expected, {"litert": tflite.run(path, probe)}, TOLERANCE)
    return report.worst(c.relative_error for c in channels.values())


def _measured(entry, mode):
    """(error, flag) of a ChannelSpread for a WEIGHT_FILES mode."""
    if mode == "per tensor":
        return entry.per_tensor_error, entry.int8_risk
    return entry.per_channel_error, entry.per_channel_int8_risk


def _slim(model, channels, gamma=1e-4):
    """Network slimming's result (L1 on γ): these channels of the digits MLP's BN near zero."""
    bn = model.get_layer(index=1)
    value = bn.gamma.numpy()
    value[channels] = gamma
    bn.gamma.assign(value)


@pytest.mark.slow
def test_slimmed_channels_are_not_flagged_and_the_flags_agree_with_real_files(tmp_path):
    """The false alarm of the spread heuristic: γ ≈ 0 channels give spreads of 1e4, but carry
    next to nothing, so rounding them away moves the outputs by far less than the tolerance.
    Each flag is the verdict of a real file with int8 weights, per tensor and per channel."""
    model, x_train = digits.train_mlp()
    probe = x_train[:64]
    base = model.get_weights()
    variants = {
        "healthy": lambda: None,
        "slimmed": lambda: _slim(model, [0, 4, 8, 12, 16, 20, 24, 28]),
        "scaled": lambda: digits.scale_hidden_channel(model, 5, 1000.0),
    }
    entries, int8_files = {}, {}
    for name, change in variants.items():
        model.set_weights(base)
        change()
        _, fold_report = fold_batch_norms(model, probe, int8_readiness=True)
        (entry,) = fold_report.channel_spreads
        entries[name] = entry
        for mode, fmt in WEIGHT_FILES.items():
            file_error = _file_error(model, fmt(), probe, tmp_path)
            error, flag = _measured(entry, mode)
            # The flag is the real file's verdict, and the measured error that file's error
            # within a factor 2 (the file also rounds activations per batch, biases to int32).
            assert flag == (file_error > TOLERANCE), (name, mode, error, file_error)
            assert 0.5 < error / file_error < 2, (name, mode, error, file_error)
        int8_files[name] = export_tflite(
            model,
            tmp_path / f"{name}.tflite",
            quantization="int8",
            representative_data=x_train,
            strict=False,
        )
    healthy, slimmed, scaled = entries["healthy"], entries["slimmed"], entries["scaled"]
    assert healthy.output_spread < 5 and slimmed.output_spread > 1000  # the old false alarm
    assert slimmed.per_tensor_error < TOLERANCE / 3 and not slimmed.int8_risk
    assert scaled.per_tensor_error > 3 * TOLERANCE and scaled.int8_risk
    # The int8 file export_tflite writes (activations int8 too): the slimmed model's passes,
    # and the int8 pipeline measured it (on its held-out probe) and flags nothing.
    assert not slimmed.per_channel_int8_risk and int8_files["slimmed"].passed
    assert int8_files["slimmed"].fold.int8_risks == []
    # What the measurement does not cover: the scaled channel's activations are 1000x larger
    # too, and int8 activations have one scale per tensor, so that int8 file fails although
    # its weights (one scale per channel) lose nothing.
    assert not scaled.per_channel_int8_risk and not int8_files["scaled"].passed
    assert [spread.host for spread in int8_files["scaled"].fold.int8_risks] == ["hidden"]


@pytest.mark.slow
def test_per_channel_flag_agrees_with_real_files_of_a_forward_fold(tmp_path):
    """Inputs in different units (feature 2 is 100x smaller), standardized by a BN that folds
    forward: its row of the next kernel is 100x larger, every output channel's one scale spans
    it, and even per-channel int8 weights round the other rows away: flagged, as a real file
    with int8 weights per channel and the int8 file export_tflite writes say."""
    x = np.random.default_rng(5).normal(size=(256, 64)).astype("float32")
    bn = keras_bn.BatchNormalization(epsilon=1e-6)
    model = keras.Sequential(
        [keras.Input((64,)), bn, L.Dense(32, name="dense"), L.ReLU(), L.Dense(3, name="head")]
    )
    for units, flagged in ((1e-2, True), (1.0, False)):
        data = x.copy()
        data[:, 2] *= units
        bn.set_weights([np.ones(64), np.zeros(64), data.mean(0), data.var(0)])  # standardizes
        _, fold_report = fold_batch_norms(model, data[:64], int8_readiness=True)
        (entry,) = fold_report.channel_spreads
        assert entry.host == "dense" and (entry.input_spread > 50) == flagged
        file_error = _file_error(model, WEIGHT_FILES["per channel"](), data[:64], tmp_path)
        assert entry.per_channel_int8_risk == flagged == (file_error > TOLERANCE), file_error
        if flagged:
            assert 0.5 < entry.per_channel_error / file_error < 2, file_error
            int8_file = export_tflite(
                model,
                tmp_path / "m.tflite",
                quantization="int8",
                representative_data=data,
                strict=False,
            )
            assert not int8_file.passed and int8_file.fold.int8_risks[0].per_channel_int8_risk


@pytest.mark.slow
def test_cli_shows_the_scaled_channel_and_its_int8_file_is_worse(tmp_path, capfd):
    model, x_train = digits.train_mlp()
    model.save(tmp_path / "healthy.keras")
    probe = x_train[:64]
    healthy_outputs = model.predict(probe, verbose=0)
    digits.scale_hidden_channel(model, channel=5, factor=1000.0)
    np.testing.assert_allclose(
        model.predict(probe, verbose=0),
        healthy_outputs,
        rtol=1e-4,
        atol=1e-4 * np.abs(healthy_outputs).max(),
    )
    model.save(tmp_path / "scaled.keras")
    np.save(tmp_path / "x.npy", x_train)

    errors = {}
    for name in ("healthy", "scaled"):
        result = cli_in_process(
            capfd,
            tmp_path / f"{name}.keras",
            "--tflite",
            tmp_path / f"{name}.tflite",
            "--quantize",
            "int8",
            "--representative-data",
            tmp_path / "x.npy",
            "--report",
            tmp_path / f"{name}.json",
        )
        cli_report = json.loads((tmp_path / f"{name}.json").read_text())
        errors[name] = cli_report["exports"][0]["relative_error"]
        (spread,) = cli_report["fold"]["channel_spreads"]
        assert cli_report["fold"]["int8_readiness_measured"] is True  # on with int8
        if name == "healthy":
            assert result.returncode == 0, result.stderr
            assert cli_report["fold"]["int8_risks"] == [] and spread["output_spread"] < 10
            assert spread["per_tensor_error"] < TOLERANCE / 3
            assert (
                f"int8 readiness: rounding any one folded host's weights to int8 moves the "
                f"outputs by at most {spread['per_tensor_error']:.2e} of their scale per tensor "
                f"(hidden), {spread['per_channel_error']:.2e} per channel (hidden): within 0.1"
            ) in result.stdout
        else:
            assert result.returncode in (0, 1), result.stderr  # 1: over the int8 tolerance
            assert cli_report["fold"]["int8_risks"] == ["hidden"] and spread["int8_risk"]
            assert spread["output_spread"] > 1000 and spread["per_tensor_error"] > TOLERANCE
            assert spread["per_channel_int8_risk"] is False and spread["input_spread"] is None
            assert (
                "int8 risk: 1 folded host(s) whose weights alone, rounded to int8, move the "
                "outputs by more than 0.1 of their scale"
            ) in result.stdout
            assert (
                f"  hidden (Dense): error {spread['per_tensor_error']:.2e} per tensor, "
                f"{spread['per_channel_error']:.2e} per channel (output channels "
                f"{spread['output_spread']:.3g}x apart): per-tensor int8 only (TFLite's int8 "
                f"is per channel)"
            ) in result.stdout
            # Printed with the fold, before the file's own lines.
            assert result.stdout.index("int8 risk") < result.stdout.index("tflite (int8)")
    # The same function, measured in LiteRT: the scaled model's int8 file is far worse. TFLite
    # scales the hidden weights per channel, so the loss comes from the activation channel
    # that is 1000x larger too (one int8 scale per activation tensor) and the head's row that
    # is 1000x smaller; a per-tensor runtime loses the hidden weights as well.
    assert errors["scaled"] > 5 * errors["healthy"], errors

    # Without an export: measured on request only.
    for flag, expected in (([], "int8 readiness: not measured"), (["--int8-readiness"], "")):
        result = cli_in_process(
            capfd, tmp_path / "scaled.keras", "--representative-data", tmp_path / "x.npy", *flag
        )
        assert result.returncode == 0, result.stderr
        assert (expected or "int8 risk: 1 folded host(s)") in result.stdout


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_snippet_runs_and_flags_the_scaled_host_by_its_measured_error(capsys):
    page = docs_page("guide/export.md")
    section = page[page.index("## int8 readiness") :]
    start = section.index("```python\n") + len("```python\n")
    snippet = section[start : section.index("\n```", start)]
    namespace = {}
    exec(compile(snippet, "docs/guide/export.md", "exec"), namespace)
    (spread,) = namespace["report"].channel_spreads
    assert namespace["report"].int8_risks == [spread] and spread.host == "dense"
    assert spread.per_tensor_error > 5 * TOLERANCE and spread.per_channel_error < TOLERANCE / 5
    out = capsys.readouterr().out
    assert "output_spread=1121.19" in out and "per_tensor_error=0.976" in out
    assert "per_channel_error=0.00555" in out and "['dense']" in out


@pytest.mark.slow
def test_bench_int8_spread_smoke():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_int8_spread.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        line.split("|")[1:-1]
        for line in result.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| variant ")
    ]
    assert [row[0].strip() for row in rows] == ["γ×1", "γ×1000"]
    assert all(len(row) == 8 for row in rows)
    (_, spread, per_tensor, per_channel), scaled = rows[0][:4], rows[1][:4]
    assert float(scaled[1]) > 100 * float(spread)  # the spread follows the scale
    # Measured beside it: per tensor, rounding the small channels away is over the tolerance;
    # per channel, scaling a channel changes nothing.
    assert float(per_tensor) < TOLERANCE < float(scaled[2])
    assert float(scaled[3]) == pytest.approx(float(per_channel), rel=0.05)

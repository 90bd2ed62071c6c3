"""int8 readiness: the spread of each folded host's per-channel weight ranges.

The pure functions are checked against explicit loops over channel indices; fold_batch_norms
against the same loops run on the folded layers' own weights, with one BN channel scaled ×1000
(a wrong channel axis puts that channel among others and the spread stays small); the claim
that TFLite quantizes every host per channel against the scales in a converted file; and the
CLI end to end, where the ×1000 model's int8 file is also measured in LiteRT.
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
from helpers import docs_page, run_cli
from keras_bn.export import (
    INT8_SPREAD_THRESHOLD,
    ChannelSpread,
    export_tflite,
    fold,
    fold_batch_norms,
)

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


def test_nan_weight_gives_nan_spread_which_is_a_risk():
    kernel = np.ones((4, 3))
    kernel[1, 2] = np.nan
    assert np.isnan(fold.output_channel_ranges(kernel)[2])
    spread = fold.channel_spread(fold.output_channel_ranges(kernel))
    assert np.isnan(spread)
    entry = ChannelSpread("host", "Dense", spread)
    assert entry.int8_risk and not entry.per_channel_int8_risk
    assert ChannelSpread("host", "Dense", 1.0, float("nan")).per_channel_int8_risk


def test_threshold_is_exclusive_and_none_is_no_forward_fold():
    assert not ChannelSpread("h", "Dense", INT8_SPREAD_THRESHOLD).int8_risk
    assert ChannelSpread("h", "Dense", np.nextafter(INT8_SPREAD_THRESHOLD, np.inf)).int8_risk
    assert not ChannelSpread("h", "Dense", 2.0, None).per_channel_int8_risk


def test_bad_layout_and_shapes_raise_naming_them():
    with pytest.raises(ValueError, match="layout='first'"):
        fold.output_channel_ranges(np.ones((2, 2)), "first")
    with pytest.raises(ValueError, match=r"received shape \(3,\)"):
        fold.output_channel_ranges(np.ones(3))
    with pytest.raises(ValueError, match="groups=4 does not divide"):
        fold.input_channel_ranges(np.ones((3, 2, 6)), groups=4)


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
    folded, report = fold_batch_norms(_host_then_bn(kind, scaled=True))
    (entry,) = report.channel_spreads
    kernel = folded.layers[0].get_weights()[1 if kind == "SeparableConv2D" else 0]
    ranges = _loop_ranges(kernel, channel_of)
    assert np.argmax(ranges) == SCALED
    assert entry.output_spread == pytest.approx(ranges.max() / ranges.min(), rel=1e-12)
    assert entry.output_spread > 100 * INT8_SPREAD_THRESHOLD
    assert (entry.host, entry.layer, entry.input_spread) == (folded.layers[0].name, kind, None)
    assert report.int8_risks == [entry] and not entry.per_channel_int8_risk
    _, healthy = fold_batch_norms(_host_then_bn(kind, scaled=False))
    assert healthy.channel_spreads[0].output_spread < INT8_SPREAD_THRESHOLD
    assert healthy.int8_risks == []


def test_forward_fold_reports_the_input_spread_and_nested_hosts_by_path():
    inner = keras.Sequential(
        [keras.Input((6,)), keras_bn.BatchNormalization(), L.Dense(5)], name="inner"
    )
    bn = inner.layers[0]
    gamma = bn.gamma.numpy()
    gamma[2] *= 1000.0
    bn.gamma.assign(gamma)
    outer = keras.Sequential([keras.Input((6,)), inner, L.Dense(3)])
    folded, report = fold_batch_norms(outer)
    assert [f.direction for f in report.folded] == ["forward"]
    (entry,) = report.channel_spreads
    kernel = folded.layers[0].layers[0].get_weights()[0]
    ranges = _loop_ranges(kernel, lambda i: i[0])
    assert entry.host == "inner/" + folded.layers[0].layers[0].name
    assert np.argmax(ranges) == 2
    assert entry.input_spread == pytest.approx(ranges.max() / ranges.min(), rel=1e-12)
    assert entry.input_spread > 10 * INT8_SPREAD_THRESHOLD
    assert entry.per_channel_int8_risk and report.int8_risks == [entry]
    as_dict = report.to_dict()
    assert as_dict["int8_risks"] == [entry.host]
    assert as_dict["channel_spreads"][0]["per_channel_int8_risk"] is True
    assert as_dict["int8_spread_threshold"] == INT8_SPREAD_THRESHOLD


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


@pytest.mark.slow
def test_cli_shows_the_scaled_channel_and_its_int8_file_is_worse(tmp_path):
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
        result = run_cli(
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
        report = json.loads((tmp_path / f"{name}.json").read_text())
        errors[name] = report["exports"][0]["relative_error"]
        (spread,) = report["fold"]["channel_spreads"]
        if name == "healthy":
            assert result.returncode == 0, result.stderr
            assert report["fold"]["int8_risks"] == [] and spread["output_spread"] < 10
            assert "int8 readiness: every folded host's channel ranges are within 10x" in (
                result.stdout
            )
        else:
            assert result.returncode in (0, 1), result.stderr  # 1: over the int8 tolerance
            assert report["fold"]["int8_risks"] == ["hidden"] and spread["int8_risk"]
            assert spread["output_spread"] > 1000
            assert spread["per_channel_int8_risk"] is False and spread["input_spread"] is None
            assert "int8 risk: 1 folded host(s) with channel ranges over 10x apart" in (
                result.stdout
            )
            assert (
                f"  hidden (Dense): output channels {spread['output_spread']:.3g}x apart: "
                f"per-tensor int8 only (TFLite's int8 is per channel)"
            ) in result.stdout
            # Printed with the fold, before the file's own lines.
            assert result.stdout.index("int8 risk") < result.stdout.index("tflite (int8)")
    # The same function, measured in LiteRT: the scaled model's int8 file is far worse. TFLite
    # scales the hidden weights per channel, so the loss comes from the activation channel
    # that is 1000x larger too (one int8 scale per activation tensor) and the head's row
    # that is 1000x smaller; a per-tensor runtime loses the hidden weights as well
    # (docs/guide/export.md).
    assert errors["scaled"] > 5 * errors["healthy"], errors


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_snippet_runs_and_flags_the_scaled_host(capsys):
    page = docs_page("guide/export.md")
    section = page[page.index("## int8 readiness") :]
    start = section.index("```python\n") + len("```python\n")
    snippet = section[start : section.index("\n```", start)]
    namespace = {}
    exec(compile(snippet, "docs/guide/export.md", "exec"), namespace)
    assert [spread.host for spread in namespace["report"].int8_risks] == ["dense"]
    assert "['dense'] 10.0" in capsys.readouterr().out


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
        if line.startswith("| ") and not line.startswith("| s ")
    ]
    assert [row[0].strip() for row in rows] == ["1", "1000"]
    assert all(len(row) == 6 for row in rows)
    assert float(rows[1][1]) > 100 * float(rows[0][1])  # the spread follows the scale

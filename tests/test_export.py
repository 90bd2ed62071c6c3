"""export_tflite and export_onnx on small models: the files run in LiteRT / onnxruntime and match
the unfolded Keras model; folding removes the BN ops the converters would otherwise leave."""

import os

import keras
import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter
from conftest import randomise_batch_norms

import digits
from keras_bn.export import export_onnx, export_tflite
from keras_bn.export import onnx as onnx_export
from keras_bn.export import tflite as tflite_export

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
    assert report.relative_error <= 1e-4
    assert report.path == str(path) and report.size_bytes == os.path.getsize(path)
    assert "MUL" not in report.op_histogram and report.op_histogram["CONV_2D"] == 2
    assert not any(op.startswith("Flex") or op == "CUSTOM" for op in report.op_histogram)
    assert len(report.fold.folded) == 3 and report.fold.kept == []
    # Independently re-run the file on the disk against the unfolded model.
    actual = tflite_export.run(Interpreter(model_path=str(path)), probe)
    np.testing.assert_allclose(actual, cnn(probe, training=False), atol=1e-4 * report.output_scale)


def test_tflite_without_fold_converts_the_model_as_is(cnn, tmp_path):
    report = export_tflite(cnn, tmp_path / "raw.tflite", fold=False, probe=_probe())
    assert report.fold is None and report.relative_error <= 1e-4


@pytest.mark.parametrize("quantization, rtol", [("float16", 1e-2), ("dynamic", 5e-2),
                                                ("int8", 1e-1)])
def test_tflite_quantized_files_stay_close(cnn, tmp_path, quantization, rtol):
    data = _probe(64)
    report = export_tflite(cnn, tmp_path / "q.tflite", quantization=quantization,
                           representative_data=data)
    assert report.quantization == quantization and 0 < report.relative_error <= rtol
    float_size = export_tflite(cnn, tmp_path / "f.tflite", probe=data).size_bytes
    assert report.size_bytes < 0.6 * float_size
    if quantization == "int8":
        assert report.op_histogram["QUANTIZE"] >= 1


def test_tflite_bad_quantization_arguments_raise(cnn, tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of .* received 'int4'"):
        export_tflite(cnn, tmp_path / "x.tflite", quantization="int4")
    with pytest.raises(ValueError, match="needs representative_data"):
        export_tflite(cnn, tmp_path / "x.tflite", quantization="int8")
    assert os.listdir(tmp_path) == []


def test_kept_bn_becomes_one_mul_and_one_add(tmp_path):
    inputs = keras.Input((6, 6, 2))
    y = L.Conv2D(4, 3, activation="relu")(inputs)
    y = L.BatchNormalization(name="kept")(y)  # after a ReLU, before a Flatten: cannot fold
    outputs = L.Flatten()(y)
    model = randomise_batch_norms(keras.Model(inputs, outputs))
    x = np.random.default_rng(2).normal(size=(3, 6, 6, 2)).astype("float32")
    tfl = export_tflite(model, tmp_path / "k.tflite", probe=x)
    onnx = export_onnx(model, tmp_path / "k.onnx", probe=x)
    assert [k.bn for k in tfl.fold.kept] == ["kept"]
    assert tfl.relative_error <= 1e-5 and onnx.relative_error <= 1e-5
    assert (tfl.op_histogram["MUL"], tfl.op_histogram["ADD"]) == (1, 1)
    assert (onnx.op_histogram["Mul"], onnx.op_histogram.get("Add", 0)) == (1, 1)


def test_onnx_matches_keras_with_optimisation_off_and_on(cnn, tmp_path):
    path = tmp_path / "cnn.onnx"
    probe = _probe()
    report = export_onnx(cnn, path, probe=probe)
    assert set(report.errors) == {"ort_disabled", "ort_enabled"}
    assert report.relative_error <= 1e-4
    assert "BatchNormalization" not in report.op_histogram and "Mul" not in report.op_histogram
    assert report.size_bytes == os.path.getsize(path)
    # Any batch size: the batch dim is dynamic.
    for batch in (1, 7):
        x = _probe(batch)
        np.testing.assert_allclose(onnx_export.run(str(path), x), cnn(x, training=False),
                                   atol=1e-4 * report.output_scale)


def test_onnx_mlp_bn_residue_without_fold_and_none_with_it(tmp_path):
    """tf2onnx leaves a Mul per Dense→BN (ORT does not fuse MatMul→Mul); folding removes it."""
    layers = [l for _ in range(4) for l in (L.Dense(16), L.BatchNormalization())]
    model = randomise_batch_norms(keras.Sequential([keras.Input((12,)), *layers]))
    raw = export_onnx(model, tmp_path / "raw.onnx", fold=False)
    folded = export_onnx(model, tmp_path / "folded.onnx")
    assert raw.fold is None and raw.op_histogram["Mul"] == 4
    assert folded.op_histogram == {"MatMul": 4, "Add": 4}
    assert max(raw.relative_error, folded.relative_error) <= 1e-4

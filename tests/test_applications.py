"""Real architectures (keras.applications, weights=None, BN statistics randomised) fold
completely, and their TFLite and ONNX files match the unfolded Keras model."""

import keras
import numpy as np
import pytest

import digits
import keras_bn
from helpers import randomise_batch_norms
from keras_bn.export import export_onnx, export_tflite, fold_batch_norms

pytestmark = pytest.mark.backends("tensorflow")

RTOL = 1e-4
BNS = (keras_bn.BatchNormalization, keras.layers.BatchNormalization)

APPLICATIONS = {
    "MobileNetV2": lambda: keras.applications.MobileNetV2(
        input_shape=(96, 96, 3), alpha=0.35, weights=None, classifier_activation=None
    ),
    "ResNet50": lambda: keras.applications.ResNet50(
        input_shape=(64, 64, 3), weights=None, classifier_activation=None
    ),
}


@pytest.fixture(scope="module", params=sorted(APPLICATIONS))
def application(request):
    keras.utils.set_random_seed(0)
    model = randomise_batch_norms(APPLICATIONS[request.param]())
    size = model.inputs[0].shape[1]
    probe = np.random.default_rng(0).uniform(-1, 1, (2, size, size, 3)).astype("float32")
    return request.param, model, probe


@pytest.mark.slow
def test_application_folds_completely(application):
    _, model, probe = application
    n_bn = sum(isinstance(layer, BNS) for layer in model.layers)
    folded, report = fold_batch_norms(model, probe)
    assert report.kept == [] and len(report.folded) == n_bn > 0
    assert not any(isinstance(layer, BNS) for layer in folded.layers)
    assert report.relative_error <= RTOL
    expected = np.asarray(model(probe, training=False))
    assert np.abs(np.asarray(folded(probe)) - expected).max() <= RTOL * np.abs(expected).max()


@pytest.mark.slow
def test_application_tflite_and_onnx_match_keras(application, tmp_path):
    name, model, probe = application
    tfl = export_tflite(model, tmp_path / "m.tflite", probe=probe)
    onnx = export_onnx(model, tmp_path / "m.onnx", probe=probe)
    assert tfl.relative_error <= RTOL, tfl.errors
    assert onnx.relative_error <= RTOL, onnx.errors
    assert tfl.fold.kept == [] and onnx.fold.kept == []
    if name == "MobileNetV2":
        residual_adds = sum(isinstance(layer, keras.layers.Add) for layer in model.layers)
        assert residual_adds == 10
        assert "BatchNormalization" not in onnx.op_histogram
        assert "Mul" not in onnx.op_histogram
        assert onnx.op_histogram.get("Add", 0) <= residual_adds
        assert "MUL" not in tfl.op_histogram


@pytest.mark.slow
def test_int8_digits_cnn_loses_at_most_one_point_of_accuracy(tmp_path):
    model, keras_accuracy = digits.train(epochs=10)
    x_train = digits.load()[0]
    path = tmp_path / "digits_int8.tflite"
    report = export_tflite(model, path, quantization="int8", representative_data=x_train)
    assert report.op_histogram["QUANTIZE"] >= 1 and report.fold.kept == []
    int8_accuracy = digits.tflite_accuracy(path)  # the whole test split, run in LiteRT
    assert keras_accuracy > 0.9
    assert int8_accuracy >= keras_accuracy - 0.01, (keras_accuracy, int8_accuracy)

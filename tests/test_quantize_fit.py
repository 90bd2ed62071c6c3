"""A model from keras_bn.quantize.quantize_model in use: QAT fine-tuning of the digits CNN with
`fit` (graph and XLA) keeps the float model's accuracy; `.keras` round trips are bit-exact, and
load after a plain `import keras_bn`; recalibrate, check_batchnorm and the Recalibrate callback
refuse a QAT model, naming its QAT layers. Under every backend."""

import keras
import numpy as np
import pytest
from framework_references import array
from test_quantize_model import _branches, _branches_input

import digits
import keras_bn
from helpers import python_json
from keras_bn._errors import UnsupportedModelError
from keras_bn.diagnostics import check_batchnorm
from keras_bn.quantize import (
    ActivationQuantizer,
    FreezeBatchNorm,
    QuantizedHostBatchNorm,
    freeze_ranges,
    quantize_model,
)

BATCH = 64


@pytest.fixture(scope="module")
def trained():
    """The digits CNN (keras_bn BN) trained in float, and its test accuracy: under JAX with
    jit (without, fit runs op by op: 24 s where jit takes 7)."""
    return digits.train(epochs=6, batch_size=BATCH, jit_compile=keras.backend.backend() == "jax")


@pytest.mark.slow
@pytest.mark.parametrize(
    "jit_compile",
    [
        # Under JAX, fit without jit runs op by op: minutes, where jit (JAX's way) takes
        # seconds; under PyTorch it is PyTorch's own eager training.
        pytest.param(False, marks=pytest.mark.backends("tensorflow", "torch")),
        True,  # under PyTorch, torch.compile
    ],
    ids=["graph", "xla"],
)
def test_qat_fine_tuning_keeps_the_float_accuracy(trained, jit_compile):
    """Three epochs of QAT from the trained float model (8-bit weights and activations, BN
    frozen after 40 steps, ranges after 50) end within 2 points of the float accuracy, with
    every range set and frozen and the inference really quantized."""
    model, float_accuracy = trained
    x_train, y_train, x_test, y_test = digits.load()
    # Whole batches (1,344 of the 1,347 images) and the test set as one batch: a last, smaller
    # batch costs torch.compile and XLA another compile of each step, which this test is not
    # about (test_torch_layer.py compares a compiled QAT step on a smaller last batch with
    # eager's).
    whole = len(x_train) // BATCH * BATCH
    x_train, y_train = x_train[:whole], y_train[:whole]
    qat = quantize_model(model)
    qat.compile(
        keras.optimizers.Adam(1e-4),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    history = qat.fit(
        x_train,
        y_train,
        epochs=3,
        batch_size=BATCH,
        verbose=0,
        callbacks=[FreezeBatchNorm(40, freeze_ranges_after_steps=50)],
    )
    assert np.isfinite(history.history["loss"]).all()
    _, accuracy = qat.evaluate(x_test, y_test, batch_size=len(x_test), verbose=0)
    assert accuracy >= float_accuracy - 0.02, (accuracy, float_accuracy)
    quantizers = [
        layer for layer in qat._flatten_layers() if isinstance(layer, ActivationQuantizer)
    ]
    assert len(quantizers) == 5  # the input's, and the four QAT layers' outputs
    for quantizer in quantizers:
        assert quantizer.range_initialized.numpy() and quantizer.ranges_frozen.numpy()
    for layer in qat.layers:
        if isinstance(layer, QuantizedHostBatchNorm):
            assert layer.batch_norm_frozen.numpy()
    # The first QAT layer's outputs lie on its 8-bit grid: at most 256 distinct values.
    first = keras.Model(qat.inputs[0], qat.layers[1].output)
    assert len(np.unique(array(first(x_test[:64], training=False)))) <= 256


def _weights_by_path(model):
    return {w.path: np.array(w) for w in model.weights}


def _trained_branches(freeze_ranges_after_steps):
    model = quantize_model(_branches())
    model.compile(keras.optimizers.SGD(0.05), ["sparse_categorical_crossentropy", "mse"])
    x = _branches_input(n=16)
    y = [np.arange(16) % 3, np.ones((16, 2), "float32")]
    model.fit(
        x,
        y,
        batch_size=4,
        verbose=0,
        callbacks=[FreezeBatchNorm(2, freeze_ranges_after_steps=freeze_ranges_after_steps)],
    )
    return model, x


@pytest.mark.slow
@pytest.mark.parametrize("freeze_ranges_step", [None, 3], ids=["ranges_moving", "ranges_frozen"])
def test_keras_round_trip_is_bit_exact(tmp_path, freeze_ranges_step):
    """Every weight (ranges and freeze flags included), every config and the outputs in
    inference and in training mode (and the state training mode moves) survive `.keras`."""
    model, x = _trained_branches(freeze_ranges_step)
    path = tmp_path / "qat.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    saved, restored = _weights_by_path(model), _weights_by_path(loaded)
    assert saved.keys() == restored.keys()
    assert sum(p.endswith("batch_norm_frozen") for p in saved) == 3
    # Five quantizers in the graph, the average pool's, four QAT outputs and a separable
    # conv's intermediate.
    assert sum(p.endswith("ranges_frozen") for p in saved) == 11
    for name, value in saved.items():
        assert restored[name].dtype == value.dtype, name
        np.testing.assert_array_equal(restored[name], value, err_msg=name)
    assert bool(loaded.get_layer("avg_qat").input_quantizer.ranges_frozen.numpy()) == (
        freeze_ranges_step is not None
    )
    for layer in model.layers:
        assert loaded.get_layer(layer.name).get_config() == layer.get_config()
    for a, b in zip(loaded(x, training=False), model(x, training=False)):
        np.testing.assert_array_equal(array(a), array(b))
    for a, b in zip(loaded(x, training=True), model(x, training=True)):
        np.testing.assert_array_equal(array(a), array(b))
    for name, value in _weights_by_path(model).items():
        np.testing.assert_array_equal(_weights_by_path(loaded)[name], value, err_msg=name)


LOAD = """
import json, sys
import numpy as np
import keras_bn
import keras

model = keras.saving.load_model(sys.argv[1])
x = [np.load(sys.argv[2]), np.load(sys.argv[3])]
outputs = [keras.ops.convert_to_numpy(t).tolist() for t in model(x, training=False)]
print(json.dumps([type(model.get_layer("a_qat")).__name__, outputs]))
"""


@pytest.mark.slow
def test_a_plain_import_lets_keras_load_a_qat_model(tmp_path):
    """No custom_objects, no import of keras_bn.quantize: the QAT layers are registered."""
    model, x = _trained_branches(3)
    model.save(tmp_path / "qat.keras")
    for index, inputs in enumerate(x):
        np.save(tmp_path / f"x{index}.npy", inputs)
    kind, outputs = python_json(LOAD, *(tmp_path / n for n in ("qat.keras", "x0.npy", "x1.npy")))
    assert kind == "QuantizedHostBatchNorm"
    for got, want in zip(outputs, model(x, training=False)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), array(want))


@pytest.fixture(scope="module")
def qat_digits():
    model = digits.small_cnn()
    model(np.zeros((1, 8, 8, 1), "float32"))
    return quantize_model(model)


def test_check_batchnorm_refuses_a_qat_model(qat_digits):
    with pytest.raises(UnsupportedModelError, match="check_batchnorm cannot take"):
        check_batchnorm(qat_digits, digits.load()[0][:64])


def test_recalibrate_before_quantize_model_is_the_way(qat_digits):
    """The advice works: the float model recalibrates, and its QAT copy starts from the new
    statistics."""
    model = digits.small_cnn()
    model(np.zeros((1, 8, 8, 1), "float32"))
    report = keras_bn.recalibrate(model, digits.load()[0][:256], progress=False)
    assert len(report.layers) == 3
    qat = quantize_model(model)
    np.testing.assert_array_equal(
        qat.layers[1].batch_norm.moving_variance, model.layers[1].moving_variance
    )
    with pytest.raises(ValueError, match="have not seen a training batch"):
        freeze_ranges(qat)

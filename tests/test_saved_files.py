"""`.keras` files saved before the package layout changed (keras_bn at d473865, by
tests/fixtures/saved_by_d473865/make_fixtures.py) still load: the registered names
("keras_bn>BatchNormalization", "keras_bn.export>InferenceAffine", "keras_bn.quantize>...")
do not depend on where a class's module lives. Each model predicts what it predicted when it
was saved."""

from pathlib import Path

import keras
import numpy as np
import pytest

import keras_bn
from keras_bn.export import ChannelBias, InferenceAffine
from keras_bn.quantize import (
    ActivationQuantizer,
    QuantizedAveragePooling,
    QuantizedHost,
    QuantizedHostBatchNorm,
)

SAVED = Path(__file__).parent / "fixtures" / "saved_by_d473865"
CLASSES = {
    "float_model": {keras_bn.BatchNormalization, InferenceAffine, ChannelBias},
    "qat_w8_model": {
        QuantizedHost,
        QuantizedHostBatchNorm,
        ActivationQuantizer,
        QuantizedAveragePooling,
    },
    "qat_w3_model": {
        QuantizedHost,
        QuantizedHostBatchNorm,
        ActivationQuantizer,
        QuantizedAveragePooling,
    },
}


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_file_saved_before_the_layout_change_loads_and_predicts_as_it_did(name):
    model = keras.saving.load_model(SAVED / f"{name}.keras")
    found = {type(layer) for layer in model.layers}
    assert CLASSES[name] <= found, CLASSES[name] - found
    x = np.load(SAVED / "inputs.npy")
    expected = np.load(SAVED / f"{name}_output.npy")
    y = keras.ops.convert_to_numpy(model(x, training=False))
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-5 * np.abs(expected).max())

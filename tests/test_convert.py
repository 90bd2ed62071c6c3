"""keras_bn.convert: from_keras / to_keras on Sequential, Functional, nested models and
MobileNetV2; configs and weights carried exactly; the original untouched. Under every
backend."""

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from helpers import assert_close, hidden_bn_model
from keras_bn import convert


def _data(shape, seed=0):
    return np.random.default_rng(seed).normal(0.5, 1.0, size=shape).astype("float32")


def _randomize(model, seed=1):
    rng = np.random.default_rng(seed)
    model.set_weights([rng.uniform(0.5, 1.5, w.shape).astype(w.dtype) for w in model.weights])


def _bn_layers(model, kind):
    return [layer for layer in model._flatten_layers() if type(layer) is kind]


def _nested_keras_model():
    """Functional model holding a nested Sequential and a nested Functional, with Keras BNs
    of several configurations (renorm included)."""
    block = keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-4, name="seq_bn"),
        ],
        name="block",
    )
    inner_in = keras.Input((4,))
    inner = keras.Model(
        inner_in,
        keras.layers.BatchNormalization(
            center=False,
            renorm=True,
            renorm_clipping={"rmax": 3.0, "rmin": 0.3, "dmax": 5.0},
            renorm_momentum=0.9,
            name="renorm_bn",
        )(keras.layers.Dense(4)(inner_in)),
        name="inner",
    )
    inputs = keras.Input((6, 6, 3))
    h = keras.layers.GlobalAveragePooling2D()(block(inputs))
    h = inner(h)
    outputs = keras.layers.BatchNormalization(scale=False, name="top_bn")(keras.layers.Dense(2)(h))
    model = keras.Model(inputs, outputs)
    _randomize(model)
    return model


def _assert_same_weights(a, b):
    assert [w.name for w in a.weights] == [w.name for w in b.weights]
    for wa, wb in zip(a.weights, b.weights):
        np.testing.assert_array_equal(array(wa), array(wb))


def test_from_keras_and_back_on_nested_model():
    model = _nested_keras_model()
    snapshot = [array(w).copy() for w in model.weights]
    layer_types = [type(layer) for layer in model._flatten_layers()]
    x = _data((8, 6, 6, 3))

    ours = convert.from_keras(model)
    assert not _bn_layers(ours, keras.layers.BatchNormalization)
    converted = _bn_layers(ours, keras_bn.BatchNormalization)
    originals = _bn_layers(model, keras.layers.BatchNormalization)
    assert len(converted) == len(originals) == 3
    for old, new in zip(originals, converted):
        new_config = new.get_config()
        for key, value in old.get_config().items():
            assert new_config[key] == value, key
        _assert_same_weights(old, new)  # moving_variance copied as it is
    assert_close(ours(x, training=False), model(x, training=False), 1e-5)

    # The original is untouched: same layer objects, types and weight values.
    assert [type(layer) for layer in model._flatten_layers()] == layer_types
    for w, s in zip(model.weights, snapshot):
        np.testing.assert_array_equal(array(w), s)
    assert not {id(v) for v in ours.weights} & {id(v) for v in model.weights}

    back = convert.to_keras(ours)
    assert not _bn_layers(back, keras_bn.BatchNormalization)
    for old, new in zip(originals, _bn_layers(back, keras.layers.BatchNormalization)):
        assert new.get_config() == old.get_config()
        _assert_same_weights(old, new)
    assert_close(back(x, training=False), model(x, training=False), 1e-6)


def test_sequential_model():
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(3),
            keras.layers.BatchNormalization(axis=1),
        ]
    )
    _randomize(model)
    ours = convert.from_keras(model)
    assert isinstance(ours, keras.Sequential)
    assert type(ours.layers[1]) is keras_bn.BatchNormalization
    x = _data((4, 5))
    assert_close(ours(x, training=False), model(x, training=False), 1e-6)


# Not under JAX, for CI's time: there its eager build and inference compile every op for
# each shape and the jitted fit compiles the whole network (55 s on 2 busy cores, against 9 s
# under PyTorch); convert's code is the same under every backend, and the nested model's test
# runs it under JAX.
@pytest.mark.backends("tensorflow", "torch")
@pytest.mark.slow
def test_mobilenet_v2_inference_equal_and_converted_model_trains():
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=5
    )
    # Non-trivial statistics, so that the comparison exercises them.
    for layer in _bn_layers(model, keras.layers.BatchNormalization):
        n = layer.moving_mean.shape[0]
        rng = np.random.default_rng(n)
        layer.moving_mean.assign(rng.normal(0, 0.1, n).astype("float32"))
        layer.moving_variance.assign(rng.uniform(0.5, 2.0, n).astype("float32"))
    x = _data((4, 32, 32, 3))  # every layer at the smallest input MobileNetV2 takes
    expected = array(model(x, training=False))

    ours = convert.from_keras(model)
    assert len(_bn_layers(ours, keras_bn.BatchNormalization)) == 52
    assert not _bn_layers(ours, keras.layers.BatchNormalization)
    assert_close(ours(x, training=False), expected, 1e-5)
    assert_close(convert.to_keras(ours)(x, training=False), expected, 1e-5)

    ours.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    before = [array(w).copy() for w in ours.trainable_weights]
    history = ours.fit(x, np.arange(4) % 5, batch_size=4, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    changed = [not np.array_equal(b, array(w)) for b, w in zip(before, ours.trainable_weights)]
    assert all(changed)
    np.testing.assert_array_equal(array(model(x, training=False)), expected)  # original untouched


# Keras's BatchNormalization takes synchronized=True under TensorFlow only.
@pytest.mark.backends("tensorflow")
def test_keras_synchronized_is_carried_over():
    inputs = keras.Input((4,))
    synced = keras.Model(inputs, keras.layers.BatchNormalization(synchronized=True)(inputs))
    (converted,) = _bn_layers(convert.from_keras(synced), keras_bn.BatchNormalization)
    assert converted.synchronized is True  # carried over, not an error


def test_keras_bn_only_arguments_are_errors():
    for layer, match in [
        (keras_bn.BatchNormalization(momentum=None), "momentum=None"),
        (keras_bn.BatchNormalization(virtual_batch_size=2), "virtual_batch_size=2"),
        (keras_bn.BatchNormalization(axis=[1, 2]), r"axis=\[1, 2\]"),
    ]:
        inputs = keras.Input((3, 4))
        with pytest.raises(ValueError, match=match):
            convert.to_keras(keras.Model(inputs, layer(inputs)))


def test_unconvertible_models_are_errors():
    with pytest.raises(ValueError, match="inside its own code"):
        convert.from_keras(hidden_bn_model())
    unbuilt = keras.Sequential([keras.layers.BatchNormalization()])
    with pytest.raises(ValueError, match="not built"):
        convert.from_keras(unbuilt)

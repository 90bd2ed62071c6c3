"""QAT in compiled `fit` (graph and XLA): the FreezeBatchNorm callback flips at the right
optimizer step, the freeze functions, frozen training = inference, and `.keras` round trips that
keep every weight, range and flag bit for bit."""

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from keras_bn.quantize import (
    ActivationQuantizer,
    FreezeBatchNorm,
    QuantizedHost,
    QuantizedHostBatchNorm,
    freeze_batch_norm,
    freeze_ranges,
)

L = keras.layers
BATCH, STEPS = 8, 6


def _model():
    inputs = keras.Input((8, 8, 3))
    x = ActivationQuantizer(name="input_quantizer")(inputs)
    x = QuantizedHostBatchNorm(
        L.Conv2D(4, 3, padding="same", use_bias=False),
        keras_bn.BatchNormalization(momentum=0.9),
        activation="relu",
        name="conv_bn",
    )(x)
    x = QuantizedHostBatchNorm(
        L.DepthwiseConv2D(3, depth_multiplier=2, padding="same"),
        keras_bn.BatchNormalization(momentum=0.9),
        activation="relu6",
        weight_bits=4,
        per_channel=False,
        name="depthwise_bn",
    )(x)
    x = L.GlobalAveragePooling2D()(x)
    x = ActivationQuantizer(name="pool_quantizer")(x)
    outputs = QuantizedHost(L.Dense(2), activation_bits=None, name="head")(x)
    return keras.Model(inputs, outputs)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 8, 8, 3)).astype("float32")
    return x, rng.normal(size=(BATCH * STEPS, 2)).astype("float32")


class _Recorder(keras.callbacks.Callback):
    """After each batch: the conv's moving mean, its freeze flag and a range."""

    def __init__(self):
        super().__init__()
        self.mean, self.frozen, self.ranges = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        layer = self.model.get_layer("conv_bn")
        self.mean.append(array(layer.batch_norm.moving_mean))
        self.frozen.append(bool(array(layer.batch_norm_frozen)))
        quantizer = self.model.get_layer("pool_quantizer")
        self.ranges.append((float(array(quantizer.range_min)), float(array(quantizer.range_max))))


def _changed(snapshots, initial):
    previous = [initial, *snapshots[:-1]]
    return [not np.array_equal(a, b) for a, b in zip(snapshots, previous)]


@pytest.mark.parametrize(
    "jit_compile",
    [
        False,
        True,  # under PyTorch, torch.compile
    ],
    ids=["graph", "xla"],
)
def test_fit_freezes_batch_norm_and_ranges_at_the_right_step(jit_compile):
    model = _model()
    model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=jit_compile)
    x, y = _data()
    initial_mean = array(model.get_layer("conv_bn").batch_norm.moving_mean)
    recorder = _Recorder()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[FreezeBatchNorm(after_steps=3, freeze_ranges_after_steps=4), recorder],
    )
    assert np.isfinite(history.history["loss"]).all()
    assert int(array(model.optimizer.iterations)) == STEPS
    # Steps 0, 1, 2 train with batch statistics and move the averages; from step 3, frozen.
    assert recorder.frozen == [False, False, False, True, True, True]
    assert _changed(recorder.mean, initial_mean) == [True, True, True, False, False, False]
    assert _changed(recorder.ranges, (0.0, 0.0)) == [True, True, True, True, False, False]
    for layer in (model.get_layer("conv_bn"), model.get_layer("depthwise_bn")):
        assert array(layer.batch_norm_frozen)
    for name in ("input_quantizer", "pool_quantizer"):
        assert array(model.get_layer(name).ranges_frozen)
    assert array(model.get_layer("conv_bn").output_quantizer.ranges_frozen)


def test_after_steps_zero_freezes_before_the_first_step():
    model = _model()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    x, y = _data()
    layer = model.get_layer("conv_bn")
    initial = array(layer.batch_norm.moving_mean)
    model.fit(x[:16], y[:16], batch_size=BATCH, verbose=0, callbacks=[FreezeBatchNorm(0)])
    np.testing.assert_array_equal(array(layer.batch_norm.moving_mean), initial)
    assert not array(model.get_layer("pool_quantizer").ranges_frozen)


def test_frozen_training_is_inference_bit_for_bit():
    """Frozen BN and ranges: training mode computes the folded model inference computes, and
    moves no statistic or range."""
    model = _model()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert len(freeze_batch_norm(model)) == 2
    assert len(freeze_ranges(model)) == 4  # input, pool, and the two QAT layers' outputs
    state = [array(w) for w in model.non_trainable_weights]
    training = array(model(x[:8], training=True))
    np.testing.assert_array_equal(training, array(model(x[:8], training=False)))
    for before, weight in zip(state, model.non_trainable_weights):
        np.testing.assert_array_equal(before, array(weight))


def _weights_by_path(model):
    return {w.path: array(w) for w in model.weights}


@pytest.mark.parametrize("freeze_ranges_step", [None, 2], ids=["ranges_moving", "ranges_frozen"])
def test_keras_round_trip_is_bit_exact(tmp_path, freeze_ranges_step):
    model = _model()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    x, y = _data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        verbose=0,
        callbacks=[FreezeBatchNorm(3, freeze_ranges_after_steps=freeze_ranges_step)],
    )
    path = tmp_path / "qat.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    saved, restored = _weights_by_path(model), _weights_by_path(loaded)
    assert saved.keys() == restored.keys()
    assert any(p.endswith("batch_norm_frozen") for p in saved)
    for path_name, value in saved.items():
        assert restored[path_name].dtype == value.dtype, path_name
        np.testing.assert_array_equal(restored[path_name], value, err_msg=path_name)
    assert bool(array(loaded.get_layer("pool_quantizer").ranges_frozen)) == (
        freeze_ranges_step is not None
    )
    for layer in model.layers:
        assert loaded.get_layer(layer.name).get_config() == layer.get_config()
    np.testing.assert_array_equal(
        array(loaded(x[:8], training=False)), array(model(x[:8], training=False))
    )
    # Training mode from the same state: the same output and the same updated state.
    np.testing.assert_array_equal(
        array(loaded(x[8:16], training=True)), array(model(x[8:16], training=True))
    )
    for path_name, value in _weights_by_path(model).items():
        np.testing.assert_array_equal(_weights_by_path(loaded)[path_name], value)


def test_every_argument_round_trips_through_the_config():
    layers = [
        QuantizedHostBatchNorm(
            L.SeparableConv2D(3, 3, depth_multiplier=2, use_bias=False),
            keras.layers.BatchNormalization(
                momentum=0.8, epsilon=1e-4, center=False, gamma_regularizer="l2"
            ),
            activation="relu6",
            weight_bits=3,
            activation_bits=5,
            per_channel=False,
            range_momentum=0.7,
            name="qat",
        ),
        QuantizedHost(L.Conv1D(2, 3), "relu", weight_bits=2, activation_bits=None, name="plain"),
        QuantizedHostBatchNorm(L.SeparableConv1D(2, 3), quantize_output=False, name="inner"),
        ActivationQuantizer(bits=6, momentum=0.5, name="act"),
    ]
    for layer in layers:
        config = layer.get_config()
        clone = type(layer).from_config(config)
        assert clone.get_config() == config
    bn = layers[0].batch_norm
    assert type(bn) is keras_bn.BatchNormalization
    assert (bn.momentum, bn.epsilon, bn.center) == (0.8, 1e-4, False)
    assert bn.gamma_regularizer is not None
    assert layers[0].host.use_bias is False and layers[0].host.depth_multiplier == 2
    # No output quantizer, but a separable host's intermediate tensor keeps its own.
    inner = type(layers[2]).from_config(layers[2].get_config())
    assert inner.output_quantizer is None and inner.intermediate_quantizer is not None


def test_freeze_functions_refuse_what_they_cannot_freeze():
    plain = keras.Sequential([keras.Input((3,)), L.Dense(2)])
    with pytest.raises(ValueError, match="no QuantizedHostBatchNorm"):
        freeze_batch_norm(plain)
    with pytest.raises(ValueError, match="no ActivationQuantizer"):
        freeze_ranges(plain)
    with pytest.raises(ValueError, match="have not seen a training batch"):
        freeze_ranges(_model())


@pytest.mark.parametrize(
    "kwargs, value",
    [
        ({"after_steps": -1}, "after_steps=-1"),
        ({"after_steps": True}, "after_steps=True"),
        ({"after_steps": 2.0}, "after_steps=2.0"),
        ({"after_steps": 3, "freeze_ranges_after_steps": 0}, "freeze_ranges_after_steps=0"),
        ({"after_steps": 3, "freeze_ranges_after_steps": "5"}, "freeze_ranges_after_steps='5'"),
    ],
)
def test_freeze_callback_refuses_bad_steps(kwargs, value):
    with pytest.raises(ValueError, match=value):
        FreezeBatchNorm(**kwargs)


def test_freeze_callback_refuses_a_model_without_folded_batch_norm_when_training_starts():
    # Issue 32, item 4: a QAT model with no QuantizedHostBatchNorm is refused in
    # on_train_begin, before any step trains, not at step `after_steps` half-way through.
    inputs = keras.Input((4,))
    x = ActivationQuantizer(name="input_quantizer")(inputs)
    outputs = QuantizedHost(L.Dense(2), name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    x, y = np.zeros((16, 4), "float32"), np.zeros((16, 2), "float32")
    with pytest.raises(ValueError, match="holds no QuantizedHostBatchNorm"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[FreezeBatchNorm(3)])
    assert int(array(model.optimizer.iterations)) == 0
    # Likewise the ranges: a model with no ActivationQuantizer at all.
    plain = keras.Sequential([keras.Input((4,)), L.Dense(2)])
    plain.compile("sgd", "mse")
    with pytest.raises(ValueError, match="holds no QuantizedHostBatchNorm"):
        plain.fit(x, y, batch_size=4, verbose=0, callbacks=[FreezeBatchNorm(2)])
    assert int(array(plain.optimizer.iterations)) == 0

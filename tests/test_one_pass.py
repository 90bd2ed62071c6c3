"""recalibrate's one pass (keras_bn/_recalibration/one_pass.py) against the per-layer method it
replaces, which stays as its reference: the same statistics to 1e-5 on every kind of model, with
the frontier in memory and spilled to disk, and the work and memory it reports. Under every
backend: tf.data pipelines where TensorFlow is installed, the compiled segments' tracing under
TensorFlow (under JAX and PyTorch the passes run eagerly)."""

import os
import tempfile
import weakref

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from helpers import assert_close
from keras_bn import population
from keras_bn._graph import bn_layers
from keras_bn._recalibration import hooks
from keras_bn._recalibration.batches import Batches
from keras_bn.callbacks import Recalibrate
from keras_bn.diagnostics import check_batchnorm

RTOL = 1e-5


def _data(shape, seed=0, loc=1.0, scale=2.0):
    return np.random.default_rng(seed).normal(loc, scale, size=shape).astype("float32")


def _counted_dataset():
    """A tf.data pipeline of three (16, 6) batches from a generator, and the list that gains
    one entry each time the pipeline starts reading the generator."""
    import tensorflow as tf

    calls = []

    def produce():
        calls.append(1)
        yield from (_data((16, 6), seed=i) for i in range(3))

    dataset = tf.data.Dataset.from_generator(
        produce, output_signature=tf.TensorSpec((None, 6), tf.float32)
    )
    return dataset, calls


def test_synchronized_must_be_a_bool_and_is_the_plain_call_in_one_process():
    """`synchronized` is checked (the callback when made); in one process, with no group of
    processes, it computes what the plain call computes (tests/test_torch_distributed.py
    runs it across processes)."""
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras_bn.BatchNormalization()(inputs))
    with pytest.raises(ValueError, match=r"synchronized='yes'"):
        keras_bn.recalibrate(model, _data((8, 3)), synchronized="yes")
    with pytest.raises(ValueError, match=r"synchronized=1"):
        Recalibrate(_data((8, 3)), synchronized=1)
    found = []
    for synchronized in (True, False):
        _randomize_statistics(model)
        keras_bn.recalibrate(model, _data((20, 3)), batch_size=8, synchronized=synchronized)
        found.append(_statistics(bn_layers.in_model(model)))
    for want, got in zip(*found):
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)


@pytest.mark.backends("tensorflow")
def test_synchronized_tf_workers_outside_their_strategy_are_refused(monkeypatch):
    """Under TF_CONFIG with two workers, recalibrate(synchronized=True) outside the scope of a
    strategy of several replicas is a ValueError saying where to call it, not one worker's
    shard's statistics taken as everyone's; the statistics are kept
    (test_distributed.py runs it within MultiWorkerMirroredStrategy)."""
    inputs = keras.Input((3,))
    model = _randomize_statistics(keras.Model(inputs, keras_bn.BatchNormalization()(inputs)))
    before = _statistics(bn_layers.in_model(model))
    cluster = '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": '
    monkeypatch.setenv("TF_CONFIG", cluster + '{"type": "worker", "index": 0}}')
    with pytest.raises(ValueError, match=r"naming 2 workers, outside the scope.*strategy"):
        keras_bn.recalibrate(model, _data((8, 3)), synchronized=True)
    for want, got in zip(before, _statistics(bn_layers.in_model(model))):
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)


def _randomize_statistics(model, seed=0):
    """Moving statistics far from the data's, so that recalibrating a BN changes what every
    layer downstream of it sees (an upstream BN left stale would show)."""
    rng = np.random.default_rng(seed)
    for layer in bn_layers.in_model(model):
        shape = layer.moving_mean.shape
        layer.moving_mean.assign(rng.normal(0.0, 2.0, shape).astype("float32"))
        layer.moving_variance.assign(rng.uniform(0.2, 3.0, shape).astype("float32"))
    return model


def _statistics(layers):
    return [[array(v) for v in layer.non_trainable_variables] for layer in layers]


def _compare(model, data, layers=None, batch_size=16, steps=None, max_memory=None):
    """Recalibrate `layers` (default: every BN) by the per-layer method, then, from the same
    starting statistics, by the one pass; assert the same statistics and reports; return the
    one pass's report. `data` may be a function that makes it (a generator, read once)."""
    layers = bn_layers.in_model(model) if layers is None else layers
    make = data if callable(data) else lambda: data
    with hooks.model_state(model):
        reference = population.recalibrate_per_layer(
            model, layers, Batches(make(), steps, batch_size), progress=False
        )
        expected = _statistics(layers)
    report = population.recalibrate_layers(
        model, layers, Batches(make(), steps, batch_size), False, max_memory
    )
    assert reference.strategy == "per_layer"
    assert report.strategy in ("one_pass", "one_pass_spilled")
    for layer, want, got in zip(layers, expected, _statistics(layers)):
        # A mean near 0 (after an upstream BN) is judged on the spread of its layer's input,
        # the scale its rounding follows, not on its own size.
        spread = np.sqrt(np.max(array(layer.moving_variance)))
        for variable, w, g in zip(layer.non_trainable_variables, want, got):
            if w.dtype.kind in "iu":  # num_batches_tracked
                np.testing.assert_array_equal(g, w, err_msg=layer.name)
            elif variable is layer.moving_mean:
                np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * spread, err_msg=layer.name)
            else:
                assert_close(g, w, RTOL)
    assert [c.name for c in report.layers] == [c.name for c in reference.layers]
    assert [c.batches_used for c in report.layers] == [c.batches_used for c in reference.layers]
    assert report.batches == reference.batches
    assert report.not_called == reference.not_called
    return report


def test_sequential_mlp():
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8),
            keras_bn.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dropout(0.5),  # off in both methods
            keras.layers.Dense(5),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3),
            keras_bn.BatchNormalization(),
        ]
    )
    report = _compare(_randomize_statistics(model), _data((70, 6)))  # 16 × 4 and a batch of 6
    assert report.strategy == "one_pass" and report.batches == 5


def test_cnn_both_layouts():
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(6, 3, padding="same")(inputs)
    h = keras_bn.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Permute((3, 1, 2))(h)  # channels first from here
    h = keras.layers.Conv2D(4, 3, data_format="channels_first")(h)
    h = keras_bn.BatchNormalization(axis=1)(h)
    h = keras.layers.GlobalAveragePooling2D(data_format="channels_first")(h)
    outputs = keras.layers.Dense(2)(keras.layers.BatchNormalization()(h))
    _compare(_randomize_statistics(keras.Model(inputs, outputs)), _data((40, 8, 8, 3)))


def _residual_net(image=8, width=4):
    """bench_model's small ResNet, with both BN classes, renorm and momentum=None mixed in."""
    norms = iter(
        [
            lambda: keras_bn.BatchNormalization(),
            lambda: keras.layers.BatchNormalization(),
            lambda: keras_bn.BatchNormalization(renorm=True),
            lambda: keras_bn.BatchNormalization(momentum=None),
            lambda: keras.layers.BatchNormalization(renorm=True),
        ]
        * 4
    )

    def conv_bn_relu(x, filters, strides=1, relu=True):
        x = keras.layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False)(x)
        x = next(norms)()(x)
        return keras.layers.ReLU()(x) if relu else x

    inputs = keras.Input((image, image, 3))
    x = conv_bn_relu(inputs, width)
    for stage, filters in enumerate((width, 2 * width, 2 * width)):
        strides = 2 if stage == 1 else 1
        shortcut = x
        y = conv_bn_relu(x, filters, strides)
        y = conv_bn_relu(y, filters, relu=False)
        if strides != 1 or shortcut.shape[-1] != filters:
            shortcut = keras.layers.Conv2D(filters, 1, strides=strides, use_bias=False)(shortcut)
            shortcut = next(norms)()(shortcut)
        x = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x))


def test_residual_net_with_both_classes_renorm_and_cumulative_layers():
    model = _residual_net()
    model(_data((4, 8, 8, 3)), training=True)  # renorm and momentum=None bookkeeping moves
    report = _compare(_randomize_statistics(model), _data((40, 8, 8, 3)))
    assert len(report.layers) == 8
    for layer in bn_layers.in_model(model):
        if getattr(layer, "moving_stddev", None) is not None:  # renorm, both classes
            expected = np.sqrt(array(layer.moving_variance) + layer.epsilon)
            assert_close(layer.moving_stddev, expected, 1e-6)
        if getattr(layer, "num_batches_tracked", None) is not None:
            assert int(array(layer.num_batches_tracked)) == 3
    # Each node that leads to a BN ran once per batch: less than one forward pass (the
    # pooling and Dense head after the last BN did not run).
    assert 0.8 < report.passes < 1.0


def test_nested_models_walked_through():
    """A Sequential and a Functional with BNs inside (one nested two deep), and a BN-free
    sub-model called twice: one pass, no fallback."""
    inner_most = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(5), keras_bn.BatchNormalization()], name="deep"
    )
    inner_inputs = keras.Input((6,))
    h = keras.layers.Dense(5)(inner_inputs)
    h = keras.layers.BatchNormalization()(h)
    functional = keras.Model(inner_inputs, [inner_most(h), h], name="functional_inner")
    sequential = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(6), keras_bn.BatchNormalization()], name="seq"
    )
    plain = keras.Sequential([keras.Input((5,)), keras.layers.Dense(5)], name="plain")
    inputs = keras.Input((4,))
    a, b = functional(sequential(inputs))
    h = keras.layers.Add()([plain(a), plain(b)])
    outputs = keras_bn.BatchNormalization(name="last")(h)
    model = _randomize_statistics(keras.Model(inputs, outputs))
    report = _compare(model, _data((48, 4)))
    assert [c.name for c in report.layers][-1] == "last" and len(report.layers) == 4
    assert report.strategy == "one_pass" and report.fallbacks == ()


def _several_inputs():
    """Inputs a and b, read at different depths: (inputs, outputs, data as a dict)."""
    a, b = keras.Input((2,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Concatenate()(
        [keras_bn.BatchNormalization()(keras.layers.Dense(4)(a)), keras.layers.Dense(3)(b)]
    )
    h = keras.layers.BatchNormalization()(h)
    late = keras.layers.Dense(7)(b)  # an input read only after the first BNs
    outputs = keras_bn.BatchNormalization()(keras.layers.Concatenate()([h, late]))
    data = {"a": _data((40, 2)), "b": _data((40, 3), seed=1)}
    return (a, b), outputs, data


def test_several_inputs_as_a_dict():
    (a, b), outputs, data = _several_inputs()
    _compare(_randomize_statistics(keras.Model({"a": a, "b": b}, outputs)), data)


@pytest.mark.requires_tensorflow  # a tf.data dataset
def test_several_inputs_as_a_list_from_a_dataset():
    import tensorflow as tf

    (a, b), outputs, data = _several_inputs()
    _compare(_randomize_statistics(keras.Model({"a": a, "b": b}, outputs)), data)
    listed = keras.Model([a, b], outputs)
    dataset = tf.data.Dataset.from_tensor_slices(((data["a"], data["b"]), np.zeros(40))).batch(16)
    _compare(listed, dataset)


def test_masks_reach_the_statistics():
    """Embedding(mask_zero) → Dense (passes the mask on) → BN: only real tokens count, as in
    the per-layer method; a Keras BN after pooling the masked sequence."""
    tokens = np.random.default_rng(0).integers(0, 6, size=(40, 7))
    tokens[::3, 4:] = 0  # padding
    inputs = keras.Input((7,), dtype="int32")
    h = keras.layers.Embedding(6, 4, mask_zero=True)(inputs)
    h = keras.layers.Dense(5)(h)
    h = keras_bn.BatchNormalization()(h)
    h = keras_bn.BatchNormalization(axis=1)(h)  # per time step: its own count per channel
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.BatchNormalization()(pooled)
    report = _compare(_randomize_statistics(keras.Model(inputs, outputs)), tokens)
    assert len(report.layers) == 3


class Block(keras.layers.Layer):
    """A custom layer whose call hides two BNs from the graph."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(5)
        self.bn = keras_bn.BatchNormalization(name="hidden")
        self.second = keras.layers.BatchNormalization(name="hidden_keras")

    def call(self, x, training=None):
        return self.second(keras.ops.relu(self.bn(self.dense(x), training=training)))


def test_bn_inside_a_custom_layer_falls_back_to_the_per_layer_method_there():
    inputs = keras.Input((6,))
    h = keras_bn.BatchNormalization(name="before")(keras.layers.Dense(5)(inputs))
    h = Block(name="block")(h)
    outputs = keras_bn.BatchNormalization(name="after")(keras.layers.Dense(4)(h))
    model = _randomize_statistics(keras.Model(inputs, outputs))
    report = _compare(model, _data((40, 6)))
    assert [c.name for c in report.layers] == ["before", "hidden", "hidden_keras", "after"]
    assert report.strategy == "one_pass"
    assert len(report.fallbacks) == 2
    assert report.fallbacks[0].startswith("block/hidden: inside 'block' (Block)")
    assert "per-layer method" in report.fallbacks[0] and "block/hidden" in str(report)


def test_a_tiny_budget_spills_the_frontier_and_removes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = _randomize_statistics(_residual_net())
    report = _compare(model, _data((40, 8, 8, 3)), max_memory=0)
    assert report.strategy == "one_pass_spilled"
    assert report.peak_frontier_bytes == 0 and report.spilled_bytes > 0
    # The spill folder is gone. (Autograph writes its converted functions to the temp folder
    # too, the first time in a process: run alone, this test saw them.)
    left = [p for p in tmp_path.iterdir() if not p.name.startswith("__autograph_generated")]
    assert left == []


def test_the_spill_folder_is_removed_when_it_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def fail_once_spilled(t):
        seen.append(os.listdir(tmp_path))  # traced in the second segment, after a spill
        raise RuntimeError("boom")

    inputs = keras.Input((6,))
    h = keras_bn.BatchNormalization()(keras.layers.Dense(5)(inputs))
    h = keras.layers.Lambda(fail_once_spilled, output_shape=(5,))(h)
    model = keras.Model(inputs, keras_bn.BatchNormalization()(h))
    with pytest.raises(RuntimeError, match="boom"):
        keras_bn.recalibrate(model, _data((32, 6)), batch_size=16, progress=False, max_memory=0)
    assert seen and seen[0]  # the folder existed while it ran
    assert list(tmp_path.iterdir()) == []


def test_frontier_bytes_and_passes_are_what_was_kept_and_run():
    """Dense(5) → BN → Dense(4) → BN over 4 batches of 16: the frontier between the two
    segments is the first BN's input, 16 × 5 float32 per batch; of it a budget of 700 bytes
    holds 2 batches and spills 2."""
    inputs = keras.Input((6,))
    h = keras_bn.BatchNormalization()(keras.layers.Dense(5)(inputs))
    model = keras.Model(inputs, keras_bn.BatchNormalization()(keras.layers.Dense(4)(h)))
    x = _data((64, 6))
    report = keras_bn.recalibrate(model, x, batch_size=16, progress=False)
    assert report.strategy == "one_pass"
    assert report.peak_frontier_bytes == 4 * 16 * 5 * 4 and report.spilled_bytes == 0
    assert report.passes == 0.75  # 3 of the 4 nodes: the last BN's output is not needed
    spilled = _compare(model, x, max_memory=700)
    assert spilled.strategy == "one_pass_spilled"
    assert spilled.peak_frontier_bytes == 2 * 320 and spilled.spilled_bytes == 2 * 320
    assert "spilled to disk" in str(spilled)


@pytest.mark.requires_tensorflow  # a tf.data pipeline
def test_data_is_read_once_by_the_one_pass():
    """A tf.data pipeline from a generator: the one pass reads it once, the per-layer method
    once per BN layer; a one-shot generator is read once by either."""
    dataset, calls = _counted_dataset()
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(5), keras_bn.BatchNormalization()]
        + [keras.layers.Dense(5), keras.layers.BatchNormalization()] * 1
    )
    _compare(_randomize_statistics(model), dataset)
    # The per-layer method's first (tracing) batch and its two passes, then the one pass.
    assert len(calls) == 4
    _compare(model, lambda: (_data((16, 6), seed=i) for i in range(3)))


def test_frozen_layers_are_recalibrated_by_recalibrate_and_kept_by_the_callback():
    """A frozen BN (trainable=False) inside a nested backbone: `recalibrate` does it too; the
    callback's subset (the trainable BNs) leaves it as it is and runs the backbone as a layer,
    and the BNs after it match the per-layer method's for that subset."""
    backbone = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(5), keras.layers.BatchNormalization()],
        name="backbone",
    )
    backbone.layers[-1].trainable = False
    inputs = keras.Input((6,))
    h = keras_bn.BatchNormalization(name="head_bn")(keras.layers.Dense(4)(backbone(inputs)))
    model = _randomize_statistics(keras.Model(inputs, keras.layers.Dense(1)(h)))
    x = _data((48, 6))
    frozen = backbone.layers[-1]
    with hooks.model_state(model):
        report = _compare(model, x)
        assert report.layers[0].name == frozen.name
    trainable = [layer for layer in bn_layers.in_model(model) if layer.trainable]
    before = array(frozen.moving_variance)
    report = _compare(model, x, layers=trainable)
    np.testing.assert_array_equal(array(frozen.moving_variance), before)
    assert [c.name for c in report.layers] == ["head_bn"]
    # The callback runs this subset (and reports the one pass).
    callback = Recalibrate(x, batch_size=16)
    callback.set_model(model)
    callback.on_train_end()
    assert callback.last_report.strategy == "one_pass"
    np.testing.assert_array_equal(array(frozen.moving_variance), before)


def test_shared_bn_raises_as_before():
    inputs = keras.Input((3,))
    shared = keras_bn.BatchNormalization(name="shared")
    model = keras.Model(inputs, shared(keras.layers.Dense(3)(shared(inputs))))
    with pytest.raises(ValueError, match="'shared' is called more than once"):
        keras_bn.recalibrate(model, _data((8, 3)), progress=False)
    block = keras.Sequential([keras.Input((3,)), keras_bn.BatchNormalization(name="in_block")])
    model = keras.Model(inputs, block(block(inputs)))
    with pytest.raises(ValueError, match="'in_block' is called more than once"):
        keras_bn.recalibrate(model, _data((8, 3)), progress=False)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(4)
        self.bn = keras_bn.BatchNormalization()
        self.second = keras.layers.BatchNormalization()

    def call(self, x, training=None):
        return self.second(self.dense(self.bn(x, training=training)), training=training)


def test_subclassed_models_keep_the_per_layer_method():
    model = Subclassed()
    model(_data((4, 3)))
    report = keras_bn.recalibrate(model, _data((32, 3)), batch_size=16, progress=False)
    assert report.strategy == "per_layer" and report.passes == 2.0
    assert report.peak_frontier_bytes == 0
    # A generator is held in memory for its two passes: the same statistics as from a list
    # (they do not depend on the starting ones).
    batches = [_data((16, 3), seed=i) for i in range(2)]
    keras_bn.recalibrate(model, batches, progress=False)
    from_list = _statistics(bn_layers.in_model(model))
    _randomize_statistics(model, seed=1)
    report = keras_bn.recalibrate(model, (b for b in batches), progress=False)
    assert report.strategy == "per_layer" and report.batches == 2
    for want, got in zip(from_list, _statistics(bn_layers.in_model(model))):
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)


def test_a_generator_is_streamed_by_the_one_pass_not_held():
    """The one pass reads a generator once and keeps none of its batches: when batch i is
    made, at most the two before it are still alive (the pipeline's generators hold the last
    one until they advance); holding them all, as the per-layer method must, would keep every
    one. The statistics are the per-layer method's."""
    batches = [_data((16, 6), seed=i) for i in range(6)]
    alive = []

    def produce():
        made = []
        for batch in batches:
            alive.append(sum(ref() is not None for ref in made))
            copy = batch.copy()
            made.append(weakref.ref(copy))
            yield copy
            del copy

    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(5), keras_bn.BatchNormalization()]
        + [keras.layers.Dense(5), keras.layers.BatchNormalization()]
    )
    _randomize_statistics(model)
    with hooks.model_state(model):
        population.recalibrate_per_layer(
            model, bn_layers.in_model(model), Batches(batches, None, 16), False
        )
        expected = _statistics(bn_layers.in_model(model))
    report = keras_bn.recalibrate(model, produce(), progress=False)
    assert report.strategy == "one_pass" and report.batches == 6
    assert len(alive) == 6 and max(alive) <= 2, alive
    for want, got in zip(expected, _statistics(bn_layers.in_model(model))):
        for w, g in zip(want, got):
            assert_close(g, w, RTOL)


def test_max_memory_must_be_bytes():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras_bn.BatchNormalization()(inputs))
    with pytest.raises(ValueError, match=r"max_memory=-1"):
        keras_bn.recalibrate(model, _data((8, 3)), max_memory=-1)
    with pytest.raises(ValueError, match=r"max_memory='1GB'"):
        keras_bn.recalibrate(model, _data((8, 3)), max_memory="1GB")
    with pytest.raises(ValueError, match=r"max_memory=1.5"):
        keras_bn.recalibrate(model, _data((8, 3)), max_memory=1.5)
    with pytest.raises(ValueError, match=r"max_memory=True"):
        keras_bn.recalibrate(model, _data((8, 3)), max_memory=True)
    # The callback refuses it when made, not at the end of training.
    with pytest.raises(ValueError, match=r"max_memory=-5"):
        Recalibrate(_data((8, 3)), max_memory=-5)


@pytest.mark.backends("tensorflow")  # the segments' tf.function tracing counts
def test_the_callback_runs_the_one_pass_and_traces_it_once(tmp_path, monkeypatch):
    """`Recalibrate(before_validation=True)` in `fit`: every recalibration is the one pass
    (spilled under a tiny `max_memory`, its folder removed), and the segments compiled for the
    first are kept on the model and not traced again for the next epochs."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(5), keras_bn.BatchNormalization()]
        + [keras.layers.Dense(4), keras.layers.BatchNormalization(), keras.layers.Dense(1)]
    )
    model.compile("sgd", "mse")
    x, y = _data((32, 6)), _data((32, 1))
    reports = []

    class Keep(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            reports.append(callback.last_report)
            assert os.listdir(tmp_path) == []  # removed after each recalibration

    callback = Recalibrate(x, batch_size=16, before_validation=True, max_memory=0)
    model.fit(x, y, epochs=3, validation_data=(x, y), callbacks=[callback, Keep()], verbose=0)
    assert [r.strategy for r in reports] == ["one_pass_spilled"] * 3
    assert callback.last_report.strategy == "one_pass_spilled"
    (compiled,) = model.__dict__["_keras_bn_recalibration"].plans
    assert [f.experimental_get_tracing_count() for f in compiled._functions] == [1, 1]
    # The final statistics are the per-layer method's for the final weights.
    _compare(model, x)


@pytest.mark.requires_tensorflow  # a tf.data pipeline
def test_check_batchnorm_reads_the_data_once_whatever_the_bn_count():
    """check_batchnorm measures each BN's input under the statistics it has (no
    recalibration): one inference pass (and one training-mode pass) per batch, so a dataset
    is read once for 6 BN layers as for one."""
    dataset, calls = _counted_dataset()
    layers = [keras.Input((6,))]
    for _ in range(6):
        layers += [keras.layers.Dense(6), keras_bn.BatchNormalization()]
    model = keras.Sequential(layers)
    findings = check_batchnorm(model, dataset)
    assert {f.kind for f in findings} >= {"stale_statistics"}
    assert len(calls) == 1


def test_a_subclassed_model_inside_a_functional_one_falls_back_there_only():
    inner = Subclassed()
    inputs = keras.Input((3,))
    h = keras_bn.BatchNormalization(name="outer_first")(keras.layers.Dense(3)(inputs))
    outputs = keras_bn.BatchNormalization(name="outer_last")(inner(h))
    model = _randomize_statistics(keras.Model(inputs, outputs))
    report = _compare(model, _data((40, 3)))
    assert report.strategy == "one_pass" and len(report.layers) == 4
    assert len(report.fallbacks) == 2
    assert all(f.startswith(f"{inner.name}/") for f in report.fallbacks)
    assert "(Subclassed)" in report.fallbacks[0]
    # The outer graph runs once; the subclassed model once more per BN inside it.
    assert 1.0 < report.passes < 3.0


def test_a_nested_sequential_edited_after_a_recalibration_is_walked_anew():
    """The plan kept on the model from a first recalibration walked the nested Sequential's
    graph of then: after the Sequential's Dense is replaced (pop, add, the same BN put back),
    the next recalibration must run the new graph, as the model does, not the kept one."""
    backbone = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(5), keras_bn.BatchNormalization(name="inner")],
        name="backbone",
    )
    inputs = keras.Input((4,))
    h = keras.layers.Dense(5)(keras_bn.BatchNormalization(name="first")(inputs))
    h = keras.layers.Dense(3, bias_initializer="ones")(backbone(h))  # means away from 0
    model = keras.Model(inputs, keras_bn.BatchNormalization(name="last")(h))
    x = _data((40, 4))
    _compare(_randomize_statistics(model), x)
    inner = backbone.layers[-1]
    backbone.pop()
    backbone.pop()
    backbone.add(keras.layers.Dense(5, bias_initializer="ones"))
    backbone.add(inner)
    report = _compare(_randomize_statistics(model, seed=1), x)
    assert report.strategy == "one_pass" and len(report.layers) == 3


def _failing_on_call(number):
    """An identity function for a Lambda layer that raises when it runs for the `number`-th
    time (at run time: in a compiled function as eagerly; under JAX and PyTorch the passes
    run eagerly)."""
    calls = []

    def count(value):
        calls.append(1)
        if len(calls) == number:
            raise RuntimeError(f"call {number}")
        return value

    def identity(x):
        if keras.backend.backend() != "tensorflow":
            return count(x)
        import tensorflow as tf

        y = tf.py_function(count, [x], x.dtype)
        y.set_shape(x.shape)
        return y

    return identity


@pytest.mark.parametrize("method", ["one_pass", "one_pass_spilled", "per_layer"])
def test_a_failure_part_way_leaves_every_statistic_as_it_was(method, tmp_path, monkeypatch):
    """The model raises after the first BN was set, while the second BN's batches go through
    (the one pass: on the third batch; the per-layer method, whose first pass runs the whole
    model on the 4 batches, on the second batch of its second pass): the error comes out and
    the first BN is put back (no model half recalibrated); the spill folder is gone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    inputs = keras.Input((6,))
    h = keras_bn.BatchNormalization(name="first")(keras.layers.Dense(5)(inputs))
    failing = _failing_on_call(6 if method == "per_layer" else 3)
    h = keras.layers.Lambda(failing, output_shape=(5,))(h)
    h = keras.layers.BatchNormalization(renorm=True, name="second")(keras.layers.Dense(4)(h))
    model = _randomize_statistics(keras.Model(inputs, h))
    layers = bn_layers.in_model(model)
    before = _statistics(layers)
    with pytest.raises(Exception, match=r"call [36]"):
        if method == "per_layer":
            population.recalibrate_per_layer(
                model, layers, Batches(_data((64, 6)), None, 16), False
            )
        else:
            budget = 0 if method == "one_pass_spilled" else None
            keras_bn.recalibrate(
                model, _data((64, 6)), batch_size=16, progress=False, max_memory=budget
            )
    for want, got in zip(before, _statistics(layers)):
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)
    # (the per-layer method's autograph leaves its generated code there)
    assert [p for p in tmp_path.iterdir() if p.name.startswith("keras_bn_recalibrate_")] == []


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_inputs_raise_and_change_nothing(bad):
    """A NaN or inf in the data makes the pooled statistics of every BN after it NaN; both
    methods refuse to write them, naming the layer, the batch and the channels, and leave
    the statistics as they were."""
    model = keras.Sequential(
        [keras.Input((6,)), keras_bn.BatchNormalization(name="first")]
        + [keras.layers.Dense(4), keras.layers.BatchNormalization(name="second")]
    )
    layers = bn_layers.in_model(_randomize_statistics(model))
    x = _data((48, 6))
    x[20, 2] = bad  # batch 1, channel 2 of the first BN
    before = _statistics(layers)
    pattern = r"layer 'first'.* batch 1 of `data`.*NaN or inf.*channels \[2\]"
    with pytest.raises(ValueError, match=pattern):
        keras_bn.recalibrate(model, x, batch_size=16, progress=False)
    with pytest.raises(ValueError, match=pattern):
        population.recalibrate_per_layer(model, layers, Batches(x, None, 16), False)
    for want, got in zip(before, _statistics(layers)):
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)


def test_a_stateful_rnn_is_refused_and_keeps_its_state():
    """A stateful LSTM carries its state from batch to batch: the second BN's input would
    depend on how often the batches ran (the two methods disagreed, and both moved the
    state). Refused, naming the layer, with nothing changed."""
    inputs = keras.Input((4, 3), batch_size=8)
    h = keras_bn.BatchNormalization()(inputs)
    h = keras.layers.LSTM(4, stateful=True, return_sequences=True, name="carried")(h)
    model = keras.Model(inputs, keras.layers.BatchNormalization()(h))
    model(_data((8, 4, 3)))  # a state away from zero
    before = [array(v) for v in model.variables]
    with pytest.raises(ValueError, match=r"layer 'carried' \(LSTM\) is stateful"):
        keras_bn.recalibrate(model, _data((32, 4, 3)), batch_size=8, progress=False)
    for want, variable in zip(before, model.variables):
        np.testing.assert_array_equal(array(variable), want)

"""keras_bn.recalibrate: Algorithm 2's population statistics against numpy, layer by layer with
upstream layers in inference mode; and a measurable gain over the moving average. Under every
backend (tf.data datasets where TensorFlow is installed)."""

import os
import re
import sys

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from helpers import assert_close

EPS = 1e-3


def _data(shape, seed=0, loc=2.0, scale=3.0):
    return np.random.default_rng(seed).normal(loc, scale, size=shape).astype("float32")


def _two_bn_model(second_bn):
    """Dense → keras_bn BN → ReLU → Dropout → Dense → `second_bn`, weights randomized."""
    inputs = keras.Input((6,))
    h = keras.layers.Dense(5, name="dense_1")(inputs)
    h = keras_bn.BatchNormalization(name="bn_1")(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Dropout(0.5)(h)  # must be off while recalibrating
    h = keras.layers.Dense(4, name="dense_2")(h)
    outputs = second_bn(name="bn_2")(h)
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(3)
    model.set_weights([rng.uniform(0.5, 1.5, w.shape).astype("float32") for w in model.weights])
    return model


def _numpy_population(batches, unbiased):
    """Algorithm 2 for equal batches: mean of μ_B, (m/(m−1)·) mean of biased σ²_B."""
    means = np.stack([b.mean(axis=0) for b in batches])
    variances = np.stack([b.var(axis=0) for b in batches])
    m = batches[0].shape[0]
    factor = m / (m - 1) if unbiased else 1.0
    return means.mean(axis=0), factor * variances.mean(axis=0)


def _numpy_inference_bn(h, layer):
    gamma, beta, mean, var = [array(w).astype(np.float64) for w in layer.weights[:4]]
    return gamma * (h - mean) / np.sqrt(var + layer.epsilon) + beta


@pytest.mark.parametrize(
    "second_bn,unbiased",
    [(keras_bn.BatchNormalization, True), (keras.layers.BatchNormalization, False)],
    ids=["keras_bn", "keras"],
)
def test_two_bn_network_matches_numpy(second_bn, unbiased):
    model = _two_bn_model(second_bn)
    x = _data((64, 6))
    batches = np.split(x.astype(np.float64), 4)
    trainable_before = [array(w) for w in model.trainable_weights]
    w1, b1 = [array(w).astype(np.float64) for w in model.get_layer("dense_1").weights]
    w2, b2 = [array(w).astype(np.float64) for w in model.get_layer("dense_2").weights]
    bn_1, bn_2 = model.get_layer("bn_1"), model.get_layer("bn_2")

    report = keras_bn.recalibrate(model, x, batch_size=16, progress=False)

    # bn_1 sees Dense(x); keras_bn's convention is unbiased.
    pre_1 = [b @ w1 + b1 for b in batches]
    mean_1, var_1 = _numpy_population(pre_1, unbiased=True)
    assert_close(bn_1.moving_mean, mean_1, 1e-5)
    assert_close(bn_1.moving_variance, var_1, 1e-5)
    # bn_2 sees the inference-mode network upstream: bn_1 with its *new* statistics, and no
    # dropout.
    pre_2 = [np.maximum(_numpy_inference_bn(h, bn_1), 0.0) @ w2 + b2 for h in pre_1]
    mean_2, var_2 = _numpy_population(pre_2, unbiased=unbiased)
    assert_close(bn_2.moving_mean, mean_2, 1e-5)
    assert_close(bn_2.moving_variance, var_2, 1e-5)

    for before, after in zip(trainable_before, model.trainable_weights):
        np.testing.assert_array_equal(before, after)
    assert [c.name for c in report.layers] == ["bn_1", "bn_2"]
    assert [c.convention for c in report.layers] == [
        "unbiased",
        "unbiased" if unbiased else "biased",
    ]
    assert report.batches == 4
    assert_close(report.layers[0].mean_change, mean_1 - report.layers[0].old_mean, 1e-5)
    assert_close(report.layers[1].new_variance, var_2, 1e-5)
    assert "bn_2" in str(report)


def test_unequal_batches_are_pooled_by_count():
    """A smaller last batch: Σm·μ/Σm and Σm·σ²/Σ(m−1), which is Algorithm 2 for equal m."""
    inputs = keras.Input((3,))
    bn = keras_bn.BatchNormalization()
    model = keras.Model(inputs, bn(inputs))
    x = _data((40, 3))
    keras_bn.recalibrate(model, x, batch_size=16, progress=False)  # batches of 16, 16, 8
    parts = np.split(x.astype(np.float64), [16, 32])
    counts = np.array([len(p) for p in parts], dtype=np.float64)
    mean = sum(len(p) * p.mean(axis=0) for p in parts) / counts.sum()
    var = sum(len(p) * p.var(axis=0) for p in parts) / (counts - 1).sum()
    assert_close(bn.moving_mean, mean, 1e-6)
    assert_close(bn.moving_variance, var, 1e-6)


@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
@pytest.mark.parametrize("case", ["mean_1e4_std_1e-2", "outlying_shift_samples"])
def test_statistics_stay_exact_where_float32_sums_cancel(layout, case):
    """Each BN input's moments are one-read shifted sums (backend/tensorflow/xla.py) about a shift K
    taken from a few samples at the first spatial position. Far from zero (mean 1e4, std
    1e-2), and where those samples lie far out (a bright corner pixel: K ~30σ from the mean,
    so the sums are redone about the mean), Algorithm 2's statistics still match float64
    numpy. Odd sizes: no group divides the batch (it is padded)."""
    rng = np.random.default_rng(5)
    shape = (30, 31, 33, 3) if layout == "channels_last" else (30, 3, 31, 33)
    corner = (slice(None), 0, 0) if layout == "channels_last" else (slice(None), slice(None), 0, 0)
    if case == "mean_1e4_std_1e-2":
        x = 1e4 + 1e-2 * rng.normal(size=shape)
    else:
        x = rng.normal(size=shape)
        x[corner] += 1e3
    x = x.astype("float32")
    inputs = keras.Input(shape[1:])
    bn = keras_bn.BatchNormalization(axis=-1 if layout == "channels_last" else 1)
    model = keras.Model(inputs, bn(inputs))
    keras_bn.recalibrate(model, x, batch_size=10, progress=False)
    reduced = (0, 1, 2) if layout == "channels_last" else (0, 2, 3)
    batches = np.split(x.astype(np.float64), 3)
    m = x[:10].size // 3
    mean = np.mean([b.mean(axis=reduced) for b in batches], axis=0)
    variance = np.mean([b.var(axis=reduced) for b in batches], axis=0) * m / (m - 1)
    assert_close(bn.moving_mean, mean, 1e-6)
    assert_close(bn.moving_variance, variance, 1e-6)


def test_batches_with_at_most_one_value_per_channel_are_skipped():
    """As in training, where such a batch outputs β and moves no statistic: a last batch of
    one sample, or a mask that leaves one token, has no variance and is left out (it used to
    raise, which crashed `fit` at its end through the Recalibrate callback)."""
    inputs = keras.Input((3,))
    bn = keras_bn.BatchNormalization()
    model = keras.Model(inputs, bn(inputs))
    x = _data((9, 3))
    report = keras_bn.recalibrate(model, x, batch_size=4, progress=False)  # 4, 4 and 1
    assert report.batches == 3 and report.layers[0].batches_used == 2
    parts = np.split(x[:8].astype(np.float64), 2)
    assert_close(bn.moving_mean, np.mean([p.mean(axis=0) for p in parts], axis=0), 1e-6)
    assert_close(bn.moving_variance, np.mean([p.var(axis=0) for p in parts], axis=0) * 4 / 3, 1e-6)

    tokens = np.array([[3, 5, 2, 0], [4, 1, 0, 0], [2, 0, 0, 0], [0, 0, 0, 0]])
    token_inputs = keras.Input((4,), dtype="int32")
    embedding = keras.layers.Embedding(8, 3, mask_zero=True)
    masked_bn = keras_bn.BatchNormalization()
    masked = keras.Model(token_inputs, masked_bn(embedding(token_inputs)))
    keras_bn.recalibrate(masked, [tokens[:2], tokens[2:]], progress=False)  # 5 tokens, 1
    vectors = array(embedding(tokens[:2])).astype(np.float64)[tokens[:2] != 0]
    assert_close(masked_bn.moving_mean, vectors.mean(axis=0), 1e-5)
    assert_close(masked_bn.moving_variance, vectors.var(axis=0, ddof=1), 1e-5)


class OneLayerModel(keras.Model):
    """A subclassed model around one layer: recalibrated by the per-layer method."""

    def __init__(self, layer):
        super().__init__()
        self.inner = layer

    def call(self, x):
        return self.inner(x)


@pytest.mark.parametrize("subclassed", [False, True], ids=["one_pass", "per_layer"])
@pytest.mark.parametrize("shape", [(3,), (5, 7, 3)], ids=["rank2", "rank4"])
def test_an_empty_batch_is_skipped(shape, subclassed):
    """A batch of no sample whose shape is known when traced (the first batch a generator
    yields, say) has m = 0: skipped like a batch of one, not an error of the moments'
    shift estimate (which took its first sample)."""
    bn = keras_bn.BatchNormalization()
    if subclassed:
        model = OneLayerModel(bn)
        model(_data((2, *shape)))
    else:
        inputs = keras.Input(shape)
        model = keras.Model(inputs, bn(inputs))
    x = _data((6, *shape))
    report = keras_bn.recalibrate(model, [x[:0], x], progress=False)
    assert report.strategy == ("per_layer" if subclassed else "one_pass")
    assert report.batches == 2 and report.layers[0].batches_used == 1
    values = x.astype(np.float64).reshape(-1, 3)
    assert_close(bn.moving_mean, values.mean(axis=0), 1e-6)
    assert_close(bn.moving_variance, values.var(axis=0, ddof=1), 1e-6)


def test_named_inputs_as_a_dict_of_arrays():
    """A model with named inputs takes `data` as `fit` does, a dict of arrays, split into
    batches like an array (a dict was iterated as its keys and failed inside Keras)."""
    a, b = keras.Input((2,), name="a"), keras.Input((3,), name="b")
    bn = keras_bn.BatchNormalization()
    model = keras.Model({"a": a, "b": b}, bn(keras.layers.Concatenate()([a, b])))
    data = {"a": _data((40, 2)), "b": _data((40, 3), seed=1)}
    report = keras_bn.recalibrate(model, data, batch_size=16, progress=False)
    assert report.batches == 3  # 16, 16 and 8
    parts = np.split(np.concatenate([data["a"], data["b"]], axis=1).astype(np.float64), [16, 32])
    m = np.array([len(p) for p in parts], dtype=np.float64)
    assert_close(bn.moving_mean, sum(len(p) * p.mean(axis=0) for p in parts) / m.sum(), 1e-6)
    assert_close(
        bn.moving_variance, sum(len(p) * p.var(axis=0) for p in parts) / (m - 1).sum(), 1e-6
    )
    findings = keras_bn.diagnostics.check_batchnorm(model, data, batch_size=16)
    assert [f.kind for f in findings] == ["unfoldable"]  # it feeds the model output
    with pytest.raises(ValueError, match=r"one length .* lengths \{'a': 40, 'b': 39\}"):
        keras_bn.recalibrate(model, {"a": data["a"], "b": data["b"][:39]}, progress=False)


@pytest.mark.requires_tensorflow  # a tf.data dataset
def test_nested_models_dataset_and_conv_layout():
    """A keras_bn BN inside a nested Sequential, channels-first conv features, (x, y) dataset."""
    inner = keras.Sequential(
        [
            keras.Input((2, 5, 5)),
            keras.layers.Conv2D(3, 3, data_format="channels_first", name="conv"),
            keras_bn.BatchNormalization(axis=1, name="inner_bn"),
        ],
        name="inner",
    )
    inputs = keras.Input((2, 5, 5))
    model = keras.Model(inputs, keras.layers.Flatten()(inner(inputs)))
    x = _data((24, 2, 5, 5))
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, np.zeros(24))).batch(8)
    keras_bn.recalibrate(model, dataset, progress=False)
    features = array(inner.get_layer("conv")(x)).astype(np.float64)
    batches = np.split(features, 3)
    means = np.stack([b.mean(axis=(0, 2, 3)) for b in batches])
    variances = np.stack([b.var(axis=(0, 2, 3)) for b in batches])
    m = 8 * 3 * 3
    bn = inner.get_layer("inner_bn")
    assert_close(bn.moving_mean, means.mean(axis=0), 1e-5)
    assert_close(bn.moving_variance, m / (m - 1) * variances.mean(axis=0), 1e-5)


def test_iterator_and_steps():
    """A one-shot generator is read once and replayed for each layer; steps limits it."""
    model = _two_bn_model(keras_bn.BatchNormalization)
    x = _data((64, 6))
    from_array = keras_bn.recalibrate(model, x[:32], batch_size=16, progress=False)
    from_gen = keras_bn.recalibrate(
        model, (x[i : i + 16] for i in range(0, 64, 16)), steps=2, progress=False
    )
    assert from_gen.batches == 2
    for a, b in zip(from_array.layers, from_gen.layers):
        assert_close(b.new_mean, a.new_mean, 1e-6)
        assert_close(b.new_variance, a.new_variance, 1e-6)


def test_progress_bar_is_rich_and_needs_no_tqdm(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now raises ImportError
    model = _two_bn_model(keras_bn.BatchNormalization)
    keras_bn.recalibrate(model, _data((32, 6)), batch_size=16, progress=True)
    err = capsys.readouterr().err
    assert "4/4" in err and "━" in err  # 2 layers × 2 batches, in rich's bar
    assert "recalibrate bn_2" in err  # the layer being recalibrated
    keras_bn.recalibrate(model, _data((32, 6)), batch_size=16, progress=False)
    assert capsys.readouterr().err == ""


def test_dependencies_name_rich_not_tqdm():
    import tomllib  # Python 3.11+, like the CI machine

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"].values()
    requirements = project["dependencies"] + [r for extra in extras for r in extra]
    names = [re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements]
    assert "tqdm" not in names
    assert any(r.startswith("rich") for r in project["dependencies"])


def test_errors_name_the_problem():
    inputs = keras.Input((3,))
    with pytest.raises(ValueError, match="no BatchNormalization"):
        keras_bn.recalibrate(keras.Model(inputs, keras.layers.Dense(2)(inputs)), _data((8, 3)))
    shared = keras_bn.BatchNormalization()
    model = keras.Model(inputs, shared(shared(inputs)))
    with pytest.raises(ValueError, match="called more than once"):
        keras_bn.recalibrate(model, _data((8, 3)), progress=False)
    model = keras.Model(inputs, keras_bn.BatchNormalization(name="bn")(inputs))
    with pytest.raises(
        ValueError,
        match=r"no batch of `data` gives layer 'bn' at least 2 "
        r"values per channel \(m ≤ 1 in all 3 batches\)",
    ):
        keras_bn.recalibrate(model, _data((3, 3)), batch_size=1, progress=False)
    with pytest.raises(ValueError, match="steps=0"):
        keras_bn.recalibrate(model, _data((8, 3)), steps=0)


@pytest.mark.requires_tensorflow  # a tf.data dataset
def test_an_infinite_dataset_is_a_value_error():
    import tensorflow as tf

    inputs = keras.Input((3,))  # test_errors_name_the_problem's model
    model = keras.Model(inputs, keras_bn.BatchNormalization(name="bn")(inputs))
    with pytest.raises(ValueError, match="infinite"):
        keras_bn.recalibrate(model, tf.data.Dataset.from_tensors(_data((8, 3))).repeat())


def _normalization_error(model, x):
    """Σ over BN layers and channels of mean(z)² + (var(z) − 1)², with z the inference-mode
    input of each BN standardized by its moving statistics, over the whole data. Zero means
    the statistics describe the data exactly; inputs come from a separate feature model."""
    bns = [layer for layer in model.layers if isinstance(layer, keras_bn.BatchNormalization)]
    features = keras.Model(model.inputs[0], [bn.input for bn in bns])(x, training=False)
    error = 0.0
    for bn, h in zip(bns, features):
        h = array(h).astype(np.float64).reshape(-1, h.shape[-1])
        z = (h - array(bn.moving_mean)) / np.sqrt(array(bn.moving_variance))
        error += float((z.mean(axis=0) ** 2).sum() + ((z.var(axis=0) - 1.0) ** 2).sum())
    return error


def test_recalibration_beats_the_moving_average_on_a_small_batch_model():
    """Batches of 4 and fast-changing weights: the moving average lags; Algorithm 2 does not."""
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, (512, 8)).astype("float32")
    y = (x[:, :1] * x[:, 1:2] > 0).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16),
            keras_bn.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(16),
            keras_bn.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=True)
    before = _normalization_error(model, x)
    keras_bn.recalibrate(model, x, batch_size=4, progress=False)
    after = _normalization_error(model, x)
    print(f"normalization error: moving average {before:.4g}, recalibrated {after:.4g}")
    assert after < 0.1 * before, (before, after)


def test_renorm_and_cumulative_bookkeeping_follow():
    """moving_stddev stays √(moving_variance + ε); momentum=None's counter becomes the
    number of batches the new average stands for."""
    inputs = keras.Input((3,))
    bn = keras_bn.BatchNormalization(renorm=True, momentum=None)
    model = keras.Model(inputs, bn(inputs))
    model(_data((8, 3)), training=True)
    renorm_before = [array(bn.renorm_mean), array(bn.renorm_stddev)]
    keras_bn.recalibrate(model, _data((48, 3), seed=1), batch_size=16, progress=False)
    assert_close(bn.moving_stddev, np.sqrt(array(bn.moving_variance) + EPS), 1e-6)
    assert int(array(bn.num_batches_tracked)) == 3
    for before, after in zip(renorm_before, [bn.renorm_mean, bn.renorm_stddev]):
        np.testing.assert_array_equal(before, after)


def test_masked_inputs_use_unmasked_values_only():
    """A Keras mask (Embedding(mask_zero=True)) reaches the hook: only real tokens count."""
    tokens = np.array([[3, 5, 2, 0], [4, 1, 0, 0], [2, 2, 2, 1], [6, 0, 0, 0]])
    inputs = keras.Input((4,), dtype="int32")
    embedding = keras.layers.Embedding(8, 3, mask_zero=True)
    bn = keras_bn.BatchNormalization()
    model = keras.Model(inputs, bn(embedding(inputs)))
    keras_bn.recalibrate(model, [tokens[:2], tokens[2:]], progress=False)
    vectors = array(embedding(tokens)).astype(np.float64)
    parts = [vectors[:2][tokens[:2] != 0], vectors[2:][tokens[2:] != 0]]  # 5 and 5 tokens
    counts = np.array([len(p) for p in parts], dtype=np.float64)
    mean = sum(len(p) * p.mean(axis=0) for p in parts) / counts.sum()
    var = sum(len(p) * p.var(axis=0) for p in parts) / (counts - 1).sum()
    assert_close(bn.moving_mean, mean, 1e-5)
    assert_close(bn.moving_variance, var, 1e-5)


class TwoBranchModel(keras.Model):
    """Subclassed: `used` then `second` are called, `unused` is never reached."""

    def __init__(self):
        super().__init__(name="two_branch")
        self.used = keras_bn.BatchNormalization(name="used")
        self.second = keras.layers.BatchNormalization(name="second")
        self.unused = keras_bn.BatchNormalization(name="unused")
        self.unused.build((None, 3))

    def call(self, x, training=None):
        # training=True in the model's own code: recalibrate still runs `used` in inference
        # mode, so `second` sees its inference-time input.
        return self.second(self.used(x, training=True), training=training)


def test_subclassed_model_and_layers_not_called():
    model = TwoBranchModel()
    model(_data((4, 3)))
    x = _data((32, 3))
    report = keras_bn.recalibrate(model, x, batch_size=16, progress=False)
    assert report.not_called == ("unused",)
    assert [c.name for c in report.layers] == ["used", "second"]
    batches = np.split(x.astype(np.float64), 2)
    mean, var = _numpy_population(batches, unbiased=True)
    assert_close(model.used.moving_mean, mean, 1e-6)
    assert_close(model.used.moving_variance, var, 1e-6)
    normalized = [_numpy_inference_bn(b, model.used) for b in batches]
    mean_2, var_2 = _numpy_population(normalized, unbiased=False)
    np.testing.assert_allclose(model.second.moving_mean, mean_2, rtol=0, atol=1e-5)  # ~0
    assert_close(model.second.moving_variance, var_2, 1e-5)
    np.testing.assert_array_equal(model.unused.moving_variance, np.ones(3))


def test_mobilenet_v2_every_layer_matches_its_inference_input():
    """On a real DAG (residual adds, 52 BN layers), each layer's new statistics are Algorithm 2
    over its input in the final inference network, computed independently by a feature model.
    Means are compared on the scale of the standard deviation (many are ~0)."""
    base = keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, include_top=False
    )
    model = keras_bn.convert.from_keras(base)
    bns = [
        layer
        for layer in model.layers
        if isinstance(layer, (keras_bn.BatchNormalization, keras.layers.BatchNormalization))
    ]
    x = _data((24, 32, 32, 3), loc=0.0, scale=1.0)
    keras_bn.recalibrate(model, x, batch_size=8, progress=False)
    features = keras.Model(model.inputs[0], [bn.input for bn in bns])(x, training=False)
    for bn, h in zip(bns, features):
        batches = np.split(array(h).astype(np.float64).reshape(3, -1, h.shape[-1]), 3)
        batches = [b[0] for b in batches]
        mean, var = _numpy_population(batches, unbiased=True)
        np.testing.assert_allclose(
            array(bn.moving_mean), mean, rtol=0, atol=1e-4 * np.sqrt(var.max())
        )
        assert_close(bn.moving_variance, var, 1e-4)


def _pooled_reference(values, batch_size):
    """Algorithm 2 in float64 over `values` (samples, channels) cut into batches of
    `batch_size`: Σm·μ / Σm and keras_bn's Σm·σ² / Σ(m − 1)."""
    parts = [values[i : i + batch_size] for i in range(0, len(values), batch_size)]
    m = np.array([len(p) for p in parts], dtype=np.float64)
    mean = sum(len(p) * p.mean(axis=0) for p in parts) / m.sum()
    return mean, sum(len(p) * p.var(axis=0) for p in parts) / (m - 1).sum()


def test_x_y_arrays_as_fit_takes_them():
    """Issue 32, item 5: `(x, y)` and `(x, y, sample_weight)` of whole arrays are `fit`'s
    form: x alone, batched by `batch_size` (they were read as two batches, pooling y's
    statistics into the BN; a y of another shape crashed inside the layer); a list of arrays
    is a multi-input model's x; and a form that is neither is refused, naming what was given.
    The same for `callbacks.Recalibrate` and `check_batchnorm`, which share the path."""
    inputs = keras.Input((3,))
    bn = keras_bn.BatchNormalization()
    model = keras.Model(inputs, bn(inputs))
    x = _data((40, 3), loc=0.0, scale=1.0)
    y = _data((40, 3), seed=1, loc=100.0, scale=1.0)
    mean, variance = _pooled_reference(x.astype(np.float64), 16)
    tx, ty = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)  # fit takes these
    for data in [(x, y), (x, y, np.ones(40, "float32")), (x, y[:, :1]), (x, None), (tx, ty), tx]:
        bn.moving_mean.assign(np.full(3, 7.0))
        report = keras_bn.recalibrate(model, data, batch_size=16, progress=False)
        assert report.batches == 3  # 16, 16 and 8: batch_size applies
        assert_close(bn.moving_mean, mean, 1e-6)
        assert_close(bn.moving_variance, variance, 1e-6)
    # A list of arrays for a two-input model, as `fit` takes it (Keras said "expects 2
    # input(s), received 1").
    a, b = keras.Input((2,)), keras.Input((3,))
    bn2 = keras_bn.BatchNormalization()
    two = keras.Model([a, b], bn2(keras.layers.Concatenate()([a, b])))
    xa, xb = _data((40, 2)), _data((40, 3), seed=2)
    joined = np.concatenate([xa, xb], axis=1).astype(np.float64)
    mean2, variance2 = _pooled_reference(joined, 16)
    for data in [[xa, xb], ([xa, xb], y), ((xa, xb), y, None)]:
        bn2.moving_mean.assign(np.full(5, 7.0))
        report = keras_bn.recalibrate(two, data, batch_size=16, progress=False)
        assert report.batches == 3
        assert_close(bn2.moving_mean, mean2, 1e-6)
        assert_close(bn2.moving_variance, variance2, 1e-6)
    # The callback, given (x, y) and a multi-input list at construction.
    for target, data, expected in [(model, (x, y), mean), (two, [xa, xb], mean2)]:
        callback = keras_bn.callbacks.Recalibrate(data, batch_size=16)
        target.compile("sgd", "mse")
        target_bn = bn if target is model else bn2
        target_bn.moving_mean.assign(np.full(expected.shape, 7.0))
        callback.set_model(target)
        callback.on_train_end()
        assert callback.last_report is not None and callback.last_report.batches == 3
        assert_close(target_bn.moving_mean, expected, 1e-6)
    findings = keras_bn.diagnostics.check_batchnorm(two, ([xa, xb], y), batch_size=16)
    assert [f.kind for f in findings] == ["unfoldable"]
    # Sample counts that differ: fit refuses them, and so does recalibrate, naming them.
    with pytest.raises(ValueError, match=r"x has 40 samples.*y has 39"):
        keras_bn.recalibrate(model, (x, y[:39]), progress=False)
    with pytest.raises(ValueError, match=r"input 1 has 39 samples"):
        keras_bn.recalibrate(two, [xa, xb[:39]], progress=False)


class _TimeDistributedModel(keras.Model):
    """Subclassed: Dense → TimeDistributed(BN), for the per-layer method."""

    def __init__(self, bn):
        super().__init__(name="time_distributed_model")
        self.dense = keras.layers.Dense(3)
        self.wrapped = keras.layers.TimeDistributed(bn)

    def call(self, x, training=None):
        return self.wrapped(self.dense(x), training=training)


@pytest.mark.parametrize("subclassed", [False, True], ids=["functional", "subclassed"])
@pytest.mark.parametrize(
    "bn_class,unbiased",
    [(keras_bn.BatchNormalization, True), (keras.layers.BatchNormalization, False)],
    ids=["keras_bn", "keras"],
)
def test_time_distributed_batch_norm_is_recalibrated_over_batch_and_time(
    bn_class, unbiased, subclassed
):
    """Issue 32, item 7: TimeDistributed(BN) calls its BN once per time step, and infers with
    one set of statistics for every step: Algorithm 2 over the batch × time values of each
    batch (m = batch · steps per channel). It was refused as a shared BN layer."""
    bn = bn_class()
    if subclassed:
        model = _TimeDistributedModel(bn)
        model(np.zeros((2, 5, 4), "float32"))
    else:
        inputs = keras.Input((5, 4))
        h = keras.layers.Dense(3)(inputs)
        model = keras.Model(inputs, keras.layers.TimeDistributed(bn)(h))
    x = _data((40, 5, 4))
    report = keras_bn.recalibrate(model, x, batch_size=16, progress=False)
    assert report.batches == 3 and [c.name for c in report.layers] == [bn.name]
    dense = model.dense if subclassed else model.layers[1]
    features = array(dense(x)).astype(np.float64)
    parts = [features[i : i + 16].reshape(-1, 3) for i in range(0, 40, 16)]  # batch × time
    m = np.array([len(p) for p in parts], dtype=np.float64)
    mean = sum(len(p) * p.mean(axis=0) for p in parts) / m.sum()
    variance = sum(len(p) * p.var(axis=0) for p in parts) / ((m - 1).sum() if unbiased else m.sum())
    assert_close(bn.moving_mean, mean, 1e-5)
    assert_close(bn.moving_variance, variance, 1e-5)
    # And the model infers with them at every step.
    expected = (features - mean) / np.sqrt(variance + bn.epsilon)
    assert_close(model(x, training=False), expected, 1e-4)

"""keras_bn.diagnostics.check_batchnorm: each kind of finding on a model built to show it, with
its numbers checked against numpy; none on a healthy trained model; nested models and both BN
classes; the model left exactly as found. Under every backend (a custom loop under a
GradientTape is TensorFlow's; the digits models need examples/digits.py, which imports
TensorFlow)."""

import re

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from helpers import docs_page, mistaken_model, randomise_batch_norms, relu_then_bn_block
from keras_bn import check
from keras_bn._errors import UnsupportedModelError
from keras_bn._graph import augmentation, bn_layers, fold_plan
from keras_bn.diagnostics import Finding, Findings, check_batchnorm
from keras_bn.export import fold_batch_norms
from keras_bn.quantize import quantize_model


def _kinds(findings):
    return [(f.layer, f.kind) for f in findings]


def _mlp(name="mlp"):
    """Dense → keras_bn BN → ReLU → nested [Dense → Keras BN] → Dense; every BN folds."""
    inner = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(name="keras_bn_layer"),
        ],
        name="inner",
    )
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16),
            keras_bn.BatchNormalization(name="ours"),
            keras.layers.ReLU(),
            inner,
            keras.layers.ReLU(),
            keras.layers.Dense(3),
        ],
        name=name,
    )


def _variables(model):
    return [array(v).copy() for v in model.variables]


@pytest.mark.backends("tensorflow")  # the custom loop's tf.GradientTape
def test_statistics_never_updated_by_a_custom_loop_are_stale():
    import tensorflow as tf

    model = _mlp()
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 3.0, size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    optimizer = keras.optimizers.SGD(0.01)
    for start in range(0, 64, 16):  # the mistake: model(x) without training=True
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[start : start + 16]) - y[start : start + 16]))
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        )
    expected = [("ours", "stale_statistics"), ("inner/keras_bn_layer", "stale_statistics")]
    assert _kinds(check_batchnorm(model)) == expected
    # With data: still one stale finding per layer, and the outputs show it.
    with_data = check_batchnorm(model, x, batch_size=16)
    assert _kinds(with_data) == expected + [("mlp", "train_inference_gap")]
    assert "the BN furthest from its input's statistics is 'ours'" in with_data[-1].message
    assert "training=True" in check_batchnorm(model)[0].message
    # The same loop with training=True moves the statistics: no finding.
    for start in range(0, 64, 16):
        model(x[start : start + 16], training=True)
    assert check_batchnorm(model) == []


def _numpy_stale_message_parts(layer, inputs, unbiased):
    """The numbers a stale_statistics message must quote, from numpy: the input's statistics
    pooled over equal batches (within-batch variances, m/(m−1) for keras_bn)."""
    m, count = len(inputs[0]), len(inputs)
    mean = np.mean([b.mean(axis=0) for b in inputs], axis=0)
    variance = np.sum([b.var(axis=0) * m for b in inputs], axis=0) / (m * count - count * unbiased)
    eps = layer.epsilon
    moving_mean, moving_variance = (
        array(v).astype(np.float64) for v in (layer.moving_mean, layer.moving_variance)
    )
    shift = np.abs(moving_mean - mean) / np.sqrt(variance + eps)
    ratio = (moving_variance + eps) / (variance + eps)
    parts = [f"variance is {ratio[np.argmax(np.maximum(ratio, 1 / ratio))]:.3g} ×"]
    if shift.max() > 0.5:
        parts += [
            f"moving mean is {shift.max():.3g} standard deviations",
            f"{int(np.sum(shift > 0.5))} of {shift.size} channels beyond 0.5",
        ]
    return parts, moving_mean, moving_variance


def test_statistics_far_from_the_data_are_stale_with_numpy_numbers():
    model = _mlp()
    rng = np.random.default_rng(1)
    x = rng.normal(0.0, 1.0, size=(96, 8)).astype("float32")
    keras_bn.recalibrate(model, x, batch_size=32, progress=False)
    assert check_batchnorm(model, x, batch_size=32) == []
    shifted = 3.0 * x + 2.0  # the data the model now sees: another scale and offset
    findings = check_batchnorm(model, shifted, batch_size=32)
    stale = {f.layer: f.message for f in findings if f.kind == "stale_statistics"}
    assert list(stale) == ["ours", "inner/keras_bn_layer"]

    # numpy, in inference mode: Dense → keras_bn BN → ReLU → Dense → Keras BN.
    w1, b1, w2, b2 = [
        w.astype(np.float64)
        for layer in (model.layers[0], model.layers[3].layers[0])
        for w in layer.get_weights()
    ]
    ours, theirs = model.layers[1], model.layers[3].layers[1]
    h1 = np.split(shifted.astype(np.float64) @ w1 + b1, 3)
    parts, mean, variance = _numpy_stale_message_parts(ours, h1, unbiased=True)
    assert all(part in stale["ours"] for part in parts), (parts, stale["ours"])
    gamma, beta = [array(w).astype(np.float64) for w in (ours.gamma, ours.beta)]
    h2 = [
        np.maximum(gamma * (h - mean) / np.sqrt(variance + ours.epsilon) + beta, 0) @ w2 + b2
        for h in h1
    ]
    parts, _, _ = _numpy_stale_message_parts(theirs, h2, unbiased=False)
    assert all(part in stale["inner/keras_bn_layer"] for part in parts)


def test_small_batches_count_values_per_channel_spatial_positions_included():
    model = keras.Sequential(
        [
            keras.Input((4, 4, 2)),
            keras.layers.Conv2D(4, 3, padding="same"),
            keras.layers.BatchNormalization(name="conv_bn"),
            keras.layers.Flatten(),
            keras.layers.Dense(5),
            keras_bn.BatchNormalization(name="dense_bn"),
        ]
    )
    x = np.random.default_rng(2).normal(size=(44, 4, 4, 2)).astype("float32")
    keras_bn.recalibrate(model, x, batch_size=8, progress=False)
    # Batches of 8 (and a last one of 4): the conv BN sees 8·16 = 128 values per channel, the
    # Dense BN 8.
    findings = check_batchnorm(model, x, batch_size=8)
    assert [(f.layer, f.kind) for f in findings if f.kind == "small_batch"] == [
        ("dense_bn", "small_batch")
    ]
    assert "m=8 " in findings[0].message
    # Batches of 16 are enough; the short last batch (12) does not count.
    assert "small_batch" not in [f.kind for f in check_batchnorm(model, x, batch_size=16)]


def test_train_inference_gap_with_numpy_gap():
    """Batches with very different means (data that was never shuffled): batch statistics
    centre each batch, the population statistics cannot. The moving statistics are exactly the
    pooled statistics of the data, so nothing is stale, yet the outputs differ."""
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4),
            keras_bn.BatchNormalization(),
            keras.layers.Dense(2),
        ],
        name="gap",
    )
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(4.0 * b, 1.0, size=(32, 3)) for b in range(4)]).astype("float32")
    batches = np.split(x, 4)
    keras_bn.recalibrate(model, batches, progress=False)
    findings = check_batchnorm(model, batches)
    assert _kinds(findings) == [("gap", "train_inference_gap")]

    # numpy: batch-statistics against moving-statistics outputs of Dense → BN → Dense.
    w1, b1, gamma, beta, mean, var, w2, b2 = [w.astype(np.float64) for w in model.get_weights()]
    eps = model.layers[1].epsilon
    difference = spread = 0.0
    for batch in batches:
        h = batch.astype(np.float64) @ w1 + b1
        trained = (gamma * (h - h.mean(0)) / np.sqrt(h.var(0) + eps) + beta) @ w2 + b2
        inferred = (gamma * (h - mean) / np.sqrt(var + eps) + beta) @ w2 + b2
        difference += np.sum((trained - inferred) ** 2)
        spread += np.sum((inferred - inferred.mean(0)) ** 2)
    gap = np.sqrt(difference / spread)
    assert f"differ from inference outputs by {gap:.3g} of their spread" in findings[0].message
    assert gap > 0.5
    # A last batch of one sample has no batch statistics (in training mode BN outputs β for
    # it): it does not enter the gap, which stays the numpy gap of the full batches.
    (with_one,) = check_batchnorm(model, batches + [x[:1]])
    assert f"differ from inference outputs by {gap:.3g} of their spread" in with_one.message
    # Shuffled into mixed batches, the same data shows no gap.
    mixed = rng.permutation(x)
    keras_bn.recalibrate(model, mixed, batch_size=32, progress=False)
    assert check_batchnorm(model, mixed, batch_size=32) == []


def test_check_batchnorm_finds_the_mistakes():
    """Statistics far from the data, statistics never updated, a BN after a ReLU (nested,
    unfoldable), batches of 4."""
    x = np.random.default_rng(6).normal(2.0, 3.0, (32, 3)).astype("float32")
    findings = check_batchnorm(mistaken_model(), x, batch_size=4)
    kinds = {(f.layer, f.kind) for f in findings}
    assert {
        ("shifted", "stale_statistics"),
        ("untrained", "stale_statistics"),
        ("shifted", "small_batch"),
        ("inner/after_relu", "unfoldable"),
    } <= kinds


def test_unfoldable_relays_the_folds_reason():
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(name="foldable"),
            relu_then_bn_block(),
        ]
    )
    findings = check_batchnorm(randomise_batch_norms(model))
    assert _kinds(findings) == [("inner/after_relu", "unfoldable")]
    (kept,) = fold_batch_norms(model)[1].kept
    assert findings[0].message == f"the fold keeps it: {kept.reason}"
    assert "relu" in kept.reason


class _Block(keras.layers.Layer):
    """A custom layer holding a BN: the fold copies it whole and never sees the BN."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.bn = keras_bn.BatchNormalization(name="hidden_bn")

    def call(self, x, training=None):
        return self.bn(self.dense(x), training=training)


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.dense = keras.layers.Dense(4)
        self.bn = keras.layers.BatchNormalization(name="sub_bn")

    def call(self, x, training=None):
        return self.bn(self.dense(x), training=training)


def test_unfoldable_where_the_fold_cannot_see_the_bn():
    model = randomise_batch_norms(keras.Sequential([keras.Input((3,)), _Block(name="block")]))
    assert _kinds(check_batchnorm(model)) == [("block/hidden_bn", "unfoldable")]
    assert "custom layer" in check_batchnorm(model)[0].message
    subclassed = _Subclassed()
    subclassed(np.zeros((2, 3), "float32"))
    randomise_batch_norms(subclassed)
    (finding,) = check_batchnorm(subclassed)
    assert (finding.layer, finding.kind) == ("sub_bn", "unfoldable")
    assert "subclassed" in finding.message


class _ForgetsItsFactor(keras.layers.Layer):
    """A custom layer whose config lacks its constructor argument: it cannot be copied."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return super().get_config()


def test_unfoldable_where_the_fold_cannot_take_the_model():
    """The fold's UnsupportedModelError (a subclassed model, a layer it cannot copy) is an
    unfoldable finding on every BN, quoting the fold's message."""
    subclassed = _Subclassed()
    subclassed(np.zeros((2, 3), "float32"))
    uncopyable = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4),
            keras_bn.BatchNormalization(name="bn"),
            _ForgetsItsFactor(2.0, name="scale"),
        ]
    )
    for model, layer in ((subclassed, "sub_bn"), (uncopyable, "bn")):
        randomise_batch_norms(model)
        with pytest.raises(UnsupportedModelError) as refusal:
            fold_batch_norms(model)
        (finding,) = check_batchnorm(model)
        assert (finding.layer, finding.kind) == (layer, "unfoldable")
        assert finding.message == f"the fold fails on the model: {refusal.value}"


@pytest.mark.parametrize("bug", [ValueError, TypeError, KeyError, RuntimeError])
def test_a_bug_in_the_fold_propagates(monkeypatch, bug):
    """Only the fold's refusals become findings: an error of the fold's own decisions (here
    in the backward decision, or anywhere in the model's plan) reaches the caller."""
    model = randomise_batch_norms(_mlp())
    assert check_batchnorm(model) == []  # every BN folds

    def broken(*args, **kwargs):
        raise bug("a bug in the fold")

    with monkeypatch.context() as patch:
        patch.setattr(fold_plan, "refuse_backward", broken)
        with pytest.raises(bug, match="a bug in the fold"):
            check_batchnorm(model)
    with monkeypatch.context() as patch:
        patch.setattr(fold_plan, "plan", broken)
        with pytest.raises(bug, match="a bug in the fold"):
            check_batchnorm(model, np.zeros((8, 8), "float32"))
    assert check_batchnorm(model) == []


def test_a_non_finite_bn_is_unfoldable_itself():
    """The fold refuses a BN whose inference scale or shift is NaN or inf by failing on the
    whole model; the check reports that BN, and no other, instead."""
    model = randomise_batch_norms(_mlp())
    gamma = model.get_layer("ours").gamma
    gamma.assign(np.where(np.arange(16) == 3, np.inf, array(gamma)).astype("float32"))
    with pytest.raises(ValueError, match="not finite"):
        fold_batch_norms(model)
    (finding,) = check_batchnorm(model)  # finite statistics: only the fold check reports it
    assert (finding.layer, finding.kind) == ("ours", "unfoldable")
    assert "inference scale or shift is not finite" in finding.message
    model.get_layer("ours").gamma.assign(np.ones(16, "float32"))
    model.get_layer("inner").layers[1].moving_mean.assign(np.full(16, np.nan, "float32"))
    kinds = _kinds(check_batchnorm(model))
    assert kinds == [
        ("inner/keras_bn_layer", "stale_statistics"),
        ("inner/keras_bn_layer", "unfoldable"),
    ]


@pytest.mark.slow
@pytest.mark.requires_tensorflow  # examples/digits.py imports TensorFlow
def test_a_healthy_trained_nested_model_has_no_finding():
    import digits

    x_train, y_train, x_test, _ = digits.load()
    block = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.ReLU(),
        ],
        name="block",
    )
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            block,
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(32),
            keras_bn.BatchNormalization(momentum=0.9),
            keras.layers.ReLU(),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x_train, y_train, batch_size=32, epochs=5, verbose=0)
    before = _variables(model)
    findings = check_batchnorm(model, x_test, batch_size=32)
    assert findings == [], str(findings)
    assert str(findings) == "check_batchnorm: no finding in 2 BN layer(s)."
    for now, then in zip(_variables(model), before, strict=True):
        np.testing.assert_array_equal(now, then)  # the training-mode passes were undone


def test_str_is_a_table():
    findings = Findings(
        [
            Finding("a", "small_batch", "m=2"),
            Finding("outer/bn_long_name", "unfoldable", "the fold keeps it"),
        ],
        3,
    )
    lines = str(findings).splitlines()
    assert lines[0] == "check_batchnorm: 2 finding(s) in 3 BN layer(s)."
    header, rule, *rows = lines[1:]
    assert header.split() == ["layer", "kind", "message"]
    kind_column = header.index("kind")
    message_column = header.index("message")
    for row, finding in zip(rows, findings, strict=True):
        assert row[:kind_column].rstrip() == finding.layer
        assert row[kind_column:message_column].rstrip() == finding.kind
        assert row[message_column:] == finding.message
    assert set(rule.replace(" ", "")) == {"-"}


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="'plain' has no BatchNormalization"):
        check_batchnorm(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)], name="plain"))
    unbuilt = keras.Sequential([keras.layers.Dense(2), keras_bn.BatchNormalization(name="nb")])
    with pytest.raises(ValueError, match=r"not built.*\['nb'\]|\['nb'\].*not built"):
        check_batchnorm(unbuilt)
    with pytest.raises(ValueError, match="steps=0"):
        check_batchnorm(_mlp(), np.zeros((8, 8), "float32"), steps=0)


# The table's numbers come from the snippet's model as TensorFlow initialises it under
# set_random_seed(0); JAX's and PyTorch's random streams give other weights (2.65 and 2.55 for
# the 2.53 shown; TensorFlow's weights give 2.53 under both).
@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_docs_training_helpers_snippets_run_and_print_the_table_shown(capsys):
    section = docs_page("guide/training-helpers.md")
    snippets = re.findall(r"```python\n(.*?)```", section, re.S)
    (table,) = re.findall(r"```text\n(.*?)```", section, re.S)
    assert len(snippets) == 2
    outputs = []
    for snippet in snippets:
        keras.backend.clear_session()  # layer names count from scratch, as in a new process
        exec(compile(snippet, "docs/guide/training-helpers.md", "exec"), {})
        outputs.append(capsys.readouterr().out)
    assert outputs[0].startswith("Recalibrated 1 BN layer(s)")
    assert outputs[1] == table


def test_non_finite_statistics_and_data():
    model = randomise_batch_norms(_mlp())
    x = np.random.default_rng(4).normal(size=(64, 8)).astype("float32")
    model.layers[1].moving_variance.assign(np.full(16, np.nan, "float32"))
    kinds = _kinds(check_batchnorm(model, x))
    assert ("ours", "stale_statistics") in kinds
    assert ("inner/keras_bn_layer", "non_finite") in kinds  # its input is NaN now
    assert ("mlp", "train_inference_gap") in kinds
    x[5, 3] = np.inf
    with pytest.raises(ValueError, match=r"batch 0 of `data` has inf at index \(5, 3\)"):
        check_batchnorm(model, x)


def test_a_frozen_bn_is_not_sent_to_recalibrate():
    """A frozen BN (fine-tuning) normalizes with its statistics in fit, and the layers after it
    are trained for them: its stale_statistics findings say so instead of advising
    keras_bn.recalibrate (which would change the trained model)."""
    model = _mlp()
    x = np.random.default_rng(4).normal(2.0, 3.0, size=(64, 8)).astype("float32")
    for layer in (model.layers[1], model.get_layer("inner").layers[1]):
        layer.trainable = False
    for findings in (check_batchnorm(model), check_batchnorm(model, x)):
        stale = [f for f in findings if f.kind == "stale_statistics"]
        assert [f.layer for f in stale] == ["ours", "inner/keras_bn_layer"]
        for finding in stale:
            assert "frozen (trainable=False)" in finding.message, finding.message
            assert "run keras_bn.recalibrate" not in finding.message
    model.get_layer("ours").moving_mean.assign(np.full(16, 5.0, "float32"))  # not initial
    (stale,) = [f for f in check_batchnorm(model, x) if f.layer == "ours"]
    assert "standard deviations from its input's mean" in stale.message
    assert "frozen (trainable=False)" in stale.message


@pytest.mark.slow
@pytest.mark.requires_tensorflow  # examples/digits.py imports TensorFlow
def test_statistics_averaged_over_in_model_augmentation_name_it_and_recalibration_clears_them():
    """A digits CNN trained with a strong RandomTranslation (zeros shifted in) has moving
    statistics that averaged translated images: on the clean training images the BN after
    the Dense is stale, and the advice names the augmentation layer and recalibrating on
    un-augmented data, which removes the finding."""
    import digits

    x_train, y_train, _, _ = digits.load()
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.RandomTranslation(
                0.3, 0.3, fill_mode="constant", name="random_translation"
            ),
            keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
            keras_bn.BatchNormalization(momentum=0.9, name="conv_bn"),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(32, use_bias=False),
            keras_bn.BatchNormalization(momentum=0.9, name="dense_bn"),
            keras.layers.ReLU(),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy")
    model.fit(x_train, y_train, batch_size=64, epochs=3, verbose=0)
    stale = [
        f for f in check_batchnorm(model, x_train, batch_size=64) if f.kind == "stale_statistics"
    ]
    assert "dense_bn" in [f.layer for f in stale], stale
    for finding in stale:
        assert (
            "the model has training-time augmentation layer(s) ['random_translation'] before "
            "this BN: its moving statistics averaged augmented inputs; if `data` is "
            "un-augmented, recalibrate on it: keras_bn.recalibrate(model, data)"
        ) in finding.message, finding.message
    keras_bn.recalibrate(model, x_train, batch_size=64, progress=False)
    after = check_batchnorm(model, x_train, batch_size=64)
    assert [f for f in after if f.kind == "stale_statistics"] == [], str(after)


def _branches():
    """Functional: image → Resizing (deterministic: not augmentation) → nested "augment"
    [RandomFlip, GaussianNoise] → Conv → BN "after"; vector → Dense → BN "beside"; both
    joined by a Dense head."""
    image, vector = keras.Input((8, 8, 1), name="image"), keras.Input((6,), name="vector")
    augment = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.RandomFlip(name="random_flip"),
            keras.layers.GaussianNoise(0.1, name="gaussian_noise"),
        ],
        name="augment",
    )
    h = keras.layers.Resizing(8, 8, name="resizing")(image)
    h = keras.layers.Conv2D(4, 3, padding="same")(augment(h))
    h = keras.layers.BatchNormalization(name="after")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    v = keras.layers.Dense(4)(vector)
    v = keras_bn.BatchNormalization(name="beside")(v)
    out = keras.layers.Dense(2)(keras.layers.Concatenate()([h, v]))
    return keras.Model([image, vector], out, name="branches")


def test_augmentation_is_named_only_for_the_bns_after_it():
    model = _branches()
    rng = np.random.default_rng(5)
    data = {
        "image": rng.normal(size=(64, 8, 8, 1)).astype("float32"),
        "vector": rng.normal(size=(64, 6)).astype("float32"),
    }
    keras_bn.recalibrate(model, data, batch_size=32, progress=False)
    for name in ("after", "beside"):  # statistics 10 input standard deviations off
        layer = model.get_layer(name)
        layer.moving_mean.assign(layer.moving_mean + 10 * keras.ops.sqrt(layer.moving_variance))
    findings = check_batchnorm(model, data, batch_size=32)
    stale = {f.layer: f.message for f in findings if f.kind == "stale_statistics"}
    assert list(stale) == ["after", "beside"], str(findings)
    assert (
        "the model has training-time augmentation layer(s) ['augment/random_flip', "
        "'augment/gaussian_noise'] before this BN" in stale["after"]
    ), stale["after"]
    assert "resizing" not in stale["after"]
    assert "training-time augmentation layer" not in stale["beside"]
    assert (
        "keep training in training mode, or run keras_bn.recalibrate; if training augments "
        "the inputs outside the model (in the input pipeline)" in stale["beside"]
    ), stale["beside"]
    assert "recalibrate on un-augmented data" in stale["beside"]
    # A frozen BN keeps the frozen advice, augmentation or not.
    model.get_layer("after").trainable = False
    (frozen,) = [
        f
        for f in check_batchnorm(model, data, batch_size=32)
        if f.layer == "after" and f.kind == "stale_statistics"
    ]
    assert "frozen (trainable=False)" in frozen.message
    assert "augmentation" not in frozen.message


def test_upstream_augmentation_follows_the_graph_and_the_layer_order():
    model = _branches()
    found = augmentation.upstream_augmentation(model)
    assert found[id(model.get_layer("after"))] == ["augment/random_flip", "augment/gaussian_noise"]
    assert found[id(model.get_layer("beside"))] == []
    # Sequential, nested: the BN inside "block" sees the noise before the block, and the
    # dropout inside the block before it, not the one after it.
    block = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dropout(0.1, name="inside_before"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dropout(0.1, name="inside_after"),
        ],
        name="block",
    )
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras_bn.BatchNormalization(name="first"),
            keras.layers.GaussianDropout(0.1, name="noise"),
            block,
            keras.layers.RandomContrast(0.1, name="not_before_any_bn"),
        ]
    )
    found = augmentation.upstream_augmentation(model)
    assert found[id(model.get_layer("first"))] == []
    assert found[id(block.get_layer("bn"))] == ["noise", "block/inside_before"]
    assert augmentation.is_augmentation(model.get_layer("not_before_any_bn"))
    for deterministic in (keras.layers.Resizing(4, 4), keras.layers.CenterCrop(2, 2)):
        assert not augmentation.is_augmentation(deterministic)


def test_data_of_one_sample_or_constant_gives_the_fold_findings_without_a_probe():
    """The fold's verification refuses a probe whose outputs do not vary (one sample, constant
    data); the check needs only the fold's decisions, so such `data` still gets its findings."""
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(4, activation="relu"),  # an activation: the BN cannot fold back
            keras_bn.BatchNormalization(),
            keras.layers.Activation("tanh"),  # nor forward
        ]
    )
    for data in (np.ones((1, 6), "float32"), np.zeros((8, 6), "float32")):
        findings = check_batchnorm(model, data, batch_size=8)
        assert [f.kind for f in findings if f.kind == "unfoldable"] == ["unfoldable"], findings


def test_a_qat_layer_stands_for_the_batch_norm_it_folds():
    """A QAT layer's BN (QuantizedHostBatchNorm.batch_norm) is part of it, never called: the
    layers the check reads are the QAT layers (`bn_layers.in_model`), and the check's naming
    and the augmentation upstream of each name them, not their BNs; check_batchnorm itself
    sends a QAT model back to its float model, naming the QAT layers."""
    model = keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            keras.layers.RandomFlip(name="flip"),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras_bn.BatchNormalization(name="bn"),
            keras.layers.ReLU(),
            keras.layers.Conv2D(2, 3, name="conv2"),
            keras.layers.BatchNormalization(name="bn2"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    qat = quantize_model(model)
    layers = bn_layers.in_model(qat)
    assert [layer.name for layer in layers] == ["conv_qat", "conv2_qat"]
    paths = check._bn_paths(qat)
    assert [paths.get(id(layer)) for layer in layers] == ["conv_qat", "conv2_qat"]
    upstream = augmentation.upstream_augmentation(qat)
    assert [upstream.get(id(layer)) for layer in layers] == [["flip"], ["flip"]]
    with pytest.raises(UnsupportedModelError, match="conv_qat"):
        check_batchnorm(qat, np.zeros((8, 6, 6, 3), "float32"))

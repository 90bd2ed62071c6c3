"""Keras's own tests, run against keras_bn.BatchNormalization: the drop-in claim, checked by
the code Keras checks its own layer with. Under every backend: the tree runs once per backend
(make test), and this module is backend-neutral.

The test modules come from the installed Keras wheel (imported, never copied): its test file
for keras.layers.BatchNormalization, every test in it, and the tests of its other test files
that construct a BatchNormalization. Each Keras test class is subclassed here, so every test
method Keras defines is collected, and a new Keras version's tests run too. While a test runs,
the `BatchNormalization` its module sees is keras_bn's; the test must construct at least one
keras_bn layer, or it fails (the swap missed).

The intended differences are in one place, DIFFERENCES, each named with its reason. A test
listed there is rewritten (in _Rewrites) to assert Keras's expectation with the difference
applied: the unbiased moving variance, m/(m−1)·σ²_B, is Keras's value times m/(m−1). The
rewrites also run against Keras's own layer with the factor 1, which shows that they assert
exactly what Keras asserts. Nothing is expected to fail.
"""

import ast
import functools
import importlib
import importlib.util
import inspect
import os
import types
import unittest

import keras
import numpy as np
import pytest
from absl.testing import parameterized
from checks import assert_close, docs_page
from keras.src import layers as keras_layers
from keras.src import testing
from keras.src.losses import MeanSquaredError
from keras.src.models import Model

import keras_bn

KERAS_BN_TESTS = "keras.src.layers.normalization.batch_normalization_test"

# The intended differences: (module, Keras's test name) → what we run instead, and why.
DIFFERENCES = {
    (KERAS_BN_TESTS, "test_correctness"): (
        "rewritten: after momentum-0 training moving_variance is Keras's 1.0 times m/(m−1) "
        "(the unbiased variance), so inference equals training once it is divided by m/(m−1)"
    ),
    (KERAS_BN_TESTS, "test_bachnorm_ignore_masked_values"): (
        "rewritten: moving_variance is Keras's [0.25, 0] times m/(m−1), m = 20 unmasked values"
    ),
    (KERAS_BN_TESTS, "test_renorm_correctness"): (
        "rewritten: with renorm, keras_bn averages the unbiased variance, moving_variance ← "
        "μ·moving_variance + (1−μ)·m/(m−1)·σ²_B, and keeps moving_stddev = √(moving_variance + "
        "ε); Keras averages √(σ²_B + ε) into moving_stddev and squares it. The output, "
        "moving_mean, renorm_mean and renorm_stddev are Keras's"
    ),
}

# Keras test modules with a BatchNormalization that this suite cannot run, and why.
NOT_RUN = {
    "keras.src.export.openvino_test": "needs the openvino package, which keras-bn does not "
    "install (Keras skips these tests without it)",
}
# The PyTorch runs (.venv-torch, and .venv beside TensorFlow) have torch.
if importlib.util.find_spec("torch") is None:
    NOT_RUN["keras.src.export.torch_test"] = (
        "imports torch, which this Python does not have (the PyTorch run has it, in .venv-torch)"
    )
if importlib.util.find_spec("jax") is None:
    NOT_RUN["keras.src.trainers.trainer_test"] = (
        "imports jax whatever the backend, which this Python (make's .venv-torch) does not have"
    )
if keras.backend.backend() == "torch":
    NOT_RUN["keras.src.export.onnx_test"] = (
        "under PyTorch, Keras exports ONNX through torch.onnx and the onnx, onnxscript and "
        "onnxruntime packages, which keras-bn[torch] does not install (keras-bn writes its own "
        "ONNX files under TensorFlow)"
    )
# Under JAX Keras's ONNX export goes
# through another package.
if keras.backend.backend() == "jax":
    NOT_RUN["keras.src.export.onnx_test"] = (
        "under JAX, Keras exports ONNX through the jax2onnx package, which keras-bn does not "
        "install (it writes its own ONNX files under TensorFlow)"
    )
if importlib.util.find_spec("tensorflow") is None:
    NOT_RUN["keras.src.export.saved_model_test"] = (
        "imports TensorFlow, which this Python (make's .venv-jax or .venv-torch) does not have"
    )


def _keras_test_files():
    """{module name: source} of the installed Keras's *_test.py files that construct a
    BatchNormalization."""
    root = os.path.dirname(importlib.util.find_spec("keras").origin)
    found = {}
    for folder, _, names in os.walk(os.path.join(root, "src")):
        for name in sorted(names):
            if not name.endswith("_test.py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                source = f.read()
            if "BatchNormalization(" in source:
                relative = os.path.relpath(path[: -len(".py")], os.path.dirname(root))
                found[relative.replace(os.sep, ".")] = source
    return dict(sorted(found.items()))


def _called_names(node):
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            f = call.func
            yield call, f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)


def _tests_that_construct_bn(source):
    """Names of the test methods that construct a BatchNormalization, directly (nested
    classes included) or through the module's helper functions, e.g. get_model(). A helper
    argument that replaces the BN-holding default (`layer_list or [..., BN(), ...]`) makes
    a call that passes it BN-free."""
    tree = ast.parse(source)
    helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    involved, overrides = {"BatchNormalization"}, {}

    def constructs_bn(node):
        for call, name in _called_names(node):
            if name in involved and not (set(overrides.get(name, ())) & passed(call, name)):
                return True
        return False

    def passed(call, name):
        args = [a.arg for a in helpers[name].args.args] if name in helpers else []
        return {k.arg for k in call.keywords} | set(args[: len(call.args)])

    changed = True
    while changed:
        changed = False
        for name, node in helpers.items():
            if name not in involved and constructs_bn(node):
                involved.add(name)
                overrides[name] = [
                    b.values[0].id
                    for b in ast.walk(node)
                    if isinstance(b, ast.BoolOp)
                    and isinstance(b.values[0], ast.Name)
                    and any(constructs_bn(v) for v in b.values[1:])
                ]
                changed = True
    return {
        method.name
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for method in cls.body
        if isinstance(method, ast.FunctionDef) and constructs_bn(method)
    }


def _original_name(method):
    """A parameterized test's generated method → the name of the method Keras wrote."""
    return getattr(method, "__wrapped__", method).__name__


_constructed_count = [0]  # keras_bn layers constructed so far (see the fixture below)


def _constructions():
    return _constructed_count[0]


def _must_construct_keras_bn(method):
    """The Keras test, failing if it built no keras_bn layer (the swap missed)."""

    @functools.wraps(method)
    def run(self):
        before = _constructions()
        method(self)
        assert _constructions() > before, (
            f"{type(self).__name__}.{self._testMethodName} constructed no "
            f"keras_bn.BatchNormalization: the swap did not reach it."
        )

    return run


# --------------------------------------------------------------------------- the rewrites


class _Rewrites(testing.TestCase):
    """Keras's tests listed in DIFFERENCES, each with its difference applied. LAYER and
    UNBIASED are set by the classes that run them."""

    __test__ = False
    LAYER = None
    UNBIASED = None

    def factor(self, m):
        """m/(m−1) for keras_bn's unbiased moving variance, 1 for Keras's biased one."""
        return m / (m - 1) if self.UNBIASED else 1.0

    # Keras: @parameterized.product(axis=(-1, 1), input_shape=((5, 2, 3), (5, 3, 3, 2)),
    # moving_mean_initializer=("zeros", "ones"), moving_variance_initializer=("zeros", "ones")).
    @parameterized.product(
        axis=(-1, 1),
        input_shape=((5, 2, 3), (5, 3, 3, 2)),
        moving_mean_initializer=("zeros", "ones"),
        moving_variance_initializer=("zeros", "ones"),
    )
    def test_correctness(
        self, axis, input_shape, moving_mean_initializer, moving_variance_initializer
    ):
        layer = self.LAYER(
            axis=axis,
            momentum=0,
            moving_mean_initializer=moving_mean_initializer,
            moving_variance_initializer=moving_variance_initializer,
        )
        x = np.random.normal(loc=5.0, scale=10.0, size=input_shape)
        out = x
        for _ in range(3):
            out = layer(out, training=True)

        broadcast_shape = [1] * len(input_shape)
        broadcast_shape[axis] = input_shape[axis]
        # keras.ops.convert_to_numpy as Keras's test (a PyTorch output requires grad).
        out = keras.ops.convert_to_numpy(out) - np.reshape(np.asarray(layer.beta), broadcast_shape)
        out = out / np.reshape(np.asarray(layer.gamma), broadcast_shape)
        reduction_axes = list(range(len(input_shape)))
        del reduction_axes[axis]
        reduction_axes = tuple(reduction_axes)
        self.assertAllClose(np.mean(out, axis=reduction_axes), 0.0, atol=1e-3)
        self.assertAllClose(np.std(out, axis=reduction_axes), 1.0, atol=1e-3)
        self.assertAllClose(layer.moving_mean, 0.0, atol=1e-3)
        m = np.prod(input_shape) // input_shape[axis]
        # Keras: moving_variance ≈ 1.0.
        self.assertAllClose(np.asarray(layer.moving_variance) / self.factor(m), 1.0, atol=1e-3)

        inference_out = layer(x, training=False)
        training_out = layer(x, training=True)
        self.assertNotAllClose(inference_out, training_out)

        # Keras: with momentum 0, inference after training equals training. Here it does once
        # the moving variance is Keras's (divided by m/(m−1)), and not before.
        training_out = layer(x, training=True)
        if self.UNBIASED:
            self.assertNotAllClose(layer(x, training=False), training_out)
        layer.moving_variance.assign(np.asarray(layer.moving_variance) / self.factor(m))
        inference_out = layer(x, training=False)
        self.assertAllClose(inference_out, training_out)

        x[:, 1, :] = 0.0
        unmasked_out = layer(x, training=False)
        masked = keras_layers.Masking()(x)
        masked_out = layer(masked, training=False)
        self.assertAllClose(unmasked_out, masked_out)

        unmasked_out = layer(x, training=False)
        x[:, 1, :] = 0.0
        masked = keras_layers.Masking()(x)
        masked_out = layer(masked, training=True)
        self.assertNotAllClose(unmasked_out, masked_out)

    @parameterized.product(run_eagerly=(True, False), mask_value=(0.0, 0.1, 1))
    @pytest.mark.requires_trainable_backend
    def test_bachnorm_ignore_masked_values(self, run_eagerly, mask_value):
        padded_data = np.array(
            [
                [[1, 5], [2, 5], [mask_value, mask_value], [mask_value, mask_value]]
                for _ in range(10)
            ],
            dtype="float32",
        )
        inputs = keras_layers.Input((None, 2))
        masked = keras_layers.Masking(mask_value=mask_value)(inputs)
        normed = self.LAYER(momentum=0.0)(masked)
        model = Model(inputs, normed)
        model.compile("rmsprop", loss=MeanSquaredError(), run_eagerly=run_eagerly)
        model.fit(x=padded_data, y=padded_data, batch_size=10, epochs=5, verbose=0)
        self.assertAllClose(model.layers[2].moving_mean, [1.5, 5.0])
        m = int(np.any(padded_data != mask_value, axis=-1).sum())  # 20 values per channel
        self.assertEqual(m, 20)
        # Keras: [0.25, 0.0].
        self.assertAllClose(model.layers[2].moving_variance, np.array([0.25, 0.0]) * self.factor(m))

    def test_renorm_correctness(self):
        keras.utils.set_random_seed(1337)
        epsilon, momentum, renorm_momentum = 1e-3, 0.9, 0.8
        layer = self.LAYER(
            axis=-1,
            epsilon=epsilon,
            momentum=momentum,
            renorm=True,
            renorm_momentum=renorm_momentum,
        )
        layer.build((None, 3))
        size = (3,)
        init_moving_mean = np.random.normal(0.0, 1.0, size=size)
        init_moving_var = np.abs(np.random.normal(1.0, 0.5, size=size))
        init_moving_stddev = np.sqrt(init_moving_var)
        init_renorm_mean = np.random.normal(0.0, 1.0, size=size)
        init_renorm_stddev = np.abs(np.random.normal(1.0, 0.5, size=size))
        init_gamma = np.random.normal(1.0, 0.1, size=size)
        init_beta = np.random.normal(0.0, 0.1, size=size)
        for name, value in (
            ("moving_mean", init_moving_mean),
            ("moving_variance", init_moving_var),
            ("moving_stddev", init_moving_stddev),
            ("renorm_mean", init_renorm_mean),
            ("renorm_stddev", init_renorm_stddev),
            ("gamma", init_gamma),
            ("beta", init_beta),
        ):
            getattr(layer, name).assign(value)
        x = np.array([[4.0, 6.0, 2.0], [8.0, -2.0, 5.0], [6.0, 4.0, 3.0]], dtype="float32")

        batch_mean = np.mean(x, axis=0)
        batch_var = np.var(x, axis=0)
        batch_stddev = np.sqrt(batch_var + epsilon)
        r = batch_stddev / init_renorm_stddev
        d = (batch_mean - init_renorm_mean) / init_renorm_stddev
        expected_output = (((x - batch_mean) / batch_stddev) * r + d) * init_gamma + init_beta
        self.assertAllClose(layer(x, training=True), expected_output, atol=1e-5)

        self.assertAllClose(
            layer.renorm_mean,
            init_renorm_mean * renorm_momentum + batch_mean * (1 - renorm_momentum),
            atol=1e-5,
        )
        self.assertAllClose(
            layer.renorm_stddev,
            init_renorm_stddev * renorm_momentum + batch_stddev * (1 - renorm_momentum),
            atol=1e-5,
        )
        self.assertAllClose(
            layer.moving_mean,
            init_moving_mean * momentum + batch_mean * (1 - momentum),
            atol=1e-5,
        )
        if self.UNBIASED:  # the variance is averaged, unbiased; the stddev follows from it
            m = len(x)
            expected_moving_var = init_moving_var * momentum + batch_var * self.factor(m) * (
                1 - momentum
            )
            expected_moving_stddev = np.sqrt(expected_moving_var + epsilon)
        else:  # Keras: the stddev is averaged; the variance follows from it
            expected_moving_stddev = init_moving_stddev * momentum + batch_stddev * (1 - momentum)
            expected_moving_var = expected_moving_stddev**2 - epsilon
        self.assertAllClose(layer.moving_stddev, expected_moving_stddev, atol=1e-5)
        self.assertAllClose(layer.moving_variance, expected_moving_var, atol=1e-5)


class TestRewritesAgainstKerasLayer(_Rewrites):
    """The rewrites with Keras's layer and the factor 1: they assert what Keras asserts."""

    __test__ = True
    LAYER = keras_layers.BatchNormalization
    UNBIASED = False


# --------------------------------------------------------------------------- the Keras classes


def _import_keras_test_modules():
    modules = {}
    for name, source in _keras_test_files().items():
        if name in NOT_RUN:
            continue
        modules[name] = (importlib.import_module(name), source)
    return modules


KERAS_TEST_MODULES = _import_keras_test_modules()


def _subclass(module_name, source, keras_class):
    """keras_class, run against keras_bn: the tests that construct a BN (all of them in
    Keras's BN test file), each required to construct a keras_bn layer; the rewrites replace
    the tests named in DIFFERENCES."""
    rewritten = {test for module, test in DIFFERENCES if module == module_name}
    selected = None if module_name == KERAS_BN_TESTS else _tests_that_construct_bn(source)
    body = {
        "__test__": True,
        "KERAS_MODULE": module_name,
        "LAYER": keras_bn.BatchNormalization,
        "UNBIASED": True,
    }
    if module_name != KERAS_BN_TESTS:  # model and export tests, ~1 s each: deselectable
        body["pytestmark"] = list(getattr(keras_class, "pytestmark", [])) + [pytest.mark.slow]
    for name in dir(keras_class):
        method = getattr(keras_class, name)
        if not (name.startswith("test") and callable(method)):
            continue
        original = _original_name(method)
        if original in rewritten:
            continue  # _Rewrites' method of the same generated name runs instead
        if selected is not None and original not in selected:
            body[name] = None  # constructs no BN: nothing of keras_bn's to test
        else:
            body[name] = _must_construct_keras_bn(method)
    bases = (_Rewrites, keras_class) if rewritten else (keras_class,)
    short = module_name.rsplit(".", 1)[-1]
    return type(f"TestKeras_{short}_{keras_class.__name__}", bases, body)


def _keras_classes(module, module_name):
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, unittest.TestCase)
        and value.__module__ == module_name
    ]


for _name, (_module, _source) in KERAS_TEST_MODULES.items():
    for _keras_class in _keras_classes(_module, _name):
        _cls = _subclass(_name, _source, _keras_class)
        globals()[_cls.__name__] = _cls
del _name, _module, _source, _keras_class, _cls


@pytest.fixture(autouse=True)
def _keras_bn_in_keras_tests(request, monkeypatch):
    """In a Keras test, its module's `layers.BatchNormalization` (and `keras.layers`' where
    the module uses that) is keras_bn's; keras_bn constructions are counted."""
    module_name = getattr(request.cls, "KERAS_MODULE", None)
    if module_name is None:
        return
    module, source = KERAS_TEST_MODULES[module_name]
    if getattr(module, "layers", None) is keras_layers:
        with_ours = types.SimpleNamespace(
            **{k: getattr(keras_layers, k) for k in dir(keras_layers) if not k.startswith("__")}
        )
        with_ours.BatchNormalization = keras_bn.BatchNormalization
        monkeypatch.setattr(module, "layers", with_ours)
    if "keras.layers.BatchNormalization(" in source:
        monkeypatch.setattr(keras.layers, "BatchNormalization", keras_bn.BatchNormalization)
    # Counted in __new__: Keras reads __init__'s signature for the layer's config.
    new = keras_bn.BatchNormalization.__new__

    def counted_new(cls, *args, **kwargs):
        _constructed_count[0] += 1
        return new(cls, *args, **kwargs)

    monkeypatch.setattr(keras_bn.BatchNormalization, "__new__", staticmethod(counted_new))


# --------------------------------------------------------------------------- guards


def test_keras_bn_test_file_is_found_and_run():
    assert KERAS_BN_TESTS in KERAS_TEST_MODULES
    (cls,) = _keras_classes(KERAS_TEST_MODULES[KERAS_BN_TESTS][0], KERAS_BN_TESTS)
    ours = globals()[f"TestKeras_batch_normalization_test_{cls.__name__}"]
    names = {n for n in dir(cls) if n.startswith("test")}
    assert len(names) >= 33
    assert names <= {n for n in dir(ours) if callable(getattr(ours, n))}


def test_every_variant_of_a_rewritten_test_is_rewritten():
    """A rewrite replaces every generated variant of Keras's test, by name: a variant that
    Keras adds would otherwise run unrewritten (and fail on the intended difference)."""
    for module_name, test in DIFFERENCES:
        module = KERAS_TEST_MODULES[module_name][0]
        for cls in _keras_classes(module, module_name):
            theirs = {
                n
                for n in dir(cls)
                if n.startswith("test") and _original_name(getattr(cls, n)) == test
            }
            ours = {
                n
                for n in dir(_Rewrites)
                if n.startswith("test") and _original_name(getattr(_Rewrites, n)) == test
            }
            assert theirs == ours, (module_name, test)


def test_differences_are_the_docs_parity_page():
    section = docs_page("guide/parity.md")
    for _, test in DIFFERENCES:
        assert f"`{test}`" in section, test
    for module in NOT_RUN:
        assert f"`{module.rsplit('.', 1)[-1]}`" in section, module


def test_other_keras_test_files_are_run():
    """Beyond the BN test file, Keras's tests that build a BN in a model or wrapper run too
    (each must construct a keras_bn layer); their count is at least today's (fewer where
    TensorFlow is absent and saved_model_test is not run)."""
    others = [
        name
        for name, cls in globals().items()
        if name.startswith("TestKeras_") and "batch_normalization_test" not in name
        for test in dir(cls)
        if test.startswith("test") and callable(getattr(cls, test))
    ]
    assert len(others) >= (50 if importlib.util.find_spec("tensorflow") else 24)


def test_selection_follows_helper_arguments():
    source = inspect.cleandoc("""
        def get_model(layer_list=None):
            layer_list = layer_list or [layers.Dense(1), layers.BatchNormalization()]
            return layer_list

        class T:
            def test_default(self):
                get_model()

            def test_replaced(self):
                get_model(layer_list=[layers.Dense(1)])

            def test_direct(self):
                class Inner:
                    def __init__(self):
                        self.bn = layers.BatchNormalization()

            def test_none(self):
                layers.Dense(2)
    """)
    assert _tests_that_construct_bn(source) == {"test_default", "test_direct"}


# --------------------------------------------------------------------------- renorm statistics


def _renorm_pair(momentum):
    """keras_bn's and Keras's renorm layers with the same arguments and initial weights."""
    pair = [
        cls(momentum=momentum, renorm=True, renorm_momentum=0.9)
        for cls in (keras_bn.BatchNormalization, keras_layers.BatchNormalization)
    ]
    for layer in pair:
        layer.build((None, 4))
    return pair


def test_renorm_moving_statistics_after_the_same_batches():
    """The same batches through both renorm layers: the outputs, moving_mean, renorm_mean and
    renorm_stddev agree; moving_variance and moving_stddev follow each layer's own average
    (numpy references), and the variances differ by exactly m/(m−1) when every batch has
    the same variance (here momentum 0: one batch)."""
    rng = np.random.default_rng(0)
    batches = [
        rng.normal(1.0, rng.uniform(0.5, 3.0), size=(16, 4)).astype("float32") for _ in range(20)
    ]
    momentum, eps, m = 0.8, 1e-3, 16
    ours, theirs = _renorm_pair(momentum)
    average_var, average_std = np.ones(4), np.ones(4)
    for x in batches:
        assert_close(ours(x, training=True), theirs(x, training=True), 1e-5)
        var = x.astype(np.float64).var(axis=0)
        average_var = momentum * average_var + (1 - momentum) * var * m / (m - 1)
        average_std = momentum * average_std + (1 - momentum) * np.sqrt(var + eps)
    for name in ("moving_mean", "renorm_mean", "renorm_stddev"):
        assert_close(getattr(ours, name), getattr(theirs, name), 1e-5)
    assert_close(ours.moving_variance, average_var, 1e-5)
    assert_close(ours.moving_stddev, np.sqrt(average_var + eps), 1e-5)
    assert_close(theirs.moving_stddev, average_std, 1e-5)
    assert_close(theirs.moving_variance, average_std**2 - eps, 1e-5)

    ours, theirs = _renorm_pair(momentum=0.0)
    ours(batches[0], training=True)
    theirs(batches[0], training=True)
    assert_close(ours.moving_variance, np.asarray(theirs.moving_variance) * m / (m - 1), 1e-5)


def _digits_renorm_model(layer, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32),
            layer,
            keras.layers.ReLU(),
            keras.layers.Dense(10),
        ]
    )


def test_renorm_weights_after_the_same_training(capsys):
    """Two digits models, one with each renorm BN, from the same weights and the same
    batches (m = 32): every weight agrees except moving_variance and moving_stddev; ours
    exceeds Keras's moving_variance by at least m/(m−1), Jensen's inequality adding the
    batch-to-batch spread of σ_B (Keras averages σ_B, not σ²_B)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x[:1792] / 16.0).astype("float32"), y[:1792]  # 56 batches of 32
    models = [
        _digits_renorm_model(cls(momentum=0.9, renorm=True, renorm_momentum=0.9))
        for cls in (keras_bn.BatchNormalization, keras_layers.BatchNormalization)
    ]
    models[1].set_weights(models[0].get_weights())
    for model in models:
        model.compile(
            keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    ours, theirs = (model.layers[1] for model in models)
    differ = {id(v) for v in (ours.moving_variance, ours.moving_stddev)}
    compared = [(a, b) for a, b in zip(models[0].weights, models[1].weights) if id(a) not in differ]
    assert len(compared) == len(models[0].weights) - 2
    for a, b in compared:  # (the bias before BN has no gradient: rounding noise, ~1e-8)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=a.path)
    m = 32
    variance_ratio = np.asarray(ours.moving_variance) / np.asarray(theirs.moving_variance)
    stddev_ratio = np.asarray(ours.moving_stddev) / np.asarray(theirs.moving_stddev)
    assert (variance_ratio >= m / (m - 1) * (1 - 1e-5)).all()
    with capsys.disabled():
        print(
            f"\nrenorm after the same training (m = {m}, m/(m−1) = {m / (m - 1):.4f}): "
            f"moving_variance ours/Keras median {np.median(variance_ratio):.4f}, "
            f"min {variance_ratio.min():.4f}, max {variance_ratio.max():.4f}; "
            f"moving_stddev median {np.median(stddev_ratio):.4f}, "
            f"min {stddev_ratio.min():.4f}, max {stddev_ratio.max():.4f}"
        )

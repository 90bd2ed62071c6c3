"""The bad-input matrix: each case's exception type and message, and proof that nothing is
lost (weights, statistics, existing files). The docs page guide/errors.md is this table; the last
test checks that the two agree. The layer's cases run under every backend; the export cases,
the error contract across the exporters, the CLI and the docs table under TensorFlow (the
TFLite and ONNX writers need it)."""

import os
import stat

import keras
import numpy as np
import pytest
from framework_references import array

import keras_bn
from helpers import cli_in_process, docs_page, hidden_bn_model, run_cli, training_call
from keras_bn import convert
from keras_bn.export import UnsupportedModelError, VerificationError, fold_batch_norms

BACKEND = keras.backend.backend()
# The Lambda layers below call tf.linalg.det: a module global, as the .keras files that save
# them expect.
if BACKEND == "tensorflow":
    import tensorflow as tf
# The export cases, the exporters' error contract, the CLI and the docs table.
tensorflow_only = pytest.mark.backends("tensorflow")


def export_tflite(model, path, **kwargs):
    """keras_bn.export.export_tflite, imported when called (it needs TensorFlow)."""
    from keras_bn.export import export_tflite as export

    return export(model, path, **kwargs)


def export_onnx(model, path, **kwargs):
    """keras_bn.export.export_onnx, imported when called (it needs TensorFlow)."""
    from keras_bn.export import export_onnx as export

    return export(model, path, **kwargs)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _x(shape, seed=0):
    return np.random.default_rng(seed).normal(1.0, 2.0, shape).astype("float32")


def _built_bn(shape=(8, 3), **kwargs):
    layer = keras_bn.BatchNormalization(momentum=0.5, **kwargs)
    layer(_x(shape), training=True)  # statistics that are not the initial ones
    return layer


def _state(layer):
    return [array(w).copy() for w in layer.weights]


def _unchanged(layer, before):
    def check():
        for w, b in zip(layer.weights, before):
            np.testing.assert_array_equal(array(w), b)

    return check


def _folder_holds(folder, names):
    def check():
        assert sorted(os.listdir(folder)) == sorted(names)

    return check


# Each case: (area, name, exception type, message regex, set-up(tmp_path) -> (act, check)).


def _wrong_rank(tmp_path):
    layer = _built_bn()
    return (lambda: layer(_x((8, 2, 3)), training=True)), _unchanged(layer, _state(layer))


def _axis_out_of_range(tmp_path):
    layer = keras_bn.BatchNormalization(axis=3)
    return (lambda: layer(_x((8, 3)))), lambda: None


def _unknown_channel(tmp_path):
    layer = keras_bn.BatchNormalization()
    return (lambda: layer.build((None, 4, None))), lambda: None


def _m_equal_one(tmp_path):
    layer = _built_bn()
    return (lambda: layer(_x((1, 3)), training=True)), _unchanged(layer, _state(layer))


def _non_finite(tmp_path):
    layer = _built_bn()
    before = _state(layer)
    bad = _x((8, 3))
    bad[3, 1] = np.nan

    def act():
        y = layer(bad, training=True)
        assert np.isnan(array(y)[:, 1]).all()  # the NaN shows in the output

    return act, _unchanged(layer, before)


def _m_at_most_one_at_run_time(tmp_path):
    layer = keras_bn.BatchNormalization(momentum=None, renorm=True)
    layer(_x((8, 5, 3)), training=True)  # statistics that are not the initial ones
    before = _state(layer)
    # Compiled where the backend compiles (XLA, jax.jit); PyTorch's call is eager.
    mode = {"tensorflow": "xla", "jax": "jit"}.get(BACKEND, "eager")
    step = training_call(layer, mode)

    def act():
        y = step(_x((4, 5, 3), seed=1), np.eye(4, 5, dtype=bool) & False)  # every value masked
        np.testing.assert_array_equal(array(y), np.broadcast_to(array(layer.beta), (4, 5, 3)))

    return act, _unchanged(layer, before)


def _integer_input(tmp_path):
    layer = _built_bn()
    return (lambda: layer(keras.ops.ones([8, 3], "int32"), training=True)), _unchanged(
        layer, _state(layer)
    )


def _bad_momentum(tmp_path):
    return (lambda: keras_bn.BatchNormalization(momentum=1.0)), lambda: None


def _bad_epsilon(tmp_path):
    return (lambda: keras_bn.BatchNormalization(epsilon=0.0)), lambda: None


def _wrong_mask(tmp_path):
    layer = _built_bn((4, 5, 3))
    return (lambda: layer(_x((4, 5, 3)), training=True, mask=np.ones((4, 3), bool))), _unchanged(
        layer, _state(layer)
    )


@keras.saving.register_keras_serializable(package="keras_bn_tests")
class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.bn = keras_bn.BatchNormalization()

    def call(self, x, training=None):
        return self.bn(self.dense(x), training=training)


def _subclassed(tmp_path):
    model = _Subclassed()
    model(_x((4, 5)))
    before = [array(w).copy() for w in model.weights]

    def check():
        for w, b in zip(model.weights, before):
            np.testing.assert_array_equal(array(w), b)

    return (lambda: fold_batch_norms(model)), check


class _Unconfigurable(keras.layers.Layer):
    """A custom layer whose config does not round-trip (no get_config for `factor`)."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def call(self, x):
        return x * self.factor


def _custom_layer(tmp_path):
    inputs = keras.Input((4,))
    h = keras_bn.BatchNormalization()(keras.layers.Dense(3)(inputs))
    model = keras.Model(inputs, _Unconfigurable(2.0)(h))
    target = tmp_path / "model.onnx"
    return (lambda: export_onnx(model, target)), _folder_holds(tmp_path, [])


def _lambda_safe_mode(tmp_path):
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Lambda(lambda t: t * 2.0)]
    )
    model.save(tmp_path / "lambda.keras")
    return (lambda: keras.saving.load_model(tmp_path / "lambda.keras")), _folder_holds(
        tmp_path, ["lambda.keras"]
    )


def _unwritable(tmp_path):
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras_bn.BatchNormalization()]
    )
    return (lambda: export_tflite(model, tmp_path / "missing" / "m.tflite")), _folder_holds(
        tmp_path, []
    )


def _not_a_file(tmp_path):
    """A FIFO stands for a device such as /dev/stdout: a file renamed over it would replace it."""
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras_bn.BatchNormalization()]
    )
    os.mkfifo(tmp_path / "pipe")

    def check():
        assert os.listdir(tmp_path) == ["pipe"]
        assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)

    return (lambda: export_onnx(model, tmp_path / "pipe")), check


def _export_over_a_previous_file(tmp_path, exporter, model, name):
    """(export `model` over an existing file, check that file and nothing else is there)."""
    target = tmp_path / name
    target.write_bytes(b"previous export")

    def check():
        assert target.read_bytes() == b"previous export"
        assert os.listdir(tmp_path) == [name]

    return (lambda: exporter(model, target)), check


def _conversion_fails(tmp_path):
    # MatrixDeterminant is not a TFLite builtin: the converter fails after folding.
    model = keras.Sequential(
        [
            keras.Input((3, 3)),
            keras.layers.Lambda(lambda t: tf.linalg.det(t)[:, None]),
            keras.layers.Dense(2),
            keras_bn.BatchNormalization(),
        ]
    )
    return _export_over_a_previous_file(tmp_path, export_tflite, model, "model.tflite")


def _over_tolerance(tmp_path):
    # log of a signed value: NaN on part of the probe, which no tolerance accepts.
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras_bn.BatchNormalization(),
            keras.layers.Lambda(lambda t: keras.ops.log(t)),
        ]
    )
    return _export_over_a_previous_file(tmp_path, export_onnx, model, "model.onnx")


def _channels_first_tflite(tmp_path):
    model = keras.Sequential(
        [
            keras.Input((2, 7)),
            keras.layers.Conv1D(4, 3, data_format="channels_first", name="conv"),
            keras_bn.BatchNormalization(axis=1),
        ]
    )
    return _export_over_a_previous_file(tmp_path, export_tflite, model, "model.tflite")


def _corrupt_keras(tmp_path):
    keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]).save(tmp_path / "ok.keras")
    data = (tmp_path / "ok.keras").read_bytes()
    (tmp_path / "bad.keras").write_bytes(data[: len(data) // 2])
    return (lambda: keras.saving.load_model(tmp_path / "bad.keras")), _folder_holds(
        tmp_path, ["ok.keras", "bad.keras"]
    )


ERROR_CASES = [
    ("layer", "wrong rank", ValueError, r"expected ndim=2, found ndim=3", _wrong_rank),
    (
        "layer",
        "axis out of range",
        ValueError,
        r"axis=3 is out of range for an input of rank 2",
        _axis_out_of_range,
    ),
    (
        "layer",
        "unknown channel dim",
        ValueError,
        r"needs a known size on its channel axis",
        _unknown_channel,
    ),
    (
        "layer",
        "m=1 in training",
        ValueError,
        r"needs at least 2 values per channel.*m=1",
        _m_equal_one,
    ),
    ("layer", "non-finite batch", None, None, _non_finite),
    ("layer", "m ≤ 1 known only at run time", None, None, _m_at_most_one_at_run_time),
    (
        "layer",
        "integer input",
        TypeError,
        r"requires floating-point inputs; received dtype int32",
        _integer_input,
    ),
    (
        "layer",
        "bad momentum",
        ValueError,
        r"momentum must be in \[0, 1\); received momentum=1.0",
        _bad_momentum,
    ),
    (
        "layer",
        "bad epsilon",
        ValueError,
        r"epsilon must be a positive finite float; received epsilon=0.0",
        _bad_epsilon,
    ),
    (
        "layer",
        "wrong-shaped mask",
        ValueError,
        r"The mask's shape \(4, 3\) fits no reading of a mask for the input shape \(4, 5, 3\)",
        _wrong_mask,
    ),
    (
        "export",
        "subclassed model",
        UnsupportedModelError,
        r"subclassed _Subclassed: it has no layer graph",
        _subclassed,
    ),
    (
        "export",
        "unsupported or custom layer",
        UnsupportedModelError,
        r"(?s)Cannot copy layer '.*' \(_Unconfigurable\) from its config",
        _custom_layer,
    ),
    ("export", "Lambda layer under safe mode", ValueError, r"safe_mode", _lambda_safe_mode),
    ("export", "unwritable path", OSError, r"Cannot write .*missing.*m\.tflite", _unwritable),
    (
        "export",
        "path is a folder, FIFO or device",
        OSError,
        r"Cannot write .*pipe: it is a FIFO, socket or device, not a regular file",
        _not_a_file,
    ),
    (
        "export",
        "conversion failure midway",
        "ConverterError",  # TensorFlow's: _error_type imports it
        r"MatrixDeterminant",
        _conversion_fails,
    ),
    (
        "export",
        "file over its tolerance",
        VerificationError,
        r"differs from the Keras model: output '.*' is off by nan",
        _over_tolerance,
    ),
    (
        "export",
        "channels_first layer TFLite cannot convert",
        UnsupportedModelError,
        r"TFLite cannot convert layer 'conv' \(Conv1D with data_format='channels_first'\)",
        _channels_first_tflite,
    ),
    (
        "export",
        "corrupt or truncated .keras",
        ValueError,
        r"accessible `\.keras` zip file",
        _corrupt_keras,
    ),
]


def _error_type(error):
    """A case's exception type: TFLite's ConverterError is named, imported when needed."""
    if error == "ConverterError":
        from tensorflow.lite.python.convert import ConverterError

        return ConverterError
    return error


@pytest.mark.slow
@pytest.mark.parametrize(
    "area,name,error,message,setup",
    [
        pytest.param(
            *case, marks=tensorflow_only if case[0] == "export" else (), id=f"{case[0]}: {case[1]}"
        )
        for case in ERROR_CASES
    ],
)
def test_bad_input(area, name, error, message, setup, tmp_path):
    act, nothing_lost = setup(tmp_path)
    if error is None:
        act()
    else:
        with pytest.raises(_error_type(error), match=message):
            act()
    nothing_lost()


# --------------------------------------------------------------------------- one error contract


def _structure_cases():
    """(name, callable) for every entry point that takes a model, each given one it cannot."""
    subclassed = _Subclassed()
    subclassed(_x((4, 5)))
    return [
        ("fold_batch_norms", lambda path: fold_batch_norms(subclassed)),
        ("export_tflite", lambda path: export_tflite(subclassed, path / "m.tflite")),
        ("export_onnx", lambda path: export_onnx(subclassed, path / "m.onnx")),
        ("convert.from_keras", lambda path: convert.from_keras(subclassed)),
        ("convert.to_keras", lambda path: convert.to_keras(subclassed)),
    ]


@tensorflow_only
@pytest.mark.parametrize(
    "entry",
    ["fold_batch_norms", "export_tflite", "export_onnx", "convert.from_keras", "convert.to_keras"],
)
def test_a_subclassed_model_is_the_same_error_everywhere(entry, tmp_path):
    """One type from the fold, both exporters and convert, caught by `except TypeError` and
    by `except ValueError` alike (the types the older errors had)."""
    act = dict(_structure_cases())[entry]
    with pytest.raises(UnsupportedModelError, match="a subclassed _Subclassed: it has no layer"):
        act(tmp_path)
    for older in (TypeError, ValueError):
        try:
            act(tmp_path)
        except older as error:
            assert type(error) is UnsupportedModelError
    assert keras_bn.UnsupportedModelError is UnsupportedModelError
    assert os.listdir(tmp_path) == []


def _unbuilt():
    return keras.Sequential([keras.layers.Dense(3), keras_bn.BatchNormalization()])


def _bn_subclass():
    class Shifted(keras.layers.BatchNormalization):
        pass

    inputs = keras.Input((3,))
    return keras.Model(inputs, Shifted()(inputs))


def _unconfigurable():
    inputs = keras.Input((4,))
    return keras.Model(inputs, _Unconfigurable(2.0)(keras.layers.Dense(3)(inputs)))


class _NotSerializable(keras.layers.Layer):
    """A custom layer with an argument Keras cannot serialize and no get_config of its own:
    Layer.get_config raises NotImplementedError."""

    def __init__(self, table, **kwargs):
        super().__init__(**kwargs)
        self.table = table

    def call(self, x):
        return x


def _not_serializable():
    inputs = keras.Input((4,))
    return keras.Model(inputs, _NotSerializable(object())(keras.layers.Dense(3)(inputs)))


def _no_keras_momentum():
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras_bn.BatchNormalization(momentum=None)(inputs))


STRUCTURES = [
    (
        "unbuilt Sequential",
        _unbuilt,
        [fold_batch_norms, export_onnx, convert.from_keras],
        "not built",
    ),
    ("BN inside a custom layer", hidden_bn_model, [convert.from_keras], "inside its own code"),
    ("BN subclass", _bn_subclass, [convert.from_keras], "subclass of BatchNormalization"),
    (
        "config that does not round-trip",
        _unconfigurable,
        [fold_batch_norms, export_onnx, export_tflite, convert.from_keras],
        r"(?s)Cannot copy layer '.*' \(_Unconfigurable\) from its config.*unexpected keyword",
    ),
    (
        "get_config not implemented",
        _not_serializable,
        [fold_batch_norms, export_onnx, convert.to_keras],
        r"(?s)Cannot copy layer '.*' \(_NotSerializable\) from its config.*NotImplementedError",
    ),
    ("BN argument Keras cannot express", _no_keras_momentum, [convert.to_keras], "momentum=None"),
]


@tensorflow_only
@pytest.mark.parametrize("name,make,entries,message", STRUCTURES, ids=[c[0] for c in STRUCTURES])
def test_every_structure_that_cannot_be_taken_is_an_unsupported_model_error(
    name, make, entries, message, tmp_path
):
    model = make()
    for entry in entries:
        args = (tmp_path / "m.out",) if entry in (export_onnx, export_tflite) else ()
        with pytest.raises(UnsupportedModelError, match=message):
            entry(model, *args)
    assert os.listdir(tmp_path) == []


def test_a_failing_layer_that_is_not_a_config_problem_propagates():
    """Only what a non-round-tripping config raises becomes UnsupportedModelError: a bug in a
    layer's get_config (here a RuntimeError) keeps its own type."""

    class Broken(keras.layers.Layer):
        def get_config(self):
            raise RuntimeError("a bug in get_config")

        def call(self, x):
            return x

    inputs = keras.Input((4,))
    model = keras.Model(inputs, Broken()(keras.layers.Dense(3)(inputs)))
    with pytest.raises(RuntimeError, match="a bug in get_config") as info:
        fold_batch_norms(model)
    assert not isinstance(info.value, UnsupportedModelError)


def test_no_decision_reads_an_exception_message():
    """The error contract is by type: nothing in keras_bn/ or export/ branches on an
    exception's text."""
    import re

    pattern = re.compile(r"in str\((error|exc|e|err)\)|\.args\[0\]\s*(==|in)")
    for folder in ("keras_bn", "export"):
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith(".py"):
                with open(os.path.join(ROOT, folder, name), encoding="utf-8") as file:
                    found = pattern.findall(file.read())
                assert not found, f"{folder}/{name} decides by message text: {found}"


# --------------------------------------------------------------------------- the CLI


def _cli_model(tmp_path, case):
    """A .keras file (or path) that brings each export case to the command line."""
    path = tmp_path / f"{case}.keras"
    if case == "subclassed model":  # its class exists only in this process
        model = _Subclassed()
        model(_x((4, 5)))
        model.save(path)
    elif case == "unsupported or custom layer":  # unregistered: cannot be loaded
        inputs = keras.Input((4,))
        keras.Model(inputs, _Unconfigurable(2.0)(keras.layers.Dense(3)(inputs))).save(path)
    elif case in ("Lambda layer under safe mode", "conversion failure midway"):
        keras.Sequential(
            [
                keras.Input((3, 3)),
                keras.layers.Lambda(lambda t: tf.linalg.det(t)[:, None]),
                keras.layers.Dense(2),
            ]
        ).save(path)
    elif case == "channels_first layer TFLite cannot convert":
        keras.Sequential(
            [keras.Input((2, 7)), keras.layers.Conv1D(4, 3, data_format="channels_first")]
        ).save(path)
    elif case == "corrupt or truncated .keras":
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]).save(path)
        path.write_bytes(path.read_bytes()[:200])
    else:  # unwritable path
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]).save(path)
    return path


# A file over its tolerance exits 1, not 2 (tests/test_cli.py), and also keeps the old file.
CLI_CASES = [
    name for area, name, *_ in ERROR_CASES if area == "export" and name != "file over its tolerance"
]


# The cases whose model class exists only in the process that saved it run the installed
# command in a new process, where it is unknown; the others call its main in this process
# (helpers.cli_in_process: the same exit code and output, without importing TensorFlow again).
NEW_PROCESS_CLI_CASES = ("subclassed model", "unsupported or custom layer")


@tensorflow_only
@pytest.mark.slow
@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_exits_2_in_one_line(case, tmp_path, capfd):
    model = _cli_model(tmp_path, case)
    out = tmp_path / "out"
    out.mkdir()
    target = out / "model.tflite"
    target.write_bytes(b"previous export")
    if case == "unwritable path":
        target = tmp_path / "missing" / "model.tflite"
    if case == "path is a folder, FIFO or device":
        target = out
    extra = ["--unsafe"] if case == "conversion failure midway" else []
    args = (model, "--tflite", target, *extra)
    if case in NEW_PROCESS_CLI_CASES:
        result = run_cli(*args)
    else:
        result = cli_in_process(capfd, *args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    errors = [
        line for line in result.stderr.splitlines() if line.startswith("keras-bn-export: error:")
    ]
    assert len(errors) == 1, result.stderr[-2000:]
    assert (out / "model.tflite").read_bytes() == b"previous export"
    assert os.listdir(out) == ["model.tflite"]


# --------------------------------------------------------------------------- docs page


@tensorflow_only
def test_docs_errors_page_is_this_table():
    section = docs_page("guide/errors.md")
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ")
    ][1:]
    documented = [(r[0], r[1], r[2].strip("`")) for r in rows if r[0] in ("layer", "export")]
    expected = [
        (area, name, _error_type(error).__name__ if error else "none")
        for area, name, error, _, _ in ERROR_CASES
    ]
    assert documented == expected
    assert any(r[0] == "CLI" for r in rows)

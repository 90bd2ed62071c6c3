"""`import keras_bn` is light, and still lets Keras load `.keras` files that hold keras_bn layers.

Each check runs in a fresh interpreter: what a process has imported, and what Keras has
registered, cannot be undone inside one.
"""

import keras
import pytest

import keras_bn
from helpers import docs_page, python_json, randomise_batch_norms
from keras_bn.export import InferenceAffine, fold_batch_norms

pytestmark = pytest.mark.backends("tensorflow")

HEAVY = ("tensorflow", "keras", "tf2onnx", "ai_edge_litert", "onnxruntime", "onnx")


def test_import_imports_nothing_heavy():
    found = python_json(
        "import json, sys\n"
        "import keras_bn, keras_bn.export, keras_bn.export.cli\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    assert found == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "first_import",
    [
        "import keras_bn.quantize",
        "from keras_bn.quantize import quantize_model",
        "import keras_bn.quantize.layers",
        "import keras\nfrom keras_bn.quantize.fake_quant import weight_grid",
        "import tensorflow\nimport keras_bn.quantize",
    ],
)
def test_keras_bn_quantize_imports_first_in_a_fresh_process(first_import):
    """Keras registers keras_bn's layers as soon as Keras and TensorFlow have loaded, which
    imports keras_bn.quantize's layer modules: as the first import (TensorFlow loading inside
    one of them) that raised AttributeError on a half-imported module."""
    found = python_json(
        f"import json\n{first_import}\n"
        "import keras\n"
        "print(json.dumps(keras.saving.get_registered_object("
        "'keras_bn.quantize>QuantizedHostBatchNorm') is not None))"
    )
    assert found is True


def test_the_lazy_names_are_the_public_ones():
    assert set(keras_bn.__all__) <= set(dir(keras_bn))
    assert set(keras_bn.export.__all__) <= set(dir(keras_bn.export))
    assert keras_bn.UnsupportedModelError is keras_bn.export.UnsupportedModelError
    assert issubclass(keras_bn.UnsupportedModelError, TypeError)
    assert issubclass(keras_bn.UnsupportedModelError, ValueError)
    with pytest.raises(AttributeError, match="module 'keras_bn' has no attribute 'nothing'"):
        keras_bn.nothing  # noqa: B018
    with pytest.raises(AttributeError, match=r"'keras_bn\.export' has no attribute 'nothing'"):
        keras_bn.export.nothing  # noqa: B018


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A model with a keras_bn BN, and a folded model with an InferenceAffine, as .keras files."""
    folder = tmp_path_factory.mktemp("lazy")
    model = randomise_batch_norms(
        keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(3, activation="relu"),
                keras_bn.BatchNormalization(name="bn"),
            ]
        )
    )
    model.save(folder / "bn.keras")
    folded, report = fold_batch_norms(model)
    assert [kept.bn for kept in report.kept] == ["bn"]  # after a ReLU: an InferenceAffine
    assert isinstance(folded.get_layer("bn"), InferenceAffine)
    folded.save(folder / "folded.keras")
    return folder


LOAD = """
import json
import re
{imports}
import keras

found = []
for name in ("bn.keras", "folded.keras"):
    try:
        layer = keras.saving.load_model({folder!r} + "/" + name).get_layer("bn")
        found.append(f"{{type(layer).__module__}}.{{type(layer).__name__}}")
    except TypeError as error:
        located = re.search(r"Could not locate class '\\w+'", str(error))
        found.append("TypeError: " + (located.group(0) if located else "another"))
print(json.dumps(found))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "imports",
    [
        "import keras_bn",  # then keras: the usual order
        "import keras; import keras_bn",
        "import keras_bn; import tensorflow",  # TensorFlow imports Keras halfway through
        "import tensorflow; import keras_bn",
        "from keras_bn.export import cli",  # the command's own import
    ],
)
def test_a_plain_import_lets_keras_load_keras_bn_layers(saved, imports):
    found = python_json(LOAD.format(imports=imports, folder=str(saved)))
    assert found == [
        "keras_bn.layers.BatchNormalization",
        "keras_bn._graph.affine.InferenceAffine",
    ]


@pytest.mark.slow
def test_without_keras_bn_keras_cannot_load_them(saved):
    """Keras does not import a config's module itself (only its own packages': keras,
    keras_hub, keras_cv, keras_nlp), and has no hook by which a file could name one: the
    registration above is what makes the files load, and without it Keras says what
    docs/guide/errors.md quotes."""
    found = python_json(LOAD.format(imports="", folder=str(saved)))
    assert found == [
        "TypeError: Could not locate class 'BatchNormalization'",
        "TypeError: Could not locate class 'InferenceAffine'",
    ]
    assert "Could not locate class 'BatchNormalization'" in docs_page("guide/errors.md")

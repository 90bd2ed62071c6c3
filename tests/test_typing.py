"""Every public function and method of keras_bn has a type for each parameter and its return.

The public API is tests/test_docstrings.py's walk: `__all__` of keras_bn and keras_bn.export,
and of the public submodules callbacks, convert, diagnostics and quantize, with the public
methods and properties of those classes (their own, or a keras_bn base's). A class counts with
its constructor, where it or a keras_bn base defines one (a dataclass's generated `__init__`
too); a property with its getter. Every parameter but `self`/`cls` needs a type, `*args` and
`**kwargs` included, and so does the return; each annotation must resolve at run time
(`typing.get_type_hints`), so that no annotation names something its module cannot reach.
(keras_bn.quantize.fake_quant's functions are checked in tests/test_quantize_api.py.)

mypy checks that the types are right (`make typecheck`, with `disallow_untyped_defs` on the
annotated modules); this test checks that the public API has them.
"""

import inspect
import typing

import pytest
from test_docstrings import PUBLIC, _members

pytestmark = pytest.mark.backends("tensorflow")


def _functions():
    """{qualified name: function} for every public function, method, property getter and
    constructor; a constructor is named `<class>.__init__`."""
    found = {}
    for name, value in PUBLIC.items():
        if inspect.isfunction(value):
            found[name] = value
        elif isinstance(value, property):
            found[name] = value.fget
        elif inspect.isclass(value):
            init = _members(value).get("__init__")
            if inspect.isfunction(init):  # else Keras's or Python's own
                found[f"{name}.__init__"] = init
    return found


def unannotated(function):
    """The names of `function`'s parameters without a type (`self` and `cls` need none),
    and "return" when its return has none."""
    signature = inspect.signature(function)
    missing = [
        name
        for name, parameter in signature.parameters.items()
        if name not in ("self", "cls") and parameter.annotation is parameter.empty
    ]
    if signature.return_annotation is signature.empty:
        missing.append("return")
    return missing


FUNCTIONS = _functions()


def test_the_walk_reaches_every_kind_of_public_callable():
    """Functions, methods, hooks, constructors (a dataclass's included) and property getters
    are all checked, so a broken walk cannot pass vacuously."""
    for name in (
        "keras_bn.recalibrate",
        "keras_bn.BatchNormalization.__init__",
        "keras_bn.BatchNormalization.call",
        "keras_bn.LayerChange.__init__",
        "keras_bn.LayerChange.mean_change",
        "keras_bn.callbacks.Recalibrate.on_test_end",
        "keras_bn.convert.to_keras",
        "keras_bn.diagnostics.Findings.__init__",
        "keras_bn.diagnostics.landscape_along_gradient",
        "keras_bn.quantize.quantize_model",
        "keras_bn.quantize.QuantizationReport.__init__",
        "keras_bn.export.FoldReport.relative_error",
    ):
        assert name in FUNCTIONS, name


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_every_parameter_and_the_return_have_a_type(name):
    function = FUNCTIONS[name]
    missing = unannotated(function)
    assert not missing, f"{name}: no annotation for {missing}"
    typing.get_type_hints(function)  # NameError: an annotation names what the module lacks


def test_the_check_finds_what_is_missing():
    def bare(self, model, *layers, steps=None, **options):
        return model

    def partial(model: object, steps: int | None = None):
        return model

    def complete(self, model: object, *layers: str, steps: int = 1, **options: float) -> None:
        pass

    def dangling(model: "NoSuchType") -> None:  # noqa: F821
        pass

    assert unannotated(bare) == ["model", "layers", "steps", "options", "return"]
    assert unannotated(partial) == ["return"]
    assert unannotated(complete) == unannotated(dangling) == []
    typing.get_type_hints(complete)
    with pytest.raises(NameError, match="NoSuchType"):
        typing.get_type_hints(dangling)

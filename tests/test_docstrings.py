"""Every public name has a Google-style docstring (napoleon renders it in the API reference).

The public names: `keras_bn.__all__`, `keras_bn.export.__all__`, the `__all__` of the public
submodules callbacks, diagnostics, convert and quantize, and the public methods and properties that
those classes define themselves or inherit from a keras_bn base. Each has a docstring of its
own (a dataclass's generated signature line does not count); each parameter of a function or
class is an entry of its `Args:` (or, for a dataclass, `Attributes:`) section, and every
`Args:` entry is a parameter; a function that returns a value has `Returns:`; one whose own
code raises lists each exception it raises in `Raises:`, and so do the callables in RAISES,
whose exceptions come from the helpers they call (tests/test_errors.py triggers them).
"""

import ast
import inspect
import re
import sys
import textwrap

import pytest

import keras_bn
import keras_bn.export

pytestmark = pytest.mark.backends("tensorflow")

MODULES = [
    keras_bn,
    keras_bn.export,
    keras_bn.callbacks,
    keras_bn.diagnostics,
    keras_bn.convert,
    keras_bn.quantize,
]

# Exceptions raised by the helpers a public callable calls, which its own body does not show.
RAISES = {
    "keras_bn.BatchNormalization": {"ValueError", "TypeError"},
    "keras_bn.BatchNormalization.build": {"ValueError"},
    "keras_bn.BatchNormalization.call": {"TypeError", "ValueError"},
    "keras_bn.recalibrate": {"ValueError"},
    "keras_bn.callbacks.Recalibrate": {"ValueError"},
    "keras_bn.callbacks.Recalibrate.on_train_end": {"ValueError"},
    "keras_bn.callbacks.Recalibrate.on_test_begin": {"ValueError"},
    "keras_bn.convert.from_keras": {"UnsupportedModelError"},
    "keras_bn.convert.to_keras": {"UnsupportedModelError"},
    "keras_bn.diagnostics.check_batchnorm": {"ValueError", "UnsupportedModelError"},
    "keras_bn.diagnostics.gradient_norms_by_layer": {"ValueError"},
    "keras_bn.diagnostics.landscape_along_gradient": {"ValueError"},
    "keras_bn.diagnostics.internal_covariate_shift": {"ValueError"},
    "keras_bn.export.fold_batch_norms": {"UnsupportedModelError", "ValueError"},
    "keras_bn.export.export_tflite": {
        "VerificationError",
        "UnsupportedModelError",
        "ValueError",
        "OSError",
    },
    "keras_bn.export.export_onnx": {
        "VerificationError",
        "UnsupportedModelError",
        "ValueError",
        "OSError",
    },
    "keras_bn.export.InferenceAffine.set_affine": {"ValueError"},
    "keras_bn.quantize.QuantizedHostBatchNorm": {"ValueError"},
    "keras_bn.quantize.QuantizedHost": {"ValueError"},
    "keras_bn.quantize.ActivationQuantizer": {"ValueError"},
    "keras_bn.quantize.FreezeBatchNorm": {"ValueError"},
    "keras_bn.quantize.from_layers": {"ValueError"},
    "keras_bn.quantize.freeze_batch_norm": {"ValueError"},
    "keras_bn.quantize.quantize_model": {"ValueError", "UnsupportedModelError"},
}
# Documents a clone of the project does not have.
MISSING_DOCUMENTS = ("design.md", "reference.md", "shared/")
SECTIONS = {"Args", "Attributes", "Returns", "Yields", "Raises", "Example", "Examples", "Note"}
ENTRY = re.compile(r"\s*(\*{0,2}[A-Za-z_][\w.]*)\s*(\([^)]*\))?:")


def _exported(module):
    """`module.__all__`, or else the functions and classes it defines under public names."""
    if hasattr(module, "__all__"):
        return module.__all__
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module.__name__
    ]


def _public():
    """(qualified name, object) for every public name, and for the public methods and
    properties the public classes define themselves."""
    found = {}
    for module in MODULES:
        found[module.__name__] = module
        for name in _exported(module):
            value = getattr(module, name)
            found[f"{module.__name__}.{name}"] = value
            if inspect.isclass(value):
                for member, attribute in _members(value).items():
                    if member.startswith("_"):
                        continue
                    if isinstance(attribute, (staticmethod, classmethod)):
                        attribute = attribute.__func__
                    if inspect.isfunction(attribute) or isinstance(attribute, property):
                        found[f"{module.__name__}.{name}.{member}"] = attribute
    return found


def _members(cls):
    """The attributes a class defines itself or inherits from keras_bn's own classes (a
    shared base such as the reports' error properties), not from Keras or Python."""
    members = {}
    for base in reversed(cls.__mro__):
        if base is cls or base.__module__.startswith("keras_bn"):
            members.update(vars(base))
    return members


PUBLIC = _public()
CALLABLES = {
    name: obj for name, obj in PUBLIC.items() if inspect.isclass(obj) or inspect.isfunction(obj)
}
CONSTANTS = {
    name: obj
    for name, obj in PUBLIC.items()
    if not (
        inspect.ismodule(obj)
        or inspect.isclass(obj)
        or inspect.isfunction(obj)
        or isinstance(obj, property)
    )
}


def _own_doc(obj):
    """The docstring written for `obj`, or None (a dataclass's generated one is not)."""
    if isinstance(obj, property):
        obj = obj.fget
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if doc and inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("):
        return None  # dataclasses.dataclass writes "Name(field: type, ...)" when there is none
    return doc


def _sections(doc):
    """{section title: its lines (indented)} for the Google-style sections of `doc`."""
    sections, current = {}, None
    for line in inspect.cleandoc(doc).splitlines():
        if line and not line[0].isspace():
            title = line.rstrip()[:-1] if line.rstrip().endswith(":") else None
            current = title if title in SECTIONS else None
            if current:
                sections[current] = []
        elif current:
            sections[current].append(line)
    return sections


def _entries(lines):
    """The names an Args/Attributes/Raises section describes: its least indented lines'
    `name:` or `name (type):` heads."""
    lines = [line for line in lines if line.strip()]
    if not lines:
        return []
    indent = min(len(line) - len(line.lstrip()) for line in lines)
    names = []
    for line in lines:
        match = ENTRY.match(line)
        if len(line) - len(line.lstrip()) == indent and match:
            names.append(match.group(1).lstrip("*"))
    return names


def _parameters(obj):
    """The documented parameters: a function's, or a class's constructor's (self dropped)."""
    target = _members(obj).get("__init__") if inspect.isclass(obj) else obj
    if target is None:
        # Inherits its constructor from Keras or Python (keras.layers.Layer's): nothing of its
        # own; a keras_bn base's (a private one's) is its own.
        return []
    names = list(inspect.signature(target).parameters)
    return [name for name in names if name not in ("self", "cls")]


def _function_node(function):
    """The ast node of a function's own definition."""
    source = textwrap.dedent(inspect.getsource(function))
    return ast.parse(source).body[0]


def _own_statements(node):
    """Every node of a function's body, not descending into nested functions or classes."""
    stack = list(node.body)
    while stack:
        current = stack.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
            ):
                stack.append(child)


def _raised_directly(function):
    """Names of the exceptions `raise X(...)` statements in the function's own body raise."""
    names = set()
    for node in _own_statements(_function_node(function)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            names.add(exc.attr if isinstance(exc, ast.Attribute) else getattr(exc, "id", "?"))
    return names


def _returns_value(function):
    return any(
        isinstance(node, ast.Return)
        and node.value is not None
        and not (isinstance(node.value, ast.Constant) and node.value.value is None)
        for node in _own_statements(_function_node(function))
    )


def test_the_public_api_is_what_this_test_walks():
    """The walk reaches the names the issue lists, so a broken walk cannot pass vacuously."""
    for name in (
        "keras_bn.BatchNormalization",
        "keras_bn.export.FoldReport.relative_error",
        "keras_bn.export.ExportReport.passed",
        "keras_bn.export.ExportReport.to_dict",
        "keras_bn.export.InferenceAffine.set_affine",
        "keras_bn.convert.to_keras",
        "keras_bn.diagnostics.Findings",
        "keras_bn.export.INT8_SPREAD_THRESHOLD",
    ):
        assert name in PUBLIC, name
    assert set(RAISES) <= set(PUBLIC), sorted(set(RAISES) - set(PUBLIC))


@pytest.mark.parametrize("name", sorted(set(PUBLIC) - set(CONSTANTS)))
def test_has_a_docstring_of_its_own(name):
    doc = _own_doc(PUBLIC[name])
    assert doc and len(doc.split()) >= 5, f"{name} has no docstring (or a trivial one)"
    cited = [document for document in MISSING_DOCUMENTS if document in doc]
    assert not cited, f"{name}'s docstring cites {cited}, which the project does not contain"


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_constant_has_a_doc_comment(name):
    """Sphinx documents a module constant from the `#:` comment above its assignment."""
    short = name.rsplit(".", 1)[-1]
    # The module that assigns this very object (a re-exporting module does not; another module
    # may assign a different object to the same name).
    module = next(
        module
        for module in list(sys.modules.values())
        if getattr(module, "__name__", "").startswith("keras_bn")
        and getattr(module, short, None) is CONSTANTS[name]
        and re.search(rf"^{short} = ", _source(module), re.M)
    )
    lines = _source(module).splitlines()
    line = next(i for i, text in enumerate(lines) if text.startswith(f"{short} = "))
    assert line > 0 and lines[line - 1].startswith("#: "), f"{name} has no #: doc comment"


def _source(module):
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


@pytest.mark.parametrize("name", sorted(CALLABLES))
def test_every_parameter_is_documented(name):
    obj = CALLABLES[name]
    sections = _sections(_own_doc(obj) or "")
    args = _entries(sections.get("Args", []))
    attributes = _entries(sections.get("Attributes", []))
    parameters = _parameters(obj)
    documented = args + (attributes if hasattr(obj, "__dataclass_fields__") else [])
    missing = [p for p in parameters if p not in documented]
    assert not missing, f"{name}: parameters {missing} have no entry in Args/Attributes"
    unknown = [a for a in args if a not in parameters]
    assert not unknown, f"{name}: Args documents {unknown}, which are not parameters"


@pytest.mark.parametrize("name", sorted(n for n, o in CALLABLES.items() if inspect.isfunction(o)))
def test_a_function_that_returns_a_value_documents_it(name):
    if _returns_value(CALLABLES[name]):
        sections = _sections(_own_doc(CALLABLES[name]) or "")
        assert "Returns" in sections or "Yields" in sections, f"{name} has no Returns section"


@pytest.mark.parametrize("name", sorted(CALLABLES))
def test_every_exception_raised_is_documented(name):
    obj = CALLABLES[name]
    function = obj.__init__ if inspect.isclass(obj) and "__init__" in vars(obj) else obj
    raised = RAISES.get(name, set())
    # A dataclass's generated __init__ has no source, and raises nothing.
    if inspect.isfunction(function) and not function.__code__.co_filename.startswith("<"):
        raised = raised | _raised_directly(function)
    documented = {
        entry.rsplit(".", 1)[-1]
        for entry in _entries(_sections(_own_doc(obj) or "").get("Raises", []))
    }
    missing = sorted(raised - documented)
    assert not missing, f"{name} raises {missing}, which its Raises section does not list"


def test_the_checks_catch_an_undocumented_function():
    """The parsing above finds what is missing: a docstring without Args, Returns and Raises
    fails every check, and a complete one passes them."""

    def bare(model, steps=None):
        """Does something useful with a model, in several steps."""
        if steps is None:
            raise ValueError(steps)
        return model

    def documented(model, steps=None):
        """Does something useful with a model, in several steps.

        Args:
            model: a model.
            steps (int): how many.

        Returns:
            The model.

        Raises:
            ValueError: no steps.
        """
        if steps is None:
            raise ValueError(steps)
        return model

    assert _entries(_sections(bare.__doc__).get("Args", [])) == []
    assert _returns_value(bare) and _raised_directly(bare) == {"ValueError"}
    sections = _sections(documented.__doc__)
    assert _entries(sections["Args"]) == _parameters(documented) == ["model", "steps"]
    assert "Returns" in sections and _entries(sections["Raises"]) == ["ValueError"]

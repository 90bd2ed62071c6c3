"""The import structure of the project, read statically with `ast`: no module of keras_bn/ or
export/ (installed as keras_bn.export) imports itself back through any chain of imports, the
TensorFlow backend's train paths sit on its leaves, and TensorFlow, JAX and PyTorch are imported
at module level only inside keras_bn/backend/ (docs/architecture.md, "Modules").

The graph's nodes are the project's modules, found by walking the package directories (so a
module added later is covered). Its edges are every `import` and `from ... import` statement
anywhere in a file, those inside functions (lazy imports) included: a cycle closed by a lazy
import still means the two modules cannot be understood, or loaded, one before the other.
`from package import name` is an edge to the submodule package.name when there is one, else to
the package (its __init__). The implicit import of a module's parent packages is not an edge.
"""

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.backends("tensorflow")

ROOT = Path(__file__).resolve().parent.parent
# Package name → its directory; export/ is installed as keras_bn.export (pyproject.toml).
PACKAGES = {"keras_bn": ROOT / "keras_bn", "keras_bn.export": ROOT / "export"}

TF = "keras_bn.backend.tensorflow"
# The backend-neutral shape rules, the shared constants, and where the traced graph runs: they
# import no project module.
LEAVES = {"keras_bn.backend.axes", "keras_bn.backend.constants", f"{TF}.placement"}
# The TensorFlow backend's statistics helpers: on the leaves only.
STATISTICS = f"{TF}.statistics"
# The three train paths: siblings that import only the leaves and the statistics, never each
# other nor ops.
TRAIN_PATHS = {f"{TF}.fused", f"{TF}.xla", f"{TF}.composite"}
# The frameworks whose import only keras_bn/backend/ may make at module level.
FRAMEWORKS = ("tensorflow", "jax", "torch", "tf2onnx")
# The modules outside keras_bn/backend/ that touch TensorFlow at all, lazily: the diagnostics'
# gradient probes, tf.data input, the writers (with the writers' traced functions and the
# keras-bn-export command), and the entry points' quiet import of TensorFlow.
LAZY_FRAMEWORK_USERS = {
    "keras_bn._quiet",
    "keras_bn.export.cli",
    "keras_bn.diagnostics",
    "keras_bn._recalibration.batches",
    "keras_bn.export.tflite",
    "keras_bn.export.onnx",
    "keras_bn.export.trace",
}


def project_modules(packages):
    """{module name: file} for every .py file under each package's directory.

    Args:
        packages: {package name: its directory}.

    Returns:
        The modules, a package named by its __init__.py.
    """
    modules = {}
    for package, directory in packages.items():
        for path in sorted(Path(directory).rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _known_prefix(name, modules):
    """The longest dotted prefix of `name` (itself included) that is a project module."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _absolute(node, module, path):
    """The absolute module name a `from` statement imports from (resolving `from . import`)."""
    if node.level == 0:
        return node.module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _is_type_checking(node):
    """An `if TYPE_CHECKING:` (or `if typing.TYPE_CHECKING:`) statement."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree, type_checking):
    """Every node of `tree`; without the bodies of `if TYPE_CHECKING:` where `type_checking`
    is False (their `else` runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not type_checking and _is_type_checking(child):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def imports_of(module, path, modules, type_checking=True):
    """The project modules that `module`'s file imports, anywhere in it.

    Args:
        module: the module's name.
        path: its file.
        modules: every project module, from `project_modules`.
        type_checking: include the imports only a type checker makes (`if TYPE_CHECKING:`).

    Returns:
        The set of imported project modules, `module` itself left out.
    """
    targets = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in _statements(tree, type_checking):
        if isinstance(node, ast.Import):
            targets.update(_known_prefix(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in modules else _known_prefix(source, modules))
    return targets - {None, module}


def import_graph(packages, type_checking=True):
    """{module: the project modules it imports} for every module of `packages` (with or
    without the imports only a type checker makes)."""
    modules = project_modules(packages)
    return {
        module: imports_of(module, path, modules, type_checking) for module, path in modules.items()
    }


def longest_chain(graph):
    """The longest chain of imports in an acyclic `graph`, as the modules along it, from the
    importing one down to a module that imports none."""
    chains = {}

    def chain(module):
        if module not in chains:
            below = [chain(target) for target in sorted(graph.get(module, ()))]
            chains[module] = [module, *max(below, key=len, default=[])]
        return chains[module]

    return max((chain(module) for module in sorted(graph)), key=len, default=[])


def find_cycle(graph):
    """One import cycle of `graph`, as the modules along it with the first repeated at the end
    (e.g. ["a", "b", "a"]), or None when there is none. A depth-first search: a cycle is an
    edge back to a module still on the search's path."""
    done, on_path = set(), []

    def visit(module):
        on_path.append(module)
        for target in sorted(graph.get(module, ())):
            if target in on_path:
                return [*on_path[on_path.index(target) :], target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        on_path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


GRAPH = import_graph(PACKAGES)


def test_the_walk_covers_every_installed_package():
    """Each package pyproject.toml installs is found under its name, from its directory."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    directories = setuptools.get("package-dir", {})
    modules = project_modules(PACKAGES)
    for package in setuptools["packages"]:
        directory = ROOT / directories.get(package, package.replace(".", "/"))
        assert modules.get(package) == directory / "__init__.py", package


def test_the_walk_finds_the_imports():
    """A broken walk cannot pass vacuously: it has the edges it must, a lazy one included."""
    for module in ("keras_bn", f"{TF}.ops", "keras_bn.layers", "keras_bn.export.fold"):
        assert module in GRAPH, module
    assert GRAPH[f"{TF}.ops"] >= TRAIN_PATHS
    assert "keras_bn.backend" in GRAPH["keras_bn.layers"]
    # imported inside a function of export/cli.py
    assert "keras_bn.export.onnx" in GRAPH["keras_bn.export.cli"]


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_keras_bn_never_imports_the_exporter():
    """The package stands without export/ (installed as keras_bn.export): no module outside it
    imports it, lazily or not; what both need (the fold's decisions, its affine layers) lives
    in keras_bn/_graph/."""
    exporter = "keras_bn.export"
    found = {
        module: sorted(t for t in targets if t == exporter or t.startswith(exporter + "."))
        for module, targets in GRAPH.items()
        if not (module == exporter or module.startswith(exporter + "."))
    }
    assert not {module: targets for module, targets in found.items() if targets}


def test_the_import_graph_is_at_most_8_levels_deep():
    """The longest chain of imports that run, lazy ones included, is 8 modules at most. The
    imports only a type checker makes are left out: they never run (keras_bn/__init__.py's,
    which name the lazy public names for type checkers, add a ninth level over
    keras_bn.quantize). Before the layout of docs/architecture.md: 9, and 11 with them."""
    chain = longest_chain(import_graph(PACKAGES, type_checking=False))
    assert len(chain) <= 8, " -> ".join(chain)


def test_longest_chain_and_the_type_checking_reading(tmp_path):
    graph = {"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert longest_chain(graph) == ["d", "a", "b", "c"]
    package = tmp_path / "p"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "b.py").write_text("")
    (package / "c.py").write_text("")
    (package / "a.py").write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    from p import b\nelse:\n    from p import c\n"
    )
    assert import_graph({"p": package})["p.a"] == {"p.b", "p.c"}
    assert import_graph({"p": package}, type_checking=False)["p.a"] == {"p.c"}


def test_leaves_import_no_project_module():
    for module in sorted(LEAVES):
        assert module in GRAPH, f"{module} is missing"
        assert not GRAPH[module], f"{module} imports {sorted(GRAPH[module])}"


def test_statistics_import_only_the_leaves():
    assert GRAPH[STATISTICS] <= LEAVES, f"{STATISTICS} imports {sorted(GRAPH[STATISTICS])}"


def test_train_paths_import_only_the_leaves():
    allowed = LEAVES | {STATISTICS}
    for module in sorted(TRAIN_PATHS):
        assert module in GRAPH, f"{module} is missing"
        assert GRAPH[module] <= allowed, f"{module} imports {sorted(GRAPH[module] - allowed)}"


def framework_imports(path):
    """(module-level, lazy): the frameworks of FRAMEWORKS that `path` imports at module level
    (outside any function or class body, under an `if` or `try` too) and inside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nested = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        for inner in ast.walk(node)
        if inner is not node
    }
    top, lazy = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            names = []
        for name in names:
            root = name.split(".")[0]
            if root in FRAMEWORKS:
                (lazy if id(node) in nested else top).add(root)
    if 'sys.modules.get("tensorflow")' in path.read_text():  # a look without an import
        lazy.add("tensorflow")
    return top, lazy


def test_only_the_backends_import_a_framework_at_module_level():
    """Importing any keras_bn module outside keras_bn/backend/ imports no TensorFlow, JAX or
    PyTorch: a JAX or PyTorch user needs no TensorFlow, a TensorFlow user neither of them."""
    offenders = {}
    for module, path in project_modules(PACKAGES).items():
        top, _ = framework_imports(path)
        if top and not module.startswith("keras_bn.backend."):
            offenders[module] = sorted(top)
    assert not offenders, f"module-level framework imports outside keras_bn/backend/: {offenders}"


def test_few_modules_outside_the_backends_touch_a_framework():
    touching = {
        module
        for module, path in project_modules(PACKAGES).items()
        if not module.startswith("keras_bn.backend") and any(framework_imports(path))
    }
    assert touching == LAZY_FRAMEWORK_USERS


def imported_signatures(backend_name):
    """({function: ((parameter, repr of its default or None), ...)}, __all__) of the imported
    keras_bn.backend.<backend_name>."""
    import inspect

    module = importlib.import_module(f"keras_bn.backend.{backend_name}")
    functions = {
        name: tuple(
            (p.name, None if p.default is p.empty else repr(p.default))
            for p in inspect.signature(function).parameters.values()
        )
        for name, function in vars(module).items()
        if inspect.isfunction(function)
    }
    return functions, list(module.__all__)


def static_signatures(backend_name):
    """What `imported_signatures` gives, read from the sources with `ast`, for a backend whose
    framework this Python lacks: the functions keras_bn/backend/<backend_name>/__init__.py
    defines, those it imports by name from keras_bn/backend/ and, from a `*` import, those of
    the interface the module defines (its `__all__`); `__all__ = list(INTERFACE)`."""
    from keras_bn.backend import INTERFACE

    package = "keras_bn.backend"
    directory = ROOT / "keras_bn" / "backend" / backend_name

    def parameters(args):
        """((name, repr of its default or None), ...) in inspect's order."""
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
        pairs = list(zip(positional, defaults))
        pairs += [(args.vararg, None)] if args.vararg else []
        pairs += list(zip(args.kwonlyargs, args.kw_defaults))
        pairs += [(args.kwarg, None)] if args.kwarg else []
        return tuple(
            (arg.arg, None if default is None else repr(ast.literal_eval(default)))
            for arg, default in pairs
        )

    def defined(path):
        tree = ast.parse(path.read_text(), filename=str(path))
        return tree, {
            node.name: parameters(node.args)
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
        }

    tree, functions = defined(directory / "__init__.py")
    exported = None
    for node in tree.body:
        source = (
            ROOT.joinpath(*node.module.split(".")) if isinstance(node, ast.ImportFrom) else None
        )
        # `from <package> import a, b` imports modules: only imports from module files count.
        if source is not None and node.module.startswith(package + ".") and not source.is_dir():
            _, found = defined(source.with_suffix(".py"))
            if [alias.name for alias in node.names] == ["*"]:
                functions.update({name: found[name] for name in INTERFACE if name in found})
            else:
                functions.update({alias.name: found[alias.name] for alias in node.names})
        elif isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"]:
            assert ast.unparse(node.value) == "list(INTERFACE)", ast.unparse(node.value)
            exported = list(INTERFACE)
    return functions, exported


def _importable(backend_name):
    """Whether this Python has the backend's framework (each backend is named after its
    framework's module)."""
    return importlib.util.find_spec(backend_name) is not None


# The calls that tell which backend Keras runs: `keras_bn.backend.name()`,
# `keras.backend.backend()` and `keras.config.backend()`.
_NAME_CALLS = {("backend", "name"), ("keras.backend", "backend"), ("keras.config", "backend")}


def _dotted(node):
    """ "a.b.c" for a chain of attribute reads on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def backend_name_calls(path):
    """The lines of `path` that ask for the Keras backend's name."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and (_dotted(node.func.value), node.func.attr) in _NAME_CALLS
        ):
            lines.append(node.lineno)
    return lines


def test_no_backend_name_branch_outside_the_backends():
    """Code outside keras_bn/backend/ asks the backend for what it can do
    (`backend.get().takes_tf_data()`, ...), never which one it is: a new backend then needs
    no change outside its own folder."""
    found = {
        module: backend_name_calls(path)
        for module, path in project_modules(PACKAGES).items()
        if not module.startswith("keras_bn.backend")
    }
    assert not {module: lines for module, lines in found.items() if lines}


def test_the_name_call_finder_sees_each_form(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import keras\nfrom keras_bn import backend\n"
        "a = backend.name() == 'jax'\nb = keras.backend.backend()\nc = keras.config.backend()\n"
        "d = backend.get().takes_tf_data()\n"
    )
    assert sorted(backend_name_calls(path)) == [3, 4, 5]


def test_each_backend_exposes_the_same_interface():
    """keras_bn/backend/{tensorflow,jax,torch} each have every function of the interface, with
    the same parameters (names and defaults): imported where this Python has the framework,
    else read from the sources (the TensorFlow suite's Python has no PyTorch)."""
    from keras_bn import backend

    found = {
        name: (imported_signatures(name) if _importable(name) else static_signatures(name))
        for name in backend.SUPPORTED
    }
    missing = {
        name: sorted(set(backend.INTERFACE) - set(functions))
        for name, (functions, _) in found.items()
        if set(backend.INTERFACE) - set(functions)
    }
    assert not missing, missing
    differ = {}
    for function in backend.INTERFACE:
        signatures = {functions[function] for functions, _ in found.values()}
        if len(signatures) > 1:
            differ[function] = sorted(signatures)
    assert not differ, differ
    for name, (_, exported) in found.items():
        assert sorted(exported) == sorted(backend.INTERFACE), name


def test_the_static_reading_of_a_backend_agrees_with_its_import():
    """The `ast` reading that stands in for a backend whose framework is missing gives what
    importing it gives, on every backend this Python can import (it cannot pass vacuously)."""
    from keras_bn import backend

    checked = 0
    for name in backend.SUPPORTED:
        if not _importable(name):
            continue
        imported, exported = imported_signatures(name)
        static, static_exported = static_signatures(name)
        assert static_exported == exported, name
        assert {f: static[f] for f in backend.INTERFACE} == {
            f: imported[f] for f in backend.INTERFACE
        }, name
        checked += 1
    assert checked, "no backend's framework is importable here"


def test_the_framework_finder_tells_module_level_from_lazy(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import os\ntry:\n    import tensorflow as tf\nexcept ImportError:\n    pass\n"
        "def f():\n    import jax.numpy as jnp\nclass C:\n    from tf2onnx import convert\n"
    )
    assert framework_imports(path) == ({"tensorflow"}, {"jax", "tf2onnx"})


# The finder itself, on trees written here: it must see the cycles it exists to catch.


def _tree(root, files):
    """Write {relative path: source} under root; returns root."""
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


def _rotated(cycle):
    """A cycle without its repeated end, rotated to start at its smallest module."""
    body = cycle[:-1]
    start = body.index(min(body))
    return body[start:] + body[:start]


def test_finder_reports_the_old_ops_xla_cycle(tmp_path):
    """The layout this test replaced: ops imported xla at module level, and xla imported ops."""
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.ops import batch_norm_train\n",
            "pkg/ops.py": "import tensorflow as tf\n\nfrom pkg import xla\n",
            "pkg/xla.py": "from pkg import ops\n",
        },
    )
    graph = import_graph({"pkg": root / "pkg"})
    assert graph == {"pkg": {"pkg.ops"}, "pkg.ops": {"pkg.xla"}, "pkg.xla": {"pkg.ops"}}
    cycle = find_cycle(graph)
    assert cycle[0] == cycle[-1] and _rotated(cycle) == ["pkg.ops", "pkg.xla"]


def test_finder_sees_lazy_imports_and_the_mapped_package(tmp_path):
    """A cycle closed by an import inside a function, through a package installed under another
    name (as export/ is keras_bn.export), via `from package import name` of a non-module."""
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.layers import Layer\n",
            "pkg/layers.py": "def fold():\n    from pkg.export import fold_all\n",
            "exp/__init__.py": "from pkg.export.graph import fold_all\n",
            "exp/graph.py": "import numpy\n\n\ndef f():\n    from pkg import Layer\n",
        },
    )
    graph = import_graph({"pkg": root / "pkg", "pkg.export": root / "exp"})
    assert graph["pkg.layers"] == {"pkg.export"}  # fold_all is no module: the package
    assert graph["pkg.export.graph"] == {"pkg"}
    assert _rotated(find_cycle(graph)) == ["pkg", "pkg.layers", "pkg.export", "pkg.export.graph"]


def test_finder_resolves_relative_and_dotted_imports(tmp_path):
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from . import b\nfrom .sub import c\nimport pkg.sub.d as d\n",
            "pkg/b.py": "from .a import *\n",
            "pkg/sub/__init__.py": "from .. import b\n",
            "pkg/sub/c.py": "",
            "pkg/sub/d.py": "",
        },
    )
    graph = import_graph({"pkg": root / "pkg"})
    assert graph["pkg.a"] == {"pkg.b", "pkg.sub.c", "pkg.sub.d"}
    assert graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.sub"] == {"pkg.b"}
    assert _rotated(find_cycle(graph)) == ["pkg.a", "pkg.b"]


def test_finder_ignores_parent_packages_and_accepts_a_tree_without_cycles(tmp_path):
    """A submodule's implicit import of its package is no edge, though the package imports it;
    nor is a package's import of itself."""
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import core\nfrom pkg import VERSION\n",
            "pkg/core.py": "from pkg import leaf\n",
            "pkg/leaf.py": "import os\n",
        },
    )
    graph = import_graph({"pkg": root / "pkg"})
    assert graph == {"pkg": {"pkg.core"}, "pkg.core": {"pkg.leaf"}, "pkg.leaf": set()}
    assert find_cycle(graph) is None


@pytest.mark.parametrize(
    "graph,expected",
    [
        ({"a": {"a"}}, ["a", "a"]),  # a graph given directly may hold a self-edge
        ({"a": {"b"}, "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),  # a diamond is no cycle
    ],
)
def test_find_cycle_on_small_graphs(graph, expected):
    assert find_cycle(graph) == expected


def test_the_float_tools_do_not_import_qat():
    """recalibrate, Recalibrate and check_batchnorm tell a QAT layer (which recalibrate
    settles, and check_batchnorm refuses) by a class attribute (`folds_batch_norm`), not by
    importing keras_bn.quantize."""
    for module in ("keras_bn.population", "keras_bn.callbacks", "keras_bn.check"):
        qat = sorted(m for m in GRAPH[module] if m.startswith("keras_bn.quantize"))
        assert not qat, f"{module} imports {qat}"

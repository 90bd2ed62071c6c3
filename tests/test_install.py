"""`pip install ".[export]"` gives a working keras_bn.export and keras-bn-export, the core
installs no backend, and the wheel ships the PEP 561 markers of both packages.

Offline: a fresh venv sees, through a .pth file, only the distributions that the core
dependency list of pyproject.toml and its export extra pull in (resolved from this environment's
metadata), each file linked from this environment; pip then installs the project into it with
--no-index. A dependency missing from those lists is missing there too, and the export fails.
"""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile

import keras
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.backends("tensorflow")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Building the project offline needs its build backend in the venv too.
BUILD_TOOLS = ["setuptools", "wheel"]
# PEP 561: type checkers read a package's annotations only where it holds this marker.
TYPED_MARKERS = ["keras_bn/py.typed", "keras_bn/export/py.typed"]
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _requirements(*extras):
    """The core dependencies of pyproject.toml and those of `extras`."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as file:
        project = tomllib.load(file)["project"]
    optional = project["optional-dependencies"]
    return project["dependencies"] + [r for extra in extras for r in optional[extra]]


def _closure(requirements):
    """Every installed distribution that `requirements` need, transitively (markers evaluated,
    extras followed where a requirement asks for them)."""
    found, todo = {}, [(r, "") for r in requirements]
    while todo:
        text, extra = todo.pop()
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        wanted = {""} | set(requirement.extras)
        done = found.get(name, (None, set()))[1]
        if wanted <= done:
            continue
        distribution = importlib.metadata.distribution(requirement.name)
        found[name] = (distribution, done | wanted)
        for dependency in distribution.requires or []:
            todo.extend((dependency, e) for e in wanted - done)
    return [distribution for distribution, _ in found.values()]


def _link_files(distributions, site):
    """Mirror the distributions' files into `site` as symlinks. Top-level entries owned by one
    distribution are linked whole (with their compiled .pyc); shared ones file by file."""
    owners = {}
    for distribution in importlib.metadata.distributions():
        for top in {f.parts[0] for f in distribution.files or [] if f.parts[0] != ".."}:
            owners.setdefault(top, set()).add(canonicalize_name(distribution.metadata["Name"]))
    for distribution in distributions:
        for file in distribution.files or []:
            top = file.parts[0]
            if top == "..":  # scripts in bin/: pip makes the ones this project needs
                continue
            whole = len(owners.get(top, ())) == 1
            relative = top if whole else str(file)
            target = os.path.join(site, relative)
            if os.path.lexists(target):
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(distribution.locate_file(relative), target)


def _copy_source(tmp_path):
    """What the build reads, copied (the build writes egg-info and build/ next to it)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    for name in ("keras_bn", "export"):
        shutil.copytree(
            os.path.join(ROOT, name), source / name, ignore=shutil.ignore_patterns("__pycache__")
        )
    return source


def test_the_wheel_ships_both_packages_type_markers(tmp_path):
    """keras_bn/py.typed and keras_bn/export/py.typed (from export/) are in the wheel, with
    the modules they mark."""
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path / "dist"),
            str(_copy_source(tmp_path)),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **OFFLINE},
        timeout=300,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("keras_bn-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in TYPED_MARKERS if name not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    assert {
        "keras_bn/layers.py",
        "keras_bn/export/graph.py",
        "keras_bn/quantize/rewrite.py",
    } <= names


@pytest.mark.slow
def test_install_with_the_export_extra_runs_the_export_command(tmp_path):
    core = {canonicalize_name(d.metadata["Name"]) for d in _closure(_requirements())}
    assert {"keras", "numpy", "rich"} <= core
    assert not core & {"tensorflow", "jax", "jaxlib", "tf2onnx", "onnx", "onnxruntime"}
    distributions = _closure(_requirements("export") + BUILD_TOOLS)
    names = {canonicalize_name(d.metadata["Name"]) for d in distributions}
    assert {"tensorflow", "tf2onnx", "onnx", "onnxruntime", "ai-edge-litert", "rich"} <= names
    assert not names & {"scikit-learn", "pytest", "hypothesis", "nbclient", "jax"}
    site = tmp_path / "deps"
    _link_files(distributions, site)

    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with open(os.path.join(purelib, "_keras_bn_test_deps.pth"), "w") as file:
        file.write(f"{site}\n")
    source = _copy_source(tmp_path)
    env = {**os.environ, **OFFLINE, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    install = subprocess.run(
        [python, "-m", "pip", "install", "--no-index", "--no-build-isolation", f"{source}[export]"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    for marker in TYPED_MARKERS:
        assert os.path.isfile(os.path.join(purelib, marker)), marker

    script = venv / "bin" / "keras-bn-export"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0 and "--tflite" in result.stdout, result.stderr
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(2),
        ]
    )
    model.save(tmp_path / "m.keras")
    result = subprocess.run(
        [
            script,
            tmp_path / "m.keras",
            "--tflite",
            tmp_path / "m.tflite",
            "--onnx",
            tmp_path / "m.onnx",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "batch norms: 1 folded" in result.stdout and "verification passed" in result.stdout
    # The installed copy, not this checkout, and no extra's package.
    where = subprocess.run(
        [
            python,
            "-c",
            "import keras_bn.export, importlib.util as u; "
            "print(keras_bn.export.__file__, u.find_spec('sklearn'), "
            "u.find_spec('pytest'))",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert where.stdout.split() == [
        os.path.join(purelib, "keras_bn", "export", "__init__.py"),
        "None",
        "None",
    ], where

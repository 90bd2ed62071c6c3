"""Settings and fixtures for the whole suite, under the Keras backend of this run.

The one tree runs once per backend, as Keras's own suite does: KERAS_BACKEND (default
"tensorflow") picks it, and Keras fixes it when first imported, so each backend is a pytest
process of its own (`make test` runs three). Per backend: under TensorFlow, 4 logical CPUs (the
tf.distribute tests); under JAX, 2 host devices (keras.distribution); under PyTorch, float32
matmuls (no TF32). Markers: `backends(*names)` runs a test only under those backends;
`requires_tensorflow` only where TensorFlow is importable; `slow` leaves a test out of `make
test-fast` (slow_tests.txt marks the tests that are slow under one backend only). A
module-level `pytestmark` with them skips the whole module before it is imported (a
TensorFlow-only module imports TensorFlow). Helpers that tests import live in helpers.py
(pytest advises against importing conftest.py).
"""

import ast
import importlib.util
import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
BACKEND = os.environ.setdefault("KERAS_BACKEND", "tensorflow")
HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None

# An xdist worker computes with its share of the cores: PyTorch's OpenMP pool, as wide as the
# machine in each of `make test`'s workers, only makes them contend (the PyTorch run took 278 s
# against 318 s with one thread a worker on 2 cores; TensorFlow's and XLA's pools gained
# nothing). A value given in the environment is kept; the processes that tests start inherit it.
# The cores are those this process may run on (a container's or taskset's), not the host's.
if "PYTEST_XDIST_WORKER" in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _share = (_cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))

if BACKEND == "tensorflow":
    # TensorFlow turns oneDNN on by default only on CPUs with AVX-512; without it, an eager
    # channels_first convolution fails ("Conv2D op currently only supports the NHWC tensor
    # format on the CPU"), and the channels_first fold and export tests could not run.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

    import tensorflow as tf

    # Four logical CPU devices, for the tf.distribute tests' real MirroredStrategy replicas.
    # This must run before TensorFlow initialises its devices; ops without a device scope
    # still run on /CPU:0, so the rest of the suite is unaffected.
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
elif BACKEND == "jax":
    # Two CPU devices for keras.distribution.DataParallel (test_jax_distribution.py), added to
    # any XLA_FLAGS given: XLA reads them when JAX starts, so before Keras imports it. Code
    # that names no device runs on the first.
    os.environ["XLA_FLAGS"] = " ".join(
        dict.fromkeys(
            [*os.environ.get("XLA_FLAGS", "").split(), "--xla_force_host_platform_device_count=2"]
        )
    )
    # One compilation cache for the run: its xdist workers and the fresh processes that tests
    # start compile the same programs again and again (the same small models, one per test),
    # and JAX finds them there by their HLO, cutting the run's time by a fifth (2 cores). Made
    # by the first process (xdist's controller, which the workers inherit it from), empty, so
    # a run's speed never depends on an earlier run; every entry, however quick to compile.
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        import atexit
        import shutil
        import tempfile

        _cache = tempfile.mkdtemp(prefix="keras_bn_tests_jax_cache_")
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import first_step  # noqa: E402
import keras  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

assert keras.backend.backend() == BACKEND, (
    f"KERAS_BACKEND={BACKEND!r} but Keras is using {keras.backend.backend()!r}: Keras was "
    f"imported before the suite's conftest.py"
)

# Keras's trainers prepare the first train step of every `fit` twice (a second trace under
# TensorFlow, a second compile under torch.compile); the suite's fits prepare it once, and end
# where Keras's do, bit for bit (first_step.py, test_first_step.py).
first_step.install()

# Property-based tests: "ci" (the default) runs 700 examples per property, over 2,000 in all;
# HYPOTHESIS_PROFILE=thorough runs ten times more.
for _name, _examples in (("ci", 700), ("thorough", 7000)):
    settings.register_profile(
        _name,
        max_examples=_examples,
        deadline=None,
        derandomize=(_name == "ci"),
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _skip_reason(backends=None, requires_tensorflow=False):
    """Why a test with these markers does not run here, or None where it does."""
    if backends is not None and BACKEND not in backends:
        needed = " or ".join(backends)
        return f"runs under KERAS_BACKEND={needed}; this run is KERAS_BACKEND={BACKEND}"
    if requires_tensorflow and not HAS_TENSORFLOW:
        return "needs TensorFlow in this Python, which does not have it"
    return None


def _module_marks(path):
    """(backends, requires_tensorflow) of a module's top-level `pytestmark`, read from its
    source: a module that runs elsewhere is skipped before its imports run."""
    backends, requires_tensorflow = None, False
    tree = ast.parse(path.read_bytes(), str(path))
    for node in tree.body:
        if not (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        ):
            continue
        marks = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
        for mark in marks:
            call = mark if isinstance(mark, ast.Call) else None
            name = ast.unparse(call.func if call else mark)
            if name == "pytest.mark.backends" and call is not None:
                backends = [ast.literal_eval(arg) for arg in call.args]
            elif name == "pytest.mark.requires_tensorflow":
                requires_tensorflow = True
    return backends, requires_tensorflow


class _SkippedModule(pytest.Module):
    """A test module whose markers rule this run out: reported skipped, never imported."""

    reason = ""

    def collect(self):
        raise pytest.skip.Exception(self.reason, allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if not module_path.name.startswith("test_"):
        return None
    reason = _skip_reason(*_module_marks(module_path))
    if reason is None:
        return None
    module = _SkippedModule.from_parent(parent, path=module_path)
    module.reason = f"{module_path.name} {reason}"
    return module


def _slow_here():
    """The node ids that slow_tests.txt names for this run's backend (find_slow_tests.py)."""
    lines = (pathlib.Path(__file__).with_name("slow_tests.txt")).read_text().splitlines()
    return {
        test
        for backend, _, test in (line.partition(" ") for line in lines if not line.startswith("#"))
        if backend == BACKEND
    }


def pytest_collection_modifyitems(config, items):
    slow = _slow_here()
    for item in items:
        if item.nodeid in slow:  # slow under this backend: `make test-fast` leaves it out
            item.add_marker(pytest.mark.slow)
        # Every `backends` marker counts (the module's, the function's, a parameter's): the
        # test runs under the backends all of them name.
        backends = None
        for marker in item.iter_markers("backends"):
            backends = [b for b in marker.args if backends is None or b in backends]
        reason = _skip_reason(backends, item.get_closest_marker("requires_tensorflow") is not None)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Each test starts from the float32 policy and a fixed seed; under PyTorch from float32
    matmuls too (no TF32 on a GPU: the references' tolerances are float32's)."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    if BACKEND == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def framework():
    """This run's backend framework: its own autodiff of a plain batch norm (the independent
    reference of a backend-neutral test) and a training step through a layer
    (framework_references.py)."""
    import framework_references

    return framework_references.for_backend(BACKEND)

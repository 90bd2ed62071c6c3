"""GPU readiness: the exactness tests and the layer benchmark on a GPU, results as JSON.

Run it through benchmarks/gpu_check.sh (`make gpu-check`), which picks the Python. It runs
under TensorFlow where TensorFlow is importable, else under JAX and then under PyTorch where
both are importable (the GPU machine: --backend jax+torch), else under the one that is
(--backend picks one, or both). Each step runs in its own process of this Python, under a
deadline, so the whole check takes at most 8 minutes: with both JAX and PyTorch, each backend's
steps get SHARED_DEADLINES, half the time they get alone.

Under TensorFlow:

1. probe: TensorFlow imports and sees a GPU; if not, the check stops at once (exit code 2) with
   one line saying why, and the JSON still holds what nvidia-smi reports;
2. tests: TEST_FILES, the tests that check keras_bn against independent references (numpy
   formulas in float64, autodiff, Keras), on the GPU: gpu_check_plugin stops them before the
   first test unless an op without a device scope runs on the GPU (TensorFlow's default
   placement), and records the counts. TF32 is off: it rounds matmul and convolution inputs to
   10 mantissa bits, which the references' float32 tolerances do not allow for;
3. bench: benchmarks/bench_layer.py on /GPU:0, graph mode and XLA, float32 and mixed_float16,
   at its four full-size shapes. It runs whether or not a test failed.

Under JAX (the GPU machine: JAX with its CUDA plugin, no TensorFlow, no Keras, no network):

0. setup: where Keras is not importable, the wheels of `make gpu-wheels` (build/gpu_wheels/,
   carried with the repository) are installed with pip into a temporary folder (those of
   distributions this Python lacks), and where keras_bn is not importable the checkout is, as
   a link tree (export/ as keras_bn/export, as pyproject.toml installs it); both go on
   PYTHONPATH for the steps, with benchmarks/ and the checkout, PYTHONSAFEPATH=1 keeps the
   checkout's own keras_bn/ (without export/) from coming first, and the folder is removed at
   the end;
1. probe: JAX imports and sees a GPU (jax.devices("gpu")), Keras and keras_bn import;
2. tests: JAX_TEST_FILES less their `tensorflow_side` tests (those compare with a TensorFlow
   process), on the GPU (JAX's default device, checked before the first test), float32
   matmuls at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest: no TF32);
3. bench: benchmarks/bench_layer_jax.py (what `bench_layer.py --backend jax` runs), jitted train
   step and inference, float32 and mixed_float16, keras_bn against Keras BN, on the GPU;
4. fake_quant: benchmarks/gpu_fake_quant.py: QAT's fake quantization on the GPU equals the
   CPU's bit for bit (outputs and gradients, eager and jit).

Under PyTorch (the same machine), the same steps:

0. setup: as under JAX (Keras needs nothing more under PyTorch than the same wheels);
1. probe: torch imports and sees a GPU (torch.cuda.is_available(), its device names), Keras
   and keras_bn import under KERAS_BACKEND=torch, and Keras's default device, where a new
   tensor goes, is cuda;
2. tests: TORCH_TEST_FILES less their `tensorflow_side` tests, on the GPU: gpu_check_plugin
   stops them before the first test unless Keras puts a new tensor on cuda (its default
   device under PyTorch where torch sees a GPU), and turns TF32 off
   (torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32 False, as
   tests/conftest.py does before each test under PyTorch);
3. bench: benchmarks/bench_layer_torch.py (`bench_layer.py --backend torch`) on cuda: the
   eager train step and inference, float32 and autocast float16/bfloat16, keras_bn against
   Keras BN with F.batch_norm as the floor, and the small ResNet's train_on_batch;
4. fake_quant: benchmarks/gpu_fake_quant_torch.py: QAT's fake quantization on cuda equals the
   CPU's bit for bit (outputs and autograd gradients).

    benchmarks/gpu_check.sh [--dry-run] [--backend auto|tensorflow|jax|torch|jax+torch] [OUT]

OUT (default build/gpu_check/) gets gpu_check.json (rewritten after each step, so it is there
whatever happens), tests.json, bench_layer.json, under JAX and PyTorch fake_quant.json, and
each step's log; with two backends, those go to OUT/jax/ and OUT/torch/, and OUT/gpu_check.json
sums them up (each backend's status, reason and exit code). --dry-run runs the same steps on
the CPU (CUDA_VISIBLE_DEVICES="", and JAX_PLATFORMS=cpu), at the benchmark's smoke sizes and
one test per file, so that CI can check this script in a minute or so
(tests/test_gpu_check.py runs it under JAX and under PyTorch without TensorFlow).

Exit codes: 0 every step passed; 1 a test failed, or a step failed or ran out of time;
2 the check cannot run here (none of TensorFlow, JAX, PyTorch importable, no GPU, the tests'
ops not on the GPU, no Keras and no wheels, bad usage). With two backends: 0 both passed, 1
one failed, else 2. A failure also prints one line, on stderr, saying why.

Only the standard library is imported here: the check must also say, clearly, that the Python
it was given has no TensorFlow (or JAX, or PyTorch).
"""

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
TEST_FILES = [
    "tests/test_ops.py",
    "tests/test_xla.py",
    "tests/test_fused.py",
    "tests/test_layers.py",
]
# The files of tests/ that check keras_bn under JAX against independent references (numpy
# float64 formulas, plain jnp autodiff, numpy replays of the moving statistics, Algorithm 2 in
# float64, the unfolded model), less their tests marked tensorflow_side; tests/conftest.py
# skips those of other backends. Left out: test_jax_distribution.py (DataParallel over two host
# devices), test_keras_parity.py (Keras's own test files, which its wheel does not ship),
# test_jax_readme.py (the docs) and test_no_tensorflow.py, test_gpu_check.py (this check).
JAX_TEST_FILES = [
    "tests/test_layer_maths.py",
    "tests/test_training_backends.py",
    "tests/test_jax_recalibrate.py",
    "tests/test_fold_backends.py",
    "tests/test_quantize_backends.py",
]
# Those under PyTorch (torch.nn.BatchNorm, torch autograd, numpy float64, numpy replays), as
# above.
TORCH_TEST_FILES = [
    "tests/test_layer_maths.py",
    "tests/test_torch_layer.py",
    "tests/test_training_backends.py",
    "tests/test_torch_tools.py",
    "tests/test_fold_backends.py",
    "tests/test_quantize_backends.py",
]
# Both keep out the tests that run a TensorFlow Python beside them.
JAX_TEST_MARKERS = TORCH_TEST_MARKERS = "not tensorflow_side"
WHEELS = ROOT / "build" / "gpu_wheels"
# Seconds per step: with nvidia-smi's (NVIDIA_SMI_DEADLINE), 465 s at most, under 8 minutes.
# The tests took 125 s on 2 CPU cores (273 tests, 2026-11-26); XLA compiles more slowly for a GPU.
DEADLINES = {"probe": 60, "tests": 240, "bench": 150}
DRY_RUN_DEADLINES = {"probe": 60, "tests": 120, "bench": 120}
# Under JAX, 460 s at most with nvidia-smi's.
JAX_DEADLINES = {"setup": 30, "probe": 45, "tests": 200, "bench": 120, "fake_quant": 50}
JAX_DRY_RUN_DEADLINES = {"setup": 30, "probe": 60, "tests": 120, "bench": 120, "fake_quant": 60}
# Under PyTorch alone, the same.
TORCH_DEADLINES, TORCH_DRY_RUN_DEADLINES = JAX_DEADLINES, JAX_DRY_RUN_DEADLINES
# Each backend's, where JAX and PyTorch run one after the other (the GPU machine has both):
# 225 s each, 480 s at most with nvidia-smi's twice, the 8 minutes.
SHARED_DEADLINES = {"setup": 20, "probe": 30, "tests": 90, "bench": 60, "fake_quant": 25}
# The backends whose check installs Keras where it is missing, and compares fake quantization.
KERAS_ONLY_BACKENDS = ("jax", "torch")
BACKEND_NAMES = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "PyTorch"}
BOTH = "jax+torch"
NVIDIA_SMI_DEADLINE = 15
CANNOT_RUN, FAILED = 2, 1

PROBE_MARK = "gpu_check probe: "


def _load_atomic():
    """export/atomic.py, loaded by its path: it needs only the standard library, whereas
    importing keras_bn.export imports TensorFlow, which this script must run without."""
    spec = importlib.util.spec_from_file_location("_atomic", ROOT / "export" / "atomic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


atomic = _load_atomic()


def tensorflow_devices():
    """TensorFlow's GPUs (name and details), its logical devices, and the device an op without
    a device scope runs on. It imports TensorFlow: the probe and gpu_check_plugin call it."""
    import tensorflow as tf

    return {
        "gpus": [
            {
                "name": gpu.name,
                **{
                    key: str(value)
                    for key, value in tf.config.experimental.get_device_details(gpu).items()
                },
            }
            for gpu in tf.config.list_physical_devices("GPU")
        ],
        "logical_devices": [device.name for device in tf.config.list_logical_devices()],
        "default_device": tf.reduce_sum(tf.ones([4])).device,
    }


def probe_tensorflow():
    """Print one line, PROBE_MARK and JSON: TensorFlow's version, build and devices, or why it
    does not import. The probe step runs it in a process of its own."""
    try:
        import tensorflow as tf
    except Exception as error:  # noqa: BLE001  any failure to import is the answer
        print(PROBE_MARK + json.dumps({"import_error": f"{type(error).__name__}: {error}"}))
        return
    build = tf.sysconfig.get_build_info()
    record = {
        "version": tf.__version__,
        "built_with_cuda": tf.test.is_built_with_cuda(),
        "cuda_version": build.get("cuda_version"),
        "cudnn_version": build.get("cudnn_version"),
        **tensorflow_devices(),
    }
    print(PROBE_MARK + json.dumps(record))


def jax_devices():
    """JAX's GPUs, its devices, its default backend and the device an array made without a
    device runs on (`kind`: GPU or CPU). It imports JAX: the probe and gpu_check_plugin call it."""
    import jax
    import jax.numpy as jnp

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend
        gpus = []
    (default,) = jnp.zeros(4).devices()
    return {
        "gpus": [{"name": str(gpu), "device_kind": gpu.device_kind} for gpu in gpus],
        "devices": [str(device) for device in jax.devices()],
        "default_backend": jax.default_backend(),
        "default_device": f"{default} ({default.device_kind})",
        "kind": "GPU" if default.platform in ("gpu", "cuda", "rocm") else default.platform.upper(),
    }


def _keras_imports():
    """Keras's and keras_bn's versions and files, or why each does not import, and Keras's
    backend: part of the probes of JAX and PyTorch."""
    record = {}
    for name in ("keras", "keras_bn"):
        try:
            module = __import__(name)
            record[name] = {"version": module.__version__, "file": module.__file__}
        except Exception as error:  # noqa: BLE001  reported: the check cannot run without them
            record[name] = {"import_error": f"{type(error).__name__}: {error}"}
    record["keras_backend"] = (
        sys.modules["keras"].backend.backend() if "keras" in sys.modules else None
    )
    return record


def probe_jax():
    """Print one line, PROBE_MARK and JSON: JAX's version and devices, Keras's and keras_bn's,
    or why one does not import. The probe step runs it in a process of its own."""
    try:
        import jax
    except Exception as error:  # noqa: BLE001  any failure to import is the answer
        print(PROBE_MARK + json.dumps({"import_error": f"{type(error).__name__}: {error}"}))
        return
    record = {"version": jax.__version__, **jax_devices(), **_keras_imports()}
    print(PROBE_MARK + json.dumps(record))


def torch_devices():
    """PyTorch's GPUs, and the device Keras puts a new tensor on under PyTorch (its default:
    cuda where torch sees one; `kind`: GPU or CPU). It imports torch and Keras (under
    KERAS_BACKEND=torch): the probe and gpu_check_plugin call it."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    record = {
        "gpus": [
            {"name": f"cuda:{i}", "device_name": torch.cuda.get_device_name(i)}
            for i in range(count)
        ],
        "cuda_available": torch.cuda.is_available(),
    }
    import keras

    (default,) = {keras.ops.zeros(4).device}
    record["default_device"] = str(default)
    record["kind"] = "GPU" if default.type == "cuda" else default.type.upper()
    return record


def probe_torch():
    """Print one line, PROBE_MARK and JSON: PyTorch's version, CUDA build and devices, Keras's
    and keras_bn's, or why one does not import. The probe step runs it in a process of its
    own."""
    try:
        import torch
    except Exception as error:  # noqa: BLE001  any failure to import is the answer
        print(PROBE_MARK + json.dumps({"import_error": f"{type(error).__name__}: {error}"}))
        return
    record = {"version": torch.__version__, "cuda_version": torch.version.cuda}
    record.update(_keras_imports())
    if "keras" in sys.modules:
        record.update(torch_devices())
    else:
        record.update(gpus=[], kind=None, default_device=None)
    print(PROBE_MARK + json.dumps(record))


def resolve_backends(requested):
    """The backends to check, in order: `requested` ("jax+torch": both), or for "auto"
    TensorFlow where it is importable, else JAX and PyTorch where they are (both on the GPU
    machine), else TensorFlow (whose probe then says what is missing)."""
    if requested == BOTH:
        return list(KERAS_ONLY_BACKENDS)
    if requested != "auto":
        return [requested]
    if importlib.util.find_spec("tensorflow") is not None:
        return ["tensorflow"]
    found = [name for name in KERAS_ONLY_BACKENDS if importlib.util.find_spec(name) is not None]
    return found or ["tensorflow"]


def _distribution_of(wheel):
    """The distribution name of a wheel file (its first dash-separated field)."""
    return wheel.name.split("-", 1)[0]


class CheckFailed(Exception):
    """A reason, in one line, that the check failed or cannot run; `code` is the exit code."""

    def __init__(self, reason, code=FAILED):
        super().__init__(reason)
        self.code = code


def nvidia_smi():
    """nvidia-smi's GPUs (name, driver, memory), None without nvidia-smi, or its error."""
    if shutil.which("nvidia-smi") is None:
        return None
    fields = ["name", "driver_version", "memory.total"]
    try:
        result = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_DEADLINE,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": str(error)}
    if result.returncode != 0:
        return {"error": (result.stderr or result.stdout).strip()[-500:]}
    return [
        dict(zip(("name", "driver_version", "memory_total"), (v.strip() for v in line.split(","))))
        for line in result.stdout.strip().splitlines()
    ]


def run_step(command, log, deadline, env):
    """Run `command` in ROOT with its output in `log`; (exit code or None if it ran past
    `deadline` seconds and was killed, seconds taken)."""
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the step and its children
            process.wait()
            code = None
    return code, round(time.monotonic() - started, 1)


def tail(path, lines=5):
    """The last lines of a log, in one line."""
    text = pathlib.Path(path).read_text(encoding="utf-8", errors="replace")
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


class Check:
    def __init__(self, out, dry_run, argv, backend, wheels, shared=False):
        """`shared`: another backend's check runs in the same 8 minutes (SHARED_DEADLINES)."""
        self.out = out
        self.dry_run = dry_run
        self.backend = backend
        self.wheels = wheels
        self.jax = backend == "jax"
        self.torch = backend == "torch"
        self.keras_only = backend in KERAS_ONLY_BACKENDS  # setup and fake_quant steps too
        if shared and not dry_run:
            self.deadlines = SHARED_DEADLINES
        elif self.jax:
            self.deadlines = JAX_DRY_RUN_DEADLINES if dry_run else JAX_DEADLINES
        elif self.torch:
            self.deadlines = TORCH_DRY_RUN_DEADLINES if dry_run else TORCH_DEADLINES
        else:
            self.deadlines = DRY_RUN_DEADLINES if dry_run else DEADLINES
        self.started = time.monotonic()
        self.site = None  # the temporary folder of the setup step, removed by cleanup()
        self.env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",  # take GPU memory as needed, not all at once
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # JAX's: the same
            "KERAS_BACKEND": backend,
        }
        if dry_run:
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, even on a machine with a GPU
            if self.jax:
                self.env["JAX_PLATFORMS"] = "cpu"
        self.result = {
            "status": "running",
            "reason": None,
            "dry_run": dry_run,
            "backend": backend,
            "command": " ".join(["benchmarks/gpu_check.sh", *argv]),
            "python": sys.executable,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
            "device": None,
            "nvidia_smi": None,
            **({"setup": None} if self.keras_only else {}),
            backend: None,
            "tests": None,
            "bench": None,
            **({"fake_quant": None} if self.keras_only else {}),
        }

    def save(self):
        self.result["seconds"] = round(time.monotonic() - self.started, 1)
        atomic.write_text(self.out / "gpu_check.json", json.dumps(self.result, indent=1) + "\n")

    def steps(self):
        """(name, method) of each step after the probe, in order."""
        if self.keras_only:
            return [("tests", self.tests), ("bench", self.bench), ("fake_quant", self.fake_quant)]
        return [("tests", self.tests), ("bench", self.bench)]

    def setup(self):
        """Under JAX and PyTorch: Keras from the wheels and keras_bn from the checkout where
        this Python cannot import them, in a temporary folder put on PYTHONPATH for every
        step."""
        record = {"keras": "importable", "keras_bn": "importable", "installed": []}
        self.result["setup"] = record
        paths = []
        if importlib.util.find_spec("keras") is None:
            wheels = sorted(self.wheels.glob("*.whl")) if self.wheels.is_dir() else []
            if not wheels:
                raise CheckFailed(
                    f"Keras is not importable by {sys.executable} and {self.wheels} holds no "
                    f"wheels: run `make gpu-wheels` where there is a network, and carry "
                    f"build/gpu_wheels with the repository",
                    CANNOT_RUN,
                )
            self.site = pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_"))
            missing = []
            for wheel in wheels:
                try:
                    importlib.metadata.distribution(_distribution_of(wheel))
                except importlib.metadata.PackageNotFoundError:
                    missing.append(wheel)
            record.update(
                keras=f"installed from {self.wheels}", installed=[w.name for w in missing]
            )
            self._install(missing, self.site / "site")
            paths.append(self.site / "site")
        if importlib.util.find_spec("keras_bn") is None:
            self.site = self.site or pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_"))
            tree = self.site / "src" / "keras_bn"
            tree.mkdir(parents=True)
            for entry in (ROOT / "keras_bn").iterdir():
                (tree / entry.name).symlink_to(entry)
            (tree / "export").symlink_to(ROOT / "export")
            record["keras_bn"] = f"linked from {ROOT}"
            paths.append(self.site / "src")
            # Python puts the working directory (the checkout, whose keras_bn has no export/)
            # or a script's folder first on sys.path; not with PYTHONSAFEPATH (Python 3.11+).
            self.env["PYTHONSAFEPATH"] = "1"
        if paths:
            paths += [BENCHMARKS, ROOT]  # the benchmarks' shared modules, then the checkout
            record["pythonpath"] = [str(path) for path in paths]
            self.env["PYTHONPATH"] = os.pathsep.join(
                [*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])]
            )
        self.save()

    def _install(self, wheels, target):
        """pip install --no-index --no-deps --target; a plain unpacking where pip is missing."""
        log = self.out / "setup.log"
        if importlib.util.find_spec("pip") is not None:
            command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps"]
            command += ["--disable-pip-version-check", "--target", str(target), *map(str, wheels)]
            code, seconds = run_step(command, log, self.deadlines["setup"], self.env)
            self.result["setup"]["seconds"] = seconds
            if code != 0:
                when = f"ran past {self.deadlines['setup']} s" if code is None else f"exit {code}"
                raise CheckFailed(f"installing the wheels failed ({when}): {tail(log)}", CANNOT_RUN)
            return
        for wheel in wheels:  # a wheel is a zip of its files, plus .data/ for some
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        for data in target.glob("*.data"):
            for kind in ("purelib", "platlib"):
                if (data / kind).is_dir():
                    shutil.copytree(data / kind, target, dirs_exist_ok=True)
        log.write_text(f"no pip: unpacked {len(wheels)} wheels into {target}\n")

    def cleanup(self):
        if self.site is not None:
            shutil.rmtree(self.site, ignore_errors=True)

    def probe(self):
        smi = nvidia_smi()
        self.result["nvidia_smi"] = smi
        if isinstance(smi, list) and smi:
            self.result["device"] = smi[0]["name"]
        self.save()
        {"jax": self.probe_jax, "torch": self.probe_torch}.get(self.backend, self.probe_tensorflow)(
            smi
        )
        if self.dry_run:
            self.result["device"] = "CPU (dry run)"
        self.save()

    def _probe(self, function, name):
        """Run gpu_check.`function` in a process of this Python; its record."""
        log = self.out / "probe.log"
        probe = f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); "
        probe += f"import gpu_check; gpu_check.{function}()"
        code, _ = run_step([sys.executable, "-c", probe], log, self.deadlines["probe"], self.env)
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        found = [line[len(PROBE_MARK) :] for line in lines if line.startswith(PROBE_MARK)]
        if code != 0 or not found:
            raise CheckFailed(f"probing {name} failed (exit {code}): {tail(log)}", CANNOT_RUN)
        return json.loads(found[-1])

    def probe_tensorflow(self, smi):
        probe = self._probe("probe_tensorflow", "TensorFlow")
        if "import_error" in probe:
            reason = f"TensorFlow is not importable by {sys.executable}: {probe['import_error']}"
            if not any(importlib.util.find_spec(name) for name in KERAS_ONLY_BACKENDS):
                reason += " (nor is JAX or PyTorch: the check runs under any of them)"
            raise CheckFailed(reason, CANNOT_RUN)
        self.result["tensorflow"] = probe
        gpus = probe["gpus"]
        if gpus:
            self.result["device"] = gpus[0].get("device_name", gpus[0]["name"])
        if not gpus and not self.dry_run:
            raise self._no_gpu(smi, f"built with CUDA: {probe['built_with_cuda']}")

    def _probe_keras_backend(self, function):
        """The probe of JAX or PyTorch, Keras and keras_bn: its record, or CheckFailed saying
        what does not import."""
        name = BACKEND_NAMES[self.backend]
        probe = self._probe(function, name)
        if "import_error" in probe:
            raise CheckFailed(
                f"{name} is not importable by {sys.executable}: {probe['import_error']}",
                CANNOT_RUN,
            )
        self.result[self.backend] = probe
        for module in ("keras", "keras_bn"):
            if "import_error" in probe[module]:
                raise CheckFailed(
                    f"{module} does not import under {name} in {sys.executable}: "
                    f"{probe[module]['import_error']}",
                    CANNOT_RUN,
                )
        return probe

    def _no_gpu(self, smi, seen):
        """CheckFailed: the backend sees no GPU (`seen`: what it sees), with nvidia-smi's."""
        smi_names = [g["name"] for g in smi] if isinstance(smi, list) else smi or "not found"
        return CheckFailed(
            f"{BACKEND_NAMES[self.backend]} {self.result[self.backend]['version']} sees no GPU "
            f"({seen}; nvidia-smi: {smi_names})",
            CANNOT_RUN,
        )

    def _expect_gpu(self, smi, probe, name_key, seen):
        """The device's name from the probe's first GPU (its `name_key`); CheckFailed unless
        there is one and the default device is on it (but in a dry run)."""
        gpus = probe["gpus"]
        if gpus:
            self.result["device"] = gpus[0][name_key]
        if not self.dry_run and (not gpus or probe["kind"] != "GPU"):
            raise self._no_gpu(smi, seen)

    def probe_jax(self, smi):
        probe = self._probe_keras_backend("probe_jax")
        seen = f"default backend {probe['default_backend']}, devices {probe['devices']}"
        self._expect_gpu(smi, probe, "device_kind", seen)

    def probe_torch(self, smi):
        probe = self._probe_keras_backend("probe_torch")
        seen = (
            f"CUDA build {probe['cuda_version']}, cuda available {probe['cuda_available']}, "
            f"Keras's default device {probe['default_device']}"
        )
        self._expect_gpu(smi, probe, "device_name", seen)

    def tests(self):
        report = self.out / "tests.json"
        report.unlink(missing_ok=True)
        files = {"jax": JAX_TEST_FILES, "torch": TORCH_TEST_FILES}.get(self.backend, TEST_FILES)
        command = [sys.executable, "-m", "pytest", *files, "-q"]
        env = dict(self.env)
        if self.keras_only:
            # xdist may be missing there; -m leaves out what needs a TensorFlow process.
            command += ["-p", "no:xdist", "-m", JAX_TEST_MARKERS]
        else:
            command += ["-n", "0"]  # one process: the GPU is not shared between workers
        if self.jax:
            env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"  # no TF32 (torch's: the plugin)
        command += [
            "-p",
            "no:cacheprovider",
            "-p",
            "gpu_check_plugin",
            "--gpu-check-report",
            str(report),
            "--gpu-check-backend",
            self.backend,
            "--gpu-check-expect",
            "CPU" if self.dry_run else "GPU",
            "--gpu-check-tf32-off",
        ]
        if self.dry_run:
            command.append("--gpu-check-one-per-file")
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(BENCHMARKS), self.env.get("PYTHONPATH")])
        )
        log = self.out / "tests.log"
        code, seconds = run_step(command, log, self.deadlines["tests"], env)
        record = json.loads(report.read_text()) if report.exists() else {}
        self.result["tests"] = {
            "files": files,
            **({"markers": JAX_TEST_MARKERS} if self.keras_only else {}),
            "exit_code": code,
            "timed_out": code is None,
            "seconds": seconds,
            "log": log.name,
            **record,
        }
        self.save()
        if record.get("stopped"):  # gpu_check_plugin: not on the expected device
            raise CheckFailed(f"tests not run: {record['stopped']}", CANNOT_RUN)
        counts = (
            f"{record.get('passed', 0)} passed, {record.get('failed', 0)} failed, "
            f"{record.get('errors', 0)} errors"
        )
        if code is None:
            return f"the tests ran past {self.deadlines['tests']} s ({counts} by then): see {log}"
        if code != 0 or not record.get("passed"):
            failed = record.get("failed_tests", [])
            return f"tests: {counts} (exit {code}) {failed[:3]}: see {log}"
        return None

    def bench(self):
        bench_json = self.out / "bench_layer.json"
        bench_json.unlink(missing_ok=True)
        script = {"jax": "bench_layer_jax.py", "torch": "bench_layer_torch.py"}.get(
            self.backend, "bench_layer.py"
        )
        command = [sys.executable, str(BENCHMARKS / script), "--json", str(bench_json)]
        devices = {"tensorflow": ("/CPU:0", "/GPU:0"), "torch": ("cpu", "cuda")}
        if self.backend in devices:  # JAX: its default device, the GPU unless a dry run
            command += ["--device", devices[self.backend][0 if self.dry_run else 1]]
        command += ["--smoke", "--max-shapes", "1"] if self.dry_run else ["--reps", "10"]
        log = self.out / "bench_layer.log"
        code, seconds = run_step(command, log, self.deadlines["bench"], self.env)
        bench = {
            "command": " ".join(command[1:]),
            "exit_code": code,
            "timed_out": code is None,
            "seconds": seconds,
            "log": log.name,
        }
        if bench_json.exists():
            record = json.loads(bench_json.read_text())
            bench.update(
                json=bench_json.name,
                device=record["device"],
                machine=record["machine"],
                rows=record["rows"],
                targets=record["targets"],
            )
        else:  # stopped early: the rows it printed
            row = r"(?:train|inference)" if self.keras_only else r"(?:graph|XLA)"
            bench["rows_printed"] = re.findall(
                rf"^\| .* \| {row} \| .*\|$",
                log.read_text(encoding="utf-8", errors="replace"),
                re.M,
            )
        self.result["bench"] = bench
        self.save()
        if code != 0 or not bench.get("rows"):
            when = f"ran past {self.deadlines['bench']} s" if code is None else f"exit {code}"
            return f"the layer benchmark failed ({when}): {tail(log)}"
        return None

    def fake_quant(self):
        """Under JAX and PyTorch: QAT's fake quantization on the GPU against the CPU, bit for
        bit (in the dry run, the CPU against itself)."""
        found = self.out / "fake_quant.json"
        found.unlink(missing_ok=True)
        device = "cpu" if self.dry_run else "cuda" if self.torch else "gpu"
        name = "gpu_fake_quant_torch.py" if self.torch else "gpu_fake_quant.py"
        script = str(BENCHMARKS / name)
        command = [sys.executable, script, "--device", device, "--against", "cpu"]
        command += ["--json", str(found), *(["--every", "8"] if self.dry_run else [])]
        log = self.out / "fake_quant.log"
        code, seconds = run_step(command, log, self.deadlines["fake_quant"], self.env)
        record = json.loads(found.read_text()) if found.exists() else {}
        self.result["fake_quant"] = {
            "exit_code": code,
            "timed_out": code is None,
            "seconds": seconds,
            "log": log.name,
            **record,
        }
        self.save()
        if code == 0 and record.get("bit_for_bit"):
            return None
        if record.get("mismatches"):
            first = record["mismatches"][0]
            return (
                f"fake quantization on {record['device']} differs from {record['against']} in "
                f"{record['mismatched_cases']} outputs (first: {first['case']}): see {found}"
            )
        when = f"ran past {self.deadlines['fake_quant']} s" if code is None else f"exit {code}"
        return f"the fake-quantization comparison failed ({when}): {tail(log)}"

    def summary(self):
        """The line printed when every step passed."""
        tests, bench = self.result["tests"], self.result["bench"]
        if self.keras_only:
            probe = self.result[self.backend]
            versions = (
                f"{BACKEND_NAMES[self.backend]} {probe['version']}, "
                f"Keras {probe['keras']['version']}"
            )
            extra = (
                f", fake quantization equal bit for bit to the CPU's "
                f"({self.result['fake_quant']['values_compared']} values)"
            )
        else:
            versions, extra = f"TensorFlow {self.result['tensorflow']['version']}", ""
        return (
            f"gpu_check: passed on {self.result['device']} ({versions}): {tests['passed']} tests "
            f"passed on {tests['placement']['default_device']}, {len(bench['rows'])} benchmark "
            f"rows{extra} [{self.out / 'gpu_check.json'}]"
        )


def run_check(check, out):
    """Every step of one backend's check; its exit code, the result saved in `out`."""
    name = BACKEND_NAMES[check.backend]
    try:
        if check.keras_only:
            print(f"gpu_check: setup (Keras, keras_bn under {name}) ...", flush=True)
            check.setup()
        print(f"gpu_check: probe ({name}, its GPUs) ...", flush=True)
        check.probe()
        # A failing test does not stop the benchmark: the check reports both.
        failures = []
        for step, run in check.steps():
            print(f"gpu_check: {step} ({name}) ...", flush=True)
            failures.append(run())
        if any(failures):
            raise CheckFailed("; ".join(filter(None, failures)))
    except CheckFailed as failure:
        check.result.update(status="failed", reason=str(failure))
        check.save()
        print(f"gpu_check: FAILED: {failure} [{out / 'gpu_check.json'}]", file=sys.stderr)
        return failure.code
    finally:
        check.cleanup()
    check.result["status"] = "passed"
    check.save()
    print(check.summary())
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="benchmarks/gpu_check.sh", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="the same steps on the CPU at tiny sizes"
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "tensorflow", "jax", "torch", BOTH),
        default="auto",
        help="auto (default): TensorFlow where it is importable, else JAX and PyTorch, one "
        f"after the other, where both are ({BOTH}), else the one that is",
    )
    parser.add_argument(
        "--wheels",
        type=pathlib.Path,
        default=WHEELS,
        help="under JAX or PyTorch without Keras, the wheels to install "
        "(default: build/gpu_wheels/)",
    )
    parser.add_argument(
        "out",
        nargs="?",
        type=pathlib.Path,
        default=ROOT / "build" / "gpu_check",
        help="folder for the results (default: build/gpu_check/)",
    )
    args = parser.parse_args(argv)
    backends = resolve_backends(args.backend)
    # One backend's results in OUT; with two, each in OUT/<backend>/ and a summary in OUT.
    outs = {b: args.out / b if len(backends) > 1 else args.out for b in backends}
    try:
        for out in outs.values():
            out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"cannot create the output folder {args.out}: {error}")
    codes = {}
    for backend, out in outs.items():
        check = Check(
            out.resolve(),
            args.dry_run,
            argv,
            backend,
            args.wheels.resolve(),
            shared=len(backends) > 1,
        )
        codes[backend] = run_check(check, out)
    if len(backends) == 1:
        return codes[backends[0]]
    return summarize(args.out, codes, args.dry_run, argv)


def summarize(out, codes, dry_run, argv):
    """gpu_check.json in `out` for a check of several backends: each one's status and folder;
    the exit code (0 all passed, 1 one failed, else 2: one could not run)."""
    backends = {}
    for backend, code in codes.items():
        result = json.loads((out / backend / "gpu_check.json").read_text())
        backends[backend] = {
            "status": result["status"],
            "reason": result["reason"],
            "exit_code": code,
            "results": f"{backend}/gpu_check.json",
            "seconds": result["seconds"],
        }
    passed = all(code == 0 for code in codes.values())
    record = {
        "status": "passed" if passed else "failed",
        "dry_run": dry_run,
        "command": " ".join(["benchmarks/gpu_check.sh", *argv]),
        "backends": backends,
    }
    atomic.write_text(out / "gpu_check.json", json.dumps(record, indent=1) + "\n")
    names = " and ".join(BACKEND_NAMES[b] for b in codes)
    if passed:
        print(f"gpu_check: passed under {names} [{out / 'gpu_check.json'}]")
        return 0
    failed = [BACKEND_NAMES[b] for b, code in codes.items() if code]
    print(f"gpu_check: FAILED under {', '.join(failed)} of {names}", file=sys.stderr)
    return FAILED if FAILED in codes.values() else CANNOT_RUN


if __name__ == "__main__":
    sys.exit(main())

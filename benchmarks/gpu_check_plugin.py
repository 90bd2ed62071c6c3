"""pytest plugin of benchmarks/gpu_check.py: where the tests' ops run, and what the tests gave.

Options (gpu_check.py passes them, with `-p gpu_check_plugin` and benchmarks/ on PYTHONPATH):

    --gpu-check-report PATH   JSON of the outcome counts, the failed tests' ids, the GPUs
                              the backend sees and the device an op without a device scope
                              runs on; rewritten after every test, so a run stopped at its
                              deadline still leaves its counts.
    --gpu-check-backend NAME  tensorflow (default), jax or torch: whose devices the report
                              holds (under torch, the device Keras puts a new tensor on).
    --gpu-check-expect KIND   GPU or CPU: before the first test, stop the session (exit code 3)
                              unless an op without a device scope runs on a device of that kind.
    --gpu-check-one-per-file  keep only the first test of each file that runs under this
                              backend (gpu_check's dry run).
    --gpu-check-tf32-off      turn TensorFloat-32 off before the first test (the report says
                              whether it is on); under JAX, float32 matmuls at "highest"
                              precision (gpu_check also sets JAX_DEFAULT_MATMUL_PRECISION);
                              under PyTorch, torch.backends.cuda.matmul.allow_tf32 and
                              torch.backends.cudnn.allow_tf32 False (tests/conftest.py sets
                              them again before each test under PyTorch).

TensorFlow, JAX and PyTorch are imported in the hooks, never at import: tests/conftest.py sets
the backend's environment and devices first.
"""

import json

import pytest
from gpu_check import BACKEND_NAMES, atomic, jax_devices, tensorflow_devices, torch_devices

PLACEMENT_EXIT_CODE = 3


def pytest_addoption(parser):
    group = parser.getgroup("gpu_check")
    group.addoption("--gpu-check-report", metavar="PATH", help="write the outcome JSON here")
    group.addoption(
        "--gpu-check-expect", choices=("GPU", "CPU"), help="the kind of the default device"
    )
    group.addoption(
        "--gpu-check-one-per-file", action="store_true", help="the first test of each file only"
    )
    group.addoption("--gpu-check-tf32-off", action="store_true", help="turn TF32 off")
    group.addoption(
        "--gpu-check-backend",
        choices=("tensorflow", "jax", "torch"),
        default="tensorflow",
        help="whose devices to check and report",
    )


def pytest_configure(config):
    if config.getoption("--gpu-check-report"):
        config.pluginmanager.register(_Recorder(config), "gpu_check_recorder")


class _Recorder:
    def __init__(self, config):
        self.path = config.getoption("--gpu-check-report")
        self.expect = config.getoption("--gpu-check-expect")
        self.one_per_file = config.getoption("--gpu-check-one-per-file")
        self.tf32_off = config.getoption("--gpu-check-tf32-off")
        self.backend = config.getoption("--gpu-check-backend")
        self.record = {
            "passed": 0,
            "failed": 0,
            "errors": 0,
            "skipped": 0,
            "xfailed": 0,
            "xpassed": 0,
            "failed_tests": [],
            "placement": None,
            "exit_status": None,
        }

    def _write(self):
        atomic.write_text(self.path, json.dumps(self.record, indent=1) + "\n")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):
        if self.one_per_file:
            # The first that runs: tests/conftest.py marks those of other backends skipped.
            first = {}
            for item in items:
                if item.get_closest_marker("skip") is None:
                    first.setdefault(item.path, item)
            kept = set(first.values())
            config.hook.pytest_deselected(items=[item for item in items if item not in kept])
            items[:] = [item for item in items if item in kept]

    def _tensorflow_placement(self):
        """TensorFlow's devices, TF32 off if asked; the kind of the default device."""
        import tensorflow as tf

        if self.tf32_off:
            tf.config.experimental.enable_tensor_float_32_execution(False)
        self.record["tf32"] = tf.config.experimental.tensor_float_32_execution_enabled()
        placement = tensorflow_devices()
        return placement, placement["default_device"].rsplit(":", 2)[-2]  # ".../GPU:0" -> "GPU"

    def _jax_placement(self):
        """JAX's devices, float32 matmuls at full precision if asked; the default's kind."""
        import jax

        if self.tf32_off:
            jax.config.update("jax_default_matmul_precision", "highest")
        precision = jax.config.jax_default_matmul_precision
        self.record["matmul_precision"] = precision
        self.record["tf32"] = precision not in ("highest", "float32")
        placement = jax_devices()
        return placement, placement["kind"]

    def _torch_placement(self):
        """PyTorch's GPUs, TF32 off if asked; the kind of Keras's default device."""
        import torch

        if self.tf32_off:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        self.record["tf32"] = bool(
            torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
        )
        placement = torch_devices()
        return placement, placement["kind"]

    def pytest_collection_finish(self, session):
        placement, kind = {
            "jax": self._jax_placement,
            "torch": self._torch_placement,
        }.get(self.backend, self._tensorflow_placement)()
        self.record["placement"] = placement
        self.record["collected"] = len(session.items)
        self._write()
        if self.expect and kind != self.expect:
            name = BACKEND_NAMES[self.backend]
            self.record["stopped"] = (
                f"the tests' ops would run on {placement['default_device']}, not a "
                f"{self.expect} ({name} sees GPUs: {[g['name'] for g in placement['gpus']]})"
            )
            self._write()
            pytest.exit(self.record["stopped"], returncode=PLACEMENT_EXIT_CODE)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            if hasattr(report, "wasxfail"):
                key = "xfailed" if report.skipped else "xpassed"
            elif report.when != "call" and report.failed:
                key = "errors"
            else:
                key = report.outcome  # passed, failed, skipped
            self.record[key] += 1
            if report.failed:
                self.record["failed_tests"].append(report.nodeid)
            self._write()

    def pytest_sessionfinish(self, session, exitstatus):
        self.record["exit_status"] = int(exitstatus)
        self._write()

"""GPU readiness: the exactness tests and the layer benchmark on a GPU, results as JSON.

Run it through benchmarks/gpu_check.sh (`make gpu-check`), which picks the Python. Each step
runs in its own process of this Python, under a deadline, so the whole check takes at most 8
minutes:

1. probe: TensorFlow imports and sees a GPU; if not, the check stops at once (exit code 2) with
   one line saying why, and the JSON still holds what nvidia-smi reports;
2. tests: TEST_FILES, the tests that check keras_bn against independent references (numpy
   formulas in float64, autodiff, Keras), on the GPU: gpu_check_plugin stops them before the
   first test unless an op without a device scope runs on the GPU (TensorFlow's default
   placement), and records the counts. TF32 is off: it rounds matmul and convolution inputs to
   10 mantissa bits, which the references' float32 tolerances do not allow for;
3. bench: benchmarks/bench_layer.py on /GPU:0, graph mode and XLA, float32 and mixed_float16,
   at its four full-size shapes. It runs whether or not a test failed.

    benchmarks/gpu_check.sh [--dry-run] [OUT]    # OUT defaults to build/gpu_check/

OUT gets gpu_check.json (rewritten after each step, so it is there whatever happens),
tests.json, bench_layer.json and each step's log. --dry-run runs the same steps on the CPU
(CUDA_VISIBLE_DEVICES=""), at the benchmark's smoke sizes and one test per file, so that CI can
check this script in a minute or so.

Exit codes: 0 every step passed; 1 a test failed, or a step failed or ran out of time;
2 the check cannot run here (TensorFlow not importable, no GPU, the tests' ops not on the GPU,
bad usage). A failure also prints one line, on stderr, saying why.

Only the standard library is imported here: the check must also say, clearly, that the Python
it was given has no TensorFlow.
"""

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
TEST_FILES = [
    "tests/test_ops.py",
    "tests/test_xla.py",
    "tests/test_fused.py",
    "tests/test_layers.py",
]
# Seconds per step: with nvidia-smi's (NVIDIA_SMI_DEADLINE), 465 s at most, under 8 minutes.
# The tests took 125 s on 2 CPU cores (273 tests, 2026-11-26); XLA compiles more slowly for a GPU.
DEADLINES = {"probe": 60, "tests": 240, "bench": 150}
DRY_RUN_DEADLINES = {"probe": 60, "tests": 120, "bench": 120}
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
    def __init__(self, out, dry_run, argv):
        self.out = out
        self.dry_run = dry_run
        self.deadlines = DRY_RUN_DEADLINES if dry_run else DEADLINES
        self.started = time.monotonic()
        self.env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",  # take GPU memory as needed, not all at once
            "KERAS_BACKEND": "tensorflow",
        }
        if dry_run:
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, even on a machine with a GPU
        self.result = {
            "status": "running",
            "reason": None,
            "dry_run": dry_run,
            "command": " ".join(["benchmarks/gpu_check.sh", *argv]),
            "python": sys.executable,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
            "device": None,
            "nvidia_smi": None,
            "tensorflow": None,
            "tests": None,
            "bench": None,
        }

    def save(self):
        self.result["seconds"] = round(time.monotonic() - self.started, 1)
        atomic.write_text(self.out / "gpu_check.json", json.dumps(self.result, indent=1) + "\n")

    def probe(self):
        smi = nvidia_smi()
        self.result["nvidia_smi"] = smi
        if isinstance(smi, list) and smi:
            self.result["device"] = smi[0]["name"]
        self.save()
        log = self.out / "probe.log"
        probe = f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); "
        probe += "import gpu_check; gpu_check.probe_tensorflow()"
        code, _ = run_step([sys.executable, "-c", probe], log, self.deadlines["probe"], self.env)
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        found = [line[len(PROBE_MARK) :] for line in lines if line.startswith(PROBE_MARK)]
        if code != 0 or not found:
            raise CheckFailed(f"probing TensorFlow failed (exit {code}): {tail(log)}", CANNOT_RUN)
        probe = json.loads(found[-1])
        if "import_error" in probe:
            raise CheckFailed(
                f"TensorFlow is not importable by {sys.executable}: {probe['import_error']}",
                CANNOT_RUN,
            )
        self.result["tensorflow"] = probe
        gpus = probe["gpus"]
        if gpus:
            self.result["device"] = gpus[0].get("device_name", gpus[0]["name"])
        if self.dry_run:
            self.result["device"] = "CPU (dry run)"
        elif not gpus:
            smi_names = [g["name"] for g in smi] if isinstance(smi, list) else smi or "not found"
            raise CheckFailed(
                f"TensorFlow {probe['version']} sees no GPU (built with CUDA: "
                f"{probe['built_with_cuda']}; nvidia-smi: {smi_names})",
                CANNOT_RUN,
            )
        self.save()

    def tests(self):
        report = self.out / "tests.json"
        report.unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            "pytest",
            *TEST_FILES,
            "-q",
            "-n",
            "0",  # one process: the GPU is not shared between workers
            "-p",
            "no:cacheprovider",
            "-p",
            "gpu_check_plugin",
            "--gpu-check-report",
            str(report),
            "--gpu-check-expect",
            "CPU" if self.dry_run else "GPU",
            "--gpu-check-tf32-off",
        ]
        if self.dry_run:
            command.append("--gpu-check-one-per-file")
        env = {
            **self.env,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")])
            ),
        }
        log = self.out / "tests.log"
        code, seconds = run_step(command, log, self.deadlines["tests"], env)
        record = json.loads(report.read_text()) if report.exists() else {}
        self.result["tests"] = {
            "files": TEST_FILES,
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
        command = [sys.executable, str(BENCHMARKS / "bench_layer.py"), "--json", str(bench_json)]
        if self.dry_run:
            command += ["--smoke", "--max-shapes", "1", "--device", "/CPU:0"]
        else:
            command += ["--reps", "10", "--device", "/GPU:0"]
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
            bench["rows_printed"] = re.findall(
                r"^\| .* \| (?:graph|XLA) \| .*\|$",
                log.read_text(encoding="utf-8", errors="replace"),
                re.M,
            )
        self.result["bench"] = bench
        self.save()
        if code != 0 or not bench.get("rows"):
            when = f"ran past {self.deadlines['bench']} s" if code is None else f"exit {code}"
            return f"the layer benchmark failed ({when}): {tail(log)}"
        return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="benchmarks/gpu_check.sh", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="the same steps on the CPU at tiny sizes"
    )
    parser.add_argument(
        "out",
        nargs="?",
        type=pathlib.Path,
        default=ROOT / "build" / "gpu_check",
        help="folder for the results (default: build/gpu_check/)",
    )
    args = parser.parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"cannot create the output folder {args.out}: {error}")
    check = Check(args.out.resolve(), args.dry_run, argv)
    try:
        print("gpu_check: probe (TensorFlow, its GPUs) ...", flush=True)
        check.probe()
        # A failing test does not stop the benchmark: the check reports both.
        failures = []
        for name, step in (("tests", check.tests), ("bench", check.bench)):
            print(f"gpu_check: {name} ...", flush=True)
            failures.append(step())
        if any(failures):
            raise CheckFailed("; ".join(filter(None, failures)))
    except CheckFailed as failure:
        check.result.update(status="failed", reason=str(failure))
        check.save()
        print(f"gpu_check: FAILED: {failure} [{args.out / 'gpu_check.json'}]", file=sys.stderr)
        return failure.code
    check.result["status"] = "passed"
    check.save()
    tests, bench = check.result["tests"], check.result["bench"]
    print(
        f"gpu_check: passed on {check.result['device']} (TensorFlow "
        f"{check.result['tensorflow']['version']}): {tests['passed']} tests passed on "
        f"{tests['placement']['default_device']}, {len(bench['rows'])} benchmark rows "
        f"[{args.out / 'gpu_check.json'}]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Start-up time of the command line: the median wall time of `keras-bn-export --help`.

`--help` (like `--version` and every usage error) answers before TensorFlow, Keras, tf2onnx
or LiteRT are imported; the target is at most 1.5 s. Each run is a fresh process of this
environment's console script, timed from start to exit.

    python benchmarks/bench_cli.py             # 9 runs
    python benchmarks/bench_cli.py --runs 25
    python benchmarks/bench_cli.py --smoke     # one run: CI checks it runs
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

TARGET_S = 1.5


def console_script():
    """The keras-bn-export script installed next to this interpreter."""
    script = shutil.which("keras-bn-export", path=os.path.dirname(sys.executable))
    if script is None:
        raise SystemExit("keras-bn-export is not installed in this environment (pip install -e .)")
    return script


def time_help(script, runs):
    """Wall times, in seconds, of `runs` runs of `script --help`."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([script, "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="how many runs (default 9)")
    parser.add_argument("--smoke", action="store_true", help="one run")
    args = parser.parse_args()
    runs = 1 if args.smoke else args.runs
    if runs < 1:
        parser.error(f"--runs must be at least 1; received {runs}")
    times = time_help(console_script(), runs)
    median = statistics.median(times)
    print(
        f"keras-bn-export --help: median {median:.3f} s over {runs} run(s) "
        f"(min {min(times):.3f} s, max {max(times):.3f} s; target <= {TARGET_S} s: "
        f"{'met' if median <= TARGET_S else 'MISSED'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

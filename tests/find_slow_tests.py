"""Write tests/slow_tests.txt, the tests that `make test-fast` leaves out per backend, from
the logs of full runs with `--durations=0` (what `make slow-tests` runs).

A test is slow under a backend when its setup, call and teardown took THRESHOLD seconds or more
in a run of that backend (a backend may have several logs: a full run's, and a later `make
test-fast`'s for the tests added since). conftest.py marks the tests the file names for the
run's backend `slow`, beside those marked in the code; `make test` runs every one of them.

    python tests/find_slow_tests.py tensorflow=tf.log jax=jax.log torch=torch.log
    python tests/find_slow_tests.py --add tensorflow=fast_tf.log jax=fast_jax.log
"""

import argparse
import collections
import pathlib
import re

THRESHOLD = 1.0  # seconds
SLOW_TESTS = pathlib.Path(__file__).with_name("slow_tests.txt")
# pytest's durations lines: "12.34s call     tests/test_x.py::test_y[id]@group"; the
# `@group` is pytest-xdist's loadgroup suffix, not part of the test's node id.
DURATION = re.compile(r"^(\d+\.\d+)s (?:setup|call|teardown)\s+(\S+?)(?:@\S+)?$")
HEADER = """\
# Tests that `make test-fast` leaves out, per backend: each took {threshold:g} s or more (setup,
# call and teardown) in that backend's run of `make slow-tests`. Written by
# tests/find_slow_tests.py; conftest.py marks them slow in that backend's run.
"""


def durations(log: pathlib.Path) -> dict[str, float]:
    """{node id: seconds} of a `--durations=0` log, setup, call and teardown summed."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for line in log.read_text().splitlines():
        match = DURATION.match(line)
        if match:
            seconds[match.group(2)] += float(match.group(1))
    return dict(seconds)


def slow_tests(logs: list[tuple[str, pathlib.Path]], threshold: float) -> list[tuple[str, str]]:
    """(backend, node id) of every test at or over `threshold` seconds in some log of its
    backend, sorted."""
    found = set()
    for backend, log in logs:
        seconds = durations(log)
        if not seconds:
            raise ValueError(f"{log} holds no durations: run pytest with --durations=0")
        found |= {(backend, test) for test, s in seconds.items() if s >= threshold}
    return sorted(found)


def listed() -> set[tuple[str, str]]:
    """(backend, node id) of every test the file names now."""
    lines = SLOW_TESTS.read_text().splitlines() if SLOW_TESTS.exists() else []
    return {tuple(line.split(" ", 1)) for line in lines if line and line[0] != "#"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", metavar="BACKEND=LOG")
    parser.add_argument("--threshold", type=float, default=THRESHOLD)
    parser.add_argument(
        "--add",
        action="store_true",
        help="keep the tests the file names and add those the logs find (a `make test-fast` "
        "log's tests, added since the full runs)",
    )
    args = parser.parse_args(argv)
    logs = []
    for pair in args.logs:
        backend, _, log = pair.partition("=")
        if backend not in ("tensorflow", "jax", "torch") or not log:
            parser.error(f"expected BACKEND=LOG with a Keras backend, got {pair!r}")
        logs.append((backend, pathlib.Path(log)))
    found = set(slow_tests(logs, args.threshold)) | (listed() if args.add else set())
    lines = [f"{backend} {test}" for backend, test in sorted(found)]
    SLOW_TESTS.write_text(HEADER.format(threshold=args.threshold) + "\n".join(lines) + "\n")
    print(f"{SLOW_TESTS}: {len(lines)} tests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

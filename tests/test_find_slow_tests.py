"""tests/find_slow_tests.py: which tests `make test-fast` leaves out per backend, read from
`--durations=0` logs."""

import find_slow_tests
import pytest

LOG = """\
============================= slowest durations ==============================
1.20s call     tests/test_a.py::test_slow[x-1]@docs_site
0.60s setup    tests/test_a.py::test_setup_and_call
0.50s call     tests/test_a.py::test_setup_and_call
0.90s call     tests/test_a.py::test_fast
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_setup_call_and_teardown_add_up_and_xdists_group_is_no_part_of_the_id(tmp_path):
    (tmp_path / "jax.log").write_text(LOG)
    assert find_slow_tests.durations(tmp_path / "jax.log") == {
        "tests/test_a.py::test_slow[x-1]": 1.2,
        "tests/test_a.py::test_setup_and_call": pytest.approx(1.1),
        "tests/test_a.py::test_fast": 0.9,
    }


def test_the_file_names_each_backends_tests_at_or_over_the_threshold(tmp_path, monkeypatch):
    (tmp_path / "jax.log").write_text(LOG)
    (tmp_path / "torch.log").write_text("1.00s call     tests/test_b.py::test_b\n")
    (tmp_path / "jax2.log").write_text("3.00s call     tests/test_a.py::test_slow[x-1]\n")
    monkeypatch.setattr(find_slow_tests, "SLOW_TESTS", tmp_path / "slow.txt")
    find_slow_tests.main(
        [
            f"jax={tmp_path / 'jax.log'}",
            f"torch={tmp_path / 'torch.log'}",
            f"jax={tmp_path / 'jax2.log'}",
        ]
    )
    lines = [line for line in (tmp_path / "slow.txt").read_text().splitlines() if line[0] != "#"]
    assert lines == [
        "jax tests/test_a.py::test_setup_and_call",
        "jax tests/test_a.py::test_slow[x-1]",
        "torch tests/test_b.py::test_b",
    ]


def test_a_log_without_durations_is_refused_by_name(tmp_path):
    (tmp_path / "tf.log").write_text("2 passed in 1.0s\n")
    with pytest.raises(ValueError, match=r"tf\.log holds no durations"):
        find_slow_tests.main([f"tensorflow={tmp_path / 'tf.log'}"])


def test_add_keeps_the_tests_the_file_names_and_adds_the_new_ones(tmp_path, monkeypatch):
    slow = tmp_path / "slow.txt"
    slow.write_text("# header\ntorch tests/test_b.py::test_b\njax tests/test_a.py::test_old\n")
    (tmp_path / "jax.log").write_text(LOG)
    monkeypatch.setattr(find_slow_tests, "SLOW_TESTS", slow)
    find_slow_tests.main(["--add", f"jax={tmp_path / 'jax.log'}"])
    lines = [line for line in slow.read_text().splitlines() if line[0] != "#"]
    assert lines == [
        "jax tests/test_a.py::test_old",
        "jax tests/test_a.py::test_setup_and_call",
        "jax tests/test_a.py::test_slow[x-1]",
        "torch tests/test_b.py::test_b",
    ]
    find_slow_tests.main([f"jax={tmp_path / 'jax.log'}"])  # without --add: the logs' only
    lines = [line for line in slow.read_text().splitlines() if line[0] != "#"]
    assert lines == [
        "jax tests/test_a.py::test_setup_and_call",
        "jax tests/test_a.py::test_slow[x-1]",
    ]

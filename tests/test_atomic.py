"""Atomic writes: no partial file on failure, an existing file untouched, clear OSError, and the
mode a plain open() would give (not mkstemp's 0o600)."""

import os
import stat

import keras
import pytest

from keras_bn.export import atomic, export_onnx, export_tflite


def test_success_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    atomic.write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_failure_midway_leaves_the_existing_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.keras"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic.replacing(target) as temporary:
            assert temporary.endswith(".keras") and os.path.dirname(temporary) == str(tmp_path)
            with open(temporary, "wb") as file:
                file.write(b"half")
            raise RuntimeError("writer failed")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.keras"]


@pytest.mark.parametrize("where", ["missing_folder", "under_a_file"])
def test_unwritable_path_raises_oserror_naming_it(tmp_path, where):
    (tmp_path / "file").write_text("x")
    parent = tmp_path / ("missing" if where == "missing_folder" else "file")
    target = parent / "out.bin"
    with pytest.raises(OSError) as info:
        atomic.write_bytes(target, b"data")
    assert str(target) in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["file"]


@pytest.fixture
def umask():
    """Set the process umask for one test, and restore it."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002], ids=["022", "077", "002"])
def test_new_file_gets_the_mode_open_would_give(tmp_path, umask, mask):
    """mkstemp creates 0o600; a plain open(path, "wb") gives 0o666 less the umask."""
    umask(mask)
    with open(tmp_path / "plain", "wb"):
        pass
    atomic.write_bytes(tmp_path / "atomic", b"data")
    with atomic.replacing(tmp_path / "replaced") as temporary:
        with open(temporary, "wb") as file:
            file.write(b"data")
    plain = stat.S_IMODE(os.stat(tmp_path / "plain").st_mode)
    assert plain == 0o666 & ~mask
    for name in ("atomic", "replaced"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == plain, name


def test_replaced_file_keeps_its_mode(tmp_path, umask):
    umask(0o022)
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    atomic.write_bytes(target, b"new")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640 and target.read_bytes() == b"new"


@pytest.mark.parametrize("exporter", [export_tflite, export_onnx])
def test_exported_file_gets_the_umask_mode(tmp_path, umask, exporter):
    umask(0o027)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    exporter(model, tmp_path / "model.out")
    assert stat.S_IMODE(os.stat(tmp_path / "model.out").st_mode) == 0o640


@pytest.mark.parametrize("exporter", [export_tflite, export_onnx])
def test_export_to_an_unwritable_path_raises_oserror(tmp_path, exporter):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    target = tmp_path / "missing" / "model.out"
    with pytest.raises(OSError, match=str(target)):
        exporter(model, target)
    assert os.listdir(tmp_path) == []

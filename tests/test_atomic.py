"""Atomic writes: no partial file on failure, an existing file untouched, clear OSError, and the
mode a plain open() would give (not mkstemp's 0o600)."""

import os
import stat

import keras
import pytest

from keras_bn.export import atomic, export_onnx, export_tflite

pytestmark = pytest.mark.backends("tensorflow")


def test_success_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    atomic.write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_failure_midway_leaves_the_existing_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.keras"
    target.write_bytes(b"old")
    with (
        pytest.raises(RuntimeError, match="writer failed"),
        atomic.replacing(target) as temporary,
    ):
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
    with atomic.replacing(tmp_path / "replaced") as temporary, open(temporary, "wb") as file:
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


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path, umask):
    """As with open(path, "wb"): the file the link points to gets the new bytes (keeping its
    mode), and the link stays; a dangling link creates its target."""
    umask(0o022)
    store = tmp_path / "store"
    store.mkdir()
    (store / "v1.bin").write_bytes(b"old")
    os.chmod(store / "v1.bin", 0o604)
    (tmp_path / "latest.bin").symlink_to(store / "v1.bin")
    atomic.write_bytes(tmp_path / "latest.bin", b"new")
    assert (tmp_path / "latest.bin").is_symlink()
    assert (store / "v1.bin").read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(store / "v1.bin").st_mode) == 0o604
    assert sorted(os.listdir(tmp_path)) == ["latest.bin", "store"]
    assert os.listdir(store) == ["v1.bin"]

    (tmp_path / "next.bin").symlink_to(store / "v2.bin")
    atomic.write_bytes(tmp_path / "next.bin", b"v2")
    assert (tmp_path / "next.bin").is_symlink() and (store / "v2.bin").read_bytes() == b"v2"


@pytest.mark.parametrize("kind", ["fifo", "link_to_fifo", "folder"])
def test_a_target_that_is_not_a_regular_file_is_refused_and_kept(tmp_path, kind):
    """A FIFO or a device (e.g. /dev/stdout, a link to a pipe) would be replaced by a regular
    file, and a folder fails only at the rename: each is refused up front, naming the path."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link_to_fifo").symlink_to(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    target = tmp_path / kind
    with pytest.raises(OSError, match=f"Cannot write {target}: it is a"):
        atomic.write_bytes(target, b"data")
    assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode)
    assert (tmp_path / "link_to_fifo").is_symlink() and (tmp_path / "folder").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["fifo", "folder", "link_to_fifo"]


@pytest.mark.parametrize("exporter", [export_tflite, export_onnx])
def test_export_to_a_folder_is_refused_before_converting(tmp_path, exporter):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    stages = []
    with pytest.raises(IsADirectoryError, match=f"Cannot write {tmp_path}: it is a folder"):
        exporter(model, tmp_path, on_stage=stages.append)
    assert stages == [] and os.listdir(tmp_path) == []

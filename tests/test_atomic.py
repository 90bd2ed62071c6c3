"""Atomic writes: no partial file on failure, an existing file untouched, clear OSError."""

import os

import keras
import numpy as np
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


def _two_input_model():
    a, b = keras.Input((3,)), keras.Input((3,))
    return keras.Model([a, b], keras.layers.Add()([a, b]))


@pytest.mark.parametrize("exporter", [export_tflite, export_onnx])
def test_failed_export_leaves_the_existing_file_untouched(tmp_path, exporter):
    target = tmp_path / "model.out"
    target.write_bytes(b"previous export")
    with pytest.raises(ValueError, match="Export supports models with one input"):
        exporter(_two_input_model(), target, fold=False,
                 probe=[np.zeros((1, 3), "float32")] * 2)
    assert target.read_bytes() == b"previous export"
    assert os.listdir(tmp_path) == ["model.out"]


@pytest.mark.parametrize("exporter", [export_tflite, export_onnx])
def test_export_to_an_unwritable_path_raises_oserror(tmp_path, exporter):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    target = tmp_path / "missing" / "model.out"
    with pytest.raises(OSError, match=str(target)):
        exporter(model, target)
    assert os.listdir(tmp_path) == []

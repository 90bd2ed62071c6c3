"""The README's claim about its tour under JAX: everything but the TFLite and ONNX writers."""

import pathlib
import re

import keras
import pytest

pytestmark = pytest.mark.backends("jax")

ROOT = pathlib.Path(__file__).resolve().parents[1]
WRITERS = ("export_tflite(", "export_onnx(")


@pytest.mark.slow  # two short fits, recalibrate, the fold and a QAT fit: about 20 s
def test_readme_tour_runs_under_jax_but_the_writers(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## A tour\n", 1)[1].split("\n## ", 1)[0]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, re.S)
    assert "Under `KERAS_BACKEND=jax` everything above but the two writers runs" in section
    lines = snippet.splitlines()
    kept = [line for line in lines if not line.startswith(WRITERS)]
    assert len(lines) - len(kept) == 3  # the float TFLite and ONNX files, the int8 one
    importing = "from keras_bn.export import export_onnx, export_tflite, fold_batch_norms"
    assert importing in kept
    kept[kept.index(importing)] = "from keras_bn.export import fold_batch_norms"
    monkeypatch.chdir(tmp_path)
    keras.backend.clear_session()
    namespace = {}
    exec(compile("\n".join(kept), "README.md", "exec"), namespace)
    assert [f.host for f in namespace["report"].folded] == ["conv2d"]
    assert namespace["report"].relative_error < 1e-5
    qat_layers = [type(layer).__name__ for layer in namespace["qat"].layers]
    assert "QuantizedHostBatchNorm" in qat_layers, qat_layers
    assert list(tmp_path.iterdir()) == []
    # The writers themselves refuse JAX on import, with the way out.
    with pytest.raises(ImportError, match=r"load the \.keras file under"):
        exec(importing, {})

"""ExportReport, and the comparison every exporter makes between a runtime and Keras."""

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass
class ExportReport:
    format: str  # "tflite" or "onnx"
    path: str
    size_bytes: int
    errors: dict  # runtime setting → max abs error against the Keras model on the probe
    output_scale: float  # max |Keras output| on the probe
    op_histogram: dict  # op name → count in the written file
    quantization: str | None = None
    fold: object = None  # the FoldReport, or None when fold=False

    @property
    def max_abs_error(self):
        return max(self.errors.values())

    @property
    def relative_error(self):
        return self.max_abs_error / max(self.output_scale, 1e-30)

    def to_dict(self):
        data = dataclasses.asdict(self)
        data["fold"] = None if self.fold is None else self.fold.to_dict()
        data.update(max_abs_error=self.max_abs_error, relative_error=self.relative_error)
        return data


def max_abs_error(actual, expected):
    return float(np.max(np.abs(np.asarray(actual, np.float64) - expected), initial=0.0))


def histogram(op_names):
    """op name → count, most frequent first."""
    return dict(collections.Counter(op_names).most_common())

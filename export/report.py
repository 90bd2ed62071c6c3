"""What the fold and the exporters report, and the comparison they share.

Errors are kept per output name and measured against each output's own scale (max |output|
of the Keras model on the probe), so a small head next to a large one is judged on its own
scale. Any non-finite error, output or scale makes the relative error NaN, which never passes:
`worst` is np.max, which propagates NaN, not Python's max, which drops one that is not first.
"""

import collections
import dataclasses

import numpy as np


def max_abs_error(actual, expected):
    """max |actual − expected| in float64; inf when the shapes differ (a wrong file)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        return float("inf")
    return float(np.max(np.abs(actual - expected), initial=0.0))


def scale(expected):
    """max |expected|: what an output's error is measured against (NaN if it has a NaN)."""
    return float(np.max(np.abs(np.asarray(expected, np.float64)), initial=0.0))


def worst(values):
    """The largest of `values`, NaN if any is NaN; 0 for none."""
    values = np.asarray(list(values), np.float64)
    return float(np.max(values, initial=0.0)) if values.size else 0.0


def relative(error, output_scale):
    return error / max(output_scale, 1e-30) if np.isfinite(output_scale) else float("nan")


def histogram(op_names):
    """op name → count, most frequent first."""
    return dict(collections.Counter(op_names).most_common())


@dataclasses.dataclass
class FoldReport:
    """What `fold_batch_norms` did, and how far the folded model is from the original.

    Attributes:
        folded: FoldedBN per folded batch norm.
        kept: KeptBN per batch norm kept as an InferenceAffine layer, with the reason.
        errors: output name → max |folded − original| on the probe.
        output_scales: output name → max |original output| on the probe.
    """

    folded: list
    kept: list
    errors: dict
    output_scales: dict

    @property
    def relative_errors(self):
        """output name → error / that output's scale."""
        return {name: relative(error, self.output_scales[name])
                for name, error in self.errors.items()}

    @property
    def max_abs_error(self):
        return worst(self.errors.values())

    @property
    def relative_error(self):
        """The worst relative error over the outputs; NaN if any output or error is not
        finite."""
        return worst(self.relative_errors.values())

    def to_dict(self):
        return {**dataclasses.asdict(self), "relative_errors": self.relative_errors,
                "relative_error": self.relative_error}


@dataclasses.dataclass
class ExportReport:
    """A written file, checked in its runtime against the Keras model.

    Attributes:
        format: "tflite" or "onnx".
        path: the file's absolute path.
        size_bytes: its size.
        errors: output name → {runtime setting → max |runtime − Keras|} on the probe
            ("litert"; "ort_disabled" and "ort_enabled" for onnxruntime's optimiser).
        output_scales: output name → max |Keras output| on the probe.
        atol: the tolerance, as a fraction of each output's scale.
        op_histogram: op name → count in the file.
        quantization: the TFLite quantization, None for float32.
        fold: the FoldReport, or None when fold=False.
    """

    format: str
    path: str
    size_bytes: int
    errors: dict
    output_scales: dict
    atol: float
    op_histogram: dict
    quantization: str | None = None
    fold: FoldReport | None = None

    @property
    def relative_errors(self):
        """output name → its worst error over the runtime settings / its scale."""
        return {name: relative(worst(by_setting.values()), self.output_scales[name])
                for name, by_setting in self.errors.items()}

    @property
    def max_abs_error(self):
        return worst(worst(by_setting.values()) for by_setting in self.errors.values())

    @property
    def relative_error(self):
        """The worst relative error over outputs and settings; NaN if any is not finite."""
        return worst(self.relative_errors.values())

    @property
    def passed(self):
        """Every output of every runtime setting within `atol` of its scale (NaN fails)."""
        return bool(self.relative_error <= self.atol)

    def to_dict(self):
        data = dataclasses.asdict(self)
        data["fold"] = None if self.fold is None else self.fold.to_dict()
        data.update(max_abs_error=self.max_abs_error, relative_errors=self.relative_errors,
                    relative_error=self.relative_error, passed=self.passed)
        return data


class VerificationError(Exception):
    """A written file differs from the Keras model by more than the tolerance.

    The file was not put at its path (any existing file there is unchanged); `report` is the
    ExportReport of the rejected file, whose `path` is where it would have gone.
    """

    def __init__(self, report):
        self.report = report
        worst_name = max(report.relative_errors,
                         key=lambda n: np.nan_to_num(report.relative_errors[n], nan=np.inf))
        super().__init__(
            f"The {report.format} file for {report.path} differs from the Keras model: output "
            f"'{worst_name}' is off by {report.relative_errors[worst_name]:.3g} of its scale, "
            f"over atol={report.atol:g}; the file was not written (any existing file is "
            f"unchanged). Pass strict=False to write it anyway."
        )

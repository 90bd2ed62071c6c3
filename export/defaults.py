"""The export's default numbers and the check of a tolerance, in one module that imports nothing
heavy: the exporters use them, and `keras-bn-export --help` shows them without loading
TensorFlow. docs/guide/export.md states the same numbers (tests/test_cli.py checks).

A tolerance (`scale_tolerance`) is the largest error allowed as a fraction of each output's
scale, max |output| of the Keras model on the probe: not an absolute tolerance.
"""

import math

# By TFLite quantization (None: a float32 file, TFLite or ONNX), as a fraction of each output
# channel's scale (report.WorstChannel). float32 is exact up to rounding. The others are 2.8x
# (float16), 2.1x (dynamic) and 1.5x (int8) the worst error measured on correct exports
# (docs/guide/export.md, "Tolerances, measured"; int8's worst: an untrained CNN's softmax
# classes that peak at 0.03, against int8's 1/256 softmax step), and int8 8x or more the
# trained models'. The audited wrong files were off by 0.19 (int8 clipped beyond its
# calibrated range) to 1 (a lost channel).
SCALE_TOLERANCES = {None: 1e-4, "float16": 1e-3, "dynamic": 2e-2, "int8": 1e-1}
FLOAT32_SCALE_TOLERANCE = SCALE_TOLERANCES[None]
# A model that computes in float16 or bfloat16 (a mixed-precision policy) rounds to 2^-11 or
# 2^-8 at every layer, in Keras and in the file alike, but not in the same places: its default
# is at least this.
HALF_PRECISION_SCALE_TOLERANCE = 1e-2
HALF_PRECISION_DTYPES = ("float16", "bfloat16")
# The default probe: PROBE_SAMPLES representative samples, spread evenly over them. int8 is
# verified on samples it was not calibrated with: HELD_OUT_FRACTION of the representative
# samples (at most PROBE_SAMPLES) are held out to verify on, and up to CALIBRATION_SAMPLES of
# the rest calibrate (trace.held_out_split); it needs INT8_MIN_SAMPLES (4 held out, 12 to
# calibrate) at least.
PROBE_SAMPLES = 64
# A quantization-aware (QAT) model's file, in units of each output's quantization step (LSB):
# at most QAT_PERCENTILE_LSB on QAT_PERCENTILE percent of the values and QAT_MAX_LSB on every
# one (report.LsbTolerance). An integer runtime can land one level off at each layer where
# TensorFlow rounds in float, and those steps add up along the layers.
QAT_PERCENTILE = 99.0
QAT_PERCENTILE_LSB = 2.0
QAT_MAX_LSB = 4.0
CALIBRATION_SAMPLES = 200
HELD_OUT_FRACTION = 0.25
INT8_MIN_SAMPLES = 16


def check_scale_tolerance(value: object, name: str = "scale_tolerance") -> float:
    """`value` as a float, if it is a positive finite number.

    Args:
        value: the tolerance given.
        name: how the caller spells the argument ("scale_tolerance", "--scale-tolerance"),
            for the message.

    Returns:
        float.

    Raises:
        ValueError: `value` is not a positive finite int or float (a bool, a string, 0, a
            negative number, NaN or inf), naming `name` and the value.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{name} must be a positive finite number; received {name}={value!r}.")
    return float(value)


def short(number: float) -> str:
    """A tolerance as the docs write it: 1e-4, 5e-2 (one significant digit, no padded exponent).

    Args:
        number: a positive float.

    Returns:
        str.
    """
    mantissa, exponent = f"{number:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def describe_scale_tolerances() -> str:
    """The defaults in words, for the CLI's help.

    Returns:
        str, e.g. "1e-4 float32, 1e-3 float16, 2e-2 dynamic, 1e-1 int8; at least 1e-2 for a
        mixed-precision model".
    """
    each = ", ".join(
        f"{short(tolerance)} {quantization or 'float32'}"
        for quantization, tolerance in SCALE_TOLERANCES.items()
    )
    return f"{each}; at least {short(HALF_PRECISION_SCALE_TOLERANCE)} for a mixed-precision model"

"""Each train path's accuracy far from zero: x ~ N(1e3, 1e-2²) in float32, against float64.

One train step of a momentum-0 keras_bn layer per layout and mode (tests/helpers.py's
`large_offset_errors`: numpy's y, μ and σ², autodiff's ∂l/∂x); prints, per path, the worst
scale-relative error over the layouts and modes. The paths: fused (eager and tf.function, with
and without keras_bn/backend/tensorflow/fused.py's re-centring), the XLA:CPU path
(jit_compile=True) and the composite path (forced, every mode). docs/guide/layer.md quotes
this table.

    python benchmarks/offset_accuracy.py           # the layouts below (about a minute)
    python benchmarks/offset_accuracy.py --smoke   # two small layouts: CI's check
"""

import argparse
import os
import sys

import _tf_env  # noqa: F401  (before TensorFlow: its environment)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from bench_layer import machine_description

from keras_bn.backend.tensorflow import fused
from tf_helpers import large_offset_errors

# (shape, channel axis): every layout the fused path takes, small and conv-sized.
LAYOUTS = [
    ((8, 5, 5, 6), -1),
    ((8, 6, 5, 5), 1),
    ((32, 6), -1),
    ((4, 7, 6), -1),
    ((4, 6, 7), 1),
    ((3, 3, 4, 4, 6), -1),
    ((3, 6, 3, 4, 4), 1),
    ((32, 8, 8, 16), -1),
    ((32, 16, 8, 8), 1),
    ((512, 64), -1),
]
SMOKE_LAYOUTS = LAYOUTS[:2]
# path name: (modes, force the composite path, re-centring on)
PATHS = {
    "fused, re-centred": (("eager", "graph"), False, True),
    "fused, not re-centred": (("eager", "graph"), False, False),
    "XLA:CPU (jit_compile=True)": (("xla",), False, True),
    "composite": (("eager", "graph", "xla"), True, True),
}
QUANTITIES = ("y", "dx", "moving_mean", "moving_variance")


def worst_errors(layouts):
    """{path: {quantity: worst error over the layouts and the path's modes}}."""
    table = {}
    shipped = fused.RECENTRE_STDDEVS
    for path, (modes, composite, recentre) in PATHS.items():
        fused.RECENTRE_STDDEVS = shipped if recentre else None
        try:
            errors = [
                large_offset_errors(shape, axis, mode, composite)
                for shape, axis in layouts
                for mode in modes
            ]
        finally:
            fused.RECENTRE_STDDEVS = shipped
        table[path] = {q: max(e[q] for e in errors) for q in QUANTITIES}
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="two small layouts")
    args = parser.parse_args(argv)
    layouts = SMOKE_LAYOUTS if args.smoke else LAYOUTS
    print(f"machine: {machine_description()}")
    print(f"x ~ N(1e3, 1e-2²), float32, {len(layouts)} layouts; max |error| / max |float64|\n")
    print("| path | y | ∂l/∂x | moving mean | moving variance |\n|---|---|---|---|---|")
    for path, errors in worst_errors(layouts).items():
        print(f"| {path} | " + " | ".join(f"{errors[q]:.1e}" for q in QUANTITIES) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

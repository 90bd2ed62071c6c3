"""Batch renormalization (Ioffe 2017): the r and d corrections, and their arguments.

In training, with σ_B = √(σ²_B + ε) and the renorm moving averages μ, σ (renorm_momentum):

    r = clip(σ_B / σ, rmin, rmax)        d = clip((μ_B − μ) / σ, −dmax, dmax)
    y = γ·(x̂·r + d) + β = x̂·(γ·r) + (β + γ·d)

r and d are constants for the gradient (stop-gradient, as in the paper), so the gradient is
that of y = x̂·γ' + β' with fixed γ', β'. Inference uses the moving statistics as without renorm.
The argument names and weights follow keras.layers.BatchNormalization; each backend's
`renorm_corrections` computes r and d.
"""

import math

CLIPPING_KEYS = ("rmax", "rmin", "dmax")


def validate_clipping(renorm_clipping, renorm):
    """None, or a dict of floats over CLIPPING_KEYS with rmin ≤ rmax and dmax ≥ 0."""
    if renorm_clipping is None:
        return None
    if not isinstance(renorm_clipping, dict):
        raise ValueError(
            f"renorm_clipping must be None or a dict with keys {list(CLIPPING_KEYS)}; received "
            f"renorm_clipping={renorm_clipping!r}."
        )
    # The messages contain Keras's phrases ("Received invalid keys", "rmax should be", "dmax
    # should be non-negative"), so code that matches Keras's errors matches these too.
    unknown = sorted(set(renorm_clipping) - set(CLIPPING_KEYS))
    if unknown:
        raise ValueError(
            f"renorm_clipping has unknown key(s) {unknown}; the keys are {list(CLIPPING_KEYS)}. "
            f"Received invalid keys for `renorm_clipping`: renorm_clipping={renorm_clipping!r}."
        )
    clipping = {}
    for key, value in renorm_clipping.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"renorm_clipping[{key!r}] must be a number; received {value!r}.")
        clipping[key] = float(value)
    rmin, rmax, dmax = (clipping.get(k) for k in ("rmin", "rmax", "dmax"))
    if rmin is not None and rmax is not None and rmax < rmin:
        raise ValueError(
            f"renorm_clipping needs rmax ≥ rmin (rmax should be greater than or equal to "
            f"rmin); received rmax={rmax}, rmin={rmin}."
        )
    if dmax is not None and dmax < 0:
        raise ValueError(
            f"renorm_clipping needs dmax ≥ 0 (dmax should be non-negative); received dmax={dmax}."
        )
    if clipping and not renorm:
        raise ValueError(f"renorm_clipping={renorm_clipping!r} has no effect without renorm=True.")
    return clipping

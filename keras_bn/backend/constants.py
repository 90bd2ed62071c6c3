"""The numbers that more than one backend's maths uses, each defined once (why each value is
what it is stands beside it).
"""

# The shifted moments (keras_bn/backend/tensorflow/xla.py, keras_bn/backend/jax/ops.py) take
# each channel's shift K as the mean of up to this many values along the first reduced axis: a
# single value is often several σ out (and would trigger the redo below); a mean of 8 rarely is.
SHIFT_SAMPLES = 8
# Redo the shifted moments about the mean when (μ − K)² exceeds this multiple of σ², that is
# when K lies more than 3σ from the mean; below it the shifted sums lose at most ~10× their
# rounding. At 64 (8σ) a first sample 6-8σ out cost up to 2.6e-5 of the variance.
SHIFT_REDO_RATIO = 9.0
# Inference takes the one-pass fold y = a·x + (β − a·mean) (a kernel's own: FusedBatchNormV3's,
# F.batch_norm's) only while no channel's |mean| exceeds this many √(variance + ε), and computes
# (x − mean)·a + β otherwise (`batch_norm_eval`): below it the fold adds at most about
# 2·3·|γ|·2⁻²⁴ of rounding, about 2⁻²⁴ of an output whose scale is |γ|·max|x̂| ≳ 3|γ|; usual
# activations (a BN's input, |mean|/σ ≈ 1.4 after a ReLU) stay below it. Far above it the fold
# loses (|mean|/σ)·2⁻²⁴ of the output's scale (2e-2 at mean 1e4, σ 1e-2). Below it the error
# is still about |γ|·2⁻²⁴ times a few, more than that of an output much narrower than |γ| (data
# far narrower than its statistics), where x − mean first would keep its own few roundings.
EVAL_RECENTRE_STDDEVS = 3.0

# The FakeQuant ops divide by max − min: a range narrower than this (an activation that was 0 on
# every batch seen, a kernel channel of tiny weights) is widened to it, and 0 stays on the grid.
MIN_RANGE = 1e-8
# The range m of an all-zero kernel channel (or tensor), as γ = 0 gives one: its weights round to
# 0 on any grid, but a file's int32 bias is the bias divided by the input's and the weight's
# scales, which overflows with a step of MIN_RANGE/q_max.
ZERO_WEIGHT_RANGE = 1.0

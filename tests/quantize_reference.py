"""Independent numpy references for the QAT tests: k-bit fake quantization from its definition,
convolutions as sums over the kernel taps, and the folded-BN QAT forward pass in float64.

Nothing here imports keras_bn: the grids are written from the definitions (symmetric weights
w ↦ clip(round(w/Δ), ±q_max)·Δ with Δ = max|w|/q_max; asymmetric activations over [lo, hi]
with the zero point rounded onto the integer grid), not from TensorFlow's nudging arithmetic.
Rounding is half up, as ⌊u + ½⌋.
"""

import numpy as np

KERNEL_LAST = ("conv", "dense", "separable")


def q_max(bits):
    return 2 ** (bits - 1) - 1


def weight_scale(kernel, bits, per_channel):
    """Δ per output channel (the last axis) or per tensor, for a channels-last kernel view."""
    magnitude = np.abs(np.asarray(kernel, np.float64))
    if per_channel:
        largest = magnitude.reshape(-1, kernel.shape[-1]).max(axis=0)
    else:
        largest = magnitude.max()
    # An all-zero channel gets the range 1 (its weights are 0 on any grid).
    return np.where(largest > 0, np.maximum(largest, 1e-8), 1.0) / q_max(bits)


def straight_through_weight_mask(kernel, bits, per_channel):
    """torch.ao's straight-through rule for symmetric weight fake quantization: gradient 1
    where round(w/Δ) lies in [−q_max, q_max], else 0 (float64)."""
    levels = np.round(np.asarray(kernel, np.float64) / weight_scale(kernel, bits, per_channel))
    return ((levels >= -q_max(bits)) & (levels <= q_max(bits))).astype(np.float64)


def fake_quant_weights(kernel, bits, per_channel, scale=None):
    """Symmetric narrow-range k-bit fake quantization (Δ from the kernel unless given)."""
    kernel = np.asarray(kernel, np.float64)
    scale = weight_scale(kernel, bits, per_channel) if scale is None else scale
    q = np.clip(np.floor(kernel / scale + 0.5), -q_max(bits), q_max(bits))
    return q * scale


def lsq_gradients(kernel, max_abs, bits, upstream):
    """Learned step size quantization's gradients (Esser et al. 2020) of Σ upstream·FQ(w; m)
    for symmetric weights with the step s = m/q_max, from its definition, in float64: to w,
    upstream where |w| < m and 0 where clipped (|w| ≥ m); to s, Σ upstream·(q − w/s inside,
    ±q_max clipped) over each range's weights, times 1/√(N·q_max), N the weights per range;
    to m = q_max·s, the gradient an SGD step on m needs to move it as LSQ's moves s: q_max
    times s's (∂s/∂m = 1/q_max, and an SGD step on s moves m = q_max·s by q_max times it).

    Args:
        kernel: channels-last kernel.
        max_abs: m, per channel (a vector of the last axis) or a scalar.
        bits: 2..8.
        upstream: the gradient of the output, the kernel's shape.

    Returns:
        (gradient to the kernel, gradient to m).
    """
    kernel = np.asarray(kernel, np.float64)
    m = np.asarray(max_abs, np.float64)
    top = q_max(bits)
    step = m / top
    q = np.clip(np.floor(kernel / step + 0.5), -top, top)
    inside = np.abs(kernel) < m
    local = np.where(inside, q - kernel / step, np.sign(kernel) * top)  # ∂FQ/∂s
    flat = (upstream * local).reshape(-1, kernel.shape[-1])
    per_range = flat.shape[0] if m.ndim else flat.size
    to_step = (flat.sum(axis=0) if m.ndim else flat.sum()) / np.sqrt(per_range * top)
    return upstream * inside, to_step * top


def activation_grid(lo, hi, bits):
    """(Δ, zero point) of the asymmetric grid of [lo, hi] ∋ 0, the zero point an integer."""
    levels = 2**bits - 1
    scale = (hi - lo) / levels
    zero_point = np.clip(np.floor(-lo / scale + 0.5), 0, levels)
    return scale, zero_point


def fake_quant_activations(x, lo, hi, bits):
    """Asymmetric per-tensor k-bit fake quantization of x over [lo, hi]."""
    scale, zero_point = activation_grid(lo, hi, bits)
    q = np.clip(np.floor(np.asarray(x, np.float64) / scale + 0.5) + zero_point, 0, 2**bits - 1)
    return (q - zero_point) * scale


def distance_to_rounding_boundary(x, lo, hi, bits):
    """How far each x/Δ lies from a half-integer (in steps): where it is tiny, float32 rounding
    may put the value on either neighbouring grid point."""
    scale, _ = activation_grid(lo, hi, bits)
    u = np.asarray(x, np.float64) / scale
    return np.abs(u - np.floor(u) - 0.5)


def channels_last_view(kernel, kind):
    """Output channels on the last axis: a depthwise (*k, C, M) kernel as (*k, 1, C·M)."""
    if kind != "depthwise":
        return kernel
    return kernel.reshape(kernel.shape[:-2] + (1, kernel.shape[-2] * kernel.shape[-1]))


def away_from_ties(kernel, kind, scale_per_channel, bits, per_channel):
    """`kernel` with every entry whose scaled value lies within 0.02 steps of a rounding
    boundary moved 0.05 steps away, so that float32 and float64 round it alike."""
    kernel = np.array(kernel, np.float64)
    view = channels_last_view(kernel, kind)
    scaled = view * scale_per_channel
    step = weight_scale(scaled, bits, per_channel)
    u = scaled / step
    near = np.abs(u - np.floor(u) - 0.5) < 0.02
    u = np.where(near, u - 0.05 * np.sign(u), u)  # toward 0: the largest |u| stays the largest
    divisor = np.where(scale_per_channel == 0, 1.0, scale_per_channel)
    view = np.where(scale_per_channel == 0, view, u * step / divisor)
    return view.reshape(kernel.shape)


def activation_indices(x, lo, hi, bits):
    """The unsigned integers 0..2^k − 1 of x on the asymmetric grid of [lo, hi]."""
    scale, zero_point = activation_grid(lo, hi, bits)
    return np.clip(np.floor(np.asarray(x, np.float64) / scale + 0.5) + zero_point, 0, 2**bits - 1)


def average_pool_int8(indices, size):
    """TFLite's int8 AVERAGE_POOL_2D, in integers: channels-last (n, h, w, c) grid indices
    (a k-bit grid is the int8 grid's lowest 2^k levels, so its int8 value is index − 128), in
    size × size windows at stride size, no padding. Each window's int8 values are summed and
    the sum divided by the count, rounded half away from 0 (TFLite's reference kernel:
    (sum ± count/2)/count in C's truncating division). Returns indices again."""
    q = np.asarray(indices, np.int64) - 128
    n, h, w, c = q.shape
    q = q[:, : h // size * size, : w // size * size]
    total = q.reshape(n, h // size, size, w // size, size, c).sum(axis=(2, 4))
    count = size * size
    away = np.where(total >= 0, (total + count // 2) // count, -((-total + count // 2) // count))
    return away + 128


def _resize_axis(out_len, in_len, factor):
    """(low, high, w_low, w_high) per output position of a bilinear resize by an integer
    factor along one axis, half-pixel centres: the source position (i + ½)/factor − ½ is
    (2i + 1 − factor)/(2·factor), so integer weights over 2·factor, clamped at the edges."""
    position = 2 * np.arange(out_len) + 1 - factor  # in units of 1/(2·factor)
    low = np.maximum(position // (2 * factor), 0)
    high = np.minimum(low + 1, in_len - 1)
    fraction = np.clip(position - 2 * factor * low, 0, 2 * factor)
    return low, high, 2 * factor - fraction, fraction


def resize_bilinear_int8(indices, size):
    """TFLite's int8 RESIZE_BILINEAR with half-pixel centres as LiteRT computes it, in
    integers: channels-last (n, h, w, c) grid indices (int8 value index − 128) resized by
    the integer factors `size` (rows, cols); each output is the exact weighted average of
    its int8 neighbours, rounded halves up. Returns indices again."""
    q = np.asarray(indices, np.int64) - 128
    h, w = q.shape[1:3]
    y0, y1, wy0, wy1 = _resize_axis(h * size[0], h, size[0])
    x0, x1, wx0, wx1 = _resize_axis(w * size[1], w, size[1])
    total = sum(
        q[:, ys][:, :, xs] * (wy[None, :, None, None] * wx[None, None, :, None])
        for ys, wy in ((y0, wy0), (y1, wy1))
        for xs, wx in ((x0, wx0), (x1, wx1))
    )
    denominator = 4 * size[0] * size[1]
    return (total + denominator // 2) // denominator + 128


def _same_padding(size, kernel, stride, dilation):
    span = (kernel - 1) * dilation + 1
    out = -(-size // stride)
    total = max((out - 1) * stride + span - size, 0)
    return total // 2, total - total // 2


def _taps(x, kernel_size, strides, padding, dilation):
    """Yield (tap index, the strided input slice it multiplies), channels-last x (N, *S, C)."""
    spatial = x.shape[1:-1]
    if padding == "same":
        pads = [
            _same_padding(s, k, st, d)
            for s, k, st, d in zip(spatial, kernel_size, strides, dilation)
        ]
    elif padding == "causal":
        pads = [((kernel_size[0] - 1) * dilation[0], 0)]
    else:
        pads = [(0, 0)] * len(spatial)
    x = np.pad(x, [(0, 0), *pads, (0, 0)])
    padded = x.shape[1:-1]
    out = [
        (p - ((k - 1) * d + 1)) // st + 1
        for p, k, st, d in zip(padded, kernel_size, strides, dilation)
    ]
    for tap in np.ndindex(*kernel_size):
        index = tuple(
            slice(t * d, t * d + (o - 1) * st + 1, st)
            for t, d, o, st in zip(tap, dilation, out, strides)
        )
        yield tap, x[(slice(None), *index, slice(None))]


def conv(x, kernel, strides, padding, dilation):
    """Channels-last convolution, kernel (*k, C_in, C_out)."""
    total = 0.0
    for tap, window in _taps(x, kernel.shape[:-2], strides, padding, dilation):
        total = total + window @ kernel[tap]
    return total


def depthwise(x, kernel, strides, padding, dilation):
    """Channels-last depthwise convolution, kernel (*k, C, M), output channel c·M + m."""
    total = 0.0
    for tap, window in _taps(x, kernel.shape[:-2], strides, padding, dilation):
        product = window[..., :, None] * kernel[tap]
        total = total + product.reshape(product.shape[:-2] + (-1,))
    return total


def host_output(spec, x, kernel, depthwise_kernel=None, between=None):
    """The host's output without bias, channels-last x; `spec` a dict of the host's geometry."""
    kind = spec["kind"]
    if kind == "dense":
        return x @ kernel
    args = (spec["strides"], spec["padding"], spec["dilation"])
    if kind == "conv":
        return conv(x, kernel, *args)
    if kind == "depthwise":
        return depthwise(x, kernel, *args)
    middle = depthwise(x, depthwise_kernel, *args)
    if between is not None:
        middle = between(middle)
    ones = (1,) * (kernel.ndim - 2)
    return conv(middle, kernel, ones, "valid", ones)


def bias_on_grid(bias, input_step, weight_step):
    """The bias as an integer file adds it: an int32 in units of the input's step times the
    weights' (per output channel), so a multiple of that, nearest the float bias."""
    step = np.asarray(input_step, np.float64) * np.asarray(weight_step, np.float64)
    return np.floor(np.asarray(bias, np.float64) / step + 0.5) * step


def qat_forward(
    spec,
    x,
    weights,
    bits,
    per_channel,
    training,
    epsilon,
    activation=None,
    between=None,
    input_step=None,
    ranges=None,
):
    """The folded-BN QAT layer's output before its output quantizer, in float64.

    Args:
        spec: the host's geometry ("kind", "strides", "padding", "dilation").
        x: channels-last input.
        weights: dict with "kernel" (the folded one: pointwise for separable), optional
            "depthwise_kernel", "bias", "gamma", "beta", "mean", "variance".
        bits: weight bits, or None for float weights.
        per_channel: weight ranges per output channel.
        training: batch statistics (before the freeze) rather than the folded form.
        epsilon: the batch norm's epsilon.
        activation: None, "relu" or "relu6".
        between: for a separable host, a function of the depthwise output (its quantizer).
        input_step: the step of the grid the pointwise/host kernel's input lies on (a
            separable host's intermediate one), or None; with `bits`, the folded bias is then
            `bias_on_grid` of it and the kernel's weight step.
        ranges: None (Δ = max|w|/q_max), or learned ranges {"kernel": r, and for a separable
            host "depthwise_kernel": r}: Δ = r·|s|/q_max per channel (r in the host kernel's
            units), r/q_max per tensor (r in W·s's).

    Returns:
        (y, batch mean of the host output with bias, biased batch variance); the batch
        statistics are None when not training.
    """
    x = np.asarray(x, np.float64)
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    kind = spec["kind"]
    gamma, beta, mean, var, bias = w["gamma"], w["beta"], w["mean"], w["variance"], w["bias"]
    sigma = np.sqrt(var + epsilon)
    s = gamma / sigma
    view = channels_last_view(w["kernel"], kind) * s
    weight_step = depthwise_step = None
    if bits is not None:
        weight_step = weight_scale(view, bits, per_channel)
        if ranges is not None:
            learned = np.abs(np.asarray(ranges["kernel"], np.float64))
            weight_step = learned * (np.abs(s) if per_channel else 1.0) / q_max(bits)
        view = fake_quant_weights(view, bits, per_channel, weight_step)
    kernel = view.reshape(w["kernel"].shape)
    dw = w.get("depthwise_kernel")
    if dw is not None and bits is not None:
        dw_view = channels_last_view(dw, "depthwise")
        if ranges is not None:
            depthwise_step = np.abs(np.asarray(ranges["depthwise_kernel"])) / q_max(bits)
        dw = fake_quant_weights(dw_view, bits, per_channel, depthwise_step)
        dw = dw.reshape(w["depthwise_kernel"].shape)
    z = host_output(spec, x, kernel, dw, between)
    batch_mean = batch_var = None
    if training:
        live = gamma != 0
        z_orig = z[..., live] / s[live]
        axes = tuple(range(z.ndim - 1))
        mu = z_orig.mean(axis=axes)
        v = ((z_orig - mu) ** 2).mean(axis=axes)
        sigma_b = np.sqrt(v + epsilon)
        y = np.broadcast_to(beta, z.shape).copy()  # a γ = 0 channel outputs β
        y[..., live] = z[..., live] * (sigma[live] / sigma_b) + (
            beta[live] - gamma[live] * mu / sigma_b
        )
        batch_mean = np.zeros_like(gamma)
        batch_var = np.zeros_like(gamma)
        batch_mean[live], batch_var[live] = mu + bias[live], v
    else:
        folded = beta + s * (bias - mean)
        if input_step is not None and weight_step is not None:
            folded = bias_on_grid(folded, input_step, weight_step)
        y = z + folded
    if activation == "relu":
        y = np.maximum(y, 0.0)
    elif activation == "relu6":
        y = np.clip(y, 0.0, 6.0)
    return y, batch_mean, batch_var


def learned_range_case(bits, per_channel):
    """(kernel, range, upstream) float32 for the learned-range gradient tests of every backend:
    the range is 0.6 of max|w| (per channel or per tensor), so that some weights are clipped,
    and two weights per channel lie exactly at ±m (a tie the backends' min and max would
    split)."""
    rng = np.random.default_rng(bits)
    kernel = (rng.normal(size=(3, 3, 4, 6)) * rng.uniform(0.2, 2.0, 6)).astype(np.float32)
    magnitude = np.abs(kernel).reshape(-1, 6)
    top = magnitude.max(axis=0) if per_channel else magnitude.max()
    max_abs = np.asarray(0.6 * top, np.float32)
    kernel[0, 0, 0], kernel[0, 0, 1] = max_abs, -max_abs  # ties |w| = m: clipped
    upstream = rng.normal(size=kernel.shape).astype(np.float32)
    return kernel, max_abs, upstream

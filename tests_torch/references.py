"""Independent references for the PyTorch tests: numpy float64 formulas (tests/bn_references.py,
shared with tests_jax) and a plain torch batch norm that autograd differentiates by itself (no
keras_bn code)."""

import numpy as np
import torch
from bn_references import numpy_train, reduced  # noqa: F401  (re-exported: tests import it here)


def torch_train(x, gamma, beta, channel_axes, eps, weight=None):
    """Train-mode BN as plain torch ops (differentiated by autograd); `weight` an optional 0/1
    mask broadcastable to x."""
    axes = reduced(x.ndim, channel_axes)
    shape = [x.shape[i] if i in channel_axes else 1 for i in range(x.ndim)]
    w = torch.ones_like(x) if weight is None else torch.broadcast_to(weight, x.shape)
    m = torch.sum(w, axes, keepdim=True)
    mean = torch.sum(w * x, axes, keepdim=True) / m
    variance = torch.sum(w * (x - mean) ** 2, axes, keepdim=True) / m
    return (x - mean) / torch.sqrt(variance + eps) * torch.reshape(gamma, shape) + torch.reshape(
        beta, shape
    )


def array(t):
    """A tensor (or variable) as a numpy array, detached and on the CPU."""
    if hasattr(t, "value"):
        t = t.value
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().numpy()
    return np.asarray(t)

"""The moments at 262,144 and 1,048,576 values per channel under JAX (issue 32, item 6): the
layer's training step (jitted, as fit runs it) and recalibrate, against float64 numpy, on the
issue's worst case for the shifted sums (the first 8 samples at 2.9σ, just under the 3σ redo).

The bound is tests/test_large_counts.py's, 1e-5 of the variance at either count. XLA:CPU's
reductions under JAX already kept it (2.4e-6 at 2²⁰ before the TensorFlow fix): these guard it.
"""

import jax
import keras
import numpy as np
import pytest

import keras_bn

pytestmark = pytest.mark.backends("jax")

BOUND = 1e-5
CHANNELS = 4
SIZES = {"262k": (256, 32), "1M": (1024, 32)}


@pytest.fixture(scope="module", params=list(SIZES))
def data(request):
    batch, side = SIZES[request.param]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, side, side, CHANNELS)).astype(np.float32)
    x[:8, 0, 0, :] = 2.9  # K = the mean of the first 8 values: 2.9σ from the mean
    return x, x.astype(np.float64).var(axis=(0, 1, 2))


def _relative(value, reference):
    return float(np.max(np.abs(np.asarray(value, np.float64).ravel() / reference - 1)))


def test_training_variance(data):
    x, reference = data
    layer = keras_bn.BatchNormalization(momentum=0.0)
    layer.build(x.shape)

    @jax.jit
    def step(trainable, non_trainable, x):
        _, updated = layer.stateless_call(trainable, non_trainable, x, training=True)
        return updated

    updated = step(
        [v.value for v in layer.trainable_variables],
        [v.value for v in layer.non_trainable_variables],
        x,
    )
    moving = dict(zip([v.path for v in layer.non_trainable_variables], updated))
    (variance,) = [value for path, value in moving.items() if path.endswith("moving_variance")]
    m = x.size // CHANNELS
    assert _relative(np.asarray(variance) * (m - 1) / m, reference) < BOUND


def test_recalibrate_variance(data):
    x, reference = data
    model = keras.Sequential([keras.Input(x.shape[1:]), keras_bn.BatchNormalization()])
    keras_bn.recalibrate(model, x, batch_size=len(x), progress=False)
    m = x.size // CHANNELS
    moving = model.layers[0].moving_variance.numpy() * (m - 1) / m
    assert _relative(moving, reference) < BOUND

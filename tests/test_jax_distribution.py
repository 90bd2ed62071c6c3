"""keras_bn.BatchNormalization under keras.distribution.DataParallel on two CPU devices
(tests/conftest.py asks XLA for them under JAX): the batch statistics are those of the global batch,
as synchronized BN gives on TensorFlow, whatever `synchronized` says.

Each global batch's two halves (one per device) have means −5 and +5, so the global variance
(≈ 26) and the average of the per-device variances (≈ 1) differ by far: a per-device
computation would fail these tests."""

import jax
import keras
import numpy as np
import pytest
from framework_references import jnp_train, numpy_train
from jax.sharding import NamedSharding, PartitionSpec

import keras_bn

pytestmark = pytest.mark.backends("jax")

FEATURES, BATCH, STEPS, MOMENTUM = 4, 16, 4, 0.5


def _split_batches(seed):
    """STEPS batches of BATCH rows whose first half has mean −5 and second half +5."""
    x = np.random.default_rng(seed).normal(0.0, 1.0, (STEPS, BATCH, FEATURES))
    x[:, : BATCH // 2] -= 5.0
    x[:, BATCH // 2 :] += 5.0
    return x.reshape(STEPS * BATCH, FEATURES).astype("float32")


def _moving_variance(batches):
    """Algorithm 2's moving variance after these batches (lists of row blocks, each block's
    unbiased variances averaged with weights by size: the count-weighted pooling of
    replicas), in float64."""
    variance = np.ones(FEATURES)
    for blocks in batches:
        rows = sum(len(b) for b in blocks)
        pooled = sum(len(b) * b.astype(np.float64).var(0, ddof=1) for b in blocks) / rows
        variance = MOMENTUM * variance + (1 - MOMENTUM) * pooled
    return variance


@pytest.fixture
def two_devices():
    devices = jax.devices("cpu")
    assert len(devices) == 2, "tests/conftest.py sets XLA_FLAGS for two CPU devices"
    yield devices
    keras.distribution.set_distribution(None)


def _fit(x, y, distribution):
    """A model with one BN of each `synchronized`, trained STEPS steps (jit, no shuffling)
    under `distribution` (None: one device)."""
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras_bn.BatchNormalization(momentum=MOMENTUM, name="first"),
            keras.layers.Dense(3, name="hidden"),
            keras_bn.BatchNormalization(momentum=0.9, synchronized=True, name="second"),
            keras.layers.Dense(1, name="out"),
        ],
        name="net",
    )
    model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.slow
def test_fit_under_data_parallel_equals_one_device_on_the_global_batch(two_devices):
    x = _split_batches(0)
    y = np.random.default_rng(1).normal(size=(len(x), 1)).astype("float32")
    single = _fit(x, y, None)
    single_out = single.predict(x, verbose=0)
    distribution = keras.distribution.DataParallel(devices=two_devices)
    shared = _fit(x, y, distribution)
    # The batches were split over both devices and the weights live on both.
    layout = distribution.get_data_layout((BATCH, FEATURES))
    assert tuple(layout.axes) == ("batch", None) and layout.device_mesh.shape == (2,)
    first = shared.get_layer("first")
    assert first.moving_variance.value.sharding.device_set == set(two_devices)
    for a, b in zip(single.weights, shared.weights, strict=True):
        assert a.path == b.path
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-5, err_msg=a.path)
    np.testing.assert_allclose(shared.predict(x, verbose=0), single_out, rtol=1e-5, atol=1e-5)
    # Global statistics, not the devices' own: the moving variance replays the whole batches.
    batches = np.split(x, STEPS)
    global_variance = _moving_variance([[b] for b in batches])
    local_variance = _moving_variance([np.split(b, 2) for b in batches])
    assert np.all(global_variance > 10 * local_variance)  # the test can tell them apart
    np.testing.assert_allclose(first.moving_variance.numpy(), global_variance, rtol=1e-5)
    np.testing.assert_allclose(
        first.moving_mean.numpy(),
        sum(
            (1 - MOMENTUM) * MOMENTUM ** (STEPS - 1 - i) * b.mean(0) for i, b in enumerate(batches)
        ),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("synchronized", [False, True])
def test_sharded_train_step_reduces_over_both_devices(two_devices, synchronized):
    """A jitted stateless train step on a batch sharded over both devices: the output, the
    gradients (the hand-written backward's sums) and the new moving statistics are the global
    batch's, equal to the one-device step; XLA's program all-reduces."""
    layer = keras_bn.BatchNormalization(momentum=MOMENTUM, synchronized=synchronized)
    x = _split_batches(2)[:BATCH]
    layer.build(x.shape)
    trainable = [v.value for v in layer.trainable_variables]
    fixed = [v.value for v in layer.non_trainable_variables]
    upstream = np.random.default_rng(3).normal(size=x.shape).astype("float32")

    def step(trainable, fixed, x):
        def loss(trainable, x):
            y, new = layer.stateless_call(trainable, fixed, x, training=True)
            return (y * upstream).sum(), (y, new)

        (grads, dx), (y, new) = jax.grad(loss, argnums=(0, 1), has_aux=True)(trainable, x)
        return y, grads, dx, new

    mesh = jax.sharding.Mesh(two_devices, ("batch",))
    sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("batch")))
    assert [s.data.shape for s in sharded.addressable_shards] == [(BATCH // 2, FEATURES)] * 2
    jitted = jax.jit(step)
    assert "all-reduce" in jitted.lower(trainable, fixed, sharded).compile().as_text()
    y, grads, dx, new = jitted(trainable, fixed, sharded)
    assert y.sharding.device_set == set(two_devices)
    one_device = jax.jit(step)(trainable, fixed, x)
    for got, expected in zip(
        jax.tree.leaves((y, grads, dx, new)), jax.tree.leaves(one_device), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    # Independent references: numpy's global BN, and autodiff of plain jnp BN.
    gamma, beta = np.ones(FEATURES), np.zeros(FEATURES)
    expected_y, mean, variance, _ = numpy_train(x, gamma, beta, [1], layer.epsilon)
    np.testing.assert_allclose(np.asarray(y), expected_y, rtol=1e-5, atol=1e-5)
    local_y = np.concatenate(
        [numpy_train(h, gamma, beta, [1], layer.epsilon)[0] for h in np.split(x, 2)]
    )
    assert np.max(np.abs(local_y - expected_y)) > 1.0  # per-device BN would be far off
    reference_dx = jax.grad(
        lambda x: (jnp_train(x, gamma, beta, [1], layer.epsilon) * upstream).sum()
    )(x)
    np.testing.assert_allclose(np.asarray(dx), reference_dx, rtol=1e-4, atol=1e-5)
    moving_mean, moving_variance = (np.asarray(v) for v in new)
    np.testing.assert_allclose(moving_mean, (1 - MOMENTUM) * mean, rtol=1e-5, atol=1e-6)
    unbiased = variance * BATCH / (BATCH - 1)
    np.testing.assert_allclose(moving_variance, MOMENTUM + (1 - MOMENTUM) * unbiased, rtol=1e-5)

"""The QAT weights' straight-through gradient under JAX: 1 for every weight, as torch.ao's
weight fake quantization gives (tests/quantize_reference.py writes its rule in numpy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quantize_reference as ref

from keras_bn.quantize import fake_quant


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_weight_gradient_is_one_for_every_weight_as_torch_ao_gives(bits, per_channel):
    """The weight that sets its channel's range included: TensorFlow's kernel (which the jnp
    twin reproduces) gave it 0 wherever float32 puts the nudged maximum just below it."""
    rng = np.random.default_rng(bits)
    kernel = (rng.normal(size=(3, 3, 8, 300)) * rng.uniform(0.01, 3.0, 300)).astype(np.float32)
    upstream = rng.normal(size=kernel.shape).astype(np.float32)

    def loss(weights):
        max_abs = fake_quant.weight_max_abs(weights, per_channel)
        return jnp.sum(fake_quant.fake_quant_weights(weights, max_abs, bits) * upstream)

    for gradient in (jax.grad(loss)(kernel), jax.jit(jax.grad(loss))(kernel)):
        reference = ref.straight_through_weight_mask(kernel, bits, per_channel) * upstream
        assert reference.all()
        np.testing.assert_array_equal(np.asarray(gradient), reference.astype(np.float32))


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_learned_ranges_get_lsqs_gradients(bits, per_channel):
    """fake_quant_weights_learned under JAX (eager and jitted): fake_quant_weights' values, and
    LSQ's gradients to the kernel and the range (tests/quantize_reference.py)."""
    kernel, max_abs, upstream = ref.learned_range_case(bits, per_channel)

    def loss(weights, learned):
        return jnp.sum(fake_quant.fake_quant_weights_learned(weights, learned, bits) * upstream)

    expected_kernel, expected_range = ref.lsq_gradients(kernel, max_abs, bits, upstream)
    for gradient in (jax.grad(loss, (0, 1)), jax.jit(jax.grad(loss, (0, 1)))):
        to_kernel, to_range = gradient(jnp.asarray(kernel), jnp.asarray(max_abs))
        np.testing.assert_array_equal(np.asarray(to_kernel), expected_kernel)
        np.testing.assert_allclose(np.asarray(to_range), expected_range, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(fake_quant.fake_quant_weights_learned(kernel, max_abs, bits)),
        np.asarray(fake_quant.fake_quant_weights(kernel, max_abs, bits)),
    )

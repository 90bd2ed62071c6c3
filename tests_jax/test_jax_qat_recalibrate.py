"""tests/test_qat_recalibrate.py's checks under JAX, without TensorFlow: recalibrate, Recalibrate
and FreezeBatchNorm(data=...) on QAT models against the float64 numpy reference. Its two
comparisons of methods (one pass against per layer, one pass against ten) are left to the
TensorFlow and PyTorch runs: under JAX each costs half a minute of eager passes."""

from test_qat_recalibrate import (  # noqa: F401  (collected here)
    test_freeze_batch_norm_checks_its_new_arguments,
    test_freeze_batch_norm_re_estimates_at_the_freeze,
    test_per_channel_passes_stop_after_the_second,
    test_per_channel_qat_layers_get_algorithm_2_of_their_rounded_kernels,
    test_per_tensor_qat_layers_settle_or_say_how_far_they_are,
    test_the_recalibrate_callback_takes_a_qat_model,
)

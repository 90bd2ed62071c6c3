"""tests/test_qat_recalibrate.py's checks under PyTorch, without TensorFlow: recalibrate,
Recalibrate and FreezeBatchNorm(data=...) on QAT models against the float64 numpy reference."""

from test_qat_recalibrate import *  # noqa: F403  (its tests, collected here too)

"""The TensorFlow environment every benchmark runs in; import it before TensorFlow.

oneDNN's CPU kernels are on, as tests/conftest.py sets them. TensorFlow turns them on by itself
only on CPUs that report AVX-512 VNNI or AMX; this project's machines hide those flags, and
without oneDNN the NCHW fused kernel is ~4x slower. Every contender runs under the same setting,
and bench_layer.machine_description prints it.

Then TensorFlow is imported as every entry point of the project imports it
(keras_bn/_quiet.py): quiet logs, its start-up lines dropped, any other line still printed.
"""

import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

from keras_bn import _quiet

_quiet.entry_point()

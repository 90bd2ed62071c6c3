"""first_step.py, which the suite installs (conftest.py) so that Keras's trainers prepare the
first train step once: a float and a QAT model trained through it end bit for bit where Keras's
own `make_train_function` leaves them, and it saves the second trace (TensorFlow) or the second
compile (torch.compile) that Keras makes."""

import contextlib

import first_step
import keras
import numpy as np
import pytest

import keras_bn
from keras_bn.quantize import FreezeBatchNorm, quantize_model

pytestmark = pytest.mark.backends("tensorflow", "torch")

L = keras.layers
BACKEND = keras.backend.backend()
# Under TensorFlow a float and a QAT model, traced into a graph and compiled by XLA; under
# PyTorch the float model, compiled (each compile traces Keras's train step with Dynamo: 20 s).
CASES = {
    "tensorflow": [(False, False), (False, True), (True, False), (True, True)],
    "torch": [(False, True)],
}.get(BACKEND, [])


def _cnn():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 2))
    x = L.Conv2D(4, 3, use_bias=False)(inputs)
    x = keras_bn.BatchNormalization(momentum=0.5)(x)
    x = L.ReLU()(x)
    x = L.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, L.Dense(3)(x))


def _fit(quantized, jit_compile, keras_own):
    """Every weight and optimizer variable after 4 steps, and the train step's traces and
    Dynamo's graphs."""
    model = quantize_model(_cnn(), 4, 8, True) if quantized else _cnn()
    model.compile(
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    traces = []
    train_step = model.train_step
    model.train_step = lambda data: traces.append(1) or train_step(data)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6, 6, 2)).astype("float32"), rng.integers(0, 3, 64)
    callbacks = [FreezeBatchNorm(2, freeze_ranges_after_steps=3)] if quantized else []
    graphs = 0
    with first_step.as_keras_does() if keras_own else contextlib.nullcontext():
        if BACKEND == "torch":
            import torch
            from torch._dynamo.utils import counters

            torch._dynamo.reset()
            counters.clear()
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=callbacks)
        if BACKEND == "torch":
            graphs = counters["stats"]["unique_graphs"]
    state = [keras.ops.convert_to_numpy(v) for v in model.variables + model.optimizer.variables]
    return state, len(traces), graphs


@pytest.mark.parametrize(
    ("quantized", "jit_compile"),
    CASES,
    ids=[f"{'qat' if q else 'float'}-{'xla' if jit else 'graph'}" for q, jit in CASES],
)
def test_a_fit_prepared_once_ends_where_keras_own_fit_does(quantized, jit_compile):
    keras_state, keras_traces, keras_graphs = _fit(quantized, jit_compile, keras_own=True)
    state, traces, graphs = _fit(quantized, jit_compile, keras_own=False)
    assert len(state) == len(keras_state)
    for got, want in zip(state, keras_state, strict=True):
        np.testing.assert_array_equal(got, want)
    if BACKEND == "tensorflow":
        # A Python train_step runs only while tf.function traces it (FreezeBatchNorm's
        # freezes retrace it, once each, both ways).
        assert keras_traces - traces == 1, (keras_traces, traces)
    else:
        assert graphs < keras_graphs, (graphs, keras_graphs)

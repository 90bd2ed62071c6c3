"""Keras's trainers prepare their first train step twice; the suite makes them prepare it once.

- Under TensorFlow, with no distribution strategy, Keras builds the optimizer's variables
  inside the first trace of the train step, and tf.function traces a function that created
  variables a second time, without them: every `fit` traces its train step twice.
- Under PyTorch with `jit_compile=True`, torch.compile guards on `p.grad is None` in the
  `zero_grad` that every step calls: the first step has no gradients, the second has the
  first's, so every compiled `fit` compiles its train step twice.

`install()` wraps Keras's `make_train_function` to build what is missing before the first
step: the optimizer under TensorFlow (what Keras's own `_symbolic_build` does under a
distribution strategy), and a zero gradient for each trainable variable under PyTorch (which
`zero_grad` sets to None before the step's backward pass, so a step's gradients stay its own).
The numbers do not change: test_first_step.py fits each model with and without and compares
every weight and optimizer variable bit for bit, and counts the traces. Under JAX, whose
trainer builds the optimizer before it traces, there is nothing to do.
"""

import contextlib

import keras


def _trainer():
    """This backend's Keras trainer class, or None where it traces the first step once."""
    if keras.backend.backend() == "tensorflow":
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        return TensorFlowTrainer
    if keras.backend.backend() == "torch":
        from keras.src.backend.torch.trainer import TorchTrainer

        return TorchTrainer
    return None


def _prepare(model):
    if keras.backend.backend() == "tensorflow":
        built = all(layer.built for layer in model._flatten_layers())
        if built and model.optimizer is not None and not model.optimizer.built:
            with model.distribute_strategy.scope():
                model.optimizer.build(model.trainable_variables)
    elif model.jit_compile:
        import torch

        for variable in model.trainable_variables:
            if variable.value.grad is None:
                variable.value.grad = torch.zeros_like(variable.value)


TRAINER = _trainer()
KERAS_MAKE_TRAIN_FUNCTION = TRAINER and TRAINER.make_train_function


def _make_train_function_once(self, force=False):
    _prepare(self)
    return KERAS_MAKE_TRAIN_FUNCTION(self, force=force)


def install():
    """Every later `fit` (in this process) prepares its first step once."""
    if TRAINER is not None:
        TRAINER.make_train_function = _make_train_function_once


@contextlib.contextmanager
def as_keras_does():
    """Keras's own `make_train_function` inside the block (for the tests that compare)."""
    if TRAINER is None:
        yield
        return
    TRAINER.make_train_function = KERAS_MAKE_TRAIN_FUNCTION
    try:
        yield
    finally:
        install()

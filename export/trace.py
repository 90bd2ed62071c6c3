"""A Keras model as a tf.function with an explicit input signature and a dynamic batch dim.

Both converters start from this: TFLite's from_concrete_functions and tf2onnx's
from_function need a traced function, and an explicit signature avoids the Keras 3 paths of
from_keras (tf2onnx#2329, #2348, #2448).
"""

import keras
import tensorflow as tf


def check_single_io(model):
    """The exporters' runners feed one input and read one output: say so up front."""
    for kind, tensors in (("input", model.inputs), ("output", model.outputs)):
        count = len(keras.tree.flatten(tensors))
        if count != 1:
            raise ValueError(
                f"Export supports models with one {kind}; '{model.name}' has {count}."
            )


def input_spec(model):
    """The TensorSpec of the model's single input, with the batch dim left free."""
    check_single_io(model)
    tensor = model.inputs[0]
    return tf.TensorSpec([None, *tensor.shape[1:]], tensor.dtype, name="input")


def inference_function(model):
    """tf.function(x) -> the model's single output in inference mode."""

    @tf.function(input_signature=[input_spec(model)])
    def infer(x):
        return {"output": model(x, training=False)}

    return infer

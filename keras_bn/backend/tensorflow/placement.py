"""Where the graph being traced runs: under XLA or not, on a CPU or not.

`ops.train_path` picks an implementation from these (xla.py's arrangement only under
XLA on a CPU), and fused.py refuses the fused kernels under XLA. A leaf: it imports
only TensorFlow.
"""

import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.ops import control_flow_util


def in_xla_context():
    """Whether the graph being traced (or one it is nested in) is compiled by XLA."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def runs_on_cpu():
    """Whether the graph being traced runs on a CPU: the innermost device scope's type, or,
    with no scope (TensorFlow's default placement), whether no GPU or TPU is visible."""
    scope = context.context().device_name
    if not tf.executing_eagerly():
        scope = tf.no_op().device or scope  # a scope inside the traced function comes first
    device_type = tf.DeviceSpec.from_string(scope).device_type
    if device_type:
        return device_type == "CPU"
    return not (tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))

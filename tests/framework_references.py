"""Independent references for the backend-neutral tests, one per Keras backend: a plain batch
norm written in that framework's own ops, which its autodiff differentiates by itself (no
keras_bn code), and that framework's way to run a training step through a layer (the code
under test) and read the gradients. The numpy float64 formulas are bn_references.py's
(re-exported here). conftest.py's `framework` fixture gives a test this run's.

Each framework imports only when asked for, so the module imports in a Python that has one of
them.
"""

import importlib

import keras
import numpy as np
from bn_references import numpy_train, reduced  # noqa: F401  (re-exported: tests import it here)


def array(t):
    """A tensor or variable of any backend as a numpy array (detached, on the CPU)."""
    if hasattr(t, "value"):
        t = t.value
    return np.asarray(keras.ops.convert_to_numpy(t))


def _broadcast(x, channel_axes):
    return [x.shape[i] if i in channel_axes else 1 for i in range(len(x.shape))]


class _Framework:
    """What a backend-neutral test asks of this run's framework (see the subclasses)."""

    name = ""
    # The framework's ops module, its sum and that sum's keep-dimensions keyword.
    module, reduce_sum, keepdims = "", "", ""
    # The reference's float type: float64 where the framework has it by default.
    dtype = "float64"

    def constant(self, value, dtype=None):
        """`value` as a tensor of `dtype` (default: the reference's)."""
        raise NotImplementedError

    def gradients(self, fn, args, cotangent, dtype=None, jit=False):
        """∂(Σ fn(*args)·cotangent)/∂args by the framework's autodiff, args (numpy) and the
        cotangent as tensors of `dtype` (default: the reference's): numpy arrays. `jit`: under
        jax.jit (JAX only)."""
        raise NotImplementedError

    def plain_bn_gradients(self, x, gamma, beta, channel_axes, eps, cotangent, weight=None):
        """The reference backward: (dx, dγ, dβ) of Σ plain_bn·cotangent."""
        return self.gradients(
            lambda x, g, b: self.plain_bn(x, g, b, channel_axes, eps, weight),
            (x, gamma, beta),
            cotangent,
        )

    def train_step(self, layer, x, cotangent, mask=None):
        """One training call of `layer` (its statistics updated, as a training step updates
        them): (y, dx, dγ, dβ) of l = Σ cotangent·y, from keras_bn's own backward."""
        raise NotImplementedError

    def backward_is_hand_written(self, layer, x):
        """Whether a training call's gradient comes from keras_bn's hand-written backward (a
        custom gradient found in the traced graph), not from autodiff of its forward."""
        raise NotImplementedError

    def call_gradients(self, forward, x, cotangent, variables, state=()):
        """Eager `forward(x)` (Keras layers' calls: the code under test) and the framework's
        autodiff of l = Σ cotangent·forward(x): (y, dl/dx, [dl/dv for v in `variables`]) as
        numpy arrays, a gradient that does not reach v as None. The `state` variables that
        `forward` assigns (moving statistics, activation ranges) end up updated, as after a
        training step; under TensorFlow and PyTorch any variable does."""
        raise NotImplementedError

    def plain_bn(self, x, gamma, beta, channel_axes, eps, weight=None):
        """Train-mode BN as plain framework ops; `weight` an optional 0/1 mask (numpy)
        broadcastable to x."""
        ops = importlib.import_module(self.module)  # the framework's own ops, no Keras

        def total(t):
            return getattr(ops, self.reduce_sum)(t, axes, **{self.keepdims: True})

        axes = reduced(len(x.shape), channel_axes)
        shape = _broadcast(x, channel_axes)
        w = (
            ops.ones_like(x)
            if weight is None
            else ops.broadcast_to(self.constant(weight, x.dtype), x.shape)
        )
        m = total(w)
        mean = total(w * x) / m
        variance = total(w * (x - mean) ** 2) / m
        return (x - mean) / ops.sqrt(variance + eps) * ops.reshape(gamma, shape) + ops.reshape(
            beta, shape
        )

    def _gamma_beta(self, layer, gradients):
        """(dγ, dβ) out of gradients listed like layer.trainable_variables."""
        found = dict(zip(map(id, layer.trainable_variables), gradients))
        return tuple(None if v is None else array(found[id(v)]) for v in (layer.gamma, layer.beta))


class _Jax(_Framework):
    name = "jax"
    dtype = "float32"  # JAX's default (x64 off), as the layer computes
    module, reduce_sum, keepdims = "jax.numpy", "sum", "keepdims"

    def constant(self, value, dtype=None):
        import jax.numpy as jnp

        return jnp.asarray(value, dtype or self.dtype)

    def gradients(self, fn, args, cotangent, dtype=None, jit=False):
        import jax
        import jax.numpy as jnp

        cotangent = self.constant(cotangent, dtype)
        args = [self.constant(a, dtype) for a in args]

        def loss(*args):
            return jnp.sum(fn(*args) * cotangent)

        grad = jax.grad(loss, argnums=tuple(range(len(args))))
        return [array(g) for g in (jax.jit(grad) if jit else grad)(*args)]

    def _stateless(self, layer, mask=None):
        import jax

        trainable = [v.value for v in layer.trainable_variables]
        fixed = [v.value for v in layer.non_trainable_variables]

        def call(x, trainable):
            return layer.stateless_call(trainable, fixed, x, training=True, mask=mask)

        return jax, trainable, call

    def train_step(self, layer, x, cotangent, mask=None):
        """Through `stateless_call` under jit (as JAX trains), its new statistics assigned."""
        jax, trainable, call = self._stateless(layer, mask)

        def loss(x, trainable):
            y, new = call(x, trainable)
            return jax.numpy.sum(y * cotangent), (y, new)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (_, (y, new)), (dx, d_trainable) = step(x, trainable)
        for variable, value in zip(layer.non_trainable_variables, new):
            variable.assign(value)
        return (array(y), array(dx), *self._gamma_beta(layer, d_trainable))

    def call_gradients(self, forward, x, cotangent, variables, state=()):
        """Under a keras.StatelessScope that maps `variables` to the arguments differentiated
        (as Keras's own stateless_call does), `state`'s new values read out of it; jitted, as
        JAX trains."""
        import jax

        def loss(x, values):
            mapping = [*zip(variables, values), *((v, v.value) for v in state)]
            with keras.StatelessScope(state_mapping=mapping) as scope:
                y = forward(x)
            new = [scope.get_current_value(v) for v in state]
            return jax.numpy.sum(y * cotangent), (y, new)

        # Under jit: one compilation of the whole step, where eager autodiff compiles each
        # primitive of the forward and backward pass for each new shape (seconds a layer).
        value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (_, (y, new)), (dx, dv) = value_and_grad(jax.numpy.asarray(x), [v.value for v in variables])
        for variable, value in zip(state, new):
            variable.assign(value)
        return array(y), array(dx), [array(g) for g in dv]

    def backward_is_hand_written(self, layer, x):
        jax, trainable, call = self._stateless(layer)
        return "custom_vjp_call" in str(jax.make_jaxpr(lambda x: call(x, trainable))(x))


class _Torch(_Framework):
    name = "torch"
    module, reduce_sum, keepdims = "torch", "sum", "keepdim"

    def constant(self, value, dtype=None):
        import torch

        dtype = dtype or self.dtype
        if not isinstance(dtype, torch.dtype):
            dtype = getattr(torch, np.dtype(dtype).name)
        if isinstance(value, torch.Tensor):
            return value.to(dtype)
        return torch.as_tensor(np.asarray(value), dtype=dtype)

    def gradients(self, fn, args, cotangent, dtype=None, jit=False):
        import torch

        assert not jit, "jit: JAX only"
        args = [self.constant(a, dtype).requires_grad_() for a in args]
        torch.sum(fn(*args) * self.constant(cotangent, dtype)).backward()
        return [array(a.grad) for a in args]

    def train_step(self, layer, x, cotangent, mask=None):
        """Eager, as PyTorch trains: autograd through the layer's call."""
        import torch

        x = torch.as_tensor(x).detach().clone().requires_grad_()  # numpy or a tensor
        for variable in layer.trainable_variables:
            variable.value.grad = None
        y = layer(x, training=True, mask=mask)
        torch.sum(y * torch.as_tensor(cotangent)).backward()
        grads = [v.value.grad for v in layer.trainable_variables]
        return (array(y), array(x.grad), *self._gamma_beta(layer, grads))

    def call_gradients(self, forward, x, cotangent, variables, state=()):
        import torch

        x = self.constant(x, x.dtype).requires_grad_()
        for variable in variables:
            variable.value.grad = None
        y = forward(x)
        torch.sum(y * torch.as_tensor(cotangent)).backward()
        grads = [None if v.value.grad is None else array(v.value.grad) for v in variables]
        return array(y), array(x.grad), grads

    def backward_is_hand_written(self, layer, x):
        import torch

        traced = layer(torch.tensor(x, requires_grad=True), training=True)
        return "_NormalizeBackward" in grad_fn_names(traced)


def grad_fn_names(tensor):
    """The class names of every node of the torch graph that produced `tensor`."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


class _TensorFlow(_Framework):
    name = "tensorflow"
    module, reduce_sum, keepdims = "tensorflow", "reduce_sum", "keepdims"

    def constant(self, value, dtype=None):
        import tensorflow as tf

        return tf.cast(value, dtype or self.dtype)

    def gradients(self, fn, args, cotangent, dtype=None, jit=False):
        import tensorflow as tf

        assert not jit, "jit: JAX only"
        args = [self.constant(a, dtype) for a in args]
        with tf.GradientTape() as tape:
            tape.watch(args)
            loss = tf.reduce_sum(fn(*args) * self.constant(cotangent, dtype))
        return [array(g) for g in tape.gradient(loss, args)]

    def train_step(self, layer, x, cotangent, mask=None):
        """Eager, under a GradientTape."""
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=mask)
            loss = tf.reduce_sum(y * tf.constant(cotangent, y.dtype))
        dx, *grads = tape.gradient(loss, [x, *layer.trainable_variables])
        return (array(y), array(dx), *self._gamma_beta(layer, grads))

    def call_gradients(self, forward, x, cotangent, variables, state=()):
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = forward(x)
            loss = tf.reduce_sum(y * tf.constant(cotangent, y.dtype))
        dx, *grads = tape.gradient(loss, [x, *variables])
        return array(y), array(dx), [None if g is None else array(g) for g in grads]

    def backward_is_hand_written(self, layer, x):
        import tensorflow as tf

        traced = tf.function(lambda x: layer(x, training=True)).get_concrete_function(
            tf.TensorSpec(x.shape, x.dtype)
        )
        # tf.custom_gradient marks its output with an IdentityN carrying the gradient.
        return any(op.type == "IdentityN" for op in traced.graph.get_operations())


def jnp_train(x, gamma, beta, channel_axes, eps, weight=None):
    """Train-mode BN as plain jnp ops (differentiated by JAX's autodiff)."""
    return _Jax().plain_bn(x, gamma, beta, channel_axes, eps, weight)


def torch_train(x, gamma, beta, channel_axes, eps, weight=None):
    """Train-mode BN as plain torch ops (differentiated by autograd)."""
    return _Torch().plain_bn(x, gamma, beta, channel_axes, eps, weight)


_FRAMEWORKS = {f.name: f for f in (_Jax, _Torch, _TensorFlow)}


def for_backend(name):
    """The framework of Keras backend `name`."""
    return _FRAMEWORKS[name]()

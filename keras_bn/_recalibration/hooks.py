"""What `recalibrate`, `callbacks.Recalibrate` and `check_batchnorm` do to a model while they
work on it, and undo afterwards.

- `BatchNormCalls`: shadows each BN layer's `call` so that a forward pass also records the
  moments of every BN's input, with the BNs in inference mode; outside that recording, the BNs
  can be forced into training mode (batch statistics) whatever the model passes them.
- `Snapshot`: the values of some variables, every replica's copy under `tf.distribute`, put
  back on `restore()` or at the end of a `with` block.

Both run under every backend of keras_bn.backend: the moments are the backend's
(`input_moments`), and only TensorFlow has replicas to save (`local_copies`).
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias

import keras

from keras_bn import backend

# A BN input's (mean, biased variance, count m) per channel.
from keras_bn._graph import bn_layers

Moments: TypeAlias = tuple[Any, Any, Any]


class BatchNormCalls:
    """While open (a context manager), each BN layer's `call` is shadowed by a wrapper.

    The wrapper is an instance attribute that shadows the class's `call` (Keras calls
    `self.call`), removed again on exit. Inside `record`, it records (μ_B, σ²_B, m) of the
    layer's input and runs the layer in inference mode; elsewhere it passes `training` on as
    the model gives it, or as `training` forces it. The layer's own computation is unchanged.

    A BN wrapped in `keras.layers.TimeDistributed` is called once per time step, and infers
    with one set of statistics for every step: inside `record` its wrapper's `call` is
    shadowed too, and records the moments over batch × time (the wrapper's input with those
    two axes merged, its mask likewise), the BN's own per-step calls then only inferring.

    Args:
        layers: the BN layers (either class) to shadow; `record` keys them by their index here.
        training: what every BN gets as `training` outside `record`: None (the default) leaves
            the model's flag, True forces batch statistics (the other layers, Dropout
            included, still follow the model's flag).
        root: the model or layer the forward pass runs, searched for TimeDistributed wrappers
            of `layers`; None: no BN is wrapped.
    """

    def __init__(
        self,
        layers: Sequence[keras.layers.Layer],
        training: bool | None = None,
        root: keras.layers.Layer | None = None,
    ) -> None:
        self._layers = layers
        self._training = training
        self._recorded: dict[int, Moments] | None = None
        self._outputs = True  # inside `record`: whether the BNs compute their outputs
        self._shadowed: list[Callable[..., Any] | None] = []  # each layer's own `call` attribute
        self.order: list[int] = []  # the layers' indices in the order the last `record` called them
        index = {id(layer): i for i, layer in enumerate(layers)}
        self._wrappers = [
            (index[id(wrapper.layer)], wrapper)
            for wrapper in ([] if root is None else root._flatten_layers(include_self=True))
            if isinstance(wrapper, keras.layers.TimeDistributed) and id(wrapper.layer) in index
        ]
        self._per_step: set[int] = set()  # the BNs whose wrapper recorded them in this call

    def __enter__(self) -> "BatchNormCalls":
        shadowing = [
            *(
                (layer, self._wrap(index, layer, layer.call))
                for index, layer in enumerate(self._layers)
            ),
            *((wrapper, self._wrap_time(index, wrapper)) for index, wrapper in self._wrappers),
        ]
        self._shadowed = [layer.__dict__.get("call") for layer, _ in shadowing]
        self._shadowing = [layer for layer, _ in shadowing]
        for layer, call in shadowing:
            object.__setattr__(layer, "call", call)
        return self

    def __exit__(self, *exc: object) -> None:
        for layer, previous in zip(self._shadowing, self._shadowed):
            if previous is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", previous)

    def _wrap(
        self, index: int, layer: keras.layers.Layer, call: Callable[..., Any]
    ) -> Callable[..., Any]:
        def shadowed_call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self._recorded is not None:
                if index not in self._per_step:  # one step of a TimeDistributed: recorded
                    if index in self._recorded:
                        raise shared_error(layer)
                    self._recorded[index] = layer_moments(layer, inputs, kwargs.get("mask"))
                    if not self._outputs:
                        return inputs  # what nothing reads need not be computed (nor traced)
                # Inference even where the caller's code passes training=True to this layer.
                kwargs["training"] = False
            elif self._training is not None:
                kwargs["training"] = self._training
            return call(inputs, *args, **kwargs)

        return shadowed_call

    def _wrap_time(self, index: int, wrapper: keras.layers.TimeDistributed) -> Callable[..., Any]:
        call = wrapper.call
        layer = self._layers[index]

        def shadowed_call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self._recorded is None:
                return call(inputs, *args, **kwargs)
            if index in self._recorded:
                raise shared_error(layer)
            mask = kwargs.get("mask")
            self._recorded[index] = layer_moments(
                layer, _merge_time(inputs), None if mask is None else _merge_time(mask)
            )
            kwargs["training"] = False
            self._per_step.add(index)
            try:
                return call(inputs, *args, **kwargs)
            finally:
                self._per_step.discard(index)

        return shadowed_call

    def record(self, run_model: Callable[[], object], outputs: bool = True) -> dict[int, Moments]:
        """Runs `run_model()` (a forward pass of the model) with every BN inferring.

        Records the call order in `order` (a topological order of the layers) as it traces.

        Args:
            run_model: a function of no argument that calls the model.
            outputs: False where nothing reads the BNs' outputs (a call of one BN for its
                moments): each BN returns its input once its moments are recorded, its own
                computation neither run nor traced (a TimeDistributed one still computes its
                output).

        Returns:
            dict: {layer index: (mean, variance, count)} for each BN the pass called, the
            biased variance, shaped as the layer's moving statistics; count is m_c, the values
            in each channel (equal unless a mask leaves the channels different counts).
        """
        self._recorded, self._outputs = {}, outputs
        try:
            run_model()
            self.order = list(self._recorded)
            return dict(self._recorded)
        finally:
            self._recorded, self._outputs = None, True


def _merge_time(tensor: Any) -> Any:
    """`tensor` (batch, time, ...) as (batch · time, ...): what a TimeDistributed layer's
    steps see, as one batch."""
    shape = keras.ops.shape(tensor)
    return keras.ops.reshape(tensor, (-1, *shape[2:]))


def shared_error(layer: keras.layers.Layer) -> ValueError:
    """The error for a BN layer called more than once per forward pass."""
    return ValueError(
        f"recalibrate: layer '{layer.name}' is called more than once per forward pass; a "
        f"shared BN layer has no single input distribution."
    )


def layer_moments(layer: keras.layers.Layer, inputs: Any, mask: Any) -> Moments:
    """The moments `recalibrate` pools for `layer` from one batch of its input: a BN's
    `batch_moments`, or, for a layer that folds its BN (QAT), those of what that BN
    normalizes in training (the layer's `batch_norm_moments`; its `call` takes no mask, so
    Keras passes it none)."""
    if bn_layers.folds_batch_norm(layer):
        return layer.batch_norm_moments(inputs)
    return bn_layers.batch_moments(layer, inputs, mask)


class Snapshot:
    """The values of `variables` now, put back by `restore()` or on leaving a `with` block.

    Under a `tf.distribute` strategy each replica holds its own copy of a variable; reading
    the variable would give one (or an aggregate), so each copy is saved and put back itself.
    Under JAX each variable has one value, saved and put back as it is.

    Args:
        variables: Keras variables (of the model, its optimizer, ...).
        strategy: the `tf.distribute` strategy the variables were created under (a model's
            `distribute_strategy`); None for the current one (unused under JAX).
    """

    def __init__(self, variables: Iterable[keras.Variable], strategy: Any = None) -> None:
        self._saved = [
            (copy, copy.numpy())
            for variable in variables
            for copy in backend.get().local_copies(variable, strategy)
        ]

    def restore(self) -> None:
        """Assign every saved value back to its copy."""
        for copy, value in self._saved:
            copy.assign(value)

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def bn_statistics(model: keras.Model) -> Snapshot:
    """A `Snapshot` of every BN layer's non-trainable variables (the moving statistics and
    their bookkeeping), nested models included."""
    return Snapshot(
        [
            variable
            for layer in bn_layers.in_model(model)
            for variable in layer.non_trainable_variables
        ],
        getattr(model, "distribute_strategy", None),  # TensorFlow's trainer only
    )


def model_state(
    model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None
) -> Snapshot:
    """A `Snapshot` of every variable of `model`, and of `optimizer` when given."""
    variables = list(model.variables) + (list(optimizer.variables) if optimizer else [])
    return Snapshot(variables, getattr(model, "distribute_strategy", None))

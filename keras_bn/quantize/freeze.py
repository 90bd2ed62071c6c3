"""Freezing QAT: batch norm to its moving statistics, activation ranges to their values.

Both are flags in the layers' non-trainable weights (`batch_norm_frozen`, `ranges_frozen`),
read inside the layers' graphs: setting them between steps takes effect in compiled `fit`
(graph or XLA) without retracing, and they save with the model.

Freezing batch norm after some steps of QAT is the whitepaper's recipe (Krishnamoorthi,
"Quantizing deep convolutional networks for efficient inference", 2018, section 3.2): the
layer then computes exactly the folded BN an int8 file holds, and the last steps fine-tune
that. Freezing the ranges stops the activation grids from moving for the final steps.
"""

from typing import TYPE_CHECKING, Any, TypeVar

import keras

from keras_bn._graph import models
from keras_bn._recalibration.batches import Batches, Data
from keras_bn.quantize.activation import ActivationQuantizer
from keras_bn.quantize.layers import QuantizedHostBatchNorm

if TYPE_CHECKING:  # keras_bn.population imports what imports this module
    from keras_bn.population import RecalibrationReport

_Frozen = TypeVar("_Frozen", ActivationQuantizer, QuantizedHostBatchNorm)


def freeze_batch_norm(model: keras.layers.Layer) -> list[QuantizedHostBatchNorm]:
    """Switch every QuantizedHostBatchNorm of `model` to its moving statistics, for good.

    Args:
        model: a Keras model or layer (nested models and layers are searched).

    Returns:
        The list of QuantizedHostBatchNorm layers frozen.

    Raises:
        ValueError: `model` holds no QuantizedHostBatchNorm, or one is not built yet.
    """
    layers = _find(model, QuantizedHostBatchNorm)
    for layer in layers:
        layer.batch_norm_frozen.assign(True)
    return layers


def freeze_ranges(model: keras.layers.Layer) -> list[ActivationQuantizer]:
    """Stop every activation range of `model` from moving (each ActivationQuantizer's, those
    inside the QAT layers included).

    Args:
        model: a Keras model or layer (nested models and layers are searched).

    Returns:
        The list of ActivationQuantizer layers frozen.

    Raises:
        ValueError: `model` holds no ActivationQuantizer, one is not built yet, or one has not
            observed a training batch yet (frozen, it would never get a range).
    """
    layers = _find(model, ActivationQuantizer)
    unobserved = [layer.name for layer in layers if not bool(layer.range_initialized.numpy())]
    if unobserved:
        raise ValueError(
            f"Activation quantizer(s) {unobserved} of '{model.name}' have not seen a training "
            f"batch, so they have no range to freeze; train a few steps first."
        )
    for layer in layers:
        layer.ranges_frozen.assign(True)
    return layers


def _find(model: keras.layers.Layer, cls: type[_Frozen]) -> list[_Frozen]:
    """Every built `cls` layer inside `model` (itself included); a ValueError if none, or if
    one is not built."""
    layers = _holding(model, cls)
    unbuilt = [layer.name for layer in layers if not layer.built]
    if unbuilt:
        raise ValueError(
            f"{cls.__name__} layer(s) {unbuilt} of '{model.name}' are not built yet; call or "
            f"build the model first."
        )
    return layers


def _holding(model: keras.layers.Layer, cls: type[_Frozen]) -> list[_Frozen]:
    """Every `cls` layer inside `model` (itself included); a ValueError if none."""
    layers = models.layers_within(model, cls, include_self=True)
    if not layers:
        raise ValueError(f"'{model.name}' holds no {cls.__name__} layer: nothing to freeze.")
    return layers


def _validate_steps(value: object, name: str, minimum: int, allow_none: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{name} must be an int ≥ {minimum}{' or None' if allow_none else ''}; "
            f"received {name}={value!r}."
        )
    return value


class FreezeBatchNorm(keras.callbacks.Callback):
    """Freeze the QAT batch norms (and optionally the activation ranges) after some steps,
    re-estimating their statistics exactly at the freeze.

    Before each training batch the callback reads `model.optimizer.iterations` (the number of
    optimizer steps applied so far, across `fit` calls); once it reaches `after_steps` it runs
    `freeze_batch_norm(model)`, so exactly `after_steps` steps train with batch statistics.
    Likewise `freeze_ranges(model)` once it reaches `freeze_ranges_after_steps`. With
    `steps_per_execution` > 1 the callback runs once per execution, so the freeze lands on the
    first execution boundary at or after the step.

    Given `data`, it first sets the statistics of the layers it freezes (those that are
    trainable) to Algorithm 2's for the weights of that step (`keras_bn.recalibrate`, which
    settles each layer's rounded kernel; the report goes to `last_report`): the moving
    averages lag the weights, most where weights oscillate across rounding boundaries at low
    bit widths (Nagel et al., "Overcoming Oscillations in Quantization-Aware Training", 2022),
    and the steps after the freeze fine-tune for the statistics the file will hold. Without
    `data`, or with `reestimate=False`, the moving averages are frozen as they are.

    Args:
        after_steps: int ≥ 0, the optimizer step from which batch norm is frozen (0: from the
            start).
        freeze_ranges_after_steps: None (never), or an int ≥ 1, the optimizer step from which
            the activation ranges are frozen (at least one batch must have set them).
        data: None, or the training inputs to re-estimate from, as `keras_bn.recalibrate`
            takes them (arrays, `(x, y)`, a dataset, an iterable of batches); a one-shot
            iterator is read once, here, and kept in memory.
        batch_size: batch size for whole-array `data`.
        steps: how many batches of `data` to use; None: all.
        reestimate: re-estimate at the freeze when `data` is given (True), or not.

    Raises:
        ValueError: an argument that is not an int in range (bools included), a `reestimate`
            that is not a bool, or `data` that `recalibrate` refuses; the message names the
            value. In `on_train_begin`, before any step trains: the model holds no
            QuantizedHostBatchNorm (no BN was folded; nothing to freeze), or, with
            `freeze_ranges_after_steps`, no ActivationQuantizer.

    Example::

        model.fit(x, y, epochs=3, callbacks=[FreezeBatchNorm(after_steps=1000, data=x)])
    """

    def __init__(
        self,
        after_steps: int,
        freeze_ranges_after_steps: int | None = None,
        data: Data | None = None,
        batch_size: int = 32,
        steps: int | None = None,
        reestimate: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(reestimate, bool):
            raise ValueError(
                f"reestimate must be True or False; received reestimate={reestimate!r}."
            )
        # recalibrate's checks of data, steps and batch_size, now rather than at the freeze.
        self._batches = None if data is None or not reestimate else Batches(data, steps, batch_size)
        self.reestimate = reestimate
        self.last_report: RecalibrationReport | None = None
        self.after_steps = _validate_steps(after_steps, "after_steps", 0)
        self.freeze_ranges_after_steps = (
            None
            if freeze_ranges_after_steps is None
            else _validate_steps(
                freeze_ranges_after_steps, "freeze_ranges_after_steps", 1, allow_none=True
            )
        )
        self._done = {"batch_norm": False, "ranges": False}

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Refuse a model with nothing to freeze, and freeze at once what a resumed run has
        already passed.

        Args:
            logs: unused (Keras's callback signature).

        Raises:
            ValueError: the model holds no QuantizedHostBatchNorm, or no ActivationQuantizer
                while `freeze_ranges_after_steps` is set.
        """
        # Now rather than at step `after_steps`, which would lose the steps trained before it.
        _holding(self.model, QuantizedHostBatchNorm)
        if self.freeze_ranges_after_steps is not None:
            _holding(self.model, ActivationQuantizer)
        self._done = {"batch_norm": False, "ranges": False}
        self._freeze_due()

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Freeze what is due at this optimizer step.

        Args:
            batch: the batch index in the epoch (unused; the optimizer's step counts).
            logs: unused (Keras's callback signature).
        """
        self._freeze_due()

    def _freeze_due(self) -> None:
        step = int(self.model.optimizer.iterations.numpy())
        if not self._done["batch_norm"] and step >= self.after_steps:
            if self._batches is not None:
                from keras_bn.population import recalibrate_layers

                # As `Recalibrate`: a layer with trainable=False kept its statistics all along.
                trained = [
                    layer for layer in _find(self.model, QuantizedHostBatchNorm) if layer.trainable
                ]
                self.last_report = recalibrate_layers(
                    self.model,
                    trained,
                    self._batches.for_model(self.model).fresh(),
                    progress=False,
                )
            freeze_batch_norm(self.model)
            self._done["batch_norm"] = True
        due = self.freeze_ranges_after_steps
        if not self._done["ranges"] and due is not None and step >= due:
            freeze_ranges(self.model)
            self._done["ranges"] = True

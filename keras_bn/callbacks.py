"""Keras callbacks for batch normalization: `Recalibrate`.

Why it is needed: `fit` with `keras.optimizers.*(use_ema=True)` copies the EMA weights into the
model after the last epoch (`optimizer.finalize_variable_values`, which Keras runs just before
`on_train_end`), but the BN moving statistics still average the activations of the raw weights'
trajectory. The same holds after any weight averaging and after a large learning-rate drop.
`Recalibrate` recomputes them from data with `keras_bn.recalibrate`.
"""

import warnings
from typing import Any

import keras

from keras_bn._errors import KerasBNWarning
from keras_bn._graph import bn_layers
from keras_bn._recalibration import hooks
from keras_bn._recalibration.batches import Batches, Data
from keras_bn.population import (
    RecalibrationReport,
    check_max_memory,
    check_synchronized,
    recalibrate_layers,
)

__all__ = ["Recalibrate"]


class Recalibrate(keras.callbacks.Callback):
    """Recalibrate every BN layer's statistics at the end of `fit`, and optionally before
    each validation run.

    Example, with the EMA weights that `use_ema=True` puts into the model at the end of `fit`::

        model.compile(keras.optimizers.Adam(1e-3, use_ema=True), "mse")
        model.fit(x, y, epochs=5, validation_data=(x_val, y_val),
                  callbacks=[keras_bn.callbacks.Recalibrate(x, before_validation=True)])

    - `at_train_end`: in `on_train_end`, which Keras runs after the EMA weights are swapped in,
      the statistics are set to `keras_bn.recalibrate(model, data)` of the final weights.
    - `before_validation`: in `on_test_begin` the statistics are recalibrated for the current
      weights, so the validation metrics `fit` reports are those of precise statistics (Wu &
      Johnson, "Rethinking 'Batch' in BatchNorm", 2021); in `on_test_end` the training
      statistics are put back exactly (on every replica under a `tf.distribute` strategy), so
      training goes on as if the callback were not there. Given to `evaluate(callbacks=...)`,
      it does the same around that evaluation.

    Only the BN layers that train are recalibrated: a frozen one (`trainable=False`, e.g. a
    pretrained backbone during fine-tuning) normalized with its moving statistics all through
    `fit`, and the layers after it were trained for them, so they are kept.

    Callbacks run in list order: put `Recalibrate` after any callback that changes the weights
    in the same hook, i.e. after `keras.callbacks.SwapEMAWeights` (so validation sees the EMA
    weights and statistics computed for them) and after `EarlyStopping(restore_best_weights=
    True)`, which sets the weights, moving statistics included, in `on_train_end`.

    If `fit` stops with an exception during a validation run (e.g. KeyboardInterrupt), Keras
    runs no further callback, so the model keeps the statistics recalibrated for that run.

    Each recalibration costs about one inference pass over `data` for a Sequential or
    Functional model (`keras_bn.recalibrate`'s one pass, its compiled segments kept on the
    model so that later recalibrations trace nothing again), one per BN layer for a subclassed
    model. `last_report` holds the `RecalibrationReport` of the latest one (None before the
    first): its `strategy` says which ran.

    Args:
        data: the batches to compute the statistics from, as for `keras_bn.recalibrate`: a
            `tf.data.Dataset` (finite, or with `steps`), whole arrays (an array, a dict or a
            list of them, or `(x, y)` of those; split into batches of `batch_size`), or an
            iterable of batches; `(x, y)` and `(x, y, sample_weight)` elements
            use `x`. A one-shot iterator (a generator) is read once, here, and kept in memory.
        batch_size: batch size for numpy-array (or dict of arrays) data.
        steps: how many batches to use each time; None uses them all.
        at_train_end: recalibrate in `on_train_end`.
        before_validation: recalibrate for each validation run, then restore.
        progress: show `recalibrate`'s progress bar.
        max_memory: the bytes the one pass may keep in memory for the tensors later layers
            still read, as for `keras_bn.recalibrate` (past it they go to disk); None: the
            default there.
        synchronized: each process passes its own shard, and every process gets the
            statistics of their union, as for `keras_bn.recalibrate`.

    Raises:
        ValueError: `steps` is not a positive int (nor None), `batch_size` is not a positive
            int while `data` is a numpy array, a dataset is infinite without `steps`, a flag
            (`synchronized` included) is not a bool, `max_memory` is not an int ≥ 0 (nor
            None), or both `at_train_end`
            and `before_validation` are False (the callback would do nothing).
    """

    def __init__(
        self,
        data: Data,
        batch_size: int = 32,
        steps: int | None = None,
        at_train_end: bool = True,
        before_validation: bool = False,
        progress: bool = False,
        max_memory: int | None = None,
        synchronized: bool = False,
    ) -> None:
        super().__init__()
        self.synchronized = check_synchronized(synchronized)
        for name, value in (
            ("at_train_end", at_train_end),
            ("before_validation", before_validation),
            ("progress", progress),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False; received {name}={value!r}.")
        if not (at_train_end or before_validation):
            raise ValueError(
                "Recalibrate with at_train_end=False and before_validation=False would do "
                "nothing; set one of them to True."
            )
        # recalibrate's own checks of data, steps and batch_size, run now rather than at the
        # end of training; its batches (a one-shot iterator read into a list) are kept.
        self._batches = Batches(data, steps, batch_size)
        check_max_memory(max_memory)
        self.max_memory = max_memory
        self.batch_size = batch_size
        self.steps = steps
        self.at_train_end = at_train_end
        self.before_validation = before_validation
        self.progress = progress
        self.last_report: RecalibrationReport | None = None
        self._training_statistics: hooks.Snapshot | None = None
        self._validation_runs = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Start counting validation runs (for the warning when a fit has none).

        Args:
            logs: Keras's logs dict (unused).
        """
        self._validation_runs = 0

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Recalibrate for the final weights, if `at_train_end`; the report goes to
        `last_report`.

        Args:
            logs: Keras's logs dict (unused).

        Raises:
            ValueError: `data` gives no batch, no batch with 2 values per channel for some
                layer, or a different number of batches on another pass; or a layer's
                statistics would be NaN or inf (see `keras_bn.recalibrate`).
        """
        if self.at_train_end:
            self._recalibrate()
        elif self._validation_runs == 0:
            warnings.warn(
                "Recalibrate(before_validation=True, at_train_end=False) did nothing: this fit "
                "ran no validation (give fit validation_data or validation_split).",
                KerasBNWarning,
                stacklevel=2,
            )

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        """If `before_validation`: save the BN statistics (every replica's copy), then
        recalibrate them for the current weights.

        Args:
            logs: Keras's logs dict (unused).

        Raises:
            ValueError: as `on_train_end`.
        """
        self._validation_runs += 1
        if self.before_validation:
            self._training_statistics = hooks.bn_statistics(self.model)
            self._recalibrate()

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        """Put back the statistics that `on_test_begin` saved, exactly, so training goes on
        as if the evaluation had not recalibrated them.

        Args:
            logs: Keras's logs dict (unused).
        """
        if self._training_statistics is not None:
            self._training_statistics.restore()
            self._training_statistics = None

    def _recalibrate(self) -> None:
        # Only the BNs that train: a frozen one (trainable=False) normalized with its moving
        # statistics all through fit, and the layers after it were trained for them.
        layers = [layer for layer in bn_layers.in_model(self.model) if layer.trainable]
        if layers:
            self.last_report = recalibrate_layers(
                self.model,
                layers,
                # A list of arrays is a multi-input model's inputs: known once the model is.
                self._batches.for_model(self.model).fresh(),
                self.progress,
                self.max_memory,
                self.synchronized,
            )

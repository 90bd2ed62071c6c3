"""keras_bn.BatchNormalization: a drop-in for keras.layers.BatchNormalization."""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import keras
from keras import constraints, initializers, regularizers

from keras_bn import backend
from keras_bn import renorm as renormalization
from keras_bn._shapes import ShapePreserving
from keras_bn.backend import axes as _axes
from keras_bn.backend import ghost

# Before any keras_bn layer can be built under a backend it does not run on.
backend.get("keras_bn.BatchNormalization")

# What keras.initializers.get, .regularizers.get and .constraints.get take: a name, a
# serialized config, or an instance (any callable).
_Identifier: TypeAlias = str | dict[str, Any] | Callable[..., Any]


@keras.saving.register_keras_serializable(package="keras_bn")
class BatchNormalization(ShapePreserving, keras.layers.Layer):
    """Batch normalization with a hand-written gradient and unbiased population statistics.

    For each channel, over the m values reduced (batch × spatial; under a mask the unmasked
    ones, m_c per channel, see `call`)::

        training:   y = γ·(x − μ_B)/√(σ²_B + ε) + β,   μ_B = mean(x),  σ²_B = mean((x − μ_B)²)
        inference:  y = γ·(x − E[x])/√(Var[x] + ε) + β = a·x + b

    The population estimates follow Ioffe & Szegedy's Algorithm 2, Var[x] = m/(m−1)·E_B[σ²_B],
    as exponential moving averages (momentum is the weight on the old value, as in Keras)::

        moving_mean     ← momentum·moving_mean     + (1 − momentum)·μ_B
        moving_variance ← momentum·moving_variance + (1 − momentum)·m/(m−1)·σ²_B

    Keras 3 stores the biased σ²_B instead; with the same weights both layers give identical
    outputs in training and inference, and only moving_variance differs.

    Training mode is used when `training` is true *and* the layer is trainable: a frozen layer
    (`trainable=False`) always normalizes with its moving statistics and never updates them.

    Guards:

    - m ≤ 1 in training cannot estimate a variance. Known when traced (a static batch of 1)
      it raises a ValueError. Known only at run time (a mask that leaves a channel at most one
      value, a dynamic batch of 1) the output is β in each such channel, and its moving
      statistics are left unchanged; eager, graph and XLA alike. The other channels of the
      batch normalize and update as usual, except with `momentum=None`, where the whole
      batch is skipped and not counted, so that the one batch counter stays exact.
    - A batch whose mean or variance is not finite leaves the moving statistics unchanged; the
      output still shows the NaN or inf.

    Statistics are computed in float32 (float64 for float64 inputs) and the output is cast to
    the layer's compute dtype, so `mixed_float16` and `mixed_bfloat16` keep float32 variables.

    The layer runs under the TensorFlow and the JAX Keras backends, with the same maths,
    gradient and guards (under JAX without `jax_enable_x64`, `num_batches_tracked` is int32).

    Beyond Keras's BN (each adds weights only when it is on, after the four above):

    - `momentum=None`: the moving statistics are the plain average over the (finite) batches
      seen, as in PyTorch; the count is the int64 weight `num_batches_tracked`, and the new
      batch's weight 1/(n+1) is divided in float64, exact at any count.
    - `renorm=True`: batch renormalization (Ioffe, "Batch Renormalization", 2017), with
      Keras's arguments and weights (`moving_stddev`, `renorm_mean`, `renorm_stddev`).
      Inference and the moving statistics are as without it.
    - `virtual_batch_size=v`: ghost batches with tf-keras's semantics: a batch of v·G samples
      is viewed as (v, G, ...), ghost g holding samples g, g+G, g+2G, ..., and each ghost is
      normalized with its own statistics.

    The layer is called as `layer(inputs, training=None, mask=None)`; see `call`.

    Args:
        axis: int, or list/tuple of ints: the channel axis or axes, kept; every other axis is
            reduced. Negative values count from the end; use `axis=1` for channels_first.
        momentum: weight of the old value in the moving averages, in [0, 1); None for the
            cumulative average.
        epsilon: positive float added to the variance.
        center: if True, add the learned offset `beta`.
        scale: if True, multiply by the learned scale `gamma`.
        beta_initializer: initializer of `beta`.
        gamma_initializer: initializer of `gamma`.
        moving_mean_initializer: initializer of `moving_mean`.
        moving_variance_initializer: initializer of `moving_variance`.
        beta_regularizer: optional regularizer of `beta`.
        gamma_regularizer: optional regularizer of `gamma`.
        beta_constraint: optional constraint on `beta`.
        gamma_constraint: optional constraint on `gamma`.
        renorm: if True, use batch renormalization in training.
        renorm_clipping: None or a dict with optional keys "rmax", "rmin", "dmax" clipping r
            to [rmin, rmax] and d to [−dmax, dmax] (defaults inf, 0, inf); needs renorm.
        renorm_momentum: weight of the old value in renorm's averages, in [0, 1).
        virtual_batch_size: None, or a positive int dividing the training batch size.
        synchronized: under a `tf.distribute` strategy with several replicas, compute the
            batch statistics over the global batch (all replicas) and all-reduce the backward
            pass's sums too, so training equals single-device BN on the global batch. With
            False each replica normalizes with its own batch's statistics (Keras semantics),
            and the moving statistics move toward the replicas' count-weighted averages,
            Σmᵢμᵢ/Σmᵢ and Σmᵢ·sᵢ²/Σmᵢ (sᵢ² the unbiased variance of replica i's mᵢ values).
            Either way every replica applies the same update, so the copies stay identical,
            and a non-finite statistic on any replica skips the update on all of them.
            Under JAX there are no replicas: with `keras.distribution.DataParallel` the batch
            is one array sharded over the devices, and its statistics are the global batch's
            whatever `synchronized` says. Under PyTorch, True spans the processes of
            torch.distributed's default group (SyncBatchNorm's semantics; first-order
            gradients only), and is plain BN without one.
        **kwargs: base layer arguments (`name`, `dtype`, `trainable`, ...).

    Raises:
        ValueError: at construction, a `momentum`, `renorm_momentum`, `epsilon`,
            `renorm_clipping` or `virtual_batch_size` out of its range, `renorm` or
            `synchronized` not a bool, `renorm_clipping` without `renorm`, or
            `synchronized=True` with `virtual_batch_size`; when built, an `axis` out of range,
            named twice or covering every axis, a channel axis of unknown size, or
            `virtual_batch_size` with axis 0 as a channel axis; when called in training, a
            static batch with m ≤ 1 values per channel, a mask that fits neither of `call`'s
            readings, a mask with `virtual_batch_size`, or a static batch size that
            `virtual_batch_size` does not divide. An unknown initializer, regularizer or
            constraint name raises Keras's own error.
        TypeError: `axis` is not an int or a non-empty list/tuple of ints; or the input is
            not a floating-point tensor.
        tf.errors.InvalidArgumentError: a batch size known only at run time that
            `virtual_batch_size` does not divide.

    Example:
        A convolution without bias (BN's β replaces it), then BN over the channels::

            model = keras.Sequential([
                keras.Input((8, 8, 3)),
                keras.layers.Conv2D(16, 3, use_bias=False),
                keras_bn.BatchNormalization(momentum=0.9),
                keras.layers.ReLU(),
            ])
            model.compile("adam", "mse")

        Under `tf.distribute.MirroredStrategy`, `synchronized=True` normalizes with the
        statistics of the global batch.
    """

    def __init__(
        self,
        axis: int | Sequence[int] = -1,
        momentum: float | None = 0.99,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        beta_initializer: _Identifier = "zeros",
        gamma_initializer: _Identifier = "ones",
        moving_mean_initializer: _Identifier = "zeros",
        moving_variance_initializer: _Identifier = "ones",
        beta_regularizer: _Identifier | None = None,
        gamma_regularizer: _Identifier | None = None,
        beta_constraint: _Identifier | None = None,
        gamma_constraint: _Identifier | None = None,
        renorm: bool = False,
        renorm_clipping: dict[str, float] | None = None,
        renorm_momentum: float = 0.99,
        virtual_batch_size: int | None = None,
        synchronized: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.axis = _validate_axis(axis)
        self.momentum = _validate_momentum(momentum)
        self.epsilon = _validate_epsilon(epsilon)
        self.center = bool(center)
        self.scale = bool(scale)
        self.beta_initializer = initializers.get(beta_initializer)
        self.gamma_initializer = initializers.get(gamma_initializer)
        self.moving_mean_initializer = initializers.get(moving_mean_initializer)
        self.moving_variance_initializer = initializers.get(moving_variance_initializer)
        self.beta_regularizer = regularizers.get(beta_regularizer)
        self.gamma_regularizer = regularizers.get(gamma_regularizer)
        self.beta_constraint = constraints.get(beta_constraint)
        self.gamma_constraint = constraints.get(gamma_constraint)
        if not isinstance(synchronized, bool):
            raise ValueError(
                f"synchronized must be True or False; received synchronized={synchronized!r}."
            )
        self.synchronized = synchronized
        if not isinstance(renorm, bool):
            raise ValueError(f"renorm must be True or False; received renorm={renorm!r}.")
        self.renorm = renorm
        self.renorm_clipping = renormalization.validate_clipping(renorm_clipping, self.renorm)
        self.renorm_momentum = _validate_momentum(renorm_momentum, "renorm_momentum")
        self.virtual_batch_size = ghost.validate_virtual_batch_size(virtual_batch_size)
        if self.synchronized and self.virtual_batch_size is not None:
            raise ValueError(
                "synchronized=True and virtual_batch_size="
                f"{self.virtual_batch_size} contradict each other: one pools the statistics "
                "over every replica's batch, the other splits each batch; use one of them."
            )
        self.supports_masking = True
        # The weights and the channel axes exist once built (gamma and beta only with scale
        # and center).
        self.gamma: keras.Variable | None = None
        self.beta: keras.Variable | None = None
        self.moving_mean: keras.Variable | None = None
        self.moving_variance: keras.Variable | None = None
        self._channel_axes: list[int] | None = None
        # None: the fused kernel where it applies. Tests set False to compare with the
        # composite path; not a constructor argument, so the config stays Keras's.
        self._fused = None

    def build(self, input_shape: Sequence[int | None]) -> None:
        """Create the weights for inputs of `input_shape`: `gamma` and `beta` (when `scale`
        and `center`), `moving_mean`, `moving_variance`, then the optional ones.

        Args:
            input_shape: the input's shape; its channel axes must have known sizes.

        Raises:
            ValueError: `axis` is out of range for this rank, names an axis twice, or covers
                every axis; a channel axis has unknown size; or `virtual_batch_size` is set
                and axis 0 is a channel axis.
        """
        rank = len(input_shape)
        self._channel_axes = _channel_axes(self.axis, input_shape)
        ghost.check_channel_axes(self.virtual_batch_size, self._channel_axes)
        if not _axes.reduction_axes(rank, self._channel_axes):
            raise ValueError(
                f"BatchNormalization needs at least one axis to reduce over, but axis="
                f"{self.axis} covers every axis of the input shape {tuple(input_shape)}."
            )
        dims = {a: input_shape[a] for a in self._channel_axes}
        unknown = [a for a, d in dims.items() if d is None]
        if unknown:
            raise ValueError(
                f"BatchNormalization needs a known size on its channel axis {unknown} at build "
                f"time; received input shape {tuple(input_shape)}."
            )
        shape = tuple(d for d in dims.values() if d is not None)  # every one, after the check
        if self.scale:
            self.gamma = self._float32_weight(
                "gamma",
                shape,
                self.gamma_initializer,
                True,
                self.gamma_regularizer,
                self.gamma_constraint,
            )
        if self.center:
            self.beta = self._float32_weight(
                "beta",
                shape,
                self.beta_initializer,
                True,
                self.beta_regularizer,
                self.beta_constraint,
            )
        self.moving_mean = self._float32_weight(
            "moving_mean", shape, self.moving_mean_initializer, False
        )
        self.moving_variance = self._float32_weight(
            "moving_variance", shape, self.moving_variance_initializer, False
        )
        self._build_optional_state(shape)
        self.input_spec = keras.layers.InputSpec(ndim=rank, axes=dims)

    def call(self, inputs: Any, training: bool | None = None, mask: Any = None) -> Any:
        """Normalize `inputs`: with the batch's statistics in training (updating the moving
        ones), else with the moving statistics.

        Args:
            inputs: floating tensor.
            training: Python bool or None; true (and the layer trainable) uses the batch
                statistics and updates the moving ones.
            mask: optional boolean tensor; only the True (non-zero) positions enter the
                statistics (all positions are normalized). It is read as Keras reads it
                wherever that fits: a mask of the input's rank − 1 covers its leading axes
                and broadcasts over the last, e.g. (batch, time) for (batch, time, features).
                The channel axis may then be a masked one (`axis=1` there: a channel per
                time step), and each channel c has its own count m_c. Only where Keras's
                reading does not fit, a mask over the non-channel axes in order, broadcast
                over the channel axes, is read: (batch, time) for (batch, channels, time)
                with `axis=1` when time ≠ channels (when they are equal, Keras's reading,
                (batch, channels), wins). In both readings a dimension of size 1 broadcasts.
                A channel left m_c ≤ 1 values outputs β (see the class's guards).

        Returns:
            The normalized tensor, of the input's shape, in the layer's compute dtype.

        Raises:
            TypeError: `inputs` is not floating-point.
            ValueError: in training, a static batch with m ≤ 1 values per channel, a mask
                that fits neither reading (the message names both shapes), or a
                `virtual_batch_size` that the static batch size is not a multiple of (or a
                mask with it).
        """
        ops = backend.get()
        if not ops.is_floating(inputs):
            raise TypeError(_not_floating(keras.backend.standardize_dtype(inputs.dtype)))
        assert self.moving_mean is not None and self._channel_axes is not None  # built
        dtype = ops.statistics_dtype(inputs.dtype)
        shape = tuple(self.moving_mean.shape)
        gamma = ops.parameter(self.gamma, 1.0, shape, dtype)
        beta = ops.parameter(self.beta, 0.0, shape, dtype)
        if training and self.trainable:
            y, mean, variance, count = self._normalize_batch(inputs, gamma, beta, mask)
            weight = count
            if self.virtual_batch_size is not None:  # a replica's weight: all its ghosts
                weight = ops.element_count(inputs, self._channel_axes)
            self.update_moving_statistics(mean, variance, count, weight)
        else:
            y = ops.batch_norm_eval(
                inputs,
                ops.parameter(self.moving_mean, 0.0, shape, dtype),
                ops.parameter(self.moving_variance, 1.0, shape, dtype),
                gamma,
                beta,
                self._channel_axes,
                self.epsilon,
            )
        return keras.ops.cast(y, self.compute_dtype)

    def _normalize_batch(
        self, inputs: Any, gamma: Any, beta: Any, mask: Any
    ) -> tuple[Any, Any, Any, Any]:
        """Train mode: the output, and the per-channel mean, biased variance and count m that
        the moving statistics take (averaged over the ghosts with virtual_batch_size)."""
        ops = backend.get()
        assert self._channel_axes is not None  # build runs before any call
        batch, channel_axes = inputs, self._channel_axes
        if self.virtual_batch_size is not None:
            batch, channel_axes = ops.ghost_split(
                inputs, self.virtual_batch_size, channel_axes, mask
            )
        mask = None if mask is None else ops.expand_mask(mask, batch, channel_axes)
        replicas = ops.replica_context() if self.synchronized else None
        count = ops.element_count(batch, channel_axes, mask, replicas)
        if isinstance(count, int) and count < 2:
            if not ops.batch_size_traced(batch, channel_axes):
                self._require_two_values(count, batch.shape)
            # A traced batch of one (JAX's `fit`): run-time data, as TensorFlow's `fit` sees it.
            count = ops.run_time_count(count, gamma.shape, gamma.dtype)
        # m ≤ 1 at run time: γ = 0 makes that channel's output β and its gradients to x and γ
        # zero (x̂ stays finite), and the update leaves its statistics alone.
        gamma = ops.zero_unless_enough(gamma, count)
        train = functools.partial(
            ops.batch_norm_train,
            channel_axes=channel_axes,
            epsilon=self.epsilon,
            mask=mask,
            fused=self._fused,
            replica_context=replicas,
        )
        if not (self.renorm or self.virtual_batch_size):
            y, mean, variance = train(batch, gamma, beta)
            return y, mean, variance, count
        # x̂ keeps the hand-written gradient; the affine after it is differentiated by autodiff
        # (renorm's r and d are constants there).
        x_hat, mean, variance = train(batch, *ops.unit_affine(batch, channel_axes, gamma.dtype))
        if self.virtual_batch_size is not None:
            mean, variance = ops.ghost_average(mean), ops.ghost_average(variance)
            channel_axes = channel_axes[1:]  # x̂'s axes for the per-channel affine
        scale, offset = gamma, beta
        if self.renorm:
            r, d = ops.renorm_corrections(
                mean,
                variance,
                ops.parameter(self.renorm_mean, 0.0, gamma.shape, mean.dtype),
                ops.parameter(self.renorm_stddev, 1.0, gamma.shape, mean.dtype),
                self.epsilon,
                self.renorm_clipping,
            )
            scale, offset = gamma * r, beta + gamma * d
        y = ops.batch_norm_inference(
            keras.ops.cast(x_hat, gamma.dtype), scale, offset, channel_axes
        )
        return ops.reshape_like(y, inputs), mean, variance, count

    def _require_two_values(self, count: int, shape: Sequence[int | None]) -> None:
        """Raise for a static m ≤ 1 in training (a traced one is the backend's
        `zero_unless_enough`)."""
        if count < 2:
            raise ValueError(
                f"BatchNormalization layer '{self.name}' in training mode needs at least "
                f"2 values per channel to estimate a batch variance, but this batch gives "
                f"m={count} (input shape {tuple(shape)}). Use a larger batch, or call it with "
                f"training=False."
            )

    def update_moving_statistics(
        self, mean: Any, variance: Any, count: Any, weight: Any = None, skip: Any = False
    ) -> None:
        """Move the moving statistics toward a batch's: EMA of μ_B and of the unbiased
        m/(m−1)·σ²_B (the QAT layers call this too, with the statistics of their folded BN).

        A non-finite batch changes nothing. A channel with m_c ≤ 1 has no variance and keeps
        its statistics; with a momentum the other channels still update, while
        `momentum=None` skips the whole batch (uncounted), so that the single batch counter
        stays the number of batches every channel's average holds. Under a tf.distribute
        strategy every replica applies the same update, decided together (the backend's
        `pool_statistics`).

        Args:
            mean: the batch's per-channel mean.
            variance: the batch's per-channel biased variance.
            count: m, a Python int (checked ≥ 2) or a tensor, scalar or per channel.
            weight: this replica's count for pooling across replicas (default `count`).
            skip: a boolean tensor (or False): true leaves every statistic as it is.
        """
        ops = backend.get()
        with ops.statistics_update():
            assert self.moving_mean is not None and self.moving_variance is not None  # built
            values, enough = ops.unbiased_estimates(
                mean, variance, count, self.epsilon, self.moving_mean.dtype, self.renorm
            )
            values, updated = ops.pool_statistics(
                values, enough, count if weight is None else weight, self.synchronized
            )
            if skip is not False:
                updated = keras.ops.logical_and(updated, keras.ops.logical_not(skip))
            moving = (self.moving_mean, self.moving_variance)
            if self.momentum is None:  # cumulative average: the n-th counted batch gets weight 1/n
                assert self.num_batches_tracked is not None  # built for momentum=None
                updated = keras.ops.all(updated)
                seen = ops.read(self.num_batches_tracked)
                for variable, value in zip(moving, values):
                    variable.assign(
                        ops.cumulative_average(ops.read(variable), value, seen, updated)
                    )
                self.num_batches_tracked.assign(seen + keras.ops.cast(updated, seen.dtype))
            else:
                for variable, value in zip(moving, values):
                    variable.assign(
                        ops.moving_average(ops.read(variable), value, self.momentum, updated)
                    )
            if self.renorm:
                self._update_renorm_statistics(values[0], values[2], updated)

    def _update_renorm_statistics(self, mean: Any, stddev: Any, updated: Any) -> None:
        """Keras's renorm state: renorm_mean and renorm_stddev average μ_B and √(σ²_B + ε) with
        renorm_momentum (they give r and d). moving_stddev is kept at √(moving_variance + ε),
        the relation Keras maintains, so the weights carry over to Keras unchanged."""
        ops = backend.get()
        assert self.renorm_mean is not None and self.renorm_stddev is not None  # built
        assert self.moving_stddev is not None and self.moving_variance is not None
        for variable, value in ((self.renorm_mean, mean), (self.renorm_stddev, stddev)):
            variable.assign(
                ops.moving_average(ops.read(variable), value, self.renorm_momentum, updated)
            )
        # Only in the channels updated: a skipped one leaves every weight as it was.
        stddev = keras.ops.sqrt(ops.read(self.moving_variance) + self.epsilon)
        self.moving_stddev.assign(keras.ops.where(updated, stddev, ops.read(self.moving_stddev)))

    def _float32_weight(
        self,
        name: str,
        shape: tuple[int, ...],
        initializer: keras.initializers.Initializer,
        trainable: bool,
        regularizer: keras.regularizers.Regularizer | None = None,
        constraint: keras.constraints.Constraint | None = None,
    ) -> keras.Variable:
        """γ or β (trainable), or a moving statistic: kept in float32 (never autocast). A
        statistic's "mean" aggregation keeps it identical on every replica under tf.distribute
        (Keras's "none" lets each replica's copy drift apart)."""
        return self.add_weight(
            shape=shape,
            name=name,
            initializer=initializer,
            regularizer=regularizer,
            constraint=constraint,
            trainable=trainable,
            autocast=False,
            aggregation="none" if trainable else "mean",
        )

    def _build_optional_state(self, shape: tuple[int, ...]) -> None:
        """Weights that exist only when their feature is on, after the four of Keras's BN."""
        self.moving_stddev: keras.Variable | None = None
        self.renorm_mean: keras.Variable | None = None
        self.renorm_stddev: keras.Variable | None = None
        self.num_batches_tracked: keras.Variable | None = None
        if self.renorm:
            # Keras's renorm weights, in Keras's order; see _update_renorm_statistics.
            stddev_initializer = _sqrt_of(self.moving_variance_initializer)
            for name, initializer in (
                ("moving_stddev", stddev_initializer),
                ("renorm_mean", self.moving_mean_initializer),
                ("renorm_stddev", stddev_initializer),
            ):
                setattr(self, name, self._float32_weight(name, shape, initializer, False))
        if self.momentum is None:
            self.num_batches_tracked = self.add_weight(
                shape=(),
                name="num_batches_tracked",
                initializer="zeros",
                dtype=backend.get().counter_dtype(),
                trainable=False,
                autocast=False,
                aggregation="only_first_replica",
            )

    def get_config(self) -> dict[str, Any]:
        """The layer's config: every constructor argument, for `from_config` and saving.

        Returns:
            A dict with the base layer's config and every argument of `__init__`.
        """
        return {
            **super().get_config(),
            "axis": self.axis,
            "momentum": self.momentum,
            "epsilon": self.epsilon,
            "center": self.center,
            "scale": self.scale,
            "beta_initializer": initializers.serialize(self.beta_initializer),
            "gamma_initializer": initializers.serialize(self.gamma_initializer),
            "moving_mean_initializer": initializers.serialize(self.moving_mean_initializer),
            "moving_variance_initializer": initializers.serialize(self.moving_variance_initializer),
            "beta_regularizer": regularizers.serialize(self.beta_regularizer),
            "gamma_regularizer": regularizers.serialize(self.gamma_regularizer),
            "beta_constraint": constraints.serialize(self.beta_constraint),
            "gamma_constraint": constraints.serialize(self.gamma_constraint),
            "synchronized": self.synchronized,
            "renorm": self.renorm,
            "renorm_clipping": self.renorm_clipping,
            "renorm_momentum": self.renorm_momentum,
            "virtual_batch_size": self.virtual_batch_size,
        }


def _not_floating(dtype: str) -> str:
    """The message for an input of the non-floating `dtype` (its name)."""
    return (
        f"BatchNormalization requires floating-point inputs; received dtype {dtype}. Cast the "
        f"input to a float type first."
    )


def _validate_axis(axis: object) -> int | list[int]:
    """An int stays an int (Keras's form); a list or tuple becomes a list of ints."""
    if isinstance(axis, bool):
        raise TypeError(f"axis must be an int or a list/tuple of ints; received axis={axis!r}.")
    if isinstance(axis, int):
        return axis
    if isinstance(axis, (list, tuple)):
        if not axis or not all(isinstance(a, int) and not isinstance(a, bool) for a in axis):
            raise TypeError(
                f"axis must be an int or a non-empty list/tuple of ints; received axis={axis!r}."
            )
        return list(axis)
    raise TypeError(f"axis must be an int or a list/tuple of ints; received axis={axis!r}.")


def _channel_axes(axis: int | list[int], input_shape: Sequence[int | None]) -> list[int]:
    """`axis` as sorted non-negative channel axes for this input, with range checks."""
    rank = len(input_shape)
    requested = [axis] if isinstance(axis, int) else axis
    for a in requested:
        if not -rank <= a < rank:
            raise ValueError(
                f"axis={axis} is out of range for an input of rank {rank} "
                f"(shape {tuple(input_shape)}); valid axes are {-rank}..{rank - 1}."
            )
    normalized = sorted(a % rank for a in requested)
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"axis={axis} names the same axis twice for an input of rank {rank}.")
    return normalized


def _validate_momentum(momentum: object, name: str = "momentum") -> float | None:
    """A float in [0, 1); `momentum` (not `renorm_momentum`) may also be None."""
    if momentum is None and name == "momentum":
        return None
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise ValueError(f"{name} must be a float in [0, 1); received {name}={momentum!r}.")
    momentum = float(momentum)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"{name} must be in [0, 1); received {name}={momentum}.")
    return momentum


def _sqrt_of(initializer: Callable[..., Any]) -> Callable[..., Any]:
    """An initializer giving the square root of `initializer`'s values (Keras's moving_stddev)."""

    def initialize(shape: Sequence[int], dtype: Any = None) -> Any:
        return keras.ops.sqrt(initializer(shape, dtype=dtype))  # either backend's tensor

    return initialize


def _validate_epsilon(epsilon: object) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
        raise ValueError(f"epsilon must be a positive float; received epsilon={epsilon!r}.")
    epsilon = float(epsilon)
    if not (epsilon > 0.0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be a positive finite float; received epsilon={epsilon}.")
    return epsilon

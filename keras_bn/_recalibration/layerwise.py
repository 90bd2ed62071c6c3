"""The per-layer method (`in_call_order`): Algorithm 2 one BN layer at a time.

It recalibrates the layers one at a time, in the order a forward function
calls them, with one pass over the inputs per layer: when a layer's moments are recorded,
every layer before it already normalizes with its new statistics. `recalibrate` keeps it as
the reference its one-pass method is tested against, for subclassed models (which have no
graph to walk), and for the BN layers inside a custom layer (whose `call` the walk cannot see
into), where the forward function is that layer's call on its inputs.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import keras

from keras_bn import backend
from keras_bn._graph import bn_layers
from keras_bn._recalibration.hooks import BatchNormCalls
from keras_bn._recalibration.progress import ProgressBar
from keras_bn._recalibration.statistics import PooledMoments, Recalibrated, settle


def in_call_order(
    layers: Sequence[keras.layers.Layer],
    forward: Callable[[Any], object],
    inputs: Iterable[Any],
    first: Any,
    count: int | None,
    bar: "ProgressBar",
    check_count: Callable[[int], None] = lambda batches: None,
    root: keras.layers.Layer | None = None,
) -> Recalibrated:
    """The per-layer method: recalibrate `layers` one at a time in the order `forward` calls
    them, each from one pass over `inputs` with every layer before it already recalibrated.

    Args:
        layers: the BN layers to recalibrate; the others keep their statistics.
        forward: runs the computation on one input (a model's forward pass, a layer's call)
            with the inference flag; traced once into a tf.function that serves every pass
            (under JAX it runs eagerly: a jax.jit would bake in the statistics each pass
            changes).
        inputs: the inputs, iterable once per pass.
        first: the first input, traced first to find the call order.
        count: how many inputs a pass has, None when unknown (for the progress bar).
        bar: the progress bar; its total grows by the passes × `count`, and it advances by
            one per input of each pass.
        check_count: called with the number of inputs of each pass (it raises when they
            differ).
        root: the model or layer `forward` runs; a BN of `layers` in a TimeDistributed inside
            it is recalibrated over batch × time (`BatchNormCalls`).

    Returns:
        A `Recalibrated`.

    Raises:
        ValueError: no input gives a layer 2 values in any channel; a layer's statistics come
            out NaN or inf; or a layer is called more than once by `forward`.
    """
    with BatchNormCalls(layers, root=root) as statistics:

        def recorded(x: Any) -> dict[int, Any]:
            return statistics.record(lambda: forward(x))

        traced = backend.get().compiled(recorded)
        traced(first)
        order = statistics.order
        bar.add_total(len(order) * count if count is not None else None)
        changes = []
        for index in order:
            layer = layers[index]
            bar.set_description(layer.name)

            def pooled(layer: keras.layers.Layer = layer, index: int = index) -> PooledMoments:
                sums = PooledMoments.for_layer(bn_layers.statistics_of(layer))
                for x in inputs:
                    sums.add(*traced(x)[index])
                    bar.update(1)
                check_count(sums.batches + sums.skipped)
                return sums

            changes.append(settle(layer, pooled, lambda: bar.add_total(count)))
    not_called = tuple(i for i in range(len(layers)) if i not in order)
    return Recalibrated(tuple(changes), not_called)

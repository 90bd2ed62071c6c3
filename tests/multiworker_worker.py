"""One worker of the multi-worker test (tests/test_distributed.py), and the one-process
reference it is compared with.

    TF_CONFIG=... python multiworker_worker.py INIT.npz OUT.npz

trains a small synchronized-BN model for a few SGD steps under MultiWorkerMirroredStrategy,
each worker on its slice of every global batch, and saves every weight (the BN moving
statistics included) to OUT.npz.
"""

import os
import sys

GLOBAL_BATCH = 16
STEPS = 3


def build_model(synchronized=True):
    import keras

    import keras_bn

    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, use_bias=False),
        keras_bn.BatchNormalization(momentum=0.5, synchronized=synchronized),
        keras.layers.ReLU(),
        keras.layers.Dense(1),
    ])


def batches():
    import numpy as np

    rng = np.random.default_rng(7)
    for _ in range(STEPS):
        x = rng.normal(size=(GLOBAL_BATCH, 6)).astype("float32")
        x[GLOBAL_BATCH // 2:] += 3.0  # the two workers see different distributions
        yield x, rng.normal(size=(GLOBAL_BATCH, 1)).astype("float32")


def train(strategy, init_path):
    """Train from the weights in init_path; strategy None means one process, no strategy."""
    import keras
    import numpy as np
    import tensorflow as tf

    scope = strategy.scope() if strategy is not None else tf.init_scope()
    with scope:
        model = build_model()
        init = np.load(init_path)
        model.set_weights([init[f"arr_{i}"] for i in range(len(init.files))])
        optimizer = keras.optimizers.SGD(0.1)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            # Sum over this replica's examples / global batch: the replicas' gradients add up
            # (the optimizer all-reduces them) to the global batch's mean-loss gradient.
            loss = tf.reduce_sum(tf.square(model(x, training=True) - y)) / GLOBAL_BATCH
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def step(x, y):
        if strategy is None:
            return replica_step(x, y)
        replicas = strategy.num_replicas_in_sync
        per = GLOBAL_BATCH // replicas

        def shard(context):
            i = context.replica_id_in_sync_group
            return x[i * per:(i + 1) * per], y[i * per:(i + 1) * per]

        return strategy.run(
            replica_step, args=strategy.experimental_distribute_values_from_function(shard)
        )

    for x, y in batches():
        step(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in model.weights]


def main(init_path, out_path):
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    weights = train(strategy, init_path)
    tmp = out_path + ".tmp.npz"
    np.savez(tmp, *weights)
    os.replace(tmp, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])

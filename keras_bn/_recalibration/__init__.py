"""The recalibration engine behind `keras_bn.recalibrate`, the `Recalibrate` callback and QAT's
re-estimation: the data as batches (`batches`), the hooks that read each BN's input
(`hooks`), the one pass over a Functional graph (`one_pass`) with its frontier of live tensors
(`frontier`), and the per-layer method for what the graph hides (`layerwise`)."""

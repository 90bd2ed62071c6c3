"""Helpers that read and rebuild a Keras model's graph, shared by the fold
(keras_bn.export), `quantize_model`, `convert`, `check_batchnorm` and the recalibration
engine: which layers are batch norms (`bn_layers`), a model's graph and configs (`models`),
the layer rebuild both rewrites use (`rebuild`), the inference affine layers a rewrite inserts
(`affine`), and the augmentation layers BN statistics must not see (`augmentation`)."""

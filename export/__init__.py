"""keras_bn.export: fold batch norms into neighbouring layers and write verified TFLite/ONNX files.

Not implemented yet; the console script `keras-bn-export` says so and exits 2.
"""

__all__ = []

"""The package version: a leaf, read by keras_bn/__init__.py and keras-bn-export (which
imports no heavier part of keras_bn to print it)."""

__version__ = "0.1.0"

"""Registers keras_bn's serializable classes with Keras as soon as Keras is ready.

A `.keras` file names a keras_bn layer as "keras_bn>BatchNormalization" (or
"keras_bn.export>InferenceAffine", "keras_bn.quantize>QuantizedHostBatchNorm"); Keras finds it
only in its registry, which the class's `@register_keras_serializable` fills when its module is
imported. Keras never imports a config's module itself (only its own packages'), and
`import keras_bn` no longer imports keras_bn.layers (the package is lazy, so that
`keras-bn-export --help` does not load TensorFlow). So `register_when_keras_is_ready`, called
by `import keras_bn`:

- imports the registering modules at once if Keras (and, on its TensorFlow backend,
  TensorFlow) is already imported;
- else puts a finder first on `sys.meta_path` that wraps the loaders of `keras` and
  `tensorflow` and imports them as soon as both have finished loading (`import tensorflow`
  imports keras halfway through, and `import keras` imports tensorflow: whichever finishes
  last triggers it, so neither is half-initialized when keras_bn's modules run).

Under TensorFlow, JAX and PyTorch every registering module is imported; under any other
backend nothing is registered, and the first use of a keras_bn name raises the backend guard's
ImportError (keras_bn/backend/__init__.py).
"""

import importlib
import importlib.util
import sys
import typing

from keras_bn import backend

# The modules whose import registers keras_bn's classes with Keras.
REGISTERING_MODULES = (
    "keras_bn.layers",
    "keras_bn._graph.affine",
    "keras_bn.quantize.activation",
    "keras_bn.quantize.layers",
)
_NEEDED = ("keras", "tensorflow")


def register_when_keras_is_ready():
    """Register keras_bn's classes with Keras now, or as soon as Keras and TensorFlow load."""
    if any(isinstance(finder, _Watcher) for finder in sys.meta_path):
        return  # keras_bn imported again (importlib.reload): one watcher is enough
    watcher = _Watcher(loaded={name for name in _NEEDED if name in sys.modules})
    if not watcher.maybe_register():
        sys.meta_path.insert(0, watcher)


def _register(modules=REGISTERING_MODULES):
    for module in modules:
        importlib.import_module(module)


class _Watcher:
    """A meta path finder that only watches: it finds nothing itself, but hands the import
    system the real spec of keras and tensorflow with a loader that reports when each has
    finished loading."""

    def __init__(self, loaded):
        self.loaded = set(loaded)  # the names of _NEEDED that have finished loading
        self.done = False
        self._finding = set()

    def find_spec(self, fullname, path=None, target=None):
        """The real spec of keras or tensorflow with a reporting loader; None otherwise."""
        if self.done or fullname not in _NEEDED or fullname in self._finding:
            return None
        self._finding.add(fullname)  # the search below passes through this finder again
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = typing.cast(
            "importlib.abc.Loader", _ReportingLoader(spec.loader, fullname, self)
        )
        return spec

    def finished(self, name):
        self.loaded.add(name)
        self.maybe_register()

    def maybe_register(self):
        """Register once Keras has loaded and, on the TensorFlow backend, TensorFlow too.

        Returns:
            True when nothing is left to wait for.
        """
        if self.done or "keras" not in self.loaded:
            return self.done
        if not backend.is_supported():
            self.done = True  # nothing of keras_bn's can run there
        elif not backend.loads_tensorflow() or "tensorflow" in self.loaded:
            self.done = True
            _register()
        return self.done


class _ReportingLoader:
    """Loads a module with its real loader, then tells the watcher it has finished."""

    def __init__(self, loader, name, watcher):
        self.loader, self.name, self.watcher = loader, name, watcher

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        # The module sees its real loader (importlib.resources, pkgutil and reload use it).
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.watcher.finished(self.name)

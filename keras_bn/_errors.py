"""The exception and warning classes keras_bn raises, and how an error is told in one line, in
a leaf module that imports nothing.

`UnsupportedModelError` is public as `keras_bn.export.UnsupportedModelError` (and
`keras_bn.UnsupportedModelError`); `KerasBNWarning` as `keras_bn.KerasBNWarning`.
"""


class UnsupportedModelError(TypeError, ValueError):
    """A model whose structure the fold, an exporter or `keras_bn.convert` cannot take.

    Raised for every such structure (a subclassed model, which has no layer graph; a layer
    whose config does not round-trip; a layer a converter cannot write), with a message naming
    the model or layer and what to do instead. It subclasses both TypeError and ValueError, so
    `except TypeError` and `except ValueError` clauses written for the older errors still
    catch it.
    """


class KerasBNWarning(UserWarning):
    """A warning from keras_bn: something ran but probably not as intended."""


def one_line(error):
    """The first line of `error`'s message ("" for none), for one-line error reports."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""

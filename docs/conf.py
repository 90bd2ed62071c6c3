"""Sphinx configuration for the keras-bn documentation site (`make docs`).

Sphinx with MyST-NB, autodoc/napoleon and the PyData theme: the maintained stack of the NumPy /
SciPy world. MyST-NB executes the example notebooks during the build, in a kernel of the Python
that runs Sphinx, at the sizes KERAS_BN_SMALL selects (full by default), and caches the results
per size, so a rebuild re-executes only the notebooks that changed.
"""

import inspect
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = pathlib.Path(os.environ.get("KERAS_BN_DOCS_BUILD", ROOT / "build" / "docs"))
SMALL = os.environ.get("KERAS_BN_SMALL", "0") == "1"

os.environ["KERAS_BN_SMALL"] = "1" if SMALL else "0"  # the notebooks' kernels inherit it
# No MPLBACKEND: the kernels keep matplotlib-inline, so plt.show() puts a figure in the page.
os.environ.pop("MPLBACKEND", None)


# Sphinx is an entry point too (autodoc imports keras_bn and TensorFlow): the TensorFlow Keras
# backend, quiet logs and TensorFlow's start-up lines dropped, as in every command of the
# project (keras_bn/_quiet.py); the kernels inherit the environment.
from keras_bn import _quiet  # noqa: E402

_quiet.entry_point()

# The notebooks' kernel: this Python, its C++ logging kept out of the pages.
sys.path.insert(0, str(ROOT / "examples"))
from kernelspec import write_kernelspec  # noqa: E402

write_kernelspec(BUILD, "keras-bn (docs)")
os.environ["JUPYTER_PATH"] = str(BUILD)

project = "keras-bn"
author = "the keras-bn developers"
copyright = "2026, the keras-bn developers"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# Notebooks: executed at build time; any failing cell (an assert of a claim included) fails it.
nb_execution_mode = "cache"
nb_execution_cache_path = str(BUILD / ("jupyter_cache_small" if SMALL else "jupyter_cache_full"))
nb_execution_timeout = int(os.environ.get("KERAS_BN_CELL_TIMEOUT", "7200"))
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
# A cell's display(Markdown(...)) as MyST, as the pages are: CommonMark, the default, has no
# tables, and the Performance page's tables came out as lines of pipes.
nb_render_markdown_format = "myst"

autodoc_member_order = "bysource"
autodoc_typehints = "none"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "pydata_sphinx_theme"
html_title = "keras-bn"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
# Pages that are a section of their own have nothing to list in the left sidebar ("Section
# Navigation" stood empty): without it their tables and code get its width. The examples
# keep it, for their notebooks.
html_sidebars = {page: [] for page in ("index", "install", "api", "architecture", "guide/*")}
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
nitpicky = False


def _constructor_signature(app, what, name, obj, options, signature, return_annotation):
    """A Keras layer's signature as its __init__'s: autodoc would show Keras's
    `Layer.__new__(*args, **kwargs)`, which says nothing of the arguments."""
    if what != "class" or signature != "(*args, **kwargs)":
        return None
    # The nearest __init__ of keras_bn's own (QuantizedHost's, for a subclass that has none).
    owner = next((c for c in obj.__mro__ if "__init__" in vars(c)), object)
    if not owner.__module__.startswith("keras_bn"):
        return None
    parameters = list(inspect.signature(owner.__init__).parameters.values())[1:]  # no self
    plain = [p.replace(annotation=inspect.Parameter.empty) for p in parameters]
    return str(inspect.Signature(plain)), return_annotation


def setup(app):
    app.connect("autodoc-process-signature", _constructor_signature)

"""glue: a value computed by a notebook, for the prose around it.

The book's prose never types a number a run produced: a code cell calls
``glue("ring_vs_psum", ratio)`` and the text says ``{glue:text}`ring_vs_psum:.2f```, so the
page shows the value of the run whose outputs it shows (myst-nb's glue; the Chinese page
takes the English run's outputs, glue included).

Outside the book build — on Colab, in a plain Jupyter, in a script — myst-nb may be
missing: then :func:`glue` does nothing, and the generated notebooks
(``tools/notebooks.py``) write the stored run's value where the prose had the role.
:func:`glue` returns nothing, so a cell that ends with it shows no stray value.
"""
from __future__ import annotations

from typing import Any

__all__ = ["glue"]


def glue(name: str, value: Any) -> None:
    """Record ``value`` under ``name`` for the prose (myst-nb, in a notebook)."""
    from .plot import in_notebook
    if not in_notebook():
        return
    try:
        from myst_nb import glue as myst_glue
    except ImportError:          # Colab or a plain Jupyter: the prose shows the stored value
        return
    myst_glue(name, value, display=False)

"""Animator: a learning curve that works in Jupyter, in scripts and in the book build.

d2l's Animator only shows anything inside Jupyter. This one

* redraws in place in Jupyter (one output, updated with ``display_id``; the executed
  notebook, and so the rendered site, keeps the last drawing),
* writes an image file after every point when there is no notebook (a script, a test),
  so ``python train.py`` leaves a picture you can open while it runs,
* keeps every point in ``Animator.X`` / ``Animator.Y`` so tests can check them.

It draws on a bare :class:`matplotlib.figure.Figure` (no pyplot, no GUI backend needed).
"""
from __future__ import annotations

import io
import itertools
import os
import sys
from typing import Sequence

from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from .tools import atomic_write

__all__ = ["Animator", "in_notebook", "training_animator", "TRAINING_YLIM"]

_counter = itertools.count(1)


def in_notebook() -> bool:
    """True inside a Jupyter kernel: the shell is a ``ZMQInteractiveShell`` or a subclass
    of it (Colab's ``google.colab._shell.Shell`` is one), also when nbclient executes a
    notebook for the book. False in a terminal IPython and in scripts."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython
    try:
        from ipykernel.zmqshell import ZMQInteractiveShell
    except ImportError:                  # no kernel package: not a notebook
        return False
    return isinstance(get_ipython(), ZMQInteractiveShell)


class Animator:
    """Plot data points as they arrive.

    ``add(x, ys)`` appends one point to each line (``ys`` a number or a sequence with
    ``None`` for "no point this time"). Outside a notebook the figure is written to
    ``path`` (default: ``$DPBOOK_FIGURES`` or the current folder, ``animator-<k>.png``);
    the suffix picks the format (``.png``, ``.svg``, ``.pdf``). ``path=False`` keeps the
    points in memory only; ``live`` forces the notebook display on or off.

    ``xticks`` puts the x ticks at the given values, labelled plainly (``128``, not
    ``1.28×10²``), with no minor ticks: on a log axis with a few values (the sizes
    measured, say), matplotlib's own minor-tick labels would run into each other.
    Figures that are compared should be given the same ``ylim``; a point above it is
    drawn as a triangle on the top edge, so that it does not silently vanish.
    """

    def __init__(self, xlabel: str | None = None, ylabel: str | None = None,
                 legend: Sequence[str] | None = None, xlim=None, ylim=None,
                 xscale: str = "linear", yscale: str = "linear",
                 fmts: Sequence[str] = ("-", "m--", "g-.", "r:", "b-", "c--", "y-.", "k:"),
                 figsize=(4.0, 2.8), title: str | None = None,
                 path: str | os.PathLike | bool | None = None, live: bool | None = None,
                 xticks: Sequence[float] | None = None):
        self.legend = list(legend) if legend else []
        self.fmts = list(fmts)
        self.config = dict(xlabel=xlabel, ylabel=ylabel, xlim=xlim, ylim=ylim,
                           xscale=xscale, yscale=yscale, title=title,
                           xticks=None if xticks is None else [float(v) for v in xticks])
        self.X: list[list[float]] = []
        self.Y: list[list[float]] = []
        self.fig = Figure(figsize=figsize, layout="constrained")
        self.axes = self.fig.add_subplot()
        self.live = in_notebook() if live is None else live
        self._handle = None
        if path is None and not self.live:
            path = os.path.join(os.environ.get("DPBOOK_FIGURES", "."),
                                f"animator-{next(_counter)}.png")
        self.path = None if path is None or path is False else os.fspath(path)
        self._announced = False

    def add(self, x: float, ys) -> None:
        """Add the point ``(x, ys[i])`` to line ``i`` and redraw."""
        if not isinstance(ys, (list, tuple)):
            ys = [ys]
        if not self.X:
            self.X = [[] for _ in ys]
            self.Y = [[] for _ in ys]
        if len(ys) != len(self.Y):
            raise ValueError(f"this Animator has {len(self.Y)} lines, add() got {len(ys)} values")
        for i, y in enumerate(ys):
            if y is not None:
                self.X[i].append(float(x))
                self.Y[i].append(float(y))
        self.draw()

    def series(self) -> dict[str, tuple[list[float], list[float]]]:
        """The points of every line, by legend entry (``"0"``, ``"1"``… without a legend)."""
        names = self.legend + [str(i) for i in range(len(self.legend), len(self.Y))]
        return {name: (xs, ys) for name, xs, ys in zip(names, self.X, self.Y)}

    def draw(self) -> None:
        """Redraw the figure, then show it (notebook) or write it (everywhere else)."""
        ax, c = self.axes, self.config
        ax.cla()
        lines = [ax.plot(xs, ys, fmt, **({"marker": "o"} if len(xs) == 1 else {}))[0]
                 for xs, ys, fmt in zip(self.X, self.Y, itertools.cycle(self.fmts))]
        top = c["ylim"][1] if c["ylim"] and c["ylim"][0] != c["ylim"][1] else None
        for line, xs, ys in zip(lines, self.X, self.Y):     # above a fixed y range:
            above = [x for x, y in zip(xs, ys) if top is not None and y > top]
            if above:                                       # a triangle on the top edge
                ax.plot(above, [top] * len(above), "^", color=line.get_color(),
                        clip_on=False)
        ax.set_xlabel(c["xlabel"] or "")
        ax.set_ylabel(c["ylabel"] or "")
        ax.set_xscale(c["xscale"])       # (resets the tick locators: set ticks after it)
        ax.set_yscale(c["yscale"])
        if c["xticks"] is not None:
            ax.set_xticks(c["xticks"], [_plain(v) for v in c["xticks"]])
            ax.xaxis.set_minor_locator(NullLocator())
        for lim, setter in ((c["xlim"], ax.set_xlim), (c["ylim"], ax.set_ylim)):
            if lim and lim[0] != lim[1]:     # a one-epoch run has xlim [1, 1]: let it be
                setter(lim)
        if c["title"]:
            ax.set_title(c["title"])
        if self.legend:
            n = min(len(lines), len(self.legend))
            ax.legend(lines[:n], self.legend[:n])
        ax.grid(True, alpha=0.3)
        if self.live:
            self._show()
        if self.path:
            self.savefig(self.path)

    def _show(self) -> None:
        from IPython.display import SVG, display
        buf = io.StringIO()
        with rc_context({"svg.hashsalt": "dpbook"}):   # the same drawing, the same SVG
            self.fig.savefig(buf, format="svg", metadata={"Date": None})
        image = SVG(buf.getvalue())
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)

    def savefig(self, path: str | os.PathLike) -> str:
        """Write the figure to ``path`` (atomically: readers never see half a file)."""
        path = atomic_write(path, self.fig.savefig)
        if not self._announced and not self.live:
            print(f"Animator: drawing to {path}", file=sys.stderr)
            self._announced = True
        return path


def _plain(v: float) -> str:
    """A plain tick label: ``128`` for a whole number, else ``format(v, "g")`` (``0.5``;
    very small or large values still get an exponent)."""
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


TRAINING_YLIM = (0.0, 2.5)
"""The y range of every learning curve: runs that the book compares are drawn on the
same scale. It holds the test accuracy (0 to 1) and the training loss from its start, a
uniform guess among Fashion-MNIST's 10 classes (cross-entropy ln 10 = 2.30), down; the
points of a run whose loss grows past it are marked on the top edge."""


def training_animator(num_epochs: int, title: str | None = None,
                      ylim: tuple[float, float] = TRAINING_YLIM) -> Animator:
    """The learning curve every training loop of the book draws: train loss and test
    accuracy after each of ``num_epochs`` epochs, on the fixed y range ``ylim``
    (default :data:`TRAINING_YLIM`), so that the curves of different runs can be
    compared. The x ticks are the epochs (whole numbers) up to 12 epochs."""
    return Animator(xlabel="epoch", xlim=[1, num_epochs], ylim=ylim,
                    legend=["train loss", "test acc"], title=title,
                    xticks=range(1, num_epochs + 1) if num_epochs <= 12 else None)

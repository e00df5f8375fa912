"""Draw the book's diagrams into figures/ (run: python tools/make_figures.py).

Labels are symbols and code names only, so one figure serves both editions.
"""
from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).resolve().parent.parent / "figures"


def box(ax, x, y, w, h, text, color):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02",
                                fc=color, ec="#333333", lw=1))
    ax.text(x, y, text, ha="center", va="center", fontsize=10)


def arrow(ax, start, end):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12,
                                 color="#333333", lw=1.2, shrinkA=2, shrinkB=2))


def data_parallel_step(path: Path) -> None:
    """One data-parallel SGD step on two devices."""
    fig = Figure(figsize=(8.0, 4.2))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 5.2)
    ax.axis("off")
    blue, green, orange, grey = "#dbe9f6", "#dff0d8", "#fde5c8", "#eeeeee"
    box(ax, 1.0, 2.6, 1.5, 1.0, "$X, y$\n($B$)", grey)
    for row, (y, i) in enumerate(((4.0, 0), (1.2, 1))):
        ax.text(2.2, y + 0.75, f"dev {i}", fontsize=10, family="monospace", color="#555555")
        box(ax, 3.0, y, 1.4, 0.8, f"$X^{{({i})}}, y^{{({i})}}$\n($B/2$)", blue)
        box(ax, 5.0, y, 1.6, 0.8, "$\\mathbf{w}$\n$\\nabla_\\mathbf{w} \\sum \\ell$", green)
        box(ax, 7.0, y, 1.4, 0.8, f"$\\mathbf{{g}}^{{({i})}}$", orange)
        box(ax, 9.0, y, 1.6, 0.8, "$\\mathbf{w} \\leftarrow \\mathbf{w} - "
                                  "\\frac{\\eta}{B}\\mathbf{g}$", green)
        arrow(ax, (1.75, 2.6), (2.3, y))
        arrow(ax, (3.7, y), (4.2, y))
        arrow(ax, (5.8, y), (6.3, y))
    box(ax, 8.0, 2.6, 1.9, 0.8, "allreduce\n$\\mathbf{g} = \\mathbf{g}^{(0)} + \\mathbf{g}^{(1)}$",
        "#f2dede")
    for y in (4.0, 1.2):
        arrow(ax, (7.7, y), (7.9, 3.0 if y > 2.6 else 2.2))
        arrow(ax, (8.4, 3.0 if y > 2.6 else 2.2), (8.8, y + (-0.4 if y > 2.6 else 0.4)))
    fig.savefig(path, metadata={"Date": None})


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    data_parallel_step(OUT / "data-parallel-step.svg")
    print(f"wrote {OUT / 'data-parallel-step.svg'}")

"""Draw the book's diagrams into figures/ (run: python tools/make_figures.py).

Labels are symbols and code names only, so one figure serves both editions; the
preface's map of reading paths, whose labels are words, is drawn once per edition
(reading-paths.en.svg, reading-paths.zh.svg).
"""
from __future__ import annotations

from pathlib import Path

from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

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
    save(fig, path)


# Colours of the ZeRO figures: parameters, gradients, optimizer state (the ZeRO paper's).
W_OLD, W_NEW = "#c6dbef", "#3f7fbf"       # parameters: before / after this step's update
G_OWN, G_MEAN = "#fdd0a2", "#e6750a"      # gradients: one rank's own / the mean over ranks
OPT = "#a1d99b"                           # optimizer state (fp32 weights and moments)
EDGE, EMPTY = "#555555", "#ffffff"


def save(fig: Figure, path: Path) -> None:
    """Save with fixed SVG ids, so that drawing an unchanged figure again changes no byte."""
    with rc_context({"svg.hashsalt": path.name}):
        fig.savefig(path, metadata={"Date": None})


def shard_bar(ax, x, y, length, height, colours):
    """A bar cut into len(colours) equal pieces; a piece coloured None is empty (dashed)."""
    piece = length / len(colours)
    for i, c in enumerate(colours):
        ax.add_patch(Rectangle((x + i * piece, y), piece, height,
                               fc=EMPTY if c is None else c, ec=EDGE if c else "#aaaaaa",
                               lw=0.8, ls="-" if c else (0, (2, 2))))


def zero_memory(path: Path) -> None:
    """What each of 4 devices holds under DDP and ZeRO stages 1–3 (mixed-precision Adam:
    2Ψ fp16 parameters, 2Ψ fp16 gradients, 12Ψ fp32 optimizer state)."""
    n, unit = 4, 0.26                     # devices; drawing units per Ψ of bytes
    fig = Figure(figsize=(6.4, 5.6))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 6.4)
    ax.set_ylim(0, 5.6)
    ax.axis("off")
    x0 = 1.35
    legend = [(W_NEW, "$\\mathbf{w}$  fp16  $2\\Psi$"), (G_MEAN, "$\\mathbf{g}$  fp16  $2\\Psi$"),
              (OPT, "Adam  fp32  $12\\Psi$")]
    for i, (c, text) in enumerate(legend):
        lx = 0.15 + i * 2.1
        ax.add_patch(Rectangle((lx, 5.22), 0.3, 0.2, fc=c, ec=EDGE, lw=0.8))
        ax.text(lx + 0.4, 5.32, text, va="center", fontsize=11)
    ax.text(6.3, 4.92, f"$N = {n}$", ha="right", va="center", fontsize=11)
    rows = [("DDP", 0, "$16\\Psi$"), ("ZeRO-1", 1, "$7\\Psi$"), ("ZeRO-2", 2, "$5.5\\Psi$"),
            ("ZeRO-3", 3, "$4\\Psi$")]
    bar_h, gap = 0.17, 0.06
    for row, (name, stage, total) in enumerate(rows):
        top = 4.6 - row * 1.18
        ax.text(0.1, top - 1.5 * (bar_h + gap), name, va="center", fontsize=11,
                family="monospace", weight="bold")
        ax.text(6.3, top - 1.5 * (bar_h + gap), total, ha="right", va="center", fontsize=12)
        for r in range(n):
            y = top - r * (bar_h + gap) - bar_h
            x = x0
            for size, colour, sharded in ((2, W_NEW, stage >= 3), (2, G_MEAN, stage >= 2),
                                          (12, OPT, stage >= 1)):
                pieces = [colour if not sharded or i == r else None for i in range(n)]
                shard_bar(ax, x, y, size * unit, bar_h, pieces if sharded else [colour])
                x += size * unit + 0.05
            if row == 0:
                ax.text(x0 - 0.08, y + bar_h / 2, f"dev {r}", ha="right", va="center",
                        fontsize=9, family="monospace", color="#555555")
    save(fig, path)


def zero1_step(path: Path) -> None:
    """One ZeRO-1 step on 4 devices, in five moves (what each device holds after each)."""
    n = 4
    fig = Figure(figsize=(6.4, 6.2))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 6.4)
    ax.set_ylim(0, 6.2)
    ax.axis("off")
    legend = [(W_OLD, "$\\mathbf{w}_t$"), (W_NEW, "$\\mathbf{w}_{t+1}$"),
              (G_OWN, "$\\mathbf{g}^{(r)}$"), (G_MEAN, "$\\bar{\\mathbf{g}}$"), (OPT, "Adam")]
    for i, (c, text) in enumerate(legend):
        lx = 0.25 + i * 1.25
        ax.add_patch(Rectangle((lx, 5.85), 0.3, 0.2, fc=c, ec=EDGE, lw=0.8))
        ax.text(lx + 0.4, 5.95, text, va="center", fontsize=12)
    moves = [  # label, parameters, gradients (per piece; r is the device's own piece)
        ("1  loss.backward()", lambda r, i: W_OLD, lambda r, i: G_OWN),
        ("2  reduce-scatter", lambda r, i: W_OLD, lambda r, i: G_MEAN if i == r else None),
        ("3  inner.step()", lambda r, i: W_NEW if i == r else W_OLD,
         lambda r, i: G_MEAN if i == r else None),
        ("4  all-gather", lambda r, i: W_NEW, lambda r, i: G_MEAN if i == r else None),
        ("5  zero_grad()", lambda r, i: W_NEW, lambda r, i: None),
    ]
    x0, cell, bar_h = 0.55, 1.45, 0.17
    for r in range(n):
        ax.text(x0 + r * cell + 0.6, 5.5, f"dev {r}", ha="center", va="center",
                fontsize=10, family="monospace", color="#555555")
    for m, (label, w, g) in enumerate(moves):
        top = 5.2 - m * 1.04
        ax.text(0.1, top, label, va="center", fontsize=11, family="monospace",
                weight="bold")
        for r in range(n):
            x = x0 + r * cell
            for k, (name, colours) in enumerate(
                    (("w", [w(r, i) for i in range(n)]), ("g", [g(r, i) for i in range(n)]),
                     ("s", [OPT if i == r else None for i in range(n)]))):
                y = top - 0.42 - k * (bar_h + 0.05)
                shard_bar(ax, x, y, 1.2, bar_h, colours)
        if m < len(moves) - 1:
            ax.plot([0.1, 6.3], [top - 0.9, top - 0.9], color="#dddddd", lw=0.8)
    save(fig, path)


def zero3_timeline(path: Path) -> None:
    """Stage 3 on a time axis: each layer's parameters are gathered before its forward and
    again before its backward, freed after each; its gradients are reduce-scattered."""
    fig = Figure(figsize=(6.4, 3.3))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-1.6, 19.2)
    ax.set_ylim(-1.0, 4.9)
    ax.axis("off")
    AG, FW, BW, RS = "#c9b6e4", "#a1d99b", "#74c476", "#f4a6a6"
    legend = [(AG, "all-gather"), (FW, "forward"), (BW, "backward"), (RS, "reduce-scatter")]
    for i, (c, text) in enumerate(legend):
        lx = -1.4 + i * 5.1
        ax.add_patch(Rectangle((lx, 4.35), 0.6, 0.35, fc=c, ec=EDGE, lw=0.8))
        ax.text(lx + 0.8, 4.52, text, va="center", fontsize=10, family="monospace")
    # (layer, start, kind, length); layer 0 is the first
    blocks = []
    t = 0.0
    for layer in range(3):                               # forward: gather, compute, free
        blocks += [(layer, t, AG, 1.0), (layer, t + 1.0, FW, 1.4)]
        t += 2.4
    t += 0.8                                             # the loss, between the passes
    for layer in (2, 1, 0):                              # backward: gather, compute, scatter
        blocks += [(layer, t, AG, 1.0), (layer, t + 1.0, BW, 2.0), (layer, t + 3.0, RS, 1.0)]
        t += 3.0
    held: dict[int, list[tuple[float, float]]] = {0: [], 1: [], 2: []}
    for layer, start, kind, length in blocks:
        if kind == AG:
            held[layer].append([start, None])
        elif kind in (FW, BW):
            held[layer][-1][1] = start + length          # freed when the compute ends
    row_y = {0: 3.2, 1: 2.1, 2: 1.0}
    for layer, spans in held.items():
        y = row_y[layer]
        ax.text(-1.5, y, f"$L_{layer + 1}$", va="center", fontsize=12)
        ax.plot([-0.3, 18.3], [y, y], color="#dddddd", lw=0.8, zorder=0)
        for a, b in spans:                               # the whole w of the layer exists
            ax.add_patch(Rectangle((a, y - 0.42), b - a, 0.84, fc="#eef3fa", ec=W_NEW,
                                   lw=1.0, ls=(0, (3, 2)), zorder=1))
    for layer, start, kind, length in blocks:
        ax.add_patch(Rectangle((start + 0.03, row_y[layer] - 0.3), length - 0.06, 0.6,
                               fc=kind, ec=EDGE, lw=0.8, zorder=2))
    ax.add_patch(FancyArrowPatch((-0.3, 0.05), (19.0, 0.05), arrowstyle="-|>",
                                 mutation_scale=12, color="#333333", lw=1.0))
    ax.text(19.0, -0.35, "$t$", ha="right", va="center", fontsize=12)
    ax.plot([7.6, 7.6], [0.05, 3.8], color="#888888", lw=0.8, ls=":")
    ax.add_patch(Rectangle((0.0, -0.85), 0.6, 0.35, fc="#eef3fa", ec=W_NEW, lw=1.0,
                           ls=(0, (3, 2))))
    ax.text(0.8, -0.67, "$\\mathbf{w}_\\ell$", va="center", fontsize=12)
    save(fig, path)


# The preface's map, one figure per edition (its labels are words): each chapter in
# order, and the pages that three reading paths take through it; True = read, False = skim.
READING_PATHS = {
    "en": {
        "titles": ("PyTorch\nonly", "JAX\nonly", "DDP + FSDP\nfor my job"),
        "legend": ("read", "skim"),
        "rows": [
            ("Devices", [[("PyTorch", True)], [("JAX", True)], [("PyTorch", False)]]),
            ("From scratch", [[("PyTorch", True)], [("JAX", True)], [("PyTorch", True)]]),
            ("Concise", [[("PyTorch", True)], [("JAX", True)], [("PyTorch", True)]]),
            ("Communication", [[("4 pages", True)], [("allreduce", False), ("JAX", True)],
                               [("allreduce", True)]]),
            ("Inside DDP", [[("5 pages", True)], [("JAX", True)], [("5 pages", True)]]),
            ("Sharded", [[("ZeRO, FSDP2", True)], [("ZeRO", False), ("JAX", True)],
                         [("ZeRO, FSDP2", True)]]),
            ("Beyond one\nmachine", [[("PyTorch", True)], [("JAX", True)],
                                     [("PyTorch", True)]]),
        ],
        "appendix": ("Appendix", "glossary and API, when you need them"),
    },
    "zh": {
        "titles": ("只用\nPyTorch", "只用\nJAX", "工作中要用\nDDP和FSDP"),
        "legend": ("细读", "略读"),
        "rows": [
            ("设备", [[("PyTorch", True)], [("JAX", True)], [("PyTorch", False)]]),
            ("从零开始实现", [[("PyTorch", True)], [("JAX", True)], [("PyTorch", True)]]),
            ("简洁实现", [[("PyTorch", True)], [("JAX", True)], [("PyTorch", True)]]),
            ("通信", [[("4节", True)], [("全归约算法", False), ("JAX", True)],
                    [("全归约算法", True)]]),
            ("深入DDP", [[("5节", True)], [("JAX", True)], [("5节", True)]]),
            ("分片数据并行", [[("ZeRO、FSDP2", True)], [("ZeRO", False), ("JAX", True)],
                         [("ZeRO、FSDP2", True)]]),
            ("走出单台机器", [[("PyTorch", True)], [("JAX", True)], [("PyTorch", True)]]),
        ],
        "appendix": ("附录", "词汇表和API参考，随用随查"),
    },
}


def cjk_sans() -> str:
    """Noto Sans CJK SC for Chinese labels, registered from the system's font files
    (matplotlib's font cache may predate them); stops when it is not installed."""
    from matplotlib import font_manager
    name = "Noto Sans CJK SC"
    if not any(f.name == name for f in font_manager.fontManager.ttflist):
        for file in font_manager.findSystemFonts():
            if "NotoSansCJK" in Path(file).name:
                font_manager.fontManager.addfont(file)
    if not any(f.name == name for f in font_manager.fontManager.ttflist):
        raise SystemExit(f"the Chinese figures need {name} (Debian: fonts-noto-cjk)")
    return name


def reading_paths(path: Path, lang: str) -> None:
    """The chapters in order and three reading paths through their pages (the preface)."""
    text = READING_PATHS[lang]
    rows = text["rows"]
    colours = [("#fbd3c4", "#d9531e"), ("#cfe0f3", "#2f6db5"), ("#d4ecd0", "#3a8a3a")]
    width, row_h, top = 4.8, 0.6, 0.75              # inches: narrow, for phones
    height = top + (len(rows) + 1) * row_h + 0.4
    fonts = [cjk_sans(), "DejaVu Sans"] if lang == "zh" else ["DejaVu Sans"]
    with rc_context({"font.family": fonts}):
        fig = Figure(figsize=(width, height))
        ax = fig.add_axes((0, 0, 1, 1))
        ax.set_xlim(0, width)
        ax.set_ylim(0, height)
        ax.axis("off")
        ch_x, ch_w = 0.72, 1.34                      # the chapter column: centre, width
        cols = [1.52 + (i + 0.5) * 1.08 for i in range(3)]

        def chip(x, y, w, h, label, fc, ec, solid, size=11):
            ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h,
                                        boxstyle="round,pad=0.02,rounding_size=0.08",
                                        fc=fc if solid else "#ffffff", ec=ec, lw=1.2,
                                        ls="-" if solid else (0, (3, 2)), zorder=3))
            ax.text(x, y, label, ha="center", va="center", fontsize=size, zorder=4)

        def down(y_from, y_to):
            ax.add_patch(FancyArrowPatch((ch_x, y_from), (ch_x, y_to), arrowstyle="-|>",
                                         mutation_scale=9, color="#888888", lw=1,
                                         shrinkA=0, shrinkB=0))

        for x, title, (_, ec) in zip(cols, text["titles"], colours):
            ax.text(x, height - top / 2 + 0.02, title, ha="center", va="center",
                    fontsize=11, weight="bold", color=ec, linespacing=1.2)
        ys = [height - top - (i + 0.5) * row_h for i in range(len(rows) + 1)]
        for x, (_, ec) in zip(cols, colours):        # each path, top to bottom
            ax.plot([x, x], [ys[0], ys[-2]], color=ec, lw=2.5, alpha=0.5, zorder=1)
        for i, ((chapter, cells), y) in enumerate(zip(rows, ys)):
            chip(ch_x, y, ch_w, row_h - 0.14, chapter, "#eeeeee", "#888888", True, 11)
            down(y - row_h / 2 + 0.08, ys[i + 1] + row_h / 2 - 0.08)
            for x, pages, (fc, ec) in zip(cols, cells, colours):
                h = (row_h - 0.2) / len(pages)
                for k, (label, read) in enumerate(pages):
                    chip(x, y + (row_h - 0.2) / 2 - (k + 0.5) * h, 1.0, h - 0.05, label,
                         fc, ec, read, 10 if len(pages) > 1 or len(label) > 9 else 11)
        name, what = text["appendix"]
        chip(ch_x, ys[-1], ch_w, row_h - 0.14, name, "#eeeeee", "#888888", True, 11)
        ax.text(cols[1], ys[-1], what, ha="center", va="center", fontsize=10.5,
                color="#444444")
        for k, (label, solid) in enumerate(zip(text["legend"], (True, False))):
            lx = cols[0] - 0.25 + k * 1.3
            chip(lx, 0.25, 0.42, 0.24, "", "#dddddd", "#666666", solid)
            ax.text(lx + 0.32, 0.25, label, va="center", fontsize=11)
        save(fig, path)


# Shades of a chunk by how many ranks' values it sums: 1 (own) ... 4 (complete, N = 4).
SUMS = {1: G_OWN, 2: "#fbb073", 3: "#f39444", 4: G_MEAN}


def ring_allreduce(path: Path) -> None:
    """The ring allreduce on 4 devices, one row per step: each device's 4 chunks, the number
    in a chunk is how many devices' values it sums; arrows: the chunks sent in that step."""
    n = 4
    held = [[{r} for _ in range(n)] for r in range(n)]      # held[r][j]: who chunk j sums
    states, sends = [[[len(c) for c in row] for row in held]], []
    for phase in ("rs", "ag"):
        for s in range(n - 1):
            sent = [(r - s) % n if phase == "rs" else (r + 1 - s) % n for r in range(n)]
            new = [[set(c) for c in row] for row in held]
            for r, j in enumerate(sent):
                dst = (r + 1) % n
                new[dst][j] = held[dst][j] | held[r][j] if phase == "rs" else set(held[r][j])
            held = new
            sends.append(sent)
            states.append([[len(c) for c in row] for row in held])
    fig = Figure(figsize=(6.4, 5.95))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 6.4)
    ax.set_ylim(0.45, 6.4)
    ax.axis("off")
    x0, cell, piece, bar_h = 1.45, 1.25, 0.24, 0.34
    for r in range(n):
        ax.text(x0 + r * cell + 2 * piece, 6.15, f"dev {r}", ha="center", va="center",
                fontsize=10, family="monospace", color="#555555")
        for j in range(n):
            ax.text(x0 + r * cell + (j + 0.5) * piece, 5.9, str(j), ha="center",
                    va="center", fontsize=10, color="#888888")
    tops = [5.45 - k * 0.78 for k in range(len(states))]
    for k, (state, top) in enumerate(zip(states, tops)):
        for r in range(n):
            for j in range(n):
                x = x0 + r * cell + j * piece
                ax.add_patch(Rectangle((x, top - bar_h / 2), piece, bar_h,
                                       fc=SUMS[state[r][j]], ec=EDGE, lw=0.8))
                ax.text(x + piece / 2, top, str(state[r][j]), ha="center", va="center",
                        fontsize=10, color="#ffffff" if state[r][j] == n else "#333333")
        if k == 0:
            ax.text(0.1, top, "start", va="center", fontsize=10, family="monospace")
            continue
        ax.text(1.2, top, str((k - 1) % (n - 1) + 1), va="center", ha="right", fontsize=10)
        for r, j in enumerate(sends[k - 1]):                  # sent by r, received by r + 1
            xa = x0 + r * cell + (j + 0.5) * piece
            ya, yb = tops[k - 1] - bar_h / 2, top + bar_h / 2
            if r < n - 1:
                ax.add_patch(FancyArrowPatch((xa, ya), (xa + cell, yb), arrowstyle="-|>",
                                             mutation_scale=9, color="#333333", lw=1.0,
                                             shrinkA=1, shrinkB=1))
            else:                                             # dev 3 -> dev 0: round the ring
                ax.add_patch(FancyArrowPatch((xa, ya), (6.38, (ya + yb) / 2), arrowstyle="-",
                                             color="#333333", lw=1.0, ls=(0, (2, 2))))
                xb = x0 + (j + 0.5) * piece
                ax.add_patch(FancyArrowPatch((x0 - 0.15, (ya + yb) / 2), (xb, yb),
                                             arrowstyle="-|>", mutation_scale=9,
                                             color="#333333", lw=1.0, ls=(0, (2, 2)),
                                             shrinkA=0, shrinkB=1))
    for name, rows in (("reduce-scatter", tops[1:4]), ("all-gather", tops[4:7])):
        ax.plot([1.28, 1.28], [rows[0] + 0.2, rows[-1] - 0.2], color="#888888", lw=1)
        ax.text(0.1, (rows[0] + rows[-1]) / 2, name.replace("-", "-\n"), va="center",
                fontsize=10, family="monospace", weight="bold")
    save(fig, path)


def ddp_ladder(path: Path) -> None:
    """The four hand-written wrappers of the inside-DDP chapter on two lanes each: when the
    gradients are ready (backward) and when they are summed (allreduce)."""
    fig = Figure(figsize=(6.4, 5.3))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 6.4)
    ax.set_ylim(0, 5.3)
    ax.axis("off")
    BW, AR = "#74c476", "#f4a6a6"
    t0, grad = 1.5, 0.28                       # start of backward; one gradient's backward
    ready = [t0 + (i + 1) * grad for i in range(8)]   # 8 gradients, last layer's first
    end = ready[-1]
    small, lat = 0.12, 0.2                     # one parameter's allreduce: bytes + latency
    rows = [("(a) per-parameter", "after"), ("(b) flat", "flat"),
            ("(c) overlap", "hooks"), ("(d) bucketed", "buckets")]
    for k, (name, kind) in enumerate(rows):
        top = 5.05 - k * 1.2
        ax.text(0.1, top, name, va="center", fontsize=10, family="monospace", weight="bold")
        yb, ya = top - 0.38, top - 0.78
        ax.text(1.4, yb, "backward", ha="right", va="center", fontsize=10,
                family="monospace", color="#555555")
        ax.text(1.4, ya, "allreduce", ha="right", va="center", fontsize=10,
                family="monospace", color="#555555")
        for i in range(8):
            ax.add_patch(Rectangle((t0 + i * grad + 0.01, yb - 0.14), grad - 0.02, 0.28,
                                   fc=BW, ec=EDGE, lw=0.8))
        if kind == "after":
            blocks = [(end + i * (small + lat), small + lat) for i in range(8)]
        elif kind == "flat":
            blocks = [(end, 8 * small + lat)]
        elif kind == "hooks":                  # launched when ready, queued behind the last
            blocks = []
            for r in ready:
                blocks.append((max(r, blocks[-1][0] + blocks[-1][1]) if blocks else r,
                               small + lat))
        else:
            blocks = [(ready[2], 3 * small + lat), (ready[5], 3 * small + lat),
                      (ready[7], 2 * small + lat)]
        for a, w in blocks:
            ax.add_patch(Rectangle((a + 0.01, ya - 0.14), w - 0.02, 0.28, fc=AR, ec=EDGE,
                                   lw=0.8))
        if kind in ("hooks", "buckets"):
            launched = ready if kind == "hooks" else [ready[2], ready[5], ready[7]]
            for a in launched:
                ax.add_patch(FancyArrowPatch((a, yb - 0.15), (a, ya + 0.15),
                                             arrowstyle="-|>", mutation_scale=8,
                                             color="#333333", lw=0.8, shrinkA=0, shrinkB=0))
        done = max(a + w for a, w in blocks)
        ax.plot([done, done], [yb + 0.2, ya - 0.2], color="#333333", lw=1.2, ls=":")
    ax.add_patch(FancyArrowPatch((t0, 0.2), (6.3, 0.2), arrowstyle="-|>",
                                 mutation_scale=12, color="#333333", lw=1.0))
    ax.text(6.3, 0.35, "$t$", ha="right", va="center", fontsize=12)
    save(fig, path)


def multi_node(path: Path) -> None:
    """2 nodes of 4 GPUs: each process's rank and local_rank, and what each holds after
    the three phases of a hierarchical allreduce (slice g is local rank g's)."""
    nodes, gpus = 2, 4
    fig = Figure(figsize=(6.4, 4.6))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 6.4)
    ax.set_ylim(0, 4.6)
    ax.axis("off")
    NODE = "#fbb073"
    legend = [(G_OWN, "$\\mathbf{g}^{(r)}$"), (NODE, "$\\sum_{r \\in \\mathrm{node}}$"),
              (G_MEAN, "$\\sum_{r}$")]
    for i, (c, text) in enumerate(legend):
        lx = 2.35 + i * 1.35
        ax.add_patch(Rectangle((lx, 4.3), 0.3, 0.2, fc=c, ec=EDGE, lw=0.8))
        ax.text(lx + 0.4, 4.4, text, va="center", fontsize=11)
    phases = ["start", "1 reduce-\nscatter", "2 allreduce", "3 all-\ngather"]
    x0, col, length, bar_h, row_h = 2.3, 1.03, 0.88, 0.2, 0.36
    for p, name in enumerate(phases):
        ax.text(x0 + p * col + length / 2, 3.92, name, ha="center", va="center",
                fontsize=10, family="monospace", weight="bold", linespacing=1.0)

    def colours(p, g):
        if p == 0:
            return [G_OWN] * gpus
        if p == 1:
            return [NODE if i == g else None for i in range(gpus)]
        if p == 2:
            return [G_MEAN if i == g else None for i in range(gpus)]
        return [G_MEAN] * gpus

    ys = {}
    for node in range(nodes):
        top = 3.55 - node * (gpus * row_h + 0.35)
        ax.add_patch(FancyBboxPatch((0.08, top - gpus * row_h + 0.02), 6.24,
                                    gpus * row_h - 0.04, boxstyle="round,pad=0.04",
                                    fc="#f6f6f6", ec="#999999", lw=0.8, zorder=0))
        ax.text(0.16, top - gpus * row_h / 2, f"node {node}", va="center", rotation=90,
                fontsize=10, family="monospace", color="#555555")
        for g in range(gpus):
            y = top - (g + 0.5) * row_h
            ys[node, g] = y
            ax.text(0.42, y, f"rank {node * gpus + g}", va="center", fontsize=10,
                    family="monospace")
            ax.text(1.2, y, f"local_rank {g}", va="center", fontsize=10,
                    family="monospace", color="#555555")
            for p in range(len(phases)):
                shard_bar(ax, x0 + p * col, y - bar_h / 2, length, bar_h, colours(p, g))
    for g in range(gpus):                      # phase 2: slice g between the nodes
        x = x0 + 2 * col + (g + 0.5) * length / gpus
        ax.add_patch(FancyArrowPatch((x, ys[0, g] - bar_h / 2), (x, ys[1, g] + bar_h / 2),
                                     arrowstyle="<|-|>", mutation_scale=7,
                                     color="#333333", lw=0.9, shrinkA=0, shrinkB=0,
                                     zorder=3))
    save(fig, path)


FIGURES = {"data-parallel-step.svg": data_parallel_step, "zero-memory.svg": zero_memory,
           "zero1-step.svg": zero1_step, "zero3-timeline.svg": zero3_timeline,
           "ring-allreduce.svg": ring_allreduce, "ddp-ladder.svg": ddp_ladder,
           "multi-node.svg": multi_node,
           "reading-paths.en.svg": lambda path: reading_paths(path, "en"),
           "reading-paths.zh.svg": lambda path: reading_paths(path, "zh")}


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, draw in FIGURES.items():
        draw(OUT / name)
        print(f"wrote {OUT / name}")

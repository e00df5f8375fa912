"""Where the book's sources and stored runs are: the tocs, which toc entries are
notebooks, the code of a cell without its comments, and the path of a stored run.

The leaf of ``tools/``: ``notebooks.py`` (the generated ``.ipynb``), ``runs.py`` (stored
outputs and their key), ``build_book.py`` and the Sphinx extension import it; it imports
none of them.
"""
from __future__ import annotations

import io
import tokenize
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent
EDITIONS = {"en": ("_config.yml", "_toc.yml"), "zh": ("_config.zh.yml", "_toc.zh.yml")}
STORE = ROOT / "outputs"                  # outputs/<scale>/<slug>/<name>.ipynb


def toc_entries(lang: str) -> list[str]:
    """Every file of an edition's toc, in reading order (paths without suffix)."""
    toc = yaml.safe_load((ROOT / EDITIONS[lang][1]).read_text(encoding="utf8"))
    entries = [toc["root"]]

    def walk(items):
        for item in items or []:
            if "file" in item:
                entries.append(item["file"])
            walk(item.get("sections"))
            walk(item.get("chapters"))
            for part in item.get("parts") or []:
                walk(part.get("chapters"))

    walk(toc.get("chapters"))
    for part in toc.get("parts") or []:
        walk(part.get("chapters"))
    return entries


def is_notebook(path: Path) -> bool:
    head = path.read_text(encoding="utf8")[:400]
    return head.startswith("---") and "jupytext:" in head


def strip_comments(code: str) -> str:
    """Code without comments and trailing spaces (what the two editions must share)."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(code).readline)
              if t.type != tokenize.COMMENT]
    text = tokenize.untokenize(tokens)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


def notebook_entries(lang: str) -> list[str]:
    return [e for e in toc_entries(lang) if is_notebook(ROOT / f"{e}.md")]


def stored_path(entry: str, scale: str, store: Path = STORE) -> Path:
    """``chapters/en/concise/jax`` → ``<store>/<scale>/concise/jax.ipynb``."""
    parts = Path(entry).parts
    assert parts[:2] == ("chapters", "en"), f"only English notebooks are stored: {entry}"
    return store.joinpath(scale, *parts[2:]).with_suffix(".ipynb")


def load(path: Path) -> nbformat.NotebookNode | None:
    return nbformat.read(path, as_version=4) if path.is_file() else None

"""Helpers for the book-level tests: tocs, notebooks, code cells."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent

# The book's tools already read the tocs (tools/notebooks.py); the tests use the same code.
sys.path.insert(0, str(ROOT / "tools"))
from notebooks import (  # noqa: E402,F401
    is_notebook, strip_comments, toc_entries as toc_files, with_outputs_of)


def source(entry: str) -> Path:
    return ROOT / f"{entry}.md"


def notebooks(lang: str) -> list[Path]:
    return [source(e) for e in toc_files(lang) if is_notebook(source(e))]


def code_cells(path: Path) -> list[str]:
    nb = jupytext.read(path)
    return [strip_comments(c.source) for c in nb.cells if c.cell_type == "code"]


LABEL = re.compile(r"^\(([\w-]+)\)=\s*$", re.M)


def labels(path: Path) -> list[str]:
    return LABEL.findall(path.read_text(encoding="utf8"))

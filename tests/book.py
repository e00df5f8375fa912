"""Helpers for the book-level tests: tocs, notebooks, code cells."""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import jupytext
import yaml

ROOT = Path(__file__).resolve().parent.parent
TOCS = {"en": ROOT / "_toc.yml", "zh": ROOT / "_toc.zh.yml"}


def toc_files(lang: str) -> list[str]:
    """Every file of an edition's toc, in reading order (paths without suffix)."""
    toc = yaml.safe_load(TOCS[lang].read_text(encoding="utf8"))
    files = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections"))
            walk(entry.get("chapters"))
            for part in entry.get("parts", []) or []:
                walk(part.get("chapters"))

    walk(toc.get("chapters"))
    for part in toc.get("parts", []) or []:
        walk(part.get("chapters"))
    return files


def source(entry: str) -> Path:
    return ROOT / f"{entry}.md"


def is_notebook(path: Path) -> bool:
    head = path.read_text(encoding="utf8")[:400]
    return head.startswith("---") and "jupytext:" in head


def notebooks(lang: str) -> list[Path]:
    return [source(e) for e in toc_files(lang) if is_notebook(source(e))]


def strip_comments(code: str) -> str:
    """Code without comments and trailing spaces (what the two editions must share)."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(code).readline)
              if t.type != tokenize.COMMENT]
    text = tokenize.untokenize(tokens)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


def code_cells(path: Path) -> list[str]:
    nb = jupytext.read(path)
    return [strip_comments(c.source) for c in nb.cells if c.cell_type == "code"]


LABEL = re.compile(r"^\(([\w-]+)\)=\s*$", re.M)


def labels(path: Path) -> list[str]:
    return LABEL.findall(path.read_text(encoding="utf8"))

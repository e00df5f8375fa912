"""Numbers in the prose come from the run (glued) or name their source.

The prose of a checked chapter, in both editions, may show a decimal number or a
percentage only inside math, code, a ``{glue:text}`` role (the run's value), as a setting
that appears in the page's own code cells (a learning rate the reader can see in the
code), or when it is in ``ALLOWED`` below, each entry with its source.

Every chapter is checked; the preface and the appendix (generated pages) state no run.
"""
from __future__ import annotations

import re

import jupytext
import pytest

from book import ROOT, is_notebook

CHECKED = ["devices", "from-scratch", "concise", "inside-ddp", "sharded", "communication",
           "multi-machine"]

# (page, number) -> where it comes from. Keep it short: a number from a run is glued.
ALLOWED = {
    ("communication/allreduce", "2.4"): "NCCL release 2.4 introduced its double binary trees",
    ("communication/allreduce", "25.6"): "ResNet-50's parameters (millions), torchvision",
    ("communication/allreduce", "44.5"): "ResNet-101's parameters (millions), torchvision",
    ("communication/allreduce", "3.35"): "NVIDIA's H100 SXM data sheet: HBM3 bandwidth (TB/s)",
    ("communication/compression", "3.5"): "(0.1 - 0.03) / 0.02 standard deviations, from "
                                          "the numbers the sentence gives",
    ("communication/parameter-server", "0.1"): "chance on 10 classes",
    ("communication/parameter-server", "0.4"): "exercise 3: learning rates to try",
    ("communication/parameter-server", "0.05"): "exercise 3: learning rates to try",
    ("concise/jax", "0.8"): "JAX 0.8.0's changelog: pmap reimplemented on jit + shard_map",
    ("concise/jax", "0.10"): "the JAX release requirements.txt pins",
    ("concise/pytorch", "13.6"): "d2l-en release 1.0.3, section 13.6 (PyTorch)",
    ("inside-ddp/pytorch", "2.13"): "the torch release requirements.txt pins, whose "
                                    "reducer.cpp the list of what (d) leaves out describes",
    ("multi-machine/pytorch", "25.6"): "ResNet-50's parameters (millions), torchvision",
    ("from-scratch/pytorch", "0.8"): "exercise 1: a learning rate to try",
    ("from-scratch/jax", "0.8"): "exercise 1: a learning rate to try",
    ("sharded/fsdp", "2.9"): "dpbook/versions.yml: the torch release this page needs",
    ("sharded/overlap", "2.9"): "dpbook/versions.yml: the torch release FSDP2 needs",
    ("sharded/overlap", "0.5"): "LeNet's 129,068 float32 gradients: 516 KB",
    ("sharded/fsdp", "2.8"): "dpbook/versions.yml: the torch release whose gloo sums",
}

# A decimal number (1.5, 0.02) or a percentage (12%, 99.9 %), not part of a longer token
# (ASCII only: in Chinese text a number follows a character without a space, 均值0.286).
NUMBER = re.compile(r"(?<![A-Za-z0-9_.])(?:\d+(?:\.\d+)?\s?%|\d+\.\d+)(?!\d|\.\d)")


def prose_and_code(path) -> tuple[str, str]:
    """A page's prose with math, code, directives and roles removed, and its code cells."""
    if is_notebook(path):
        nb = jupytext.read(path)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    else:
        text, code = path.read_text(encoding="utf8"), ""
    text = re.sub(r"^(```+|:::+).*?^\1\s*$", " ", text, flags=re.M | re.S)  # directives
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)                     # math
    text = re.sub(r"\$[^$\n]+\$", " ", text)
    text = re.sub(r"\{[\w:-]+\}`[^`]*`", " ", text)          # roles: glue, ref, …
    text = re.sub(r"`[^`]*`", " ", text)                      # inline code
    text = re.sub(r"\]\([^)]*\)", "]", text)                  # link targets
    return text, code


def bare_numbers(path) -> list[str]:
    """The numbers of a page's prose that are neither glued, nor code, nor allowed."""
    text, code = prose_and_code(path)
    page = path.relative_to(path.parents[1]).with_suffix("").as_posix()
    found = []
    for m in NUMBER.finditer(text):
        number = m.group(0).rstrip("% ").strip()
        in_code = re.search(rf"(?<![\w.]){re.escape(number)}(?!\d)", code)
        if not in_code and (page, number) not in ALLOWED:
            context = " ".join(text[max(0, m.start() - 50):m.end() + 20].split())
            found.append(f"{m.group(0)!r} in …{context}…")
    return found


PAGES = [p for chapter in CHECKED for lang in ("en", "zh")
         for p in sorted((ROOT / "chapters" / lang / chapter).glob("*.md"))]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_numbers_are_glued_or_sourced(path):
    found = bare_numbers(path)
    assert not found, ("glue these from the run (dpbook.glue + {glue:text}), or name the "
                       "source in tests/test_prose_numbers.py:\n" + "\n".join(found))


def test_a_bare_number_is_caught(tmp_path):
    page = tmp_path / "communication" / "page.md"
    page.parent.mkdir()
    page.write_text("The 2-GPU run reaches 0.73 and keeps 95% of its speed; 精度为0.88。"
                    "{glue:text}`acc:.2f` and $0.5$ and `0.25` are fine.\n", encoding="utf8")
    assert [f.split()[0] for f in bare_numbers(page)] == ["'0.73'", "'95%'", "'0.88'"]


def test_allowlist_entries_are_still_needed():
    """An entry whose number left the prose goes too (the list stays short)."""
    used = set()
    for path in PAGES:
        text, _ = prose_and_code(path)
        page = path.relative_to(path.parents[1]).with_suffix("").as_posix()
        used |= {(page, m.group(0).rstrip("% ").strip()) for m in NUMBER.finditer(text)}
    assert set(ALLOWED) <= used, set(ALLOWED) - used

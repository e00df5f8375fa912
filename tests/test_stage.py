"""What the reader sees of a notebook page (issue 30): the code that teaches, in a column
that does not scroll sideways, and not the machinery behind the guarantees.

Cells that only feed the page (glue, widget data) or guard the stored run are tagged
``remove-cell``: they still run, and the notebook still fails when a claim stops holding,
but the site does not show them. The built pages are checked in ``test_site.py``.
"""
from __future__ import annotations

import re
import unicodedata

import jupytext
import pytest

from book import ROOT, notebooks

#: A code cell's lines fit this many columns: what the site's code column holds at
#: 1280 px (tools/static/dpbook-site.css sizes the code font for it).
WIDTH = 80
HIDDEN = {"remove-cell", "remove-input"}
PAGES = notebooks("en") + notebooks("zh")


def columns(line: str) -> int:
    """Width in a monospace column: CJK characters take two."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in line)


def visible_code(path) -> list[tuple[int, str]]:
    """(cell number, source) of the code cells the site shows."""
    cells = [c for c in jupytext.read(path).cells if c.cell_type == "code"]
    return [(i, c.source) for i, c in enumerate(cells)
            if not HIDDEN & set(c.metadata.get("tags", []))]


def _id(path):
    return str(path.relative_to(ROOT / "chapters"))


def test_columns_counts_cjk_as_two():
    assert columns("ab") == 2 and columns("全归约") == 6 and columns("# 全x") == 5


@pytest.mark.parametrize("path", PAGES, ids=_id)
def test_no_glue_in_view(path):
    """glue() feeds the prose; the reader sees the number in the sentence, not the call."""
    shown = [(i, line) for i, src in visible_code(path) for line in src.splitlines()
             if re.match(r"\s*glue\(", line)]
    assert not shown, f"glue in visible cells (move it to a remove-cell cell): {shown}"


@pytest.mark.parametrize("path", PAGES, ids=_id)
def test_code_fits_the_column(path):
    long = [(i, columns(line), line) for i, src in visible_code(path)
            for line in src.splitlines() if columns(line) > WIDTH]
    assert not long, f"lines over {WIDTH} columns: {long}"


@pytest.mark.parametrize("path", PAGES, ids=_id)
def test_the_hardware_line_is_printed_in_view_once(path):
    """The header prints it; a later cell shows it only where its point is where it ran
    (then it is printed by the demo, not by a print of the page's own)."""
    cells = [i for i, src in visible_code(path)
             if re.search(r"print\([^\n]*hardware", src)]
    assert len(cells) <= 1, f"cells printing the hardware line: {cells}"


@pytest.mark.parametrize("path", sorted((ROOT / "chapters/zh").rglob("*.md")), ids=_id)
def test_chinese_cross_references_read_as_numbers(path):
    """A Chinese cross-reference to a chapter or section is {numref} (第3章, 2.1节), not a
    title spliced into the sentence as {ref} would put it ("用PyTorch从零开始实现ZeRO亲手
    写出了……"); {ref} stays only with its own text ({ref}`词汇表 <sec-glossary>`)."""
    bare = re.findall(r"\{ref\}`[\w-]+`", path.read_text(encoding="utf8"))
    assert not bare, bare


def test_cjk_lines_are_joined_in_text_but_not_across_code():
    """tools/dpbook_site.join_cjk_lines: a soft break or a space between CJK characters
    goes; code and math stay whole and are not joined across; U+3000 stays."""
    from types import SimpleNamespace

    from docutils import nodes

    import dpbook_site
    para = nodes.paragraph("", "", nodes.Text("数据。"), nodes.Text("\n"), nodes.Text("这就是"),
                           nodes.strong("", "小结。"), nodes.Text(" 这一节，使用 "),
                           nodes.literal("", "torch"), nodes.Text(" 来\u3000\u3000做"))
    doc = nodes.document(None, None)
    doc += nodes.section("", para)
    app = SimpleNamespace(config=SimpleNamespace(language="zh_CN"))
    dpbook_site.join_cjk_lines(app, doc, "page")
    assert para.astext() == "数据。这就是小结。这一节，使用 torch 来\u3000\u3000做"
    english = nodes.paragraph("", "", nodes.Text("数据。"), nodes.Text("\n"), nodes.Text("这"))
    doc2 = nodes.document(None, None)
    doc2 += english
    dpbook_site.join_cjk_lines(SimpleNamespace(config=SimpleNamespace(language="en")),
                               doc2, "page")
    assert english.astext() == "数据。\n这"             # the English edition is left alone

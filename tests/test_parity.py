"""The two editions stay in step: same files, same order, same labels, same code."""
from __future__ import annotations

import pytest

from book import ROOT, code_cells, labels, notebooks, source, strip_comments, toc_files


def test_tocs_list_the_same_files_in_the_same_order():
    en = toc_files("en")
    zh = toc_files("zh")
    assert [f.replace("chapters/en/", "chapters/zh/", 1) for f in en] == zh
    assert all(f.startswith("chapters/en/") for f in en)


def test_every_toc_file_exists():
    for lang in ("en", "zh"):
        for entry in toc_files(lang):
            assert source(entry).is_file(), f"{entry}.md is in the {lang} toc but missing"


def test_chapter_folders_have_the_same_files():
    en = sorted(p.relative_to(ROOT / "chapters/en") for p in (ROOT / "chapters/en").rglob("*")
                if p.is_file())
    zh = sorted(p.relative_to(ROOT / "chapters/zh") for p in (ROOT / "chapters/zh").rglob("*")
                if p.is_file())
    assert en == zh


@pytest.mark.parametrize("entry", toc_files("en"))
def test_same_labels(entry):
    en = source(entry)
    zh = source(entry.replace("chapters/en/", "chapters/zh/", 1))
    assert labels(en) == labels(zh)


@pytest.mark.parametrize("en", notebooks("en"), ids=lambda p: str(p.relative_to(ROOT)))
def test_same_code_cells(en):
    zh = ROOT / "chapters/zh" / en.relative_to(ROOT / "chapters/en")
    en_cells, zh_cells = code_cells(en), code_cells(zh)
    assert len(en_cells) == len(zh_cells), "the editions have different numbers of code cells"
    for i, (a, b) in enumerate(zip(en_cells, zh_cells)):
        assert a == b, f"code cell {i} differs between {en.name} editions:\n{a}\n---\n{b}"


def test_strip_comments_keeps_strings():
    code = "x = '# not a comment'  # a comment\n# only a comment\ny = 1\n"
    assert strip_comments(code) == "x = '# not a comment'\ny = 1"


def test_every_literalinclude_names_an_object_that_exists():
    """A ``{literalinclude}`` with ``:pyobject:`` points at a top-level function or class, or
    a method of one (``Class.method``), of an existing file (a moved helper fails here in a
    second, not in the site build)."""
    import ast
    import re
    wrong = []
    for lang in ("en", "zh"):
        for md in sorted((ROOT / "chapters" / lang).rglob("*.md")):
            text = md.read_text(encoding="utf8")
            for m in re.finditer(r"```\{literalinclude\} (\S+)\n(?::\w+:.*\n)*?:pyobject: (\S+)", text):
                path = (md.parent / m.group(1)).resolve()
                body = ast.parse(path.read_text()).body if path.is_file() else []
                *outer, last = m.group(2).split(".")
                for part in outer:                   # Class.method: look inside the class
                    body = next((n.body for n in body
                                 if isinstance(n, ast.ClassDef) and n.name == part), [])
                names = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                if last not in names:
                    wrong.append(f"{md.relative_to(ROOT)}: {m.group(1)} :pyobject: {m.group(2)}")
    assert not wrong, wrong

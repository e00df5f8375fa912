"""Both editions build with warnings as errors, into one site."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from book import ROOT, toc_files


@pytest.fixture(scope="module")
def site(book_out):
    out = book_out
    result = subprocess.run([sys.executable, str(ROOT / "tools/build_book.py"),
                             "--scale", "quick", "-W", "--out", str(out)],
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, (result.stdout[-4000:] + result.stderr[-4000:])
    assert f"open {out / 'site' / 'index.html'}" in result.stdout
    return out / "site"


def test_site_has_both_editions(site):
    for lang, prefix in (("en", site), ("zh", site / "zh")):
        assert (prefix / "index.html").is_file()
        for entry in toc_files(lang):
            assert (prefix / f"{entry}.html").is_file(), f"{entry}.html missing"


def test_chinese_edition_is_chinese(site):
    page = (site / "zh/chapters/zh/index.html").read_text(encoding="utf8")
    assert 'lang="zh-CN"' in page and "动手学数据并行" in page
    text = (site / "zh/searchindex.js").read_text(encoding="utf8")
    index = json.loads(text[text.index("(") + 1: text.rindex(")")])
    assert {"数据", "并行", "设备"} <= set(index["terms"])   # words cut by jieba
    english = (site / "chapters/en/index.html").read_text(encoding="utf8")
    assert 'lang="en"' in english


def test_executed_outputs_are_on_the_site(site):
    page = (site / "chapters/en/devices/pytorch.html").read_text(encoding="utf8")
    assert "hardware | " in page and "scale: quick" in page
    assert list((site / "_images").glob("*.svg")), "the Animator's figures are missing"

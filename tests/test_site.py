"""Both editions build with warnings as errors, into one site; the site's own features
(language switch, Colab and download links, provenance, glossary, API reference) work,
and every internal link and image resolves. tests/test_site_browser.py looks at it in Chromium.
"""
from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from book import ROOT, is_notebook, source, toc_files

import notebooks  # noqa: E402  (tools/notebooks.py, on sys.path through book.py)
import runs  # noqa: E402  (tools/runs.py)

pytestmark = pytest.mark.site     # builds or reads the site (make test-fast skips it)

PREFIX = {"en": "", "zh": "zh/"}


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
    # the book's own terms are kept whole (a jieba dictionary made from glossary.yml)
    def pages(term: str) -> set[str]:     # in the text or in a title
        found = set()
        for where in (index["terms"], index["titleterms"]):
            docs = where.get(term, [])
            found |= {index["docnames"][i] for i in ([docs] if isinstance(docs, int) else docs)}
        return found
    assert "chapters/zh/communication/allreduce" in pages("全归约")
    assert "chapters/zh/inside-ddp/accumulation" in pages("梯度累加")
    english = (site / "chapters/en/index.html").read_text(encoding="utf8")
    assert 'lang="en"' in english
    # the dropdowns (package code on the concise page) say "click to show" in Chinese
    concise = (site / "zh/chapters/zh/concise/pytorch.html").read_text(encoding="utf8")
    assert "toggleHintShow = '点击展开'" in concise and 'dropdown' in concise


def test_executed_outputs_are_on_the_site(site):
    page = (site / "chapters/en/devices/pytorch.html").read_text(encoding="utf8")
    assert "hardware | " in page and "scale: quick" in page
    assert list((site / "_images").glob("*.svg")), "the Animator's figures are missing"


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("href", "src"):
            if tag in ("a", "img", "link", "script") and attrs.get(name):
                self.links.append(attrs[name])


def test_every_internal_link_and_image_resolves(site):
    pages = sorted(p for p in site.rglob("*.html")       # _static/ holds theme templates
                   if "_static" not in p.relative_to(site).parts)
    assert len(pages) > 20
    broken = []
    for page in pages:
        parser = _Links()
        parser.feed(page.read_text(encoding="utf8"))
        for link in parser.links:
            url = urlsplit(link)
            if url.scheme or url.netloc or link.startswith(("#", "mailto:", "data:")):
                continue
            target = (page.parent / unquote(url.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)} -> {link}")
    assert not broken, "broken links:\n" + "\n".join(broken[:30])


def _page(site: Path, lang: str, entry: str) -> str:
    return (site / f"{PREFIX[lang]}{entry}.html").read_text(encoding="utf8")


def test_every_page_links_to_the_same_page_in_the_other_edition(site):
    for lang, other in (("en", "zh"), ("zh", "en")):
        for entry in toc_files(lang):
            page = site / f"{PREFIX[lang]}{entry}.html"
            m = re.search(r'class="dpbook-lang-switch" href="([^"]+)"', page.read_text("utf8"))
            assert m, f"{entry}: no language switch"
            target = (page.parent / m[1]).resolve()
            expected = site / f"{PREFIX[other]}{entry.replace(f'/{lang}/', f'/{other}/')}.html"
            assert target == expected.resolve(), (entry, m[1])


def test_notebook_pages_offer_colab_download_and_provenance(site, book_out):
    for lang in ("en", "zh"):
        for entry in toc_files(lang):
            text = _page(site, lang, entry)
            if not is_notebook(source(entry)):
                assert "dpbook-colab" not in text and "dpbook-provenance" not in text
                continue
            colab = re.search(r'class="dpbook-colab" href="([^"]+)"', text)[1]
            assert colab == notebooks.colab_url(entry, lang)
            assert colab.endswith(f"/blob/main/notebooks/{entry.split('/', 1)[1]}.ipynb")
            link = re.search(r'class="dpbook-download" href="([^"]+)"', text)[1]
            page = site / f"{PREFIX[lang]}{entry}.html"
            downloaded = (page.parent / link).resolve()
            assert downloaded.read_text(encoding="utf8") == \
                notebooks.notebook_path(entry).read_text(encoding="utf8")
            box = re.search(r'<div class="dpbook-provenance">(.*?)</div>', text, re.S)[1]
            # one line from the run's record, under the title, with no JSON in it
            twin = entry.replace(f"/{lang}/", "/en/", 1)
            record = (runs.load(runs.stored_path(twin, "quick", book_out / "outputs"))
                      or runs.load(runs.stored_path(twin, "quick")))
            run = record.metadata["dpbook_run"]
            assert "<b>quick</b>" in box and run["executed"][:10] in box, (entry, box)
            assert html.escape(run["hardware"]["cpu"]) in box, (entry, box)
            assert not re.search(r"[{}\[\]]|&quot;", box), (entry, box)
            assert '</h1><div class="dpbook-bar">' in text, entry     # under the title


def test_glossary_page_lists_every_term_in_both_editions(site):
    terms = yaml.safe_load((ROOT / "glossary.yml").read_text(encoding="utf8"))
    for lang in ("en", "zh"):
        text = html.unescape(_page(site, lang, f"chapters/{lang}/appendix/glossary"))
        text = text.replace("\u2019", "'")          # the theme's typographic apostrophes
        for t in terms:
            for word in (t["en"], t["zh"], t["def_" + lang]):
                assert word in text, (lang, word)
        # entries link to the page that introduces the term (most terms have one)
        entries = text[text.index("dpbook-glossary"):text.index("</article>")]
        links = re.findall(r'href="\.\./[\w\-/]+\.html[^"]*"', entries)
        assert len(links) >= len(terms) * 3 // 4, (lang, len(links))


def test_api_reference_lists_every_module():
    """Every module of the package has its section in both editions' API appendix."""
    import pkgutil
    import dpbook
    modules = {m.name for m in pkgutil.walk_packages(dpbook.__path__, "dpbook.")
               if not m.ispkg}
    for lang in ("en", "zh"):
        text = (ROOT / f"chapters/{lang}/appendix/api.md").read_text(encoding="utf8")
        listed = re.findall(r"^\.\. automodule:: (\S+)$", text, re.M)
        assert set(listed) == modules and len(listed) == len(modules), (lang, listed)
        headings = re.findall(r"^## .*$", text, re.M)
        assert len(headings) == len(set(headings)), (lang, headings)    # each section once


def test_api_reference_documents_the_public_api(site):
    import dpbook
    for lang in ("en", "zh"):
        text = _page(site, lang, f"chapters/{lang}/appendix/api")
        for name in ("dpbook.config.get_scale", "dpbook.tools.Timer", "dpbook.plot.Animator",
                     "dpbook.torch.scratch.allreduce", "dpbook.torch.scratch.train_batch",
                     "dpbook.torch.dist.spawn", "dpbook.torch.ddp.Config",
                     "dpbook.jax.scratch.allreduce", "dpbook.jax.allreduce.ring_allreduce",
                     "dpbook.jax.concise.make_data_parallel"):
            assert f'id="{name}"' in text, (lang, name)
        for name in dpbook.__all__:       # everything the core exports, once per edition
            obj = getattr(dpbook, name)
            if callable(obj) and hasattr(obj, "__module__") and obj.__module__.startswith("dpbook"):
                assert text.count(f'id="{obj.__module__}.{obj.__qualname__}"') == 1, name


def test_chinese_pages_show_chinese_hints(site):
    """The Chinese pages take the English runs' outputs, with the checked exercises'
    lines said in Chinese (tools/notebooks.translate_checks): no English hint on them."""
    from dpbook.exercises import HINTS
    english = {key: html.escape(h["en"], quote=False) for key, h in HINTS.items()}
    chinese = {key: html.escape(h["zh"], quote=False) for key, h in HINTS.items()}
    shown = []
    for entry in toc_files("zh"):
        if not is_notebook(ROOT / f"{entry}.md"):
            continue
        page = _page(site, "zh", entry)
        assert not [k for k, text in english.items() if text in page], entry
        shown += [k for k, text in chinese.items() if f"提示：{text}" in page]
    assert shown, "no Chinese hint on any Chinese page"


def test_the_api_page_shows_data_by_name_not_by_value(site):
    """autodoc_default_options no-value: HINTS is listed with its docstring, without the
    hundred hints in two languages that made the page 5,900 px tall."""
    from dpbook.exercises import HINTS
    page = _page(site, "en", "chapters/en/appendix/api")
    assert 'id="dpbook.exercises.HINTS"' in page
    assert html.escape(HINTS["exception"]["en"], quote=False) not in page


_CJK = "\u3000-\u303f\u4e00-\u9fff\uff00-\uffef"
_CJK_SPACE = re.compile(f"[{_CJK}]\\s+[{_CJK}]")
_BLOCK = re.compile(r"<(p|li|h[1-6]|dt|dd|figcaption)\b[^>]*>(.*?)</\1>", re.S)


def _running_text(page: str) -> list[str]:
    """The text of the page's paragraphs, list items, headings and captions, outside code."""
    page = re.sub(r"<(script|style|pre)\b.*?</\1>", "", page, flags=re.S)
    page = re.sub(r'<span class="math[^"]*">.*?</span>', "x", page, flags=re.S)
    return [html.unescape(re.sub(r"<[^>]+>", "", m.group(2))) for m in _BLOCK.finditer(page)]


def test_chinese_paragraphs_have_no_space_between_two_cjk_characters(site):
    """A line break inside a Chinese paragraph would render as a space ("数据。 这就是");
    tools/dpbook_site.py removes those at build time (join_cjk_lines)."""
    found = []
    for entry in toc_files("zh"):
        for text in _running_text(_page(site, "zh", entry)):
            found += [(entry, text[max(0, m.start() - 8): m.end() + 8])
                      for m in _CJK_SPACE.finditer(text)]
    assert not found, found[:10]
    assert _CJK_SPACE.search("数据。 这就是")           # the check can fail


@pytest.mark.parametrize("chapter", ["devices", "from-scratch", "concise"])
def test_pages_link_to_their_twin_in_the_other_framework(site, chapter):
    for lang in ("en", "zh"):
        for name, twin, label in (("pytorch", "jax", "JAX"), ("jax", "pytorch", "PyTorch")):
            page = _page(site, lang, f"chapters/{lang}/{chapter}/{name}")
            link = re.search(r'<a class="dpbook-twin" href="([^"]+)">([^<]+)</a>', page)
            assert link and link.group(1) == f"{twin}.html" and label in link.group(2)


def test_chapters_sections_and_figures_are_numbered(site):
    """Numbered as d2l numbers them: chapter 2, section 2.1, figure 6.1 (the tocs'
    `numbered`, Sphinx's numfig); a Chinese cross-reference then reads 2.1节."""
    en = _page(site, "en", "chapters/en/from-scratch/pytorch")
    assert re.search(r'<h1><span class="section-number">2\.1\. </span>', en)
    home = _page(site, "en", "chapters/en/index")
    assert re.search(r'href="devices/index\.html">1\. Devices<', home)
    zh = _page(site, "zh", "chapters/zh/sharded/zero")
    assert re.search(r'<span class="caption-number">图\d+\.1 </span>', zh)
    en_fig = _page(site, "en", "chapters/en/sharded/zero")
    assert re.search(r'<span class="caption-number">Fig\. \d+\.1 </span>', en_fig)

"""Sphinx extension for the book's site (loaded through ``sphinx.local_extensions``).

On every page it adds a bar with

* a link to the same page in the other edition (English at the site root, Chinese
  under ``zh/``, the layout ``tools/build_book.py`` assembles);
* on notebook pages: an "Open in Colab" link and a download of the generated ``.ipynb``
  (``tools/notebooks.py``), and the provenance of the page's outputs — the scale, devices
  and hardware named by the hardware lines the notebook printed when it ran.

It also provides the ``dpbook-glossary`` directive, which renders ``glossary.yml``, and
the ``dpbook-widget`` directive, which places an interactive widget
(``static/dpbook-widgets.js``) fed by a value the page's notebook glued::

    ```{dpbook-widget} ring-replay
    :data: allreduce_ring_trace
    ```

The data (JSON text, glued by a code cell of the same page) is embedded in the page, so
the widget works from any server or from disk, with nothing fetched; without JavaScript
the reader sees a static table of the same data instead.
"""
from __future__ import annotations

import ast
import hashlib
import html
import json
import re
import shutil
from pathlib import Path

import yaml
from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

import notebooks  # tools/notebooks.py, on sys.path beside this file

TEXT = {
    "en": {"other": "中文版", "other_title": "阅读本页的中文版", "colab": "Open in Colab",
           "download": "Download .ipynb",
           "provenance": "Outputs: scale <b>{scale}</b>, run on {date} in {seconds:.0f} s, "
                         "on {hardware}; {versions}",
           "no_provenance": "The outputs on this page have no run record.",
           "twin": "The {framework} version of this page"},
    "zh": {"other": "English edition", "other_title": "Read this page in English",
           "colab": "在Colab中打开", "download": "下载 .ipynb",
           "provenance": "本页输出：规模<b>{scale}</b>，{date}运行，用时{seconds:.0f}秒；"
                         "硬件：{hardware}；{versions}",
           "no_provenance": "本页的输出没有运行记录。",
           "twin": "本页的{framework}版"},
}
OTHER = {"en": "zh", "zh": "en"}


def edition(app) -> str:
    return "zh" if str(app.config.language).startswith("zh") else "en"


def other_page(pagename: str, lang: str) -> str:
    """The URL of ``pagename`` in the other edition, relative to ``pagename``'s page."""
    up = "../" * pagename.count("/")
    other = pagename.replace(f"chapters/{lang}/", f"chapters/{OTHER[lang]}/", 1)
    if lang == "en":
        return f"{up}zh/{other}.html"
    return f"{up}../{other}.html"


#: A page named for a framework has a twin in the other one, in the same chapter folder.
FRAMEWORKS = {"pytorch": "JAX", "jax": "PyTorch"}


def twin_page(pagename: str, pages) -> str | None:
    """The same lesson in the other framework (``devices/pytorch`` ↔ ``devices/jax``) when
    the chapter has both, else ``None``."""
    folder, _, name = pagename.rpartition("/")
    other = {"pytorch": "jax", "jax": "pytorch"}.get(name)
    return f"{folder}/{other}" if other and f"{folder}/{other}" in pages else None


def machine(hw: dict | None, lang: str) -> str | None:
    """A run record's hardware in the page's language: ``AMD EPYC, 2 logical cores, 24 GiB
    RAM, no GPU``; ``None`` for a record made before runs recorded it."""
    if not hw:
        return None
    gpus = ", ".join(hw["gpus"])
    if lang == "zh":
        return (f"{hw['cpu']}，{hw['cores']}个逻辑核心，{hw['ram_gib']} GiB内存，"
                + (f"GPU：{gpus}" if gpus else "无GPU"))
    return (f"{hw['cpu']}, {hw['cores']} logical cores, {hw['ram_gib']} GiB RAM, "
            + (f"GPUs: {gpus}" if gpus else "no GPU"))


def provenance(app, pagename: str) -> str:
    """The provenance box of a notebook page: one line from its run's record (the English
    twin's run for a Chinese page), passed in by tools/build_book.py as ``dpbook_runs``."""
    lang = edition(app)
    entry = pagename.replace(f"chapters/{lang}/", "chapters/en/", 1)
    record = app.config.dpbook_runs.get(entry)
    if not record:
        return f'<div class="dpbook-provenance">{TEXT[lang]["no_provenance"]}</div>'
    versions = ", ".join(f"{name} {v}"
                         for name, v in sorted(record.get("versions", {}).items()))
    line = TEXT[lang]["provenance"].format(
        scale=record["scale"], date=record["executed"][:10], seconds=record["seconds"],
        hardware=html.escape(machine(record.get("hardware"), lang) or record["machine"]),
        versions=html.escape(versions or "-"))
    return f'<div class="dpbook-provenance">{line}</div>'


def page_bar(app, pagename: str) -> str:
    lang = edition(app)
    text = TEXT[lang]
    links = [f'<a class="dpbook-lang-switch" href="{other_page(pagename, lang)}" '
             f'hreflang="{OTHER[lang]}" title="{text["other_title"]}">{text["other"]}</a>']
    extra = ""
    if pagename in app.env.dpbook_notebooks:
        up = "../" * pagename.count("/")
        ipynb = notebooks.notebook_path(pagename).relative_to(notebooks.ROOT).as_posix()
        links.append(f'<a class="dpbook-colab" href="{notebooks.colab_url(pagename, lang)}">'
                     f'{text["colab"]}</a>')
        links.append(f'<a class="dpbook-download" href="{up}{ipynb}" download>'
                     f'{text["download"]}</a>')
        extra = provenance(app, pagename)
        twin = twin_page(pagename, app.env.dpbook_notebooks)
        if twin:
            name = pagename.rpartition("/")[2]
            links.append(f'<a class="dpbook-twin" href="{twin.rpartition("/")[2]}.html">'
                         f'{text["twin"].format(framework=FRAMEWORKS[name])}</a>')
    return f'<div class="dpbook-bar">{" · ".join(links)}</div>{extra}'


def on_page_context(app, pagename, templatename, context, doctree):
    # Inline scripts registered before a build come back from the pickled environment
    # with filename '' instead of None, so sphinx-thebe's `const THEBE_JS_URL = …` is on
    # the page twice: a JavaScript error on every page. Keep one of each.
    if context.get("script_files"):
        seen, unique = set(), []
        for js in context["script_files"]:
            key = (getattr(js, "filename", str(js)) or "",        # None and '' alike
                   tuple(sorted(getattr(js, "attributes", {}).items())))
            if key not in seen:
                seen.add(key)
                unique.append(js)
        context["script_files"] = unique
    if "body" in context and pagename.startswith("chapters/"):
        # under the page's title, so that the title comes first on a phone
        body, bar = context["body"], page_bar(app, pagename)
        end = body.find("</h1>")
        context["body"] = (body[:end + 5] + bar + body[end + 5:] if end >= 0
                           else bar + body)


CJK = "\u3000-\u303f\u4e00-\u9fff\uff00-\uffef"     # ideographs, CJK and full-width punctuation
# a break or a space between two CJK characters; the ideographic space U+3000 is meant
_CJK_GAP = re.compile(f"(?<=[{CJK}])[^\\S\u3000]+(?=[{CJK}])")


def join_cjk_lines(app, doctree, docname):
    """A line break (or a space) between two CJK characters of running text renders as a
    space in HTML ("数据。 这就是"); Chinese has none. Remove it from every text node of
    the Chinese edition outside code and math, also across inline markup
    (``**小结。** 这一节`` ends one node with 。 and starts the next with a space)."""
    if edition(app) != "zh":
        return
    skip = (nodes.literal, nodes.literal_block, nodes.math, nodes.math_block, nodes.raw,
            nodes.comment)
    # every text node, in order; one inside code or math stays as it is and is a barrier:
    # its neighbours are not joined across it ("使用 `torch` 来" keeps both spaces)
    texts, blocks = [], []
    for t in doctree.findall(nodes.Text):
        skipped = any(isinstance(a, skip) for a in _ancestors(t))
        texts.append(t)
        blocks.append(None if skipped else _block(t))
    strings = [str(t) if b is None else _CJK_GAP.sub("", str(t))
               for t, b in zip(texts, blocks)]
    ends_cjk = lambda x: re.search(f"[{CJK}]$", x) is not None
    starts_cjk = lambda x: re.match(f"[{CJK}]", x) is not None
    for i in range(1, len(texts)):
        if blocks[i] is None or blocks[i] is not blocks[i - 1]:
            continue
        here = strings[i]
        if not here.strip():              # a line break on its own (MyST's soft break)
            nxt = strings[i + 1] if i + 1 < len(texts) and blocks[i + 1] is blocks[i] else ""
            if ends_cjk(strings[i - 1]) and starts_cjk(nxt):
                strings[i] = ""
        elif ends_cjk(strings[i - 1].rstrip()) and starts_cjk(here.lstrip()):
            if here[:1].isspace():
                strings[i] = here.lstrip()
            elif strings[i - 1][-1:].isspace():
                strings[i - 1] = strings[i - 1].rstrip()
    for text, new in zip(texts, strings):
        if new != str(text):
            text.parent.replace(text, nodes.Text(new))


def _ancestors(node):
    while node.parent is not None:
        node = node.parent
        yield node


def _block(text):
    """The paragraph (or title, caption, term) a text node belongs to, if any."""
    return next((p for p in _ancestors(text)
                 if isinstance(p, (nodes.paragraph, nodes.title, nodes.caption,
                                   nodes.term))), None)


def search_dictionary(root: Path, out: Path) -> Path:
    """A jieba user dictionary of the book's Chinese terms (``glossary.yml``), so that the
    Chinese search index keeps 全归约 or 梯度累加 whole instead of cutting them into 全 +
    归约; Sphinx's Chinese indexer loads it (``html_search_options['dict']``). One word
    per line and no frequency: jieba then gives each the frequency that keeps it whole."""
    terms = yaml.safe_load((root / "glossary.yml").read_text(encoding="utf8"))
    words = sorted({t["zh"] for t in terms
                    if re.search(r"[\u4e00-\u9fff]", t["zh"]) and " " not in t["zh"]})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(f"{w}\n" for w in words), encoding="utf8")
    return out


MATHJAX = "mathjax/tex-mml-chtml.js"      # the file Sphinx loads from jsDelivr by default


def mathjax_files(out: Path) -> Path:
    """MathJax 3 for the site, so that formulas render offline and wherever jsDelivr is
    slow or blocked: its TeX/MathML-to-HTML bundle and that output's web fonts, copied from
    the pinned ``django-static-mathjax`` wheel (requirements.txt; no Django needed) into
    ``out/mathjax/``, with the parts it loads on demand. Returns ``out``, a folder for ``html_static_path``."""
    import importlib.util
    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("MathJax's files are missing: pip install -r requirements.txt "
                           "(django-static-mathjax)")
    es5 = Path(spec.submodule_search_locations[0]) / "static" / "mathjax" / "es5"
    (out / "mathjax").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(es5 / Path(MATHJAX).name, out / MATHJAX)
    # what the bundle loads on demand: TeX extensions (\boldsymbol, \color, mathtools...),
    # the menu and accessibility parts, and the CHTML fonts (about 3 MB; not the speech
    # engine, off unless a reader turns it on in the menu, nor the SVG output)
    for part in ("input", "ui", "a11y", "adaptors", Path("output") / "chtml"):
        shutil.copytree(es5 / part, out / "mathjax" / part, dirs_exist_ok=True)
    return out


def on_config_inited(app, config):
    config.html_static_path.append(str(mathjax_files(Path(app.doctreedir) / "dpbook-static")))
    config.mathjax_path = MATHJAX
    if edition(app) == "zh":
        out = Path(app.doctreedir) / "jieba-glossary.txt"
        path = search_dictionary(Path(app.srcdir), out)
        config.html_search_options = {**(config.html_search_options or {}),
                                      "dict": str(path)}


def on_builder_inited(app):
    lang = edition(app)
    app.env.dpbook_notebooks = set(notebooks.notebook_entries(lang))


def on_build_finished(app, exception):
    """Copy the generated notebooks (``notebooks/``, written by tools/notebooks.py and kept
    current by its ``--check``) into the site, for the download links."""
    if exception is not None or app.builder.format != "html":
        return
    lang = edition(app)
    for entry in notebooks.notebook_entries(lang):
        generated = notebooks.notebook_path(entry)
        if not generated.is_file():
            raise FileNotFoundError(f"{generated} is missing: run `make notebooks`")
        path = Path(app.outdir) / generated.relative_to(notebooks.ROOT)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(generated, path)


def introduced_in(terms: list[dict], lang: str) -> dict[str, str]:
    """English term → the page of ``lang`` that introduces it: the first page, in reading
    order, where the Chinese edition glosses the term with its English name in
    parentheses (术语（English）), as it does at a term's first use in a chapter."""
    pages = [e for e in notebooks.toc_entries("zh") if "/appendix/" not in e]
    texts = {e: (notebooks.ROOT / f"{e}.md").read_text(encoding="utf8") for e in pages}
    found = {}
    for t in terms:
        gloss = re.compile(re.escape(t["zh"]) + r"[（(]" + re.escape(t["en"]), re.I)
        page = next((e for e in pages if gloss.search(texts[e])), None)
        if page is not None:
            found[t["en"]] = page.replace("chapters/zh/", f"chapters/{lang}/", 1)
    return found


class GlossaryDirective(SphinxDirective):
    """``dpbook-glossary``: every term of ``glossary.yml`` as a Sphinx glossary, sorted by
    the English term; each entry names the term in both languages."""

    has_content = False

    def run(self):
        path = Path(self.env.srcdir) / "glossary.yml"
        self.env.note_dependency(str(path))
        terms = yaml.safe_load(path.read_text(encoding="utf8"))
        lang = edition(self.env.app)
        zh = lang == "zh"
        where = introduced_in(terms, lang)
        see = {"en": " Introduced in ", "zh": "见"}[lang]      # no space in Chinese
        # MyST source for Sphinx's glossary directive: terms at the left, definitions
        # indented. The page is Markdown, so nested content is parsed as MyST.
        lines = ["```{glossary}"]
        for t in sorted(terms, key=lambda t: t["en"].lower()):
            first, second = (t["zh"], t["en"]) if zh else (t["en"], t["zh"])
            link = (f"{see}{{doc}}`/{where[t['en']]}`" + ("。" if zh else ".")
                    if t["en"] in where else "")
            lines += [first, second, f"   {t['def_zh'] if zh else t['def_en']}{link}", ""]
        lines.append("```")
        container = nodes.container(classes=["dpbook-glossary"])
        self.state.nested_parse(StringList(lines, source=str(path)), self.content_offset,
                                container)
        return [container]


WIDGET_TEXT = {
    "en": {"noscript": "JavaScript is off: the interactive widget is replaced by this table.",
           "size": "message size", "rank": "rank", "initial": "values before",
           "final": "values after", "messages": "messages sent",
           "model": "α–β model, separate links, {n} processes, α = {alpha:.1f} µs, "
                    "1/β = {gbs:.2f} GB/s (this machine's fit)",
           "timeline": ["backward functions", "allreduces", "backward ends (ms)",
                        "allreduce time (ms)"]},
    "zh": {"noscript": "JavaScript未启用：交互式组件由这张表代替。",
           "size": "消息大小", "rank": "进程", "initial": "全归约前的值", "final": "全归约后的值",
           "messages": "发送的消息数",
           "model": "α–β模型，独立链路，{n}个进程，α = {alpha:.1f} µs，"
                    "1/β = {gbs:.2f} GB/s（本机的拟合值）",
           "timeline": ["反向函数个数", "全归约次数", "反向传播结束时刻（ms）",
                        "全归约总时间（ms）"]},
}


def _table(header: list[str], rows: list[list[str]], caption: str) -> str:
    cells = lambda tag, row: "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in row)
    return (f'<table class="dpbook-widget-table"><caption>{html.escape(caption)}</caption>'
            f"<thead><tr>{cells('th', header)}</tr></thead><tbody>"
            + "".join(f"<tr>{cells('td', r)}</tr>" for r in rows) + "</tbody></table>")


def _alpha_beta_fallback(data: dict, t: dict) -> str:
    from dpbook import costmodel
    n, alpha, beta = data["processes"], data["alpha"], data["beta"]
    sizes = [2**10, 2**20, 2**26]
    rows = [[f"{size >> 10:,} KB" if size < 2**20 else f"{size >> 20} MB"]
            + [f"{costmodel.predict(a, size, n, alpha, beta) * 1e3:.3g} ms"
               for a in costmodel.ALGORITHMS] for size in sizes]
    return _table([t["size"], *costmodel.ALGORITHMS], rows,
                  t["model"].format(n=n, alpha=alpha * 1e6, gbs=1 / beta / 1e9))


def _ring_replay_fallback(data: dict, t: dict) -> str:
    fmt = lambda values: " ".join(f"{v:g}" for v in values)
    rows = [[r["rank"], fmt(r["initial"]), fmt(r["final"]),
             sum(e["kind"] in ("send", "isend") for e in r["events"])] for r in data["ranks"]]
    return _table([t["rank"], t["initial"], t["final"], t["messages"]], rows,
                  f"{data['algorithm']} allreduce, {data['processes']} processes")


def _timeline_fallback(data: dict, t: dict) -> str:
    rows = [[name, len(lanes["backward"]), len(lanes["allreduce"]),
             f"{max(s + d for s, d in lanes['backward']):.1f}",
             f"{sum(d for _, d in lanes['allreduce']):.1f}"] for name, lanes in data.items()]
    return _table(["", *t["timeline"]], rows, "")


#: widget name → the static HTML shown instead when JavaScript is off
WIDGETS = {"alpha-beta": _alpha_beta_fallback, "ring-replay": _ring_replay_fallback,
           "timeline": _timeline_fallback}


class WidgetDirective(SphinxDirective):
    """``dpbook-widget <name>`` with ``:data: <glue key>``: an interactive widget of
    ``static/dpbook-widgets.js`` fed by the JSON text the page's notebook glued under
    that key, in the edition's language, with a static fallback."""

    required_arguments = 1
    option_spec = {"data": directives.unchanged_required}

    def run(self):
        from myst_nb.ext.glue.utils import retrieve_glue_data
        name, key = self.arguments[0], self.options.get("data")
        if name not in WIDGETS:
            raise self.error(f"unknown widget {name!r}: choose one of {', '.join(WIDGETS)}")
        if not key:
            raise self.error(f"dpbook-widget {name}: give the glued data as ':data: <key>'")
        try:
            glued = retrieve_glue_data(self.state.document, key)
            data = json.loads(ast.literal_eval(glued.data["text/plain"]))
        except Exception as e:  # noqa: BLE001 - say which widget and key, then stop
            raise self.error(f"dpbook-widget {name}: no JSON glued as {key!r} on this page "
                             f"({type(e).__name__}: {e})")
        lang = edition(self.env.app)
        payload = json.dumps(data, ensure_ascii=False).replace("</", "<\\/")
        html_text = (f'<div class="dpbook-widget" data-widget="{name}" data-lang="{lang}">'
                     f'<script type="application/json">{payload}</script>'
                     f'<div class="dpbook-widget-fallback"><p>{WIDGET_TEXT[lang]["noscript"]}</p>'
                     f'{WIDGETS[name](data, WIDGET_TEXT[lang])}</div></div>')
        return [nodes.raw("", html_text, format="html")]


def setup(app):
    # page → its run's record (scale, date, hardware, releases), from tools/build_book.py
    app.add_config_value("dpbook_runs", {}, "html")
    app.connect("config-inited", on_config_inited)
    app.connect("builder-inited", on_builder_inited)
    app.connect("html-page-context", on_page_context)
    app.connect("doctree-resolved", join_cjk_lines)
    app.connect("build-finished", on_build_finished)
    app.add_directive("dpbook-glossary", GlossaryDirective)
    app.add_directive("dpbook-widget", WidgetDirective)
    app.config.html_static_path.append(str(Path(__file__).parent / "static"))
    app.add_css_file("dpbook-site.css")
    app.add_js_file("dpbook-widgets.js", defer="defer")     # a classic script: works from disk
    # Sphinx rebuilds every page when env_version changes: make it change with this code.
    here = Path(__file__).parent
    digest = hashlib.sha256(b"".join(
        p.read_bytes() for p in (here / "dpbook_site.py", here / "notebooks.py",
                                 here / "static" / "dpbook-site.css",
                                 here / "static" / "dpbook-widgets.js")))
    return {"version": "1.0", "env_version": int(digest.hexdigest()[:8], 16),
            "parallel_read_safe": True, "parallel_write_safe": True}

"""Sphinx extension for the book's site (loaded through ``sphinx.local_extensions``).

On every page it adds a bar with

* a link to the same page in the other edition (English at the site root, Chinese
  under ``zh/``, the layout ``tools/build_book.py`` assembles);
* on notebook pages: an "Open in Colab" link and a download of the generated ``.ipynb``
  (``tools/notebooks.py``), and the provenance of the page's outputs — the scale, devices
  and hardware named by the hardware lines the notebook printed when it ran.

It also provides the ``dpbook-glossary`` directive, which renders ``glossary.yml``.
"""
from __future__ import annotations

import hashlib
import html
import re
from pathlib import Path

import yaml
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

import notebooks  # tools/notebooks.py, on sys.path beside this file

TEXT = {
    "en": {"other": "中文版", "other_title": "阅读本页的中文版", "colab": "Open in Colab",
           "download": "Download .ipynb",
           "provenance": "Outputs on this page were computed at scale <b>{scale}</b> on:",
           "no_provenance": "The outputs on this page print no hardware line."},
    "zh": {"other": "English edition", "other_title": "Read this page in English",
           "colab": "在Colab中打开", "download": "下载 .ipynb",
           "provenance": "本页的输出是在规模 <b>{scale}</b> 下，由以下硬件计算得到的：",
           "no_provenance": "本页的输出没有打印硬件信息行。"},
}
OTHER = {"en": "zh", "zh": "en"}
HARDWARE = re.compile(r"hardware \| ([^<\n]*)")


def edition(app) -> str:
    return "zh" if str(app.config.language).startswith("zh") else "en"


def other_page(pagename: str, lang: str) -> str:
    """The URL of ``pagename`` in the other edition, relative to ``pagename``'s page."""
    up = "../" * pagename.count("/")
    other = pagename.replace(f"chapters/{lang}/", f"chapters/{OTHER[lang]}/", 1)
    if lang == "en":
        return f"{up}zh/{other}.html"
    return f"{up}../{other}.html"


def provenance(body: str) -> list[str]:
    """The distinct hardware lines printed on a page, in order."""
    lines = [html.unescape(m[1]).strip() for m in HARDWARE.finditer(body)]
    return list(dict.fromkeys(lines))


def page_bar(app, pagename: str, body: str) -> str:
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
        lines = provenance(body)
        if lines:
            scales = sorted({m[1] for line in lines for m in re.finditer(r"scale: (\w+)", line)})
            items = "".join(f"<li><code>{html.escape(line)}</code></li>" for line in lines)
            extra = (f'<div class="dpbook-provenance">'
                     f'{text["provenance"].format(scale=", ".join(scales) or "?")}'
                     f'<ul>{items}</ul></div>')
        else:
            extra = f'<div class="dpbook-provenance">{text["no_provenance"]}</div>'
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
        context["body"] = page_bar(app, pagename, context["body"]) + context["body"]


def on_builder_inited(app):
    lang = edition(app)
    app.env.dpbook_notebooks = set(notebooks.notebook_entries(lang))


def on_build_finished(app, exception):
    """Write the generated notebooks into the site, for the download links."""
    if exception is not None or app.builder.format != "html":
        return
    lang = edition(app)
    for entry in notebooks.notebook_entries(lang):
        path = Path(app.outdir) / notebooks.notebook_path(entry).relative_to(notebooks.ROOT)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(notebooks.render(notebooks.to_ipynb(entry, lang)), encoding="utf8")


class GlossaryDirective(SphinxDirective):
    """``dpbook-glossary``: every term of ``glossary.yml`` as a Sphinx glossary, sorted by
    the English term; each entry names the term in both languages."""

    has_content = False

    def run(self):
        path = Path(self.env.srcdir) / "glossary.yml"
        self.env.note_dependency(str(path))
        terms = yaml.safe_load(path.read_text(encoding="utf8"))
        zh = edition(self.env.app) == "zh"
        # MyST source for Sphinx's glossary directive: terms at the left, definitions
        # indented. The page is Markdown, so nested content is parsed as MyST.
        lines = ["```{glossary}"]
        for t in sorted(terms, key=lambda t: t["en"].lower()):
            first, second = (t["zh"], t["en"]) if zh else (t["en"], t["zh"])
            lines += [first, second, f"   {t['def_zh'] if zh else t['def_en']}", ""]
        lines.append("```")
        container = nodes.container(classes=["dpbook-glossary"])
        self.state.nested_parse(StringList(lines, source=str(path)), self.content_offset,
                                container)
        return [container]


def setup(app):
    app.connect("builder-inited", on_builder_inited)
    app.connect("html-page-context", on_page_context)
    app.connect("build-finished", on_build_finished)
    app.add_directive("dpbook-glossary", GlossaryDirective)
    app.config.html_static_path.append(str(Path(__file__).parent / "static"))
    app.add_css_file("dpbook-site.css")
    # Sphinx rebuilds every page when env_version changes: make it change with this code.
    here = Path(__file__).parent
    digest = hashlib.sha256(b"".join(
        p.read_bytes() for p in (here / "dpbook_site.py", here / "notebooks.py",
                                 here / "static" / "dpbook-site.css")))
    return {"version": "1.0", "env_version": int(digest.hexdigest()[:8], 16),
            "parallel_read_safe": True, "parallel_write_safe": True}

"""Turn the book's MyST notebooks into ``.ipynb`` files readers can run anywhere.

    python tools/notebooks.py            # (re)write notebooks/<lang>/<slug>/<name>.ipynb
    python tools/notebooks.py --check    # exit 1 if a committed notebook is out of date

The ``.ipynb`` files are *generated* — never edit them by hand. Colab opens them from the
repository (``notebooks/`` on the configured branch); the site offers the same files for
download. Each one differs from its MyST source in three ways, so it runs top to bottom
outside the book:

* a first code cell installs ``dpbook`` when it is missing (from the repository URL in
  ``_config.yml``); ``dpbook`` does not depend on torch or jax, so pip never touches them;
* ``literalinclude`` directives become the code they show (read from ``code/``);
* figures point at the repository's raw files, and ``{ref}`` roles become the title of
  the section they name;
* a ``{glue:text}`` role (a number from the run, glued by ``dpbook.glue``) becomes the
  value of the stored run, formatted as the role asks; a ``{dpbook-widget}`` (an
  interactive widget of the site) becomes a line that says what the site shows there.

They carry the outputs of the stored run at the ``cpu`` scale (``outputs/cpu/``, see
tools/runs.py) when its code cells are those of the source, so a reader sees results
before running anything; a Chinese notebook carries its English twin's.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import textwrap
from pathlib import Path

import jupytext
import nbformat
import yaml

from sources import (EDITIONS, ROOT, is_notebook, load, notebook_entries,  # noqa: F401
                     stored_path, strip_comments, toc_entries)

OUT = ROOT / "notebooks"

INSTALL_COMMENT = {
    "en": ("# Install the book's helper package `dpbook` if it is missing (on Colab, for example).\n"
           "# It does not depend on torch or jax, so pip leaves the installed ones alone.\n"
           "# On Colab the default CPU runtime runs every page as the book shows it (2 CPU\n"
           "# devices). A T4 GPU runtime has one GPU: the from-scratch replicas share it,\n"
           "# the demos with several processes run them on the CPU (NCCL takes one GPU\n"
           "# per process), and JAX's pages use emulated CPU devices. Each page says where\n"
           "# it runs."),
    "zh": ("# 如果缺少本书的辅助包`dpbook`（例如在Colab上），先安装它。\n"
           "# `dpbook`不依赖torch和jax，所以pip不会改动已经安装的版本。\n"
           "# 在Colab上，默认的CPU运行时会像书中那样运行每一页（2个CPU设备）。\n"
           "# T4 GPU运行时只有一块GPU：从零开始实现的各个副本共用这块GPU，\n"
           "# 多进程的示例在CPU上运行这些进程（NCCL要求每个进程独占一块GPU），\n"
           "# JAX的页面使用模拟的CPU设备。\n"
           "# 每一页都会打印它在哪里运行。"),
}
INSTALL_CODE = """\
import importlib.util, os, subprocess, sys

if importlib.util.find_spec("dpbook") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                    "dpbook @ {url}"], check=True)
if "DPBOOK_LANG" not in os.environ:          # {lang_comment}
    os.environ["DPBOOK_LANG"] = "{lang}"
"""
STORED_NUMBERS = {
    "en": ("> *The numbers in the text come from the book's stored run at the `cpu` scale "
           "(its hardware line is in the first output). When you run this notebook, the "
           "outputs show your numbers; the text keeps the stored ones.*"),
    "zh": ("> *正文中的数字来自本书保存的一次`cpu`规模的运行（它的运行环境见第一个输出中的硬件信息行）。"
           "你运行这个笔记本时，输出中是你自己的数字，而正文中仍是保存的那次运行的数字。*"),
}
LANG_COMMENT = {"en": "the language of the exercises' hints",
                "zh": "练习检查的提示使用的语言"}


def config(lang: str) -> dict:
    return yaml.safe_load((ROOT / EDITIONS[lang][0]).read_text(encoding="utf8"))


def repository(lang: str = "en") -> tuple[str, str]:
    """The repository URL and branch from ``_config.yml``."""
    repo = config(lang)["repository"]
    return repo["url"].rstrip("/"), repo.get("branch", "main")


def install_url(lang: str = "en") -> str:
    url, branch = repository(lang)
    return f"git+{url}@{branch}#subdirectory=code"


def raw_url(path: str, lang: str = "en") -> str:
    """The raw-file URL of ``path`` (relative to the repository root) on GitHub."""
    url, branch = repository(lang)
    return url.replace("https://github.com/", "https://raw.githubusercontent.com/") + \
        f"/{branch}/{path}"


def colab_url(entry: str, lang: str) -> str:
    """Colab's URL for the generated notebook of toc entry ``entry``."""
    url, branch = repository(lang)
    return url.replace("https://github.com/", "https://colab.research.google.com/github/") + \
        f"/blob/{branch}/{notebook_path(entry).relative_to(ROOT).as_posix()}"


def with_outputs_of(nb: nbformat.NotebookNode, executed: nbformat.NotebookNode,
                    name: str = "notebook", lang: str = "en") -> nbformat.NotebookNode:
    """``nb`` with the outputs of ``executed``, cell by cell; raise ValueError unless
    their code cells are the same, comments aside (the two editions of a chapter are).
    For another ``lang`` than English, what the checked exercises printed is said in
    ``lang`` (:func:`translate_checks`)."""
    mine = [c for c in nb.cells if c.cell_type == "code"]
    theirs = [c for c in executed.cells if c.cell_type == "code"]
    if len(mine) != len(theirs):
        raise ValueError(f"{name}: {len(mine)} code cells, its twin has {len(theirs)}")
    for a, b in zip(mine, theirs):
        if strip_comments(a.source) != strip_comments(b.source):
            raise ValueError(f"{name}: code differs from its twin:\n{a.source}\n---\n{b.source}")
    for a, b in zip(mine, theirs):
        a.outputs, a.execution_count = b.outputs, b.execution_count
        if lang != "en" and any(o.output_type == "stream" for o in a.outputs):
            a.outputs = copy.deepcopy(a.outputs)          # the twin's stay English
            for o in a.outputs:
                if o.output_type == "stream":
                    o.text = translate_checks(o.text, lang)
    return nb


def translate_checks(text: str, lang: str) -> str:
    """``text`` printed by an English run, with the lines of the checked exercises
    (:func:`dpbook.exercises.run_check`: pass, failing case, what was seen, hint) said in
    ``lang``, from the templates and ``hints.yml`` of :mod:`dpbook.exercises`. Other lines,
    and a hint that is not in ``hints.yml``, stay as they are."""
    from dpbook.exercises import HINTS, MESSAGES
    if lang == "en":
        return text
    hints = {h["en"]: h[lang] for h in HINTS.values()}
    lines = text.split("\n")
    for i, line in enumerate(lines):
        for kind, say in MESSAGES.items():
            pattern = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>.*)", re.escape(say["en"]))
            m = re.fullmatch(pattern, line)
            if m is None:
                continue
            fields = m.groupdict()
            if kind == "hint":
                if fields["hint"] not in hints:
                    break
                fields["hint"] = hints[fields["hint"]]
            lines[i] = say[lang].format(**fields)
            break
    return "\n".join(lines)


def notebook_path(entry: str) -> Path:
    """``chapters/en/from-scratch/pytorch`` → ``notebooks/en/from-scratch/pytorch.ipynb``."""
    parts = Path(entry).parts
    assert parts[0] == "chapters", entry
    return OUT.joinpath(*parts[1:]).with_suffix(".ipynb")


def pyobject_source(path: Path, name: str) -> str:
    """The source of the function or class ``name`` in ``path``, or of a method
    (``Class.method``, dedented): what Sphinx's ``:pyobject:`` shows, found by the same
    analyzer (``sphinx.pycode.ModuleAnalyzer``)."""
    from sphinx.pycode import ModuleAnalyzer
    tags = ModuleAnalyzer.for_file(str(path), "").find_tags()
    if name not in tags:
        raise LookupError(f"{name} is not defined in {path}")
    _, start, end = tags[name]
    lines = path.read_text(encoding="utf8").splitlines()[start - 1:end]
    return textwrap.dedent("\n".join(lines)).rstrip()


FENCE = re.compile(r"^(?P<fence>```+|:::+)\{(?P<name>[\w-]+)\}\s*(?P<arg>.*?)\n"
                   r"(?P<body>.*?)^(?P=fence)\s*$", re.M | re.S)
ROLE = re.compile(r"\{(?P<role>ref|numref)\}`(?:(?P<text>[^`<]*?)\s*<)?(?P<label>[\w-]+)>?`")
#: How the site writes a {numref} to a section (Sphinx's numfig_format, _config*.yml)
SECTION_FORMAT = {"en": "Section %s", "zh": "%s节"}
LABEL = re.compile(r"^\((?P<label>[\w-]+)\)=\s*\n(?:#+\s*(?P<title>.+))?", re.M)
FIG_NAME = re.compile(r"^:name:\s*(\S+)", re.M)


def label_titles(lang: str) -> dict[str, str]:
    """Every ``(label)=`` of an edition → the heading (or figure caption) it names."""
    titles = {}
    for entry in toc_entries(lang):
        text = (ROOT / f"{entry}.md").read_text(encoding="utf8")
        for m in LABEL.finditer(text):
            if m["title"]:
                titles[m["label"]] = m["title"].strip()
        for m in FENCE.finditer(text):
            if m["name"] == "figure" and (name := FIG_NAME.search(m["body"])):
                titles[name[1]] = {"en": "the figure", "zh": "图"}[lang]
    return titles


def label_numbers(lang: str) -> dict[str, str]:
    """The label that opens each page of the numbered toc → its number, as the site
    shows it: chapters ``3``, their sections ``3.2`` (the tocs' ``numbered``)."""
    toc = yaml.safe_load((ROOT / EDITIONS[lang][1]).read_text(encoding="utf8"))
    numbers = {}

    def first_label(entry: str) -> str | None:
        text = (ROOT / f"{entry}.md").read_text(encoding="utf8")
        m = LABEL.search(text)
        heading = re.search(r"^#+ ", text, re.M)
        return m["label"] if m and (heading is None or m.start() < heading.start()) else None

    for i, chapter in enumerate(toc.get("chapters") or [], 1):
        if label := first_label(chapter["file"]):
            numbers[label] = str(i)
        for j, section in enumerate(chapter.get("sections") or [], 1):
            if label := first_label(section["file"]):
                numbers[label] = f"{i}.{j}"
    return numbers


#: MyST boxes the generated notebooks show as a quotation (or <details> for a dropdown),
#: with the title they get without one
ADMONITIONS = {"admonition": {"en": "Note", "zh": "注意"}, "note": {"en": "Note", "zh": "注意"},
               "tip": {"en": "Tip", "zh": "提示"}, "warning": {"en": "Warning", "zh": "警告"}}

FOOTNOTE = re.compile(r"(?P<definition>^)?\[\^(?P<label>[\w-]+)\](?(definition):)", re.M)


#: what footnote syntax must not touch: fenced blocks, inline code and math
CODE = re.compile(r"^(```+|:::+)[^\n]*\n.*?^\1[ \t]*$|`[^`\n]+`|\$\$.*?\$\$|\$[^$\n]+\$",
                  re.M | re.S)


def outside_code(text: str, fn) -> str:
    """``fn`` applied to the parts of ``text`` outside code and math (see ``CODE``)."""
    parts, last = [], 0
    for m in CODE.finditer(text):
        parts += [fn(text[last:m.start()]), m[0]]
        last = m.end()
    return "".join(parts + [fn(text[last:])])


def footnote_numbers(source: Path) -> dict[str, int]:
    """A page's footnote labels, numbered in the order they are first referenced (in its
    prose: code cells, code spans and math are not looked at)."""
    numbers: dict[str, int] = {}

    def count(part: str) -> str:
        for m in re.finditer(r"\[\^([\w-]+)\](?!:)", part):
            numbers.setdefault(m[1], len(numbers) + 1)
        return part

    outside_code(source.read_text(encoding="utf8"), count)
    return numbers


def cross_reference(m: re.Match, lang: str, titles: dict[str, str],
                    numbers: dict[str, str]) -> str:
    """What a {ref} or {numref} role reads as in a notebook: its own text, the number the
    site shows (``第3章``, ``2.1节``, ``Section 2.1``), or else the title, in italics."""
    label, text, number = m["label"], m["text"], numbers.get(m["label"])
    if m["role"] == "numref" and number:
        return (text or SECTION_FORMAT[lang]).replace("%s", number).replace("{number}", number)
    if text and "%s" not in text:
        return text
    return f"*{titles.get(label, label)}*"


GLUE = re.compile(r"\{glue(?::text)?\}`(?P<key>[\w-]+)(?::(?P<spec>[^`]*))?`")
GLUE_MIME = "application/papermill.record/text/plain"


def glued(run: nbformat.NotebookNode | None) -> dict[str, str]:
    """Every value a run glued (myst-nb's records in its outputs): name → text/plain."""
    values = {}
    for cell in run.cells if run is not None else []:
        for out in cell.get("outputs", []):
            name = out.get("metadata", {}).get("scrapbook", {}).get("name")
            if name and GLUE_MIME in out.get("data", {}):
                values[name] = out["data"][GLUE_MIME]
    return values


def paste(values: dict[str, str], key: str, spec: str | None) -> str:
    """The text ``{glue:text}`key:spec``` shows, formatted as myst-nb does."""
    from myst_nb.core.variables import format_plain_text
    if key not in values:            # no current run: name the value instead
        return f"`{key}`"
    return format_plain_text(values[key], spec or "")


#: ``{dpbook-widget}`` (tools/dpbook_site.py) draws an interactive widget on the site; a
#: notebook says so instead (the cell above it holds the same data).
WIDGET_TITLES = {"alpha-beta": {"en": "an α–β calculator", "zh": "α–β计算器"},
                 "ring-replay": {"en": "a replay of the ring allreduce recorded above",
                                 "zh": "上面记录的那次环形全归约的回放"},
                 "timeline": {"en": "the timelines above, to zoom into and hover",
                              "zh": "上面那些泳道的交互版本：可以缩放，把鼠标停在色块上能看到时间"}}
WIDGET_NOTE = {"en": "> *On the book's website, this place holds {}.*",
               "zh": "> *在本书的网站上，这里是{}。*"}


def convert_markdown(text: str, source: Path, lang: str, titles: dict[str, str],
                     values: dict[str, str] | None = None) -> str:
    """A markdown cell's MyST, rewritten for plain Jupyter (see the module docstring);
    ``values``: what the stored run glued."""
    def directive(m: re.Match) -> str:
        name, arg, body = m["name"], m["arg"].strip(), m["body"]
        options = dict(re.findall(r"^:([\w-]+):\s*(.*)$", body, re.M))
        content = "\n".join(l for l in body.splitlines() if not re.match(r"^:[\w-]+:", l)).strip()
        target = (source.parent / arg).resolve() if arg else None
        if name == "literalinclude":
            code = (pyobject_source(target, options["pyobject"]) if "pyobject" in options
                    else target.read_text(encoding="utf8").rstrip())
            if "start-at" in options:             # Sphinx's :start-at: and :end-at:
                start = code.index(options["start-at"])
                code = code[code.rfind("\n", 0, start) + 1:]   # from its line's start
            if "end-at" in options:
                end = code.index(options["end-at"]) + len(options["end-at"])
                code = code[:end] + code[end:].split("\n", 1)[0]
            if "dedent" in options:                # Sphinx's :dedent: n
                n = int(options["dedent"])
                code = "\n".join(line[n:] for line in code.splitlines())
            rel = target.relative_to(ROOT).as_posix()
            return f"```python\n# {rel}\n{code}\n```"
        if name == "figure":
            rel = target.relative_to(ROOT).as_posix()
            return f"![{rel}]({raw_url(rel, lang)})\n\n*{content}*"
        if name == "dpbook-widget":
            return WIDGET_NOTE[lang].format(WIDGET_TITLES[arg][lang])
        if name in ADMONITIONS:                    # a box: its body may hold directives
            inner = FENCE.sub(directive, content)
            title = arg or ADMONITIONS[name][lang]
            if "dropdown" in options.get("class", ""):
                return f"<details><summary>{title}</summary>\n\n{inner}\n\n</details>"
            return "\n".join(f"> {line}".rstrip() for line in [f"**{title}**", ""]
                             + inner.splitlines())
        return m[0]

    text = FENCE.sub(directive, text)
    numbers = label_numbers(lang)
    text = ROLE.sub(lambda m: cross_reference(m, lang, titles, numbers), text)
    notes = footnote_numbers(source)     # Jupyter has no footnotes: numbered superscripts
    text = outside_code(text, lambda part: FOOTNOTE.sub(
        lambda m: (f"<sup>{notes[m['label']]}</sup>" + (" " if m["definition"] else ""))
        if m["label"] in notes else m[0], part))
    text = GLUE.sub(lambda m: paste(values or {}, m["key"], m["spec"]), text)
    return re.sub(r"^\([\w-]+\)=[ \t]*\n", "", text, flags=re.M)   # drop (label)= lines


OUTPUTS_SCALE = "cpu"     # the generated notebooks show the outputs of this scale's runs


def stored_run(entry: str) -> nbformat.NotebookNode | None:
    """The stored run (tools/runs.py) of ``entry``'s English twin, if there is one."""
    twin = re.sub(r"^chapters/\w+/", "chapters/en/", entry)
    return load(stored_path(twin, OUTPUTS_SCALE))


def to_ipynb(entry: str, lang: str) -> nbformat.NotebookNode:
    """The runnable ``.ipynb`` of toc entry ``entry`` (a MyST notebook), with the outputs
    of its stored run when the code is the same."""
    source = ROOT / f"{entry}.md"
    nb = jupytext.read(source)
    run, values = stored_run(entry), {}
    if run is not None:
        try:
            nb = with_outputs_of(nb, run, entry, lang)
            values = glued(run)
        except ValueError:          # the code changed since that run: no outputs
            pass
    titles = label_titles(lang)
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = convert_markdown(cell.source, source, lang, titles, values)
        cell.metadata = {k: v for k, v in cell.metadata.items() if k == "tags"}
        cells.append(cell)
    install = nbformat.v4.new_code_cell(
        INSTALL_COMMENT[lang] + "\n" + INSTALL_CODE.format(
            url=install_url(lang), lang=lang, lang_comment=LANG_COMMENT[lang]).rstrip("\n"),
        metadata={"tags": ["dpbook-install"]})
    first_code = next(i for i, c in enumerate(cells) if c.cell_type == "code")
    cells.insert(first_code, install)
    if values:                      # numbers pasted into the text: say whose they are
        cells.insert(first_code, nbformat.v4.new_markdown_cell(STORED_NUMBERS[lang]))
    out = nbformat.v4.new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "dpbook": {"generated_from": f"{entry}.md",
                   "note": "generated by tools/notebooks.py; edit the .md source instead"},
        "colab": {"provenance": []},
    })
    for i, cell in enumerate(out.cells):     # stable ids: regenerating changes nothing
        cell["id"] = f"cell-{i}"
    nbformat.validate(out)
    return out


def render(nb: nbformat.NotebookNode) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def generate() -> dict[Path, str]:
    """Every generated notebook: path → file text."""
    return {notebook_path(entry): render(to_ipynb(entry, lang))
            for lang in EDITIONS for entry in notebook_entries(lang)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only report notebooks that are missing or out of date")
    args = parser.parse_args(argv)
    files = generate()
    stale = [p for p, text in files.items()
             if not p.is_file() or p.read_text(encoding="utf8") != text]
    extra = [p for p in OUT.rglob("*.ipynb") if p not in files] if OUT.is_dir() else []
    if args.check:
        for p in stale + extra:
            print(f"out of date: {p.relative_to(ROOT)}")
        if stale or extra:
            print("run: python tools/notebooks.py")
        return 1 if stale or extra else 0
    for p in extra:
        p.unlink()
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(files[p], encoding="utf8")
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

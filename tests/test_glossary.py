"""The glossary (glossary.yml) is complete and the Chinese chapters use its terms.

Rules for the Chinese edition, checked on the *prose* of each page: code cells, inline
code, roles such as ``{ref}`` and ``{glue:text}``, math, directives other than figure
captions, and link targets are left out.

1. Where a term is glossed with its English name, 中文（English）, the Chinese before the
   parentheses is the glossary's term.
2. In each **chapter** a glossary term is glossed at most once, and where it is glossed
   that is its first use in the chapter. The book's rule is "the English term in
   parentheses once, at its first use in a chapter"; the check of rule 1 looks at pages one
   by one and has no notion of a first use, so the unit is the toc's chapter: a chapter
   folder (its index page, then its sections in toc order); the preface
   (chapters/zh/index.md) is a chapter of its own. Headings and run-in heads
   (**标准化输入。**) are not a first use: the gloss belongs in the running text. An
   occurrence inside a longer glossary term does not count (参数 in 参数服务器, 全归约 in
   环形全归约); for one-character terms (轮, 桶) only "at most once" is checked, since the
   character also occurs in other words.
3. A term marked ``basic: true`` (梯度, 参数, …) is glossed only in the preface or in the
   first chapter.
4. A term may list, under ``replaces``, renderings the book has dropped for it
   (``replaces: [数据份, 那一份数据, …]`` for shard). None of them may appear in the prose,
   headings included, nor in a Chinese definition of the glossary. They are literal
   strings, matched as written (English ones regardless of case), so each must be specific
   enough not to occur in correct text: 那一份数据, not 份 (一份参数, 部分) nor 份数据
   (同一份数据). English ones are not matched inside a gloss, 归约散播（reduce-scatter）.
"""
from __future__ import annotations

import re
from collections import defaultdict

import pytest
import yaml

from book import ROOT, source, toc_files

GLOSSARY = yaml.safe_load((ROOT / "glossary.yml").read_text(encoding="utf8"))
KEYS = {"en", "zh", "def_en", "def_zh"}
OPTIONAL = {"replaces", "basic"}


def english_names(entry) -> list[str]:
    """``'jit (just-in-time compilation)'`` answers to both of its names."""
    names = [entry["en"].lower()]
    m = re.fullmatch(r"(.+?) \((.+)\)", names[0])
    return names + list(m.groups()) if m else names


TERMS = {name: entry["zh"] for entry in GLOSSARY for name in english_names(entry)}
BASIC = {entry["zh"] for entry in GLOSSARY if entry.get("basic")}
REPLACED = {r: entry["zh"] for entry in GLOSSARY for r in entry.get("replaces", [])}
# A Chinese term followed by its English name in full-width parentheses: 小批量（minibatch）
FIRST_USE = re.compile(r"([\u4e00-\u9fff]+)（([A-Za-z][A-Za-z \-]*)）")
GLOSS = re.compile(r"（([A-Za-z][A-Za-z \-]*)）")
# Every Chinese term, longest first: at each position the longest term wins.
TERM = re.compile("|".join(sorted(map(re.escape, {e["zh"] for e in GLOSSARY}),
                                  key=len, reverse=True)))
KEPT_DIRECTIVES = ("{figure}",)          # their body (the caption) is prose


def prose(text: str) -> str:
    """The prose of a MyST page; everything else becomes blank (lines keep their numbers)."""
    def blank(m):
        return "\n" * m.group(0).count("\n") or " "

    def fence(m):
        if m.group(2).strip().startswith(KEPT_DIRECTIVES):     # keep the caption
            return "\n" + re.sub(r"^:\w[\w-]*:.*$", "", m.group(3), flags=re.M)
        return blank(m)
    text = re.sub(r"\A---\n.*?\n---\n", blank, text, flags=re.S)              # front matter
    text = re.sub(r"^(```+|:::+)([^\n]*)\n(.*?)^\1[ \t]*$", fence, text, flags=re.M | re.S)
    text = re.sub(r"<!--.*?-->", blank, text, flags=re.S)                   # comments
    text = re.sub(r"^\([\w-]+\)=[ \t]*$", "", text, flags=re.M)              # labels
    text = re.sub(r"\$\$.*?\$\$", blank, text, flags=re.S)                   # math
    text = re.sub(r"\$[^$\n]+\$", " ", text)
    text = re.sub(r"\{[\w:-]+\}`[^`]*`", " ", text)                        # roles
    text = re.sub(r"`[^`]*`", " ", text)                                   # inline code
    text = re.sub(r"\]\([^)]*\)", "]", text)                               # link targets
    return text


def body(text: str) -> str:
    """Prose without headings and run-in heads (**标准化输入。** opening a paragraph or an
    item): a term is glossed at its first use in the running text, not in a title."""
    text = re.sub(r"^#+ .*$", "", text, flags=re.M)
    text = re.sub(r"^(\s*(?:[*+-]|\d+\.)?\s*)\*\*[^*\n]+\*\*", r"\1", text, flags=re.M)
    return text


def wrong_terms(text: str) -> list[str]:
    """Rule 1: glosses whose Chinese is not the glossary's."""
    text = text.replace("*", "")                                # *模拟设备*（emulated device）
    return [f"{zh}（{en}）: the glossary says {TERMS[en.lower()]}"
            for zh, en in FIRST_USE.findall(text)
            if en.lower() in TERMS and not zh.endswith(TERMS[en.lower()])]


def gloss_problems(pages: list[tuple[str, str]], first_chapter: bool = True) -> list[str]:
    """Rules 2 and 3 for one chapter, given as (name, prose) pages in toc order."""
    seen: set[str] = set()               # terms used so far in the chapter
    glossed: dict[str, str] = {}         # term -> where it was glossed
    problems = []
    for name, text in pages:
        text = body(text).replace("*", "")
        for m in TERM.finditer(text):
            term = m.group(0)
            g = GLOSS.match(text, m.end())
            if g and TERMS.get(g.group(1).lower()) == term:
                line = text.count("\n", 0, m.start()) + 1
                where = f"{name}:{line} {term}（{g.group(1)}）"
                if term in glossed:
                    problems.append(f"{where}: glossed again (first at {glossed[term]})")
                elif term in seen and len(term) > 1:
                    problems.append(f"{where}: not the term's first use in the chapter")
                if term in BASIC and not first_chapter:
                    problems.append(f"{where}: a basic term, glossed only in the preface "
                                    "or the first chapter")
                glossed.setdefault(term, where)
            seen.add(term)
    return problems


def replaced_renderings(text: str) -> list[str]:
    """Rule 4: renderings the glossary has replaced, with a little context."""
    text = GLOSS.sub(" ", text.replace("*", ""))
    found = []
    for old, new in REPLACED.items():
        for m in re.finditer(re.escape(old), text, flags=re.I if old.isascii() else 0):
            context = " ".join(text[max(0, m.start() - 15):m.end() + 15].split())
            found.append(f"{old} (the glossary says {new}) in …{context}…")
    return found


def chapters() -> dict[str, list[str]]:
    """The Chinese toc grouped by chapter folder; the preface is one chapter."""
    grouped = defaultdict(list)
    for entry in toc_files("zh"):
        grouped[entry.rsplit("/", 1)[0] if entry.count("/") > 2 else entry].append(entry)
    return dict(grouped)


CHAPTERS = chapters()
FIRST = list(CHAPTERS)[:2]               # the preface and the first chapter


def page_prose(entry: str) -> str:
    return prose(source(entry).read_text(encoding="utf8"))


def test_entries_are_complete_and_unique():
    for entry in GLOSSARY:
        assert KEYS <= set(entry) <= KEYS | OPTIONAL, entry
        assert all(isinstance(entry[k], str) and entry[k].strip() for k in KEYS), entry
        assert isinstance(entry.get("basic", False), bool), entry
        assert isinstance(entry.get("replaces", []), list), entry
    for key in ("en", "zh"):
        values = [e[key] for e in GLOSSARY]
        assert len(values) == len(set(values)), f"a {key} term appears twice"


def test_replaced_renderings_are_safe():
    """A replaced rendering is no glossary term and occurs in none (it would match it)."""
    for old in REPLACED:
        assert old.strip() == old and old, old
        assert not any(old in e["zh"] for e in GLOSSARY), old


@pytest.mark.parametrize("entry", toc_files("zh"))
def test_chinese_chapters_write_glossary_terms_the_glossary_way(entry):
    """Rules 1 and 4 on one page."""
    text = page_prose(entry)
    wrong = wrong_terms(text) + replaced_renderings(text)
    assert not wrong, "\n".join(wrong)


def test_glossary_definitions_use_the_glossary_renderings():
    wrong = [f"{e['en']}: {w}" for e in GLOSSARY for w in replaced_renderings(e["def_zh"])]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("chapter", list(CHAPTERS))
def test_terms_are_glossed_once_per_chapter_at_first_use(chapter):
    pages = [(source(e).relative_to(ROOT).as_posix(), page_prose(e)) for e in CHAPTERS[chapter]]
    problems = gloss_problems(pages, first_chapter=chapter in FIRST)
    assert not problems, "\n".join(problems)


def test_the_chapters_are_the_toc_folders():
    assert FIRST == ["chapters/zh/index", "chapters/zh/devices"]
    assert CHAPTERS["chapters/zh/devices"][0] == "chapters/zh/devices/index"
    assert sum(map(len, CHAPTERS.values())) == len(toc_files("zh"))


# The checks must catch what they are for, and only that.

def test_the_check_catches_a_wrong_term():
    bad = "把一个小批次（minibatch）分到各个设备上"
    assert wrong_terms(bad) == ["把一个小批次（minibatch）: the glossary says 小批量"]
    assert wrong_terms("把一个小批量（minibatch）分到各个设备上") == []


def test_the_check_catches_a_second_gloss_and_a_late_one():
    once = "我们用全归约（allreduce）把梯度加起来。之后每一步都做一次全归约。"
    twice = once + "\n环形全归约（ring allreduce）也是一种全归约（allreduce）。"
    assert gloss_problems([("a.md", once)]) == []
    assert gloss_problems([("a.md", once), ("b.md", "环形全归约（ring allreduce）")]) == []
    [problem] = gloss_problems([("a.md", twice)])
    assert "a.md:2 全归约（allreduce）: glossed again (first at a.md:1" in problem
    # the second gloss fails in another page of the same chapter too
    assert gloss_problems([("a.md", once), ("b.md", "一次全归约（allreduce）")])
    late = "先做一次全归约，然后解释全归约（allreduce）。"
    assert "not the term's first use" in gloss_problems([("a.md", late)])[0]
    # the longer term 参数服务器 is not a use of 参数
    assert gloss_problems([("a.md", "参数服务器保存参数（parameter）。")]) == []
    assert "basic term" in gloss_problems([("a.md", "参数（parameter）")], first_chapter=False)[0]


def test_the_check_catches_a_replaced_rendering():
    assert replaced_renderings("把小批量拆成两种大小的数据份。")
    assert replaced_renderings("每个设备只拿到那一份数据")
    assert replaced_renderings("然后用NCCL的Reduce-Scatter求和")
    assert replaced_renderings("这里0号设备最快") and replaced_renderings("经由0号GPU")
    # no false positives: a copy of the parameters, 部分, the same data, the numbering the
    # book uses, glosses, code and math
    fine = ("每个设备都保存一份完整的参数，处理一部分数据；各部分数据的梯度；同一份数据的随机样本；"
            "0号进程、设备0和GPU 0；归约散播（reduce-scatter）和全收集（all-gather）。")
    assert replaced_renderings(fine) == []
    page = "用`数据份`和$\\text{数据份}$举例。\n\n```{code-cell} ipython3\nx = '数据份'\n```\n"
    assert replaced_renderings(prose(page)) == []


def test_prose_keeps_prose_only():
    page = ("---\njupytext: {}\n---\n\n(sec-x)=\n# 标题\n\n正文`code`里$x$的"
            "{ref}`sec-x`和[链接](https://a.b/数据份)。\n\n```{figure} a.svg\n:name: fig-a\n\n"
            "图注里的分片。\n```\n\n```{code-cell} ipython3\n# 注释里的数据份\n```\n")
    text = prose(page)
    assert " ".join(text.split()) == "# 标题 正文 里 的 和[链接]。 图注里的分片。"
    assert text.count("\n") == page.count("\n")          # problems are reported by line
    assert " ".join(body(text).split()) == "正文 里 的 和[链接]。 图注里的分片。"
    assert body("* **标准化输入。** 这就是标准化（standardization）。") == \
        "*  这就是标准化（standardization）。"


def test_a_chapter_of_myst_pages_is_checked_end_to_end():
    """Two synthetic pages of one chapter, through the same steps as the book's pages."""
    index = "(sec-a)=\n# 全归约\n\n本章用全归约（allreduce）把梯度加起来。\n"
    page = ("---\njupytext: {}\n---\n\n# 一节\n\n```{code-cell} ipython3\n"
            "x = '全归约（allreduce）'   # 全归约（allreduce）\n```\n\n"
            "先把小批量拆成两种大小的数据份，`数据份`在代码里不算。\n")
    pages = [("index.md", prose(index)), ("page.md", prose(page))]
    assert gloss_problems(pages) == []                    # code cells are not prose
    again = page + "\n环形全归约之后再说一次全归约（allreduce）。\n"
    [problem] = gloss_problems([pages[0], ("page.md", prose(again))])
    assert problem.startswith("page.md:13 全归约（allreduce）: glossed again (first at index.md:4")
    [found] = replaced_renderings(prose(page))
    assert found.startswith("数据份 (the glossary says 分片)")
    assert replaced_renderings(prose("## 每个元素两比特\n"))   # headings are checked too

"""The generated .ipynb files (tools/notebooks.py): up to date, self-contained, and
runnable top to bottom in a fresh kernel with an install cell that does no harm."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

from book import ROOT, notebooks as book_notebooks

import notebooks  # noqa: E402  (tools/notebooks.py, on sys.path through book.py)
import runs  # noqa: E402  (tools/runs.py)


def test_committed_notebooks_are_generated_from_the_sources():
    assert notebooks.main(["--check"]) == 0, "run: python tools/notebooks.py"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_one_notebook_per_myst_notebook(lang):
    generated = sorted(p.relative_to(notebooks.OUT / lang).with_suffix("").as_posix()
                       for p in (notebooks.OUT / lang).rglob("*.ipynb"))
    sources = sorted(p.relative_to(ROOT / "chapters" / lang).with_suffix("").as_posix()
                     for p in book_notebooks(lang))
    assert generated == sources


def test_chinese_notebooks_show_chinese_hints():
    """A Chinese notebook carries its English twin's outputs, with the checked exercises'
    lines said in Chinese: no hint of hints.yml in English, and the Chinese ones there."""
    from dpbook.exercises import HINTS
    shown = []
    for path in sorted((notebooks.OUT / "zh").rglob("*.ipynb")):
        text = "\n".join(o.get("text", "") for c in nbformat.read(path, as_version=4).cells
                         for o in c.get("outputs", []))
        assert not [h["en"] for h in HINTS.values() if h["en"] in text], path
        shown += [key for key, h in HINTS.items() if f"提示：{h['zh']}" in text]
    assert len(shown) >= 5, shown       # the pages' first attempts fail with their hints


def test_translate_checks():
    from dpbook.exercises import HINTS
    hint = HINTS["exception"]
    english = (f"x = 1\n✗ check_f: the smallest failing case is n=3\n  seen: [1, 2]\n"
               f"  hint: {hint['en']}\n  hint: a hint of the reader's own\n"
               f"✓ check_g: all 12 cases pass\n")
    assert notebooks.translate_checks(english, "zh") == (
        f"x = 1\n✗ check_f：没有通过的最小用例是n=3\n  实际结果：[1, 2]\n"
        f"  提示：{hint['zh']}\n  hint: a hint of the reader's own\n"
        f"✓ check_g：12个用例全部通过\n")
    assert notebooks.translate_checks(english, "en") == english


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_notebooks_are_self_contained(lang):
    for path in sorted((notebooks.OUT / lang).rglob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        leftovers = re.findall(
            r"\{(?:literalinclude|ref|numref|figure|doc|glue[:\w]*|dpbook-widget)\}", text)
        assert not leftovers, (path, leftovers)
        assert "../../../" not in text, path
        # The same code cells as the source, after the install cell.
        source = ROOT / "chapters" / path.relative_to(notebooks.OUT).with_suffix(".md")
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code[0].metadata["tags"] == ["dpbook-install"]
        assert [c.source for c in code[1:]] == \
            [c.source for c in jupytext.read(source).cells if c.cell_type == "code"]
        assert not code[0].outputs
        # The outputs of the stored cpu run (tools/runs.py), the English twin's, with the
        # checked exercises' lines in the notebook's language.
        en = ROOT / "chapters/en" / source.relative_to(ROOT / "chapters" / lang)
        run = runs.load(runs.stored_path(
            en.relative_to(ROOT).with_suffix("").as_posix(), "cpu"))
        run = notebooks.with_outputs_of(jupytext.read(source), run, str(path), lang)
        assert [c.outputs for c in code[1:]] == \
            [c.outputs for c in run.cells if c.cell_type == "code"], path
    scratch = (notebooks.OUT / lang / "from-scratch" / "pytorch.ipynb").read_text("utf8")
    assert "def allreduce(data" in scratch      # literalinclude became the code itself
    assert notebooks.STORED_NUMBERS[lang][:40] in scratch   # whose numbers the text shows
    assert "raw.githubusercontent.com/dpbook/dpbook/main/figures/data-parallel-step.svg" in scratch
    allreduce = (notebooks.OUT / lang / "communication" / "allreduce.ipynb").read_text("utf8")
    assert notebooks.WIDGET_TITLES["ring-replay"][lang] in allreduce   # the site's widget, named


def test_literalinclude_cuts_and_dedents_as_sphinx():
    """:pyobject:, :start-at:, :end-at: and :dedent: give the lines the site shows."""
    page = ROOT / "chapters/en/inside-ddp/pytorch.md"
    text = ("```{literalinclude} ../../../code/dpbook/torch/ddp_by_hand.py\n"
            ":pyobject: compare_worker\n:start-at: for step in range(steps):\n"
            ":end-at: optimizer.step()\n:dedent: 12\n```\n")
    code = notebooks.convert_markdown(text, page, "en", {}).splitlines()[2:-1]
    assert code[0].startswith("for step in range(steps):")
    assert code[-1] == "    optimizer.step()"
    assert all(line.startswith("    ") for line in code[1:] if line), code


def test_install_cell_installs_only_dpbook():
    nb = nbformat.read(notebooks.OUT / "en" / "from-scratch" / "jax.ipynb", as_version=4)
    install = next(c for c in nb.cells if c.cell_type == "code").source
    url = notebooks.repository()[0]
    assert f'"dpbook @ git+{url}@main#subdirectory=code"' in install
    assert 'find_spec("dpbook") is None' in install          # nothing happens when installed
    requires = importlib.metadata.requires("dpbook") or []      # the installed package's
    names = [re.split(r"[<>=!~ \[;(]", d)[0].strip().lower() for d in requires]
    assert "numpy" in names and not {"torch", "jax", "jaxlib", "flax", "optax"} & set(names), names


def _pip_freeze() -> str:
    return subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_generated_notebook_runs_in_a_fresh_kernel(tmp_path):
    """Downloaded into an empty folder and run top to bottom, as a reader would."""
    path = tmp_path / "pytorch.ipynb"
    path.write_text((notebooks.OUT / "zh" / "devices" / "pytorch.ipynb").read_text("utf8"),
                    encoding="utf8")
    nb = nbformat.read(path, as_version=4)
    before = _pip_freeze()
    env_scale = os.environ.get("DPBOOK_SCALE")
    os.environ["DPBOOK_SCALE"] = "quick"
    try:
        NotebookClient(nb, timeout=240, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if env_scale is None:
            os.environ.pop("DPBOOK_SCALE")
        else:
            os.environ["DPBOOK_SCALE"] = env_scale
    install = nb.cells[[c.cell_type for c in nb.cells].index("code")]
    assert install.outputs == [], install.outputs        # dpbook is here: it did nothing
    assert _pip_freeze() == before                       # and no package changed
    printed = json.dumps([c.get("outputs") for c in nb.cells], ensure_ascii=False)
    assert "hardware | " in printed and "scale: quick" in printed

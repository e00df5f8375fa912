"""The stored outputs (tools/runs.py): every English notebook has a current run at the
``cpu`` scale, without an error, and the key notices what would make a run stale."""
from __future__ import annotations

import copy
import shutil

import jupytext
import nbformat
import pytest

from book import ROOT, notebooks  # first: it puts tools/ on sys.path
import runs  # noqa: E402  (tools/runs.py)

ENTRIES = [p.relative_to(ROOT).with_suffix("").as_posix() for p in notebooks("en")]


def test_every_stored_output_is_current_and_has_no_error():
    """What CI checks without executing anything. On failure: run `make outputs`."""
    bad = runs.problems("cpu")
    message = "\n".join(f"  {runs.stored_path(e, 'cpu').relative_to(ROOT)}: {'; '.join(r)}"
                        for e, r in bad.items())
    assert not bad, (f"stored outputs are not current:\n{message}\n"
                     f"refresh them with `{runs.REFRESH}` (it executes only these)")


def test_no_stored_output_without_its_notebook():
    stored = {p.relative_to(runs.STORE / "cpu").with_suffix("").as_posix()
              for p in (runs.STORE / "cpu").rglob("*.ipynb")}
    assert stored == {e.removeprefix("chapters/en/") for e in ENTRIES}


@pytest.mark.parametrize("entry", ENTRIES)
def test_stored_run_is_a_cpu_run_with_its_hardware_line(entry):
    nb = runs.load(runs.stored_path(entry, "cpu"))
    text = "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                     for c in nb.cells for o in c.get("outputs", []))
    lines = [line for line in text.splitlines() if "hardware | " in line]
    assert lines and all("scale: cpu" in line for line in lines), lines
    assert "Traceback (most recent call last)" not in text
    record = nb.metadata["dpbook_run"]
    assert record["modules"], "a notebook of this book imports dpbook"
    assert set(record["versions"]) <= set(runs.FRAMEWORKS)
    assert {"cpu", "cores", "ram_gib", "gpus"} <= set(record["hardware"])
    # a cell that ends by glueing a value for the prose shows no stray value
    for cell in nb.cells:
        lines = [line for line in cell.source.splitlines() if line.strip()]
        if cell.cell_type == "code" and lines and lines[-1].startswith("glue("):
            shown = [o for o in cell.outputs if o.output_type == "execute_result"]
            assert not shown, (entry, cell.source[-200:], shown)
    # every figure is SVG, sharp at any size on the site (issue 30, item 10)
    png = [c.source.splitlines()[0] for c in nb.cells if c.cell_type == "code"
           for o in c.outputs if "image/png" in o.get("data", {})]
    assert not png, f"figures stored as PNG, in cells starting: {png}"
    # a visible cell writes nothing to stderr: no library chatter on the page (the
    # profiler's profiler_start lines once were); what a page shows of a log, it prints
    noise = [o["text"][:120] for c in nb.cells if c.cell_type == "code"
             and "remove-cell" not in c.metadata.get("tags", [])
             for o in c.outputs if o.get("name") == "stderr"]
    assert not noise, f"visible stderr output: {noise}"


# The key: what must make a run stale, and what must not.

MODULE = '''"""A module."""
import os


def f(x):
    """Return x + 1."""
    return x + 1  # the answer
'''


def test_python_code_ignores_comments_docstrings_and_layout():
    same = MODULE.replace("# the answer", "# another comment").replace(
        '"""Return x + 1."""', '"""Add one."""').replace("x + 1", "(x\n            + 1)")
    assert runs.python_code(same) == runs.python_code(MODULE)
    for changed in (MODULE.replace("x + 1", "x + 2"), MODULE.replace("import os", "")):
        assert runs.python_code(changed) != runs.python_code(MODULE)


def test_code_digest_ignores_comments_only():
    nb = jupytext.read(ROOT / f"{ENTRIES[0]}.md")
    first = next(c for c in nb.cells if c.cell_type == "code")
    digest = runs.code_digest(nb)
    first.source += "\n# a new comment"
    assert runs.code_digest(nb) == digest
    first.source += "\nx = 1"
    assert runs.code_digest(nb) != digest


@pytest.fixture
def stored_run():
    entry = "chapters/en/devices/pytorch"
    return entry, runs.load(runs.stored_path(entry, "cpu"))


def test_a_changed_module_makes_the_run_stale(stored_run, tmp_path):
    entry, nb = stored_run
    code_root = tmp_path / "code"
    shutil.copytree(runs.CODE / "dpbook", code_root / "dpbook")
    assert runs.stale_reasons(nb, entry, "cpu", code_root) == []
    name = "dpbook.torch.devices"
    assert name in nb.metadata["dpbook_run"]["modules"]
    path = runs.module_file(name, code_root)
    text = path.read_text(encoding="utf8")
    path.write_text(text + "\n# only a comment\n", encoding="utf8")
    assert runs.stale_reasons(nb, entry, "cpu", code_root) == []
    path.write_text(text + "\nNEW_CONSTANT = 1\n", encoding="utf8")
    assert runs.stale_reasons(nb, entry, "cpu", code_root) == [f"{name} changed"]
    path.unlink()
    assert runs.stale_reasons(nb, entry, "cpu", code_root) == [f"{name} is gone"]


def test_a_changed_code_cell_makes_the_run_stale(stored_run, tmp_path, monkeypatch):
    entry, nb = stored_run
    source = tmp_path / "notebook.md"
    text = runs.english_source(entry).read_text(encoding="utf8")
    monkeypatch.setattr(runs, "english_source", lambda _: source)
    source.write_text(text.replace("```{code-cell} ipython3\n", "```{code-cell} ipython3\n"
                                   "# a new comment\n", 1), encoding="utf8")
    assert runs.stale_reasons(nb, entry, "cpu") == []
    source.write_text(text + "\n```{code-cell} ipython3\nx = 1\n```\n", encoding="utf8")
    assert runs.stale_reasons(nb, entry, "cpu") == ["its code cells changed"]


def test_other_settings_versions_or_errors_make_the_run_stale(stored_run, monkeypatch):
    entry, nb = stored_run
    assert runs.stale_reasons(nb, entry, "quick") == ["scale was 'cpu', now 'quick'"]
    monkeypatch.setenv("DPBOOK_NUM_DEVICES", "4")
    assert runs.stale_reasons(nb, entry, "cpu") == ["num_devices was None, now '4'"]
    monkeypatch.delenv("DPBOOK_NUM_DEVICES")
    old = copy.deepcopy(nb)
    old.metadata["dpbook_run"]["versions"]["torch"] = "2.0.0"
    assert runs.stale_reasons(old, entry, "cpu") == \
        [f"torch was 2.0.0, now {runs.framework_version('torch')}"]
    other_build = copy.deepcopy(nb)      # the same release, another wheel (+cpu, +cu128)
    version = runs.framework_version("torch").split("+")[0]
    other_build.metadata["dpbook_run"]["versions"]["torch"] = version + "+cu128"
    assert runs.stale_reasons(other_build, entry, "cpu") == []
    failed = copy.deepcopy(nb)
    cell = next(c for c in failed.cells if c.cell_type == "code")
    cell.outputs.append(nbformat.v4.new_output("error", ename="AssertionError", evalue="",
                                               traceback=[]))
    assert runs.errors(failed) == [f"cell {failed.cells.index(cell)}: AssertionError: "]


def test_a_page_that_shows_an_edited_hint_is_stale(stored_run):
    """Hints are data: editing one re-runs only the pages whose outputs show it."""
    from dpbook.exercises import HINTS
    entry, nb = stored_run
    cell = next(c for c in nb.cells if c.cell_type == "code")
    shown = copy.deepcopy(nb)
    shown.cells[nb.cells.index(cell)].outputs.append(nbformat.v4.new_output(
        "stream", name="stdout", text=f"  hint: {HINTS['exception']['en']}\n"))
    assert runs.stale_reasons(shown, entry, "cpu") == []
    shown.cells[nb.cells.index(cell)].outputs.append(nbformat.v4.new_output(
        "stream", name="stdout", text="✗ check: the smallest failing case is n=1\n"
                                      "  hint: a hint as it read before an edit\n"))
    assert runs.stale_reasons(shown, entry, "cpu") == ["a hint it shows was edited in hints.yml"]

"""Every notebook of both tocs runs top to bottom in quick mode, without an error.

A Chinese notebook has the same code cells as its English twin, comments aside
(tests/test_parity.py), so it is not run a second time: it gets the outputs of the English
run, cell by cell, after this file checks once more that the code is the same. The English
runs, with their run records (tools/runs.py), go where the book build looks for earlier
runs, so the test site shows outputs of real runs of exactly that code.
"""
from __future__ import annotations

import jupytext
import pytest

from book import ROOT, notebooks, with_outputs_of  # first: it puts tools/ on sys.path
import runs  # noqa: E402  (tools/runs.py)
from dpbook.exercises import HINTS
from conftest import require_data

pytestmark = pytest.mark.notebook     # executes notebooks (make test-fast skips them)

NOTEBOOKS = notebooks("en") + notebooks("zh")


def execute(path, **env):
    """Execute a MyST notebook in a fresh kernel at the quick scale (tools/runs.py)."""
    env["DPBOOK_DATA"] = str(require_data().resolve())     # never download in tests
    return runs.execute(path, "quick", env, timeout=600, progress=False)


def outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


EXECUTED = {}    # English notebook (relative to chapters/en) -> its executed notebook


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_runs(path, book_out):
    en = ROOT / "chapters/en"
    twin = None if path.is_relative_to(en) else path.relative_to(ROOT / "chapters/zh")
    if twin in EXECUTED:
        nb = with_outputs_of(jupytext.read(path), EXECUTED[twin], str(path), "zh")
    else:                      # an English notebook, or a Chinese one run on its own (-k)
        nb = execute(path, **({} if path.is_relative_to(en) else {"DPBOOK_LANG": "zh"}))
        if path.is_relative_to(en):
            EXECUTED[path.relative_to(en)] = nb
    text = outputs_text(nb)
    assert "hardware | " in text, "a notebook must print the hardware line of its run"
    assert "scale: quick" in text
    if not path.is_relative_to(en):     # a Chinese page shows its checks' hints in Chinese
        english = [h["en"] for h in HINTS.values() if h["en"] in text]
        assert not english, english
    if path.is_relative_to(en):     # where the test build of the book looks for runs
        entry = path.relative_to(ROOT).with_suffix("").as_posix()
        runs.save(nb, runs.stored_path(entry, "quick", book_out / "outputs"))


# The from-scratch chapter must work for any number of devices. Beyond the default run
# (2 devices), 3 exercises something new: it divides none of the batch sizes. One device
# (no communication) and 1–8 devices are checked on the chapter's helpers in
# tests/test_scratch_*.py; re-running the whole notebooks with 1 and 8 devices cost 70 s
# of the suite and exercised nothing more.
SCRATCH = [p for p in notebooks("en") if p.parent.name == "from-scratch"]


@pytest.mark.parametrize("num_devices", ["3"])
@pytest.mark.parametrize("path", SCRATCH, ids=lambda p: str(p.relative_to(ROOT)))
def test_from_scratch_runs_with_any_device_count(path, num_devices):
    nb = execute(path, DPBOOK_NUM_DEVICES=num_devices)
    assert f"devices ({num_devices}):" in outputs_text(nb)

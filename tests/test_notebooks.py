"""Every notebook of both tocs runs top to bottom in quick mode, without an error.

A Chinese notebook has the same code cells as its English twin, comments aside
(tests/test_parity.py), so it is not run a second time: it gets the outputs of the English
run, cell by cell, after this file checks once more that the code is the same. Both go
into the book build's execution cache, so the site shows outputs of real runs of exactly
that code.
"""
from __future__ import annotations

import importlib.util
import os

import jupytext
import pytest
from nbclient import NotebookClient

from book import ROOT, notebooks, with_outputs_of
from conftest import shared_data_dir

NOTEBOOKS = notebooks("en") + notebooks("zh")


def execute(path, **env):
    """Execute a MyST notebook in a fresh kernel; return the executed notebook."""
    nb = jupytext.read(path)
    saved = dict(os.environ)
    os.environ.update({"DPBOOK_SCALE": "quick", **env})
    data = shared_data_dir()
    if data is not None:                       # never download in tests
        os.environ["DPBOOK_DATA"] = str(data.resolve())
    os.environ.pop("XLA_FLAGS", None)          # the kernel must set its own device count
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return nb


def outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def store_in_book_cache(nb, path, out):
    """Put an executed notebook where the quick book build's jupyter-cache looks for it."""
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn
    spec = importlib.util.spec_from_file_location("build_book", ROOT / "tools/build_book.py")
    build_book = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_book)
    cache = get_cache(str(build_book.cache_folder("quick", out)))
    cache.cache_notebook_bundle(CacheBundleIn(nb, str(path)), overwrite=True)


EXECUTED = {}    # English notebook (relative to chapters/en) -> its executed notebook


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_runs(path, book_out):
    en = ROOT / "chapters/en"
    twin = None if path.is_relative_to(en) else path.relative_to(ROOT / "chapters/zh")
    if twin in EXECUTED:
        nb = with_outputs_of(jupytext.read(path), EXECUTED[twin], str(path))
    else:                      # an English notebook, or a Chinese one run on its own (-k)
        nb = execute(path)
        if path.is_relative_to(en):
            EXECUTED[path.relative_to(en)] = nb
    text = outputs_text(nb)
    assert "hardware | " in text, "a notebook must print the hardware line of its run"
    assert "scale: quick" in text
    store_in_book_cache(nb, path, book_out)


# The from-scratch chapter must work for any number of devices, including 1 and a number
# that does not divide the batch sizes (3).
SCRATCH = [p for p in notebooks("en") if p.parent.name == "from-scratch"]


@pytest.mark.parametrize("num_devices", ["1", "3", "8"])
@pytest.mark.parametrize("path", SCRATCH, ids=lambda p: str(p.relative_to(ROOT)))
def test_from_scratch_runs_with_any_device_count(path, num_devices):
    nb = execute(path, DPBOOK_NUM_DEVICES=num_devices)
    assert f"devices ({num_devices}):" in outputs_text(nb)

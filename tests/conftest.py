"""Shared test setup.

* JAX gets 8 emulated CPU devices: the flag is set here, before any test imports jax.
* Tests run at ``DPBOOK_SCALE=quick`` unless the environment says otherwise.
* One JAX compilation cache serves the session (``JAX_COMPILATION_CACHE_DIR``).
* Markers ``gpu``, ``multigpu`` and ``slow`` skip with a reason naming what is missing.
* Without Fashion-MNIST the tests that need it skip, saying why; with
  ``DPBOOK_REQUIRE_DATA=1`` (set by ``.ci/run``) they fail instead.
* Tests marked ``multiprocess`` fail if a process they started is still alive afterwards.

Helpers the test modules import live in ``tests/helpers.py`` (a plain module, not this one).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import dpbook
import helpers
from helpers import NUM_JAX_DEVICES, live_children, no_children_left, require_data

dpbook.emulate_cpu_devices(NUM_JAX_DEVICES)
os.environ.setdefault("DPBOOK_SCALE", "quick")
os.environ.setdefault("MPLBACKEND", "Agg")

# One JAX compilation cache for the whole session, inherited by every notebook kernel and
# subprocess: the Chinese notebooks run the same JAX code as the English ones, and reuse
# its compiled programs (a JAX notebook then runs in about half the time).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    _jax_cache = tempfile.mkdtemp(prefix="dpbook-jax-cache-")
    atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_jax_cache,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def _num_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


@pytest.hookimpl(tryfirst=True)    # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    # Tests of the built site run last: test_notebooks stores the runs the site build
    # then reuses (see `book_out`), whatever the file names.
    items.sort(key=lambda item: "site" in getattr(item, "fixturenames", ()))
    # Under pytest-xdist (`make test` runs two workers) the notebooks and the site that
    # reuses their runs share one worker, in this order; the other tests share the rest.
    for item in items:
        if {"book_out", "site"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("book"))
    num_gpus = None
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow test: pass --run-slow to run it"))
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            if num_gpus is None:
                num_gpus = _num_gpus()
            need = 2 if "multigpu" in item.keywords else 1
            if num_gpus < need:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs {need} CUDA GPU(s); torch.cuda.device_count() is {num_gpus}"))


@pytest.fixture(scope="session")
def fashion_mnist_dir() -> Path:
    """The real dataset (see :func:`require_data`)."""
    return require_data()


@pytest.fixture(scope="session")
def book_out(tmp_path_factory) -> Path:
    """The build folder of the test build of the book (tools/build_book.py --out).

    tests/test_notebooks.py stores the notebooks it executes in this folder's
    ``outputs/quick/``, where the book build (the ``site`` fixture; its tests are sorted
    last) finds them and does not execute them a second time.
    """
    return tmp_path_factory.mktemp("book")


@pytest.fixture(scope="session")
def site(book_out) -> Path:
    """The test build of the site: both editions at the quick scale, warnings as errors.

    ``DPBOOK_TEST_SITE=<folder>`` tests an existing site instead (one built with
    ``tools/build_book.py --scale quick``), to iterate on the site tests quickly.
    """
    import subprocess
    import sys
    if os.environ.get("DPBOOK_TEST_SITE"):
        return Path(os.environ["DPBOOK_TEST_SITE"]).resolve()
    result = subprocess.run([sys.executable, str(helpers.ROOT / "tools/build_book.py"),
                             "--scale", "quick", "-W", "--out", str(book_out)],
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, (result.stdout[-4000:] + result.stderr[-4000:])
    assert f"open {book_out / 'site' / 'index.html'}" in result.stdout
    return book_out / "site"


@pytest.fixture(autouse=True)
def _no_leftover_processes(request):
    """Under the ``multiprocess`` marker: the test fails if a process it started (a
    worker, a torchrun agent, a server) is still alive a few seconds after it ended."""
    if request.node.get_closest_marker("multiprocess") is None:
        yield
        return
    before = {p.pid for p in live_children()}
    yield
    assert no_children_left(exclude=before), [p.cmdline() for p in live_children(before)]

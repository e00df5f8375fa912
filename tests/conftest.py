"""Shared test setup.

* JAX gets 8 emulated CPU devices: the flag is set here, before any test imports jax.
* Tests run at ``DPBOOK_SCALE=quick`` unless the environment says otherwise.
* One JAX compilation cache serves the session (``JAX_COMPILATION_CACHE_DIR``).
* Markers ``gpu``, ``multigpu`` and ``slow`` skip with a reason naming what is missing.
* Without Fashion-MNIST the tests that need it skip, saying why; with
  ``DPBOOK_REQUIRE_DATA=1`` (set by ``.ci/run``) they fail instead.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import dpbook

ROOT = Path(__file__).resolve().parent.parent
NUM_JAX_DEVICES = 8
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


def pytest_collection_modifyitems(config, items):
    # Tests of the built site run last: test_notebooks stores the runs the site build
    # then reuses (see `book_out`), whatever the file names.
    items.sort(key=lambda item: "site" in getattr(item, "fixturenames", ()))
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


def shared_data_dir() -> Path | None:
    """A folder with valid Fashion-MNIST files, or None: $DPBOOK_DATA, then ../shared."""
    candidates = [os.environ.get("DPBOOK_DATA"), ROOT.parent / "shared" / "fashion-mnist"]
    for c in candidates:
        if c and all((Path(c) / name).is_file() for name in dpbook.data.FILES):
            return Path(c)
    return None


def require_data() -> Path:
    """The dataset folder; without one, skip the calling test (saying why), or fail it
    when ``DPBOOK_REQUIRE_DATA=1`` — tests never download."""
    folder = shared_data_dir()
    if folder is None:
        why = ("Fashion-MNIST not found: set DPBOOK_DATA to a folder with the four "
               "official .gz files (tests never download)")
        if os.environ.get("DPBOOK_REQUIRE_DATA") == "1":
            pytest.fail(why + "; DPBOOK_REQUIRE_DATA=1 forbids skipping", pytrace=False)
        pytest.skip(why)
    return folder


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
    result = subprocess.run([sys.executable, str(ROOT / "tools/build_book.py"),
                             "--scale", "quick", "-W", "--out", str(book_out)],
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, (result.stdout[-4000:] + result.stderr[-4000:])
    assert f"open {book_out / 'site' / 'index.html'}" in result.stdout
    return book_out / "site"


def live_children(exclude: set[int] = frozenset()) -> list:
    """This process's live descendants, except the PIDs in ``exclude`` and multiprocessing's
    resource tracker (one per parent process, kept until the parent exits, by design)."""
    import psutil
    alive = []
    for p in psutil.Process().children(recursive=True):
        try:
            if (p.pid not in exclude and p.status() != psutil.STATUS_ZOMBIE
                    and not any("resource_tracker" in part for part in p.cmdline())):
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def no_children_left(timeout: float = 10, exclude: set[int] = frozenset()) -> bool:
    """True once no process started by this one (outside ``exclude``) is alive."""
    import time
    deadline = time.monotonic() + timeout
    while live_children(exclude):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True

"""Helpers several test modules share (a plain module: tests import it, not conftest)."""
from __future__ import annotations

import contextlib
import functools
import http.server
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

import dpbook

ROOT = Path(__file__).resolve().parent.parent
NUM_JAX_DEVICES = 8          # emulated by conftest before any test imports jax

# Parameter counts of the book's models, the same in both frameworks (d2l's LeNet with
# ReLU and max-pooling, LeNet-5, and the ResNet-18 variant at three widths).
PARAMS = {"lenet": 129_068, "lenet5": 61_706}
RESNET18_PARAMS = {4: 44_738, 16: 701_930, 64: 11_175_818}


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
    deadline = time.monotonic() + timeout
    while live_children(exclude):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    requests: list[str] | None = None

    def log_message(self, *args):
        if self.requests is not None:
            self.requests.append(self.path)


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass          # a client closing a connection early is not an error of the site


@contextlib.contextmanager
def serve_folder(folder: str | os.PathLike, requests: list[str] | None = None
                 ) -> Iterator[str]:
    """Serve ``folder`` over HTTP on a free port of 127.0.0.1 while the block runs; yields
    the base URL. The paths requested are appended to ``requests`` if one is given."""
    handler = type("Handler", (_QuietHandler,), {"requests": requests})
    httpd = _QuietServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


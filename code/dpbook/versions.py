"""The oldest torch, jax, flax and optax releases the chapters work with, checked on import.

Colab and a reader's GPU box come with their own releases. ``import dpbook.torch`` and
``import dpbook.jax`` (every chapter's first cell) compare them with :data:`MINIMUM` and
stop with one line that says which package is too old and how to upgrade it, instead of
an ``AttributeError`` deep inside a later cell; the few modules that need more (FSDP2 on
CPU processes) check their own floor when a page imports them (:func:`require_for`). The
releases are data, in ``versions.yml`` beside this file. The book itself is built and
tested with the exact releases pinned in ``requirements.txt``, and ``tools/compat.sh``
runs its pages with exactly these minimums. Set ``DPBOOK_IGNORE_VERSIONS=1`` to try an
older release anyway.

>>> parse("2.13.0+cpu")
(2, 13, 0)
>>> too_old("torch", "2.5.1") is None
False
>>> too_old("torch", "2.13.0") is None
True
"""
from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

__all__ = ["MINIMUM", "MODULE_MINIMUM", "VersionError", "parse", "installed", "too_old",
           "upgrade_spec", "require", "require_for"]


def _load() -> dict:
    import yaml
    return yaml.safe_load((Path(__file__).with_name("versions.yml")).read_text("utf8"))


#: package → (oldest release, what older ones lack), from ``versions.yml`` (``book``)
MINIMUM: dict[str, tuple[str, str]] = {
    p: (v["version"], v["lacks"]) for p, v in _load()["book"].items()}
#: module → {package → (oldest release, what older ones lack)}, for the few modules that
#: need more than the book (``versions.yml``, ``modules``)
MODULE_MINIMUM: dict[str, dict[str, tuple[str, str]]] = {
    m: {p: (v["version"], v["lacks"]) for p, v in need.items()}
    for m, need in (_load().get("modules") or {}).items()}


class VersionError(ImportError):
    """An installed package is older than the chapters need."""


def parse(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2.13.0+cpu"`` → ``(2, 13, 0)``,
    ``"0.8.0rc1"`` → ``(0, 8, 0)``."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != part:      # "0rc1": a pre-release of 0; stop here
            break
    return tuple(parts)


def installed(package: str) -> str | None:
    """The installed release of ``package`` (from its metadata, without importing it)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def too_old(package: str, version: str | None = None,
            minimum: dict[str, tuple[str, str]] | None = None, who: str = "dpbook"
            ) -> str | None:
    """The one-line message if ``package`` (at ``version``, default: installed) is older
    than ``minimum`` (default :data:`MINIMUM`), else ``None``."""
    version = installed(package) if version is None else version
    oldest, reason = (MINIMUM if minimum is None else minimum)[package]
    if version is None or parse(version) >= parse(oldest):
        return None
    return (f"{who} needs {package} >= {oldest} (this is {version}; older releases lack "
            f"{reason}): pip install -U '{upgrade_spec(package, oldest)}' and restart the "
            "kernel")


def upgrade_spec(package: str, oldest: str) -> str:
    """What to ``pip install -U``: for jax on a machine with JAX's CUDA plugin
    (``jax-cuda12-plugin``, ``jax-cuda13-plugin``), ``jax[cuda12]>=…``, which upgrades the
    plugin with jax. A plain ``jax>=…`` would leave the old plugin behind, and jax would
    then run on the CPU."""
    if package == "jax":
        for cuda in ("cuda13", "cuda12"):
            if installed(f"jax-{cuda}-plugin") is not None:
                return f"jax[{cuda}]>={oldest}"
    return f"{package}>={oldest}"


def require(*packages: str) -> None:
    """Raise :class:`VersionError` for the first of ``packages`` that is too old (unless
    ``DPBOOK_IGNORE_VERSIONS=1``)."""
    if os.environ.get("DPBOOK_IGNORE_VERSIONS") == "1":
        return
    for package in packages:
        message = too_old(package)
        if message is not None:
            raise VersionError(message)


def require_for(module: str) -> None:
    """Raise :class:`VersionError` if a package is older than what ``module`` needs
    (:data:`MODULE_MINIMUM`; nothing beyond the book's minimum for most modules). The
    module calls it when it is imported, so the page that imports it stops in its first
    cell, saying what to upgrade (unless ``DPBOOK_IGNORE_VERSIONS=1``)."""
    if os.environ.get("DPBOOK_IGNORE_VERSIONS") == "1":
        return
    for package in MODULE_MINIMUM.get(module, {}):
        message = too_old(package, minimum=MODULE_MINIMUM[module], who=module)
        if message is not None:
            raise VersionError(message)

"""The oldest torch, jax, flax and optax releases the chapters work with, checked on import.

Colab and a reader's GPU box come with their own releases. ``import dpbook.torch`` and
``import dpbook.jax`` (every chapter's first cell) compare them with :data:`MINIMUM` and
stop with one line that says which package is too old and how to upgrade it, instead of
an ``AttributeError`` deep inside a later cell. The book itself is built and tested with
the exact releases pinned in ``requirements.txt``. Set ``DPBOOK_IGNORE_VERSIONS=1`` to
try an older release anyway.

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

__all__ = ["MINIMUM", "VersionError", "parse", "installed", "too_old", "upgrade_spec",
           "require"]

#: package → (oldest release, what older ones lack)
MINIMUM: dict[str, tuple[str, str]] = {
    "torch": ("2.6", "torch.distributed.get_default_backend_for_device"),
    "jax": ("0.8.2", "lax.pcast (jax 0.8.0 and 0.8.1 have jax.shard_map with check_vma but "
                     "not lax.pcast)"),
    "flax": ("0.11.0", "nnx.Optimizer.update(model, grads)"),
    "optax": ("0.2.4", "optax releases that support jax >= 0.8"),
}


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


def too_old(package: str, version: str | None = None) -> str | None:
    """The one-line message if ``package`` (at ``version``, default: installed) is older
    than :data:`MINIMUM`, else ``None``."""
    version = installed(package) if version is None else version
    oldest, reason = MINIMUM[package]
    if version is None or parse(version) >= parse(oldest):
        return None
    return (f"dpbook needs {package} >= {oldest} (this is {version}; older releases lack "
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

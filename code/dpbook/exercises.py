"""Checked exercises: run a reader's function on the cases a careless solution gets wrong,
and print either a pass or the smallest failing case with a hint. Framework-free.

A check is a list of cases, smallest first, and a function that runs the reader's code on
one case and returns ``None`` (right) or a :class:`Failure`: the key of a hint and what was
seen. The hints of every check, the framework parts' included (:mod:`dpbook.torch.exercises`,
:mod:`dpbook.jax.exercises`), are data: ``hints.yml``, one text per language
(:data:`HINTS`). A hint says what is wrong and where to look, never the solution.

The language is ``$DPBOOK_LANG`` (``en`` or ``zh``); the notebooks that
``tools/notebooks.py`` writes set it in their first cell, so the same code cells answer in
each edition's language. Without it, a notebook under a ``zh/`` folder opened in Jupyter
answers in Chinese (:func:`language`), anything else in English.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable

__all__ = ["LANGUAGES", "language", "Failure", "HINTS", "MESSAGES", "run_check",
           "check_split_sizes", "split_sizes_reference", "check_pad_batch"]

LANGUAGES = ("en", "zh")


def language() -> str:
    """``$DPBOOK_LANG`` if it is one of ``LANGUAGES``; else ``'zh'`` in a notebook of the
    Chinese edition opened in Jupyter (its path, ``$JPY_SESSION_NAME``, contains ``/zh/``);
    else ``'en'``."""
    lang = os.environ.get("DPBOOK_LANG", "").strip().lower()
    if lang in LANGUAGES:
        return lang
    return "zh" if "/zh/" in os.environ.get("JPY_SESSION_NAME", "") else "en"


@dataclasses.dataclass
class Failure:
    """What went wrong on one case: the key of a hint in :data:`HINTS`, and what was seen
    (numbers and shapes, language-neutral)."""

    hint: str
    seen: str = ""


def _load_hints() -> dict[str, dict[str, str]]:
    import yaml
    from importlib.resources import files
    return yaml.safe_load(files(__package__).joinpath("hints.yml").read_text(encoding="utf8"))


#: Every check's hints, key → language → text: data in ``hints.yml`` beside this module.
HINTS: dict[str, dict[str, str]] = _load_hints()

#: The lines around a hint, per language.
MESSAGES = {
    "pass": {"en": "✓ {name}: all {n} cases pass",
             "zh": "✓ {name}：{n}个用例全部通过"},
    "fail": {"en": "✗ {name}: the smallest failing case is {case}",
             "zh": "✗ {name}：没有通过的最小用例是{case}"},
    "seen": {"en": "  seen: {seen}", "zh": "  实际结果：{seen}"},
    "hint": {"en": "  hint: {hint}", "zh": "  提示：{hint}"},
}


def run_check(name: str, cases: Iterable[tuple[str, Any]],
              run_case: Callable[[Any], Failure | None], quiet: bool = False) -> Failure | None:
    """Run ``run_case`` on each ``(description, case)`` in order (smallest first) and stop
    at the first failure; print a pass or the failing case, what was seen and the hint, in
    :func:`language`. Returns the :class:`Failure` (``None`` on a pass), so a test can
    check which hint a wrong solution gets."""
    import traceback
    lang = language()
    cases = list(cases)
    for description, case in cases:
        try:
            failure = run_case(case)
        except Exception as e:  # noqa: BLE001 - the reader's code may raise anything
            if not quiet:
                traceback.print_exception(type(e), e, e.__traceback__, limit=-2)
            failure = Failure("exception", f"{type(e).__name__}: {e}")
        if failure is not None:
            if not quiet:
                print(MESSAGES["fail"][lang].format(name=name, case=description))
                if failure.seen:
                    print(MESSAGES["seen"][lang].format(seen=failure.seen))
                print(MESSAGES["hint"][lang].format(hint=HINTS[failure.hint][lang]))
            return failure
    if not quiet:
        print(MESSAGES["pass"][lang].format(name=name, n=len(cases)))
    return None


def split_sizes_reference(n: int, k: int, weights=None) -> list[int]:
    """The package's answer (:func:`dpbook.devices.split_sizes`), for comparison."""
    from .devices import split_sizes
    return split_sizes(n, k, weights)


def check_split_sizes(fn: Callable[..., list[int]], quiet: bool = False) -> Failure | None:
    """Check ``fn(n, k, weights=None) -> list of k sizes`` for ``n >= k``: every example
    placed once, the sizes as even as possible, or, with weights, one example per device
    and the rest within 1 of its weighted share (the contract of
    :func:`dpbook.devices.split_sizes`)."""
    cases = []
    for n in (1, 5, 7, 10, 64, 1000):
        for k in (1, 2, 3, 4, 8):
            if n >= k:                      # every device gets at least one example
                cases.append((f"n={n}, k={k}", (n, k, None)))
    for n, weights in ((10, [1, 1]), (10, [3, 1]), (7, [1, 2, 4]), (100, [0.5, 0.3, 0.2]),
                       (1000, [2, 1, 1, 1]), (5, [10, 1, 1])):
        cases.append((f"n={n}, weights={weights}", (n, len(weights), weights)))
    cases.sort(key=lambda c: (c[1][0], c[1][1]))

    def run_case(case):
        n, k, weights = case
        sizes = list(fn(n, k, weights) if weights is not None else fn(n, k))
        seen = f"sizes {sizes}"
        if len(sizes) != k:
            return Failure("split-sizes-count", seen)
        if sum(sizes) != n or any(s < 0 for s in sizes):
            return Failure("split-sizes-total", seen)
        if weights is None:
            if max(sizes) - min(sizes) > 1:
                return Failure("split-sizes-even", seen)
        else:
            total = sum(weights)
            if any(abs(s - 1 - (n - k) * w / total) >= 1 for s, w in zip(sizes, weights)):
                return Failure("split-sizes-weights", seen)
        return None

    return run_check("split_sizes", cases, run_case, quiet)


def check_pad_batch(fn: Callable, quiet: bool = False) -> Failure | None:
    """Check ``fn(X, y, sizes) -> (X_pad, y_pad, mask)`` (numpy arrays), the layout of
    :func:`dpbook.jax.unequal.pad_batch`: N blocks of ``m = max(sizes)`` rows, block i
    holding device i's ``sizes[i]`` examples in order and then zeros, and a float32 mask
    that is 1 on the real rows. Even splits first, then uneven ones."""
    import numpy as np
    cases = [(f"sizes {sizes}", sizes) for sizes in (
        [1], [2, 2], [3, 3, 3], [2, 1], [3, 1, 2], [1, 4, 2, 1], [5, 1, 1, 1])]

    def run_case(sizes):
        n, k, m = sum(sizes), len(sizes), max(sizes)
        X = np.arange(1, 2 * n + 1, dtype=np.float32).reshape(n, 2)
        y = np.arange(1, n + 1, dtype=np.int32)
        X_pad, y_pad, mask = (np.asarray(a) for a in fn(X.copy(), y.copy(), list(sizes)))
        if X_pad.shape != (k * m, 2) or y_pad.shape != (k * m,) or mask.shape != (k * m,):
            return Failure("pad-shape", f"shapes {X_pad.shape}, {y_pad.shape}, {mask.shape} "
                           f"for {k} blocks of {m} rows")
        start = 0
        for i, size in enumerate(sizes):
            block = slice(i * m, i * m + size)
            if not (np.array_equal(X_pad[block], X[start:start + size])
                    and np.array_equal(y_pad[block], y[start:start + size])):
                return Failure("pad-rows", f"block {i} starts with y = "
                               f"{y_pad[i * m:(i + 1) * m].tolist()}, expected "
                               f"{y[start:start + size].tolist()} then padding")
            start += size
        real = np.zeros(k * m, bool)
        for i, size in enumerate(sizes):
            real[i * m:i * m + size] = True
        if mask.dtype != np.float32 or not np.array_equal(mask, real.astype(np.float32)):
            return Failure("pad-mask", f"mask {mask.tolist()} ({mask.dtype})")
        if np.any(X_pad[~real] != 0) or np.any(y_pad[~real] != 0):
            return Failure("pad-zeros", f"padding rows of X: {X_pad[~real].tolist()}")
        return None

    return run_check("pad_batch", cases, run_case, quiet)

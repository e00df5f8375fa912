"""Checked exercises: run a reader's function on the cases a careless solution gets wrong,
and print either a pass or the smallest failing case with a hint. Framework-free.

A check is a list of cases, smallest first, and a function that runs the reader's code on
one case and returns ``None`` (right) or a :class:`Failure`: the key of a hint and what was
seen. The hints are data, one text per language (:data:`HINTS`); the framework parts
(:mod:`dpbook.torch.exercises`, :mod:`dpbook.jax.exercises`) add theirs. A hint says what
is wrong and where to look, never the solution.

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
    """``$DPBOOK_LANG`` if it is one of :data:`LANGUAGES`; else ``'zh'`` in a notebook of the
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


#: Hints shared by the checks; the framework modules add theirs to this dict.
HINTS: dict[str, dict[str, str]] = {
    "exception": {
        "en": "your function raised an exception on this case (shown above the hint)",
        "zh": "你的函数在这个用例上抛出了异常（见提示上方）"},
    "split-sizes-total": {
        "en": "the sizes must add up to n: every example goes to some device, none twice",
        "zh": "各份大小之和必须等于n：每个样本都要分给某个设备，且只分一次"},
    "split-sizes-even": {
        "en": "without weights, two sizes may differ by at most 1: give the remainder "
              "n mod k to some devices, one example each",
        "zh": "不给权重时，任意两份的大小最多相差1："
              "把余数n mod k分给其中几个设备，每个多分一个样本"},
    "split-sizes-weights": {
        "en": "with weights, every device gets one example and the other n - k are shared in "
              "proportion: each size within 1 of 1 + (n - k) × weight / sum(weights)",
        "zh": "给了权重时，每个设备先分到一个样本，其余n - k个按权重的比例分配：每一份的大小与"
              "1 + (n - k) × 权重 / 权重之和的差小于1"},
    "split-sizes-count": {
        "en": "return one size per device: a list of k sizes",
        "zh": "每个设备对应一个大小：返回由k个大小组成的列表"},
    "pad-shape": {
        "en": "every device runs the same program, so every block has m = max(sizes) rows: "
              "X and y must have N × m rows and the mask N × m entries",
        "zh": "每个设备运行同一个程序，所以每一块都有m = max(sizes)行："
              "X和y必须有N × m行，掩码有N × m个元素"},
    "pad-rows": {
        "en": "block i (rows i × m to (i + 1) × m - 1) must start with device i's "
              "sizes[i] examples, in order, then padding: pad each block, not the batch's end",
        "zh": "第i块（第i × m行到第(i + 1) × m - 1行）开头必须按顺序放设备i的sizes[i]个样本，"
              "后面才是填充：要填充每一块，而不是整个批量的末尾"},
    "pad-mask": {
        "en": "the mask must be 1.0 for a real example and 0.0 for a padding row (float32: "
              "the loss multiplies by it and divides by its sum)",
        "zh": "掩码对真实样本为1.0，对填充行为0.0（float32：损失要乘以它，再除以它的和）"},
    "pad-zeros": {
        "en": "the padding rows must be zeros, a valid input: the masked loss multiplies them "
              "by 0, and 0 × NaN or 0 × inf would still spoil the sum",
        "zh": "填充行必须是零，也就是合法的输入：带掩码的损失会把它们乘以0，"
              "而0 × NaN或0 × inf仍会破坏求和"},
}

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
                       (1000, [2, 1, 1, 1])):
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

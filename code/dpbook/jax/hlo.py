"""What XLA compiled: the collective instructions in a jitted function's optimized HLO.

One parser, :func:`collectives`, reads every collective instruction with its result type;
:func:`allreduce_ops` (the concise chapter: where ``jit`` put the gradient all-reduce) and
:func:`collective_ops` (the communication chapter: the ring's ``collective-permute`` instructions
against ``psum``'s one ``all-reduce``) are two views of it.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Callable

__all__ = ["COLLECTIVES", "compiled_text", "collectives", "allreduce_ops", "collective_ops"]

#: The HLO names of the collective instructions.
COLLECTIVES = ("all-reduce", "collective-permute", "all-gather", "reduce-scatter", "all-to-all")

# `%name = <result type> <kind>(` or, for an asynchronous pair, `<kind>-start(` (the
# matching `-done` is not counted). A result type is one array or a tuple of them.
_INSTRUCTION = re.compile(r"= (\(.*?\)|\S+) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_LAYOUT_OR_COMMENT = re.compile(r"\{[^}]*\}|/\*.*?\*/")


def compiled_text(jitted: Callable, *args) -> str:
    """The optimized HLO that XLA compiles for ``jitted(*args)``, as text."""
    return jitted.lower(*args).compile().as_text()


def collectives(jitted: Callable, *args) -> list[tuple[str, str]]:
    """``(kind, result type)`` of every collective instruction compiled for ``jitted(*args)``.

    E.g. ``('all-reduce', '(f32[20], f32[3,3,1,20], ..., f32[])')``; layouts and
    ``/*index=5*/`` comments are dropped from the types.
    """
    return [(kind, _LAYOUT_OR_COMMENT.sub("", result))
            for result, kind in _INSTRUCTION.findall(compiled_text(jitted, *args))]


def allreduce_ops(jitted: Callable, *args) -> list[str]:
    """The all-reduce instructions XLA compiled for ``jitted(*args)``, as result types.

    E.g. ``['(f32[20], f32[3,3,1,20], ..., f32[])']``: one entry per all-reduce, listing
    the arrays it sums (XLA fuses many small ones into one).
    """
    return [result for kind, result in collectives(jitted, *args) if kind == "all-reduce"]


def collective_ops(jitted: Callable, *args) -> dict[str, int]:
    """How many instructions of each collective kind XLA compiled for ``jitted(*args)``.

    E.g. ``{'collective-permute': 6}`` for the ring on 4 devices. An asynchronous pair
    (``all-reduce-start`` / ``all-reduce-done``) counts once.
    """
    return dict(Counter(kind for kind, _ in collectives(jitted, *args)))

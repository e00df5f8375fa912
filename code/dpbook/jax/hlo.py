"""What XLA compiled: the collective instructions in a jitted function's optimized HLO,
their place in the schedule, and the memory the program needs.

One parser, :func:`collectives`, reads every collective instruction with its result type;
:func:`allreduce_ops` (the concise chapter: where ``jit`` put the gradient all-reduce) and
:func:`collective_ops` (the communication chapter: the ring's ``collective-permute`` instructions
against ``psum``'s one ``all-reduce``) are two views of it. :func:`schedule` (the inside-DDP
chapter) lists the entry computation in the order XLA will run it, each instruction marked
forward, backward, collective or other; :func:`memory` reads XLA's own memory analysis.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Callable

__all__ = ["COLLECTIVES", "compiled_text", "collectives", "allreduce_ops", "collective_ops",
           "type_bytes", "schedule", "memory"]

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


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")


def type_bytes(result: str) -> int:
    """The bytes of an HLO result type, e.g. ``'(f32[20], bf16[3,3])'`` → 4·20 + 2·9 = 98."""
    total = 0
    for dtype, dims in _ARRAY.findall(result):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += _BYTES[dtype] * n
    return total


# An instruction of the scheduled entry computation: `%name = <type> <opcode>(...)`, with
# the jaxpr path that produced it in `op_name="..."`.
_ENTRY_LINE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([\w-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _phase(opcode: str, op_name: str) -> str:
    if opcode.removesuffix("-start").removesuffix("-done") in COLLECTIVES:
        return "collective"
    if "transpose(" in op_name:          # JAX's reverse mode: the backward pass
        return "backward"
    if "jvp(" in op_name:                # the forward pass, linearized
        return "forward"
    return "other"


def schedule(jitted: Callable, *args) -> list[tuple[str, str, str]]:
    """``(name, opcode, phase)`` of every instruction of the compiled entry computation,
    in the order of XLA's schedule (the module is printed ``is_scheduled=true``).

    ``phase`` is ``'collective'``, ``'backward'`` (JAX names the reverse pass
    ``transpose(...)``), ``'forward'`` (``jvp(...)``) or ``'other'`` (parameters,
    constants, the optimizer update). Instructions inside fusions are not listed: a fusion
    runs as one.
    """
    text = compiled_text(jitted, *args)
    entry = text[text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    rows = []
    for line in entry.splitlines()[1:]:
        m = _ENTRY_LINE.match(line)
        if m:
            op_name = _OP_NAME.search(line)
            rows.append((m.group(1), m.group(3), _phase(m.group(3), op_name.group(1)
                                                         if op_name else "")))
    return rows


def memory(jitted: Callable, *args) -> dict[str, int]:
    """XLA's memory analysis of the program compiled for ``jitted(*args)``, in bytes per
    device: ``arguments``, ``outputs``, ``temporaries`` (what the program allocates while
    it runs, activations included), ``aliased`` (outputs written into donated arguments)
    and ``total`` = arguments + outputs + temporaries − aliased."""
    m = jitted.lower(*args).compile().memory_analysis()
    out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "temporaries": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes}
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    return out

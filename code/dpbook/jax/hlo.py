"""What XLA compiled: the collective instructions in a jitted function's optimized HLO,
their place in the schedule, and the memory the program needs.

:func:`parse_collectives` reads every collective instruction of an HLO text with its
result type; :func:`collectives` applies it to what XLA compiled for a jitted function, and
:func:`allreduce_ops` (the concise chapter: where ``jit`` put the gradient all-reduce) and
:func:`collective_ops` (the communication chapter: the ring's ``collective-permute``
instructions against ``psum``'s one ``all-reduce``) are two views of it.
:func:`parse_schedule` / :func:`schedule` (the inside-DDP chapter) list the entry
computation in the order XLA will run it, each instruction marked forward, backward,
collective or other; :func:`memory` reads XLA's own memory analysis.

The parsers take the text that ``compiled.as_text()`` prints on any backend. On GPUs XLA
splits a collective into an asynchronous pair: ``all-reduce-start``, ``all-gather-start``
and ``collective-permute-start`` with their ``-done``, and ``async-start`` /
``async-done`` wrapping a computation whose root is the collective (printed
``reduce-scatter-start`` / ``reduce-scatter-done`` when the wrapper holds that one
instruction). A pair counts once, with the result type its ``-done`` returns. GPU
command buffers move instructions into computations that the entry calls; the schedule
reads them at the call site.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Callable, NamedTuple

__all__ = ["COLLECTIVES", "compiled_text", "collectives", "allreduce_ops", "collective_ops",
           "type_bytes", "schedule", "memory", "parse_collectives", "executed_collectives",
           "parse_schedule"]

#: The HLO names of the collective instructions.
COLLECTIVES = ("all-reduce", "collective-permute", "all-gather", "reduce-scatter",
               "all-to-all")

_LAYOUT_OR_COMMENT = re.compile(r"\{[^}]*\}|/\*.*?\*/")


def compiled_text(jitted: Callable, *args) -> str:
    """The optimized HLO that XLA compiles for ``jitted(*args)``, as text."""
    return jitted.lower(*args).compile().as_text()


# --- Reading HLO text -------------------------------------------------------------------
# A module is a list of computations, `[ENTRY] %name (params) -> type {` ... `}`, each a
# list of instructions, one a line: `[ROOT] %name = <type> <opcode>(<operands>), <attrs>`.
# A type is an array, `f32[8,4]{1,0}`, or a tuple of types, `(f32[8]{0}, u32[])`.

class _Instruction(NamedTuple):
    root: bool           # the computation's ROOT
    name: str
    type: str            # as printed, layouts included
    opcode: str
    operands: tuple      # the operands' names
    attrs: str           # everything after the operands

    def attr(self, key: str) -> str | None:
        """The computation named by ``key=%comp`` (``calls``, ``to_apply``), if any."""
        m = re.search(r"\b" + key + r"=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None

    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")


def _balanced(s: str, i: int, stop_at_space: bool) -> int:
    """The end of the bracketed text (or, with ``stop_at_space``, of the token) at s[i:]."""
    depth = 0
    for j in range(i, len(s)):
        c = s[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0 and not stop_at_space:
                return j + 1
        elif c.isspace() and depth == 0 and stop_at_space:
            return j
    return len(s)


def _split(s: str) -> list[str]:
    """The comma-separated parts of ``s`` at bracket depth 0."""
    parts, depth, start = [], 0, 0
    for j, c in enumerate(s):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            parts.append(s[start:j].strip())
            start = j + 1
    last = s[start:].strip()
    return parts + [last] if last else parts


def _instruction(line: str) -> _Instruction | None:
    head = _HEAD.match(line)
    if not head:
        return None
    i = head.end()
    end = _balanced(line, i, stop_at_space=True)
    opcode = _OPCODE.match(line, end)
    if not opcode:
        return None
    close = _balanced(line, opcode.end() - 1, stop_at_space=False)
    inside = _LAYOUT_OR_COMMENT.sub(" ", line[opcode.end():close - 1])
    operands = tuple(o.split()[-1].lstrip("%") for o in _split(inside) if o.split())
    return _Instruction(bool(head.group(1)), head.group(2), line[i:end], opcode.group(1),
                        operands, line[close:])


def _module(text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """The computations of an HLO module, in the order printed, and the entry's name.
    (Instructions outside any computation go into one named ``''``.)"""
    computations: dict[str, list[_Instruction]] = {"": []}
    entry, current, lines = "", "", []
    for line in text.splitlines():       # an instruction may go on over indented lines
        if (lines and _HEAD.match(lines[-1]) and line[:1].isspace()
                and not _HEAD.match(line) and not _COMPUTATION.match(line)
                and line.strip() not in ("", "}")):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    for line in lines:
        header = None if _HEAD.match(line) else _COMPUTATION.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line.lstrip().startswith("}"):
            current = ""
        elif (instruction := _instruction(line)) is not None:
            computations[current].append(instruction)
    return computations, entry


def _clean(t: str) -> str:
    return _LAYOUT_OR_COMMENT.sub("", t)


def _wrapped_kind(computations: dict, instruction: _Instruction) -> str | None:
    """The collective an ``async-start`` wraps: the root of its called computation."""
    roots = [i for i in computations.get(instruction.attr("calls") or "", []) if i.root]
    return roots[0].opcode if roots and roots[0].opcode in COLLECTIVES else None


class _Async:
    """The asynchronous instructions of a module: the start of each ``-update`` and
    ``-done``, which collective each one is part of, and the result type of each pair
    (the type of its ``-done``)."""

    def __init__(self, computations: dict[str, list[_Instruction]]):
        self.start: dict[_Instruction, _Instruction] = {}   # update/done -> its start
        self.kind: dict[_Instruction, str] = {}      # start/update/done -> collective
        self.result: dict[_Instruction, str] = {}    # start -> result type
        self.wrapped: set[str] = set()      # the computations async collectives run
        for body in computations.values():
            by_name = {i.name: i for i in body}
            for i in body:
                if i.opcode.endswith("-start"):
                    kind = i.opcode.removesuffix("-start")
                    if i.opcode == "async-start":
                        kind = _wrapped_kind(computations, i)
                    if kind in COLLECTIVES:
                        self.kind[i] = kind
                        self.wrapped.add(i.attr("calls") or "")
                elif i.opcode.endswith(("-update", "-done")):
                    start = i        # follow the first operand back to the -start
                    while start is not None and not start.opcode.endswith("-start"):
                        start = by_name.get(start.operands[0]) if start.operands else None
                    if start is not None:
                        self.start[i] = start
        for i, start in self.start.items():
            if start in self.kind:
                self.kind[i] = self.kind[start]
                if i.opcode.endswith("-done"):
                    self.result[start] = i.type

    def result_type(self, start: _Instruction) -> str:
        """The result of an asynchronous collective: the type of its ``-done``; without
        one, read from the start's tuple, ``((operands), result, context...)`` or
        ``(operand, result, ...)`` (an ``all-reduce-start`` has the result type itself)."""
        if start in self.result:
            return self.result[start]
        parts = _split(start.type[1:-1]) if start.type.startswith("(") else []
        if start.opcode == "all-reduce-start" or len(parts) < 2:
            return start.type
        return parts[1]


def _collectives(computations: dict[str, list[_Instruction]]):
    """``(computation, kind, result type)`` of every collective instruction."""
    pairs = _Async(computations)
    for name, body in computations.items():
        if name and name in pairs.wrapped:        # counted at its async-start
            continue
        for i in body:
            if i.opcode in COLLECTIVES:
                yield name, i.opcode, _clean(i.type)
            elif i.opcode.endswith("-start") and i in pairs.kind:
                yield name, pairs.kind[i], _clean(pairs.result_type(i))


def parse_collectives(text: str) -> list[tuple[str, str]]:
    """``(kind, result type)`` of every collective instruction in an HLO module's text.

    An asynchronous pair counts once, with the type its ``-done`` returns: for
    ``all-gather-start`` the gathered array, not the ``(operand, result)`` tuple.
    """
    computations, _ = _module(text)
    return [(kind, result) for _, kind, result in _collectives(computations)]


def _times(computations: dict[str, list[_Instruction]], entry: str) -> dict[str, int]:
    """How many times each computation runs per run of the entry: a ``while`` body as
    many times as the trip count XLA knows (``known_trip_count``; once if it does not),
    every other called computation as often as its caller."""
    times: dict[str, int] = {}

    def visit(name: str, n: int, depth: int = 0) -> None:
        times[name] = times.get(name, 0) + n
        if depth > 50:                             # no recursion in HLO; a guard anyway
            return
        for i in computations.get(name, []):
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', i.attrs)
            loop = int(trip[1]) if i.opcode == "while" and trip else 1
            for key in ("body", "condition", "calls", "to_apply"):
                called = i.attr(key)
                if called in computations and called != name:
                    visit(called, n * (loop if key == "body" else 1), depth + 1)

    visit(entry, 1)
    return times


def executed_collectives(text: str) -> list[tuple[str, str, int]]:
    """``(kind, result type, times)``: :func:`parse_collectives` with how many times each
    instruction runs in one run of the module. A collective inside a ``lax.fori_loop``
    of 3 steps is one instruction of the text, run 3 times."""
    computations, entry = _module(text)
    times = _times(computations, entry)
    return [(kind, result, times.get(name, 1))
            for name, kind, result in _collectives(computations)]


def collectives(jitted: Callable, *args) -> list[tuple[str, str]]:
    """``(kind, result type)`` of every collective instruction compiled for
    ``jitted(*args)``.

    E.g. ``('all-reduce', '(f32[20], f32[3,3,1,20], ..., f32[])')``; layouts and
    ``/*index=5*/`` comments are dropped from the types. See :func:`parse_collectives`.
    """
    return parse_collectives(compiled_text(jitted, *args))


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
    """The bytes of an HLO type: ``'(f32[20], bf16[3,3])'`` has 4·20 + 2·9 = 98."""
    total = 0
    for dtype, dims in _ARRAY.findall(result):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += _BYTES[dtype] * n
    return total


def _phase(opcode: str, op_name: str) -> str:
    if re.sub(r"-(start|update|done)$", "", opcode) in COLLECTIVES:
        return "collective"
    if "transpose(" in op_name:          # JAX's reverse mode: the backward pass
        return "backward"
    if "jvp(" in op_name:                # the forward pass, linearized
        return "forward"
    return "other"


def _runs(i: _Instruction) -> str | None:
    """The computation that runs in place of ``i``: what a ``call`` or ``call-start``
    applies, what an ``async-start`` calls."""
    if i.opcode in ("call", "call-start"):
        return i.attr("to_apply")
    return i.attr("calls") if i.opcode == "async-start" else None


def parse_schedule(text: str) -> list[tuple[str, str, str]]:
    """``(name, opcode, phase)`` of every instruction of the entry computation of a
    scheduled HLO module's text, in the order printed (see :func:`schedule`).

    A ``call`` (a GPU command buffer) is replaced by the instructions of the computation
    it calls, parameters left out, and so is an asynchronous call (``call-start``, or an
    ``async-start`` of anything but a collective), whose ``-update`` and ``-done`` then
    drop out. An asynchronous collective keeps its start, update and done, named
    ``<kind>-start`` and so on whichever way it is printed.
    """
    computations, entry = _module(text)
    pairs = _Async(computations)
    rows: list[tuple[str, str, str]] = []

    def read(name: str, depth: int) -> None:
        for i in computations.get(name, []):
            if i in pairs.kind:
                opcode = pairs.kind[i] + i.opcode[i.opcode.rindex("-"):]
            elif (callee := _runs(i)) in computations and depth < 32:
                read(callee, depth + 1)
                continue
            elif i in pairs.start and _runs(pairs.start[i]) in computations:
                continue                                   # its work was read at the start
            elif depth and i.opcode == "parameter":
                continue
            else:
                opcode = i.opcode
            rows.append((i.name, opcode, _phase(opcode, i.op_name())))

    read(entry, 0)
    return rows


def schedule(jitted: Callable, *args) -> list[tuple[str, str, str]]:
    """``(name, opcode, phase)`` of every instruction of the compiled entry computation,
    in the order of XLA's schedule (the module is printed ``is_scheduled=true``).

    ``phase`` is ``'collective'``, ``'backward'`` (JAX names the reverse pass
    ``transpose(...)``), ``'forward'`` (``jvp(...)``) or ``'other'`` (parameters,
    constants, the optimizer update). Instructions inside fusions are not listed: a fusion
    runs as one. Those of a computation the entry calls (a GPU command buffer) are, in
    place of the call: see :func:`parse_schedule`.
    """
    return parse_schedule(compiled_text(jitted, *args))


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

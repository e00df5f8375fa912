"""Seeing the overlap: one training step of a data-parallel wrapper, recorded with
``torch.profiler`` on real processes, and read back as two lanes, backward and allreduce.

:func:`profile` returns a Chrome trace per wrapper of :mod:`dpbook.torch.ddp_by_hand`
(or DDP); :func:`timeline` turns a trace into ``(start, length)`` spans of the backward
functions and of the allreduce; :func:`overlap_fraction` is the share of the time the
allreduces were in flight (handed to the library, not yet done, waiting for peers
included) that fell during backward.

For sharded data parallelism (:class:`dpbook.torch.zero.ZeroModel` and FSDP2, which mark
their steps in the trace as ``ZeroModel::pre_forward (name)`` / ``FSDP::pre_forward
(name)``), :func:`gather_timeline` reads the lanes compute, all-gather and
reduce-scatter, and :func:`gather_order` the order in which all-gathers were issued and
units started computing; :func:`gathers_ahead` counts the all-gathers issued before the
compute that preceded their unit's (prefetched).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from torch.nn import functional as F

from .ddp_by_hand import sync_gradients, wrap
from .dist import process_group, run

__all__ = ["profile", "profile_worker", "timeline", "overlap_fraction", "gather_timeline",
           "gather_order", "gathers_ahead"]


@contextlib.contextmanager
def _quiet_stderr():
    """Send the process's stderr (file descriptor 2) to /dev/null for a moment: the
    profiler's C++ side prints a "profiler_start"/"profiler_stop" line on every start and
    no setting turns it off. Python exceptions still propagate."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def profile_worker(rank: int, world_size: int, names: Sequence[str], width: int,
                   batch_size: int, bucket_cap_mb: float) -> dict:
    """Two warm-up steps, then one step of ResNet-18 (``width`` channels) per wrapper, which
    rank 0 records with ``torch.profiler`` and returns as Chrome traces, ``{name: trace}``
    (the other ranks take the same step unrecorded: every allreduce needs all of them)."""
    from .models import resnet18
    with process_group(rank, world_size) as device:
        g = torch.Generator().manual_seed(rank)
        X = torch.rand(batch_size // world_size, 1, 28, 28, generator=g).to(device)
        y = torch.randint(0, 10, (batch_size // world_size,), generator=g).to(device)
        traces = {}
        for name in names:
            torch.manual_seed(0)
            model = wrap(name, resnet18(width=width).to(device), bucket_cap_mb)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

            def step():
                optimizer.zero_grad()
                F.cross_entropy(model(X), y).backward()
                sync_gradients(model)
                optimizer.step()

            step()
            step()                                 # DDP has rebuilt its buckets by now
            dist.barrier()
            if rank == 0:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                with _quiet_stderr(), torch.profiler.profile(activities=activities) as prof:
                    step()
                with tempfile.TemporaryDirectory() as folder:
                    path = os.path.join(folder, "trace.json")
                    prof.export_chrome_trace(path)
                    traces[name] = json.loads(Path(path).read_text())
            else:
                step()
        return traces


def profile(nprocs: int, names: Sequence[str] = ("flat", "bucketed", "ddp"), width: int = 16,
            batch_size: int = 64, bucket_cap_mb: float = 1, timeout: float = 300
            ) -> dict[str, dict]:
    """Profile one training step of each wrapper on ``nprocs`` processes (see
    :func:`profile_worker`); returns ``{name: Chrome trace (a dict with "traceEvents")}``."""
    return run(profile_worker, nprocs, list(names), width, batch_size, bucket_cap_mb,
               timeout=timeout)


def timeline(trace: dict) -> dict[str, list[tuple[float, float]]]:
    """The two lanes of a profiled step, from the trace's own events, as ``(start, length)``
    in milliseconds from the step's first event: ``"backward"`` and ``"allreduce"``.

    On the CPU they are autograd's evaluation of each backward function (on the main
    thread) and the collective as gloo ran it (on its own thread). On a GPU those CPU
    spans only launch work, so the lanes are the GPU's kernels instead: the kernels that
    backward functions launched, and NCCL's kernels (the trace's ``kernel`` events, tied
    to their launch by the ``correlation`` id).
    """
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    start = min(e["ts"] for e in events)
    lanes: dict[str, list[tuple[float, float]]] = {"backward": [], "allreduce": []}
    backward = [e for e in events
                if e["name"].startswith("autograd::engine::evaluate_function:")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        launched = {e["args"]["correlation"]: e["ts"] for e in events
                    if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
        spans = _union([(e["ts"], e["dur"]) for e in backward])
        chosen = []
        for k in kernels:
            at = launched.get(k.get("args", {}).get("correlation"))
            if "nccl" in k["name"].lower():
                chosen.append(("allreduce", k))
            elif at is not None and any(a <= at <= b for a, b in spans):
                chosen.append(("backward", k))
    else:
        chosen = [("backward", e) for e in backward] + [
            ("allreduce", e) for e in events
            if e["name"] in ("gloo:all_reduce", "nccl:all_reduce")]
    for lane, e in chosen:
        lanes[lane].append(((e["ts"] - start) / 1e3, e["dur"] / 1e3))
    return {lane: sorted(spans) for lane, spans in lanes.items()}


def _union(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, d in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], s + d)
        else:
            merged.append([s, s + d])
    return [(a, b) for a, b in merged]


def overlap_fraction(lanes: dict[str, list[tuple[float, float]]], comm: str = "allreduce",
                     compute: str = "backward") -> float:
    """The share of the ``comm`` lane's in-flight time during which ``compute`` ran too:
    0 when communication only starts after backward, near 1 when it hides behind it."""
    comm, back = _union(lanes[comm]), _union(lanes[compute])
    busy = sum(b - a for a, b in comm)
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in back)
    return hidden / busy if busy else 0.0


_MARK = re.compile(r"^(?:ZeroModel|FSDP)::(pre_forward|post_forward|pre_backward|all_gather"
                   r"|forward_prefetch|backward_prefetch)(?: for (.*)| \((.*)\))$")


def _marks(trace: dict) -> list[tuple[str, str, float, float]]:
    """``(step, unit name, start, end)`` of the ZeroModel/FSDP2 marks, in microseconds,
    by start. A pre-forward or pre-backward mark is extended to the end of a prefetch
    mark that follows it before the unit's post-forward (FSDP2 issues its forward
    prefetch after its pre-forward mark, before the unit computes); prefetch marks are
    dropped."""
    out = []
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and "dur" in e:
            m = _MARK.match(e["name"])
            if m:
                out.append([m.group(1), m.group(2) or m.group(3), e["ts"], e["ts"] + e["dur"]])
    out.sort(key=lambda x: x[2])
    marks, pre = [], None
    for step, name, a, b in out:
        if step.endswith("_prefetch"):
            if pre is not None:
                pre[3] = max(pre[3], b)
            continue
        mark = [step, name, a, b]
        marks.append(mark)
        if step in ("pre_forward", "pre_backward"):
            pre = mark
        elif step == "post_forward":          # the unit has computed: nothing to extend
            pre = None
    return [tuple(m) for m in marks]


def gather_timeline(trace: dict) -> dict[str, list[tuple[float, float]]]:
    """The lanes of a profiled ZeRO-3 or FSDP2 step on the CPU, as ``(start, length)`` in
    milliseconds from the step's first event: ``"compute"`` (each unit's forward, from
    the end of its pre-forward mark to its post-forward mark, and autograd's backward
    functions, those that run hooks left out, less the pre-backward marks, in which a
    unit waits for its gather), ``"all-gather"`` and ``"reduce-scatter"``
    (gloo's spans on its own threads: from the moment gloo takes the collective until it
    is done, waiting for the other rank included; gloo runs a reduce-scatter as an
    ``all_reduce``)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    start = min(e["ts"] for e in events)
    lanes: dict[str, list[tuple[float, float]]] = {
        "compute": [], "all-gather": [], "reduce-scatter": []}
    opened: dict[str, float] = {}
    waits = []                  # pre-backward marks: the gather runs inside a backward
    for step, name, a, b in _marks(trace):       # function (a hook on its input)
        if step == "pre_forward":
            opened[name] = b
        elif step == "post_forward" and name in opened:
            lanes["compute"].append((opened[name], a - opened.pop(name)))
        elif step == "pre_backward":
            waits.append((a, b - a))
    hooks = ("AccumulateGrad", "PostBackward", "PreBackward", "BackwardHook")
    backward = [(e["ts"], e["dur"]) for e in events
                if e["name"].startswith("autograd::engine::evaluate_function:")
                and not any(h in e["name"] for h in hooks)]
    lanes["compute"] += _subtract(_union(backward), _union(waits))
    for e in events:
        if e["name"] in ("gloo:all_gather", "gloo:all_gather_into_tensor"):
            lanes["all-gather"].append((e["ts"], e["dur"]))
        elif e["name"] in ("gloo:all_reduce", "gloo:reduce_scatter"):
            lanes["reduce-scatter"].append((e["ts"], e["dur"]))
    return {lane: sorted(((a - start) / 1e3, d / 1e3) for a, d in spans)
            for lane, spans in lanes.items()}


def _subtract(spans: Sequence[tuple[float, float]], holes: Sequence[tuple[float, float]]
              ) -> list[tuple[float, float]]:
    """``(start, length)`` of what of ``spans`` (``(start, end)``) lies outside
    ``holes`` (``(start, end)``), both sorted and disjoint."""
    out = []
    for a, b in spans:
        for c, d in holes:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c - a))
            a = max(a, d)
        if b > a:
            out.append((a, b - a))
    return out


def gather_order(trace: dict) -> list[tuple[str, str]]:
    """What happened, in order: ``("gather", unit)`` when the unit's all-gather was
    issued, ``("forward", unit)`` / ``("backward", unit)`` when its computation began
    (the end of its pre-forward / pre-backward mark). The form of
    ``ZeroModel.events``, with unit names."""
    points = []
    for step, name, a, b in _marks(trace):
        if step == "all_gather":
            points.append((a, "gather", name))
        elif step in ("pre_forward", "pre_backward"):
            points.append((b, step[4:], name))
    return [(kind, name) for _, kind, name in sorted(points, key=lambda x: x[0])]


def gathers_ahead(order: Sequence[tuple[str, object]]) -> tuple[int, int]:
    """``(prefetched, computed)``: of the units' computations in ``order`` (forward and
    backward) that waited for an all-gather, how many had it issued before the
    computation just before them began, i.e. early enough to travel while another unit
    computed."""
    prefetched = computed = 0
    last_gather: dict = {}
    for j, (kind, unit) in enumerate(order):
        if kind == "gather":
            last_gather[unit] = j
        elif unit in last_gather:              # a computation that needed a gather
            computed += 1
            g = last_gather.pop(unit)
            prefetched += any(k != "gather" for k, _ in order[g + 1:j])
    return prefetched, computed

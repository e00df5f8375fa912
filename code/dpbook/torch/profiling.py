"""Seeing the overlap: one training step of a data-parallel wrapper, recorded with
``torch.profiler`` on real processes, and read back as two lanes, backward and allreduce.

:func:`profile` returns a Chrome trace per wrapper of :mod:`dpbook.torch.ddp_by_hand`
(or DDP); :func:`timeline` turns a trace into ``(start, length)`` spans of the backward
functions and of the allreduce; :func:`overlap_fraction` is the share of the time the
allreduces were in flight (handed to the library, not yet done, waiting for peers
included) that fell during backward.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from torch.nn import functional as F

from .ddp_by_hand import sync_gradients, wrap
from .dist import process_group, run

__all__ = ["profile", "profile_worker", "timeline", "overlap_fraction"]


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


def overlap_fraction(lanes: dict[str, list[tuple[float, float]]]) -> float:
    """The share of the allreduce lane's in-flight time during which backward ran too:
    0 when communication only starts after backward, near 1 when it hides behind it."""
    comm, back = _union(lanes["allreduce"]), _union(lanes["backward"])
    busy = sum(b - a for a, b in comm)
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in back)
    return hidden / busy if busy else 0.0

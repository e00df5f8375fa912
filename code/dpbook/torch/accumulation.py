"""Gradient accumulation with DDP: ``no_sync()`` over k micro-batches, one allreduce per
optimizer step.

A process that can hold only a micro-batch of ``b`` examples still trains with the batch of
``k * b``: it runs backward on k micro-batches, adding up their gradients in ``.grad``,
and steps once. Under DDP, every backward would allreduce; inside ``with
model.no_sync():`` DDP skips the allreduce and only the last micro-batch's backward
sends the accumulated gradients::

    for i, (X, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            (loss_fn(model(X), y) / len(micro_batches)).backward()
    optimizer.step()

:func:`compare` checks this against one step on the whole batch and counts the
allreduce calls with a DDP communication hook (:func:`dpbook.torch.ddp_hooks.counting_hook`).
"""
from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .data import random_batch
from .evaluate import max_abs_difference
from .devices import full_float32, hardware_line, synchronize
from .dist import group_devices, process_group, run
from .ddp_hooks import register

__all__ = ["accumulate_step", "compare", "compare_worker"]


def accumulate_step(model: DDP, optimizer: torch.optim.Optimizer,
                    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    no_sync: bool = True) -> float:
    """One optimizer step on ``micro_batches``: backward on each (its loss divided by their
    number, so the accumulated gradient is the mean over all of them), the allreduce
    only on the last one (every one with ``no_sync=False``). Returns the mean loss."""
    optimizer.zero_grad()
    total, k = 0.0, len(micro_batches)
    for i, (X, y) in enumerate(micro_batches):
        sync = i == k - 1 or not no_sync                   # communicate once, at the end
        with contextlib.nullcontext() if sync else model.no_sync():
            loss = F.cross_entropy(model(X), y) / k
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "lenet":
        from .models import lenet
        return lenet()
    if kind == "resnet18":
        from .models import resnet18
        return resnet18(width=4)
    raise ValueError(f"unknown model {kind!r}: choose 'lenet' or 'resnet18'")


def compare_worker(rank: int, world_size: int, kind: str, ks: Sequence[int], micro_batch: int,
                   steps: int) -> dict:
    """For every k in ``ks``: ``steps`` optimizer steps of k micro-batches of
    ``micro_batch`` examples per process with ``no_sync``, and the same steps on the whole
    batch at once. Returns, for each k, the largest parameter difference between the
    two, the allreduce calls per optimizer step and the seconds per step; ``"every"`` is
    the same accumulation without ``no_sync`` (an allreduce after every micro-batch)."""
    with process_group(rank, world_size) as device:
        full_float32()                 # compared in float32: no TF32 on a GPU
        results = []
        for k in ks:
            finals, record = {}, {"k": k}
            for way in ("accumulated", "every", "whole"):
                model = DDP(_model(kind).to(device))
                counter = register(model)        # DDP's own averaging, counted
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                seconds = 0.0
                for step in range(steps):
                    X, y = random_batch(k * micro_batch * world_size, seed=step)
                    X = X.chunk(world_size)[rank].to(device)   # this process's part
                    y = y.chunk(world_size)[rank].to(device)
                    batches = ([(X, y)] if way == "whole" else
                               list(zip(X.split(micro_batch), y.split(micro_batch))))
                    tik = time.perf_counter()
                    accumulate_step(model, optimizer, batches, no_sync=way == "accumulated")
                    synchronize([device])              # a GPU's work, not its launch
                    seconds += time.perf_counter() - tik
                finals[way] = [p.detach().cpu() for p in model.module.parameters()]
                record[way] = {"calls_per_step": counter.calls / steps,
                               "bytes_per_step": counter.bytes / steps,
                               "seconds_per_step": seconds / steps}
            for way in ("accumulated", "every"):
                record[way]["max_difference"] = max_abs_difference(finals[way],
                                                                   finals["whole"])
            start = [p.detach() for p in _model(kind).parameters()]
            record["moved"] = max_abs_difference(finals["whole"], start)
            results.append(record)
        return {
            "model": kind, "micro_batch": micro_batch, "results": results,
            "hardware": hardware_line(group_devices(device))}


def compare(nprocs: int, kind: str = "lenet", ks: Sequence[int] = (1, 2, 4),
            micro_batch: int = 16, steps: int = 3, timeout: float = 300) -> dict:
    """:func:`compare_worker` on ``nprocs`` processes: ``{"results": [{"k", "moved",
    "accumulated": {"max_difference", "calls_per_step", "bytes_per_step",
    "seconds_per_step"}, "every": {...}, "whole": {...}}, ...], "hardware"}``."""
    if any(k < 1 for k in ks):
        raise ValueError(f"every k must be at least 1, got {list(ks)}")
    return run(compare_worker, nprocs, kind, list(ks), micro_batch, steps, timeout=timeout)

"""Where to sum the gradients of several devices in one process (MXNet's KVStore question).

Each function takes one gradient tensor per device and leaves the sum in every one of
them, in place (like :func:`dpbook.torch.scratch.allreduce`):

* ``sum_on_host``: copy every gradient to the host (CPU) memory, add there, copy back
  (KVStore ``local``); the CPU and its PCIe link carry everything.
* ``sum_on_device``: add everything into device 0, copy back (KVStore ``device``); the
  GPUs' links and device 0's adders carry everything.
* ``ring_on_devices``: the ring allreduce, each device adding 1/k of the gradient.

On a CPU-only machine the "devices" are all the same memory, so only the number of bytes
copied and added differs between them; the chapter turns that into predictions for real
links with :mod:`dpbook.costmodel`.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["sum_on_host", "sum_on_device", "ring_on_devices", "AGGREGATORS"]


@torch.no_grad()
def sum_on_host(grads: Sequence[torch.Tensor]) -> None:
    """Sum in host memory: k copies in, k - 1 additions on the CPU, k copies out."""
    host = torch.device("cpu")
    total = grads[0].to(host, copy=True)       # a real copy even when already on the CPU
    for g in grads[1:]:
        total += g.to(host)
    for g in grads:
        g.copy_(total)                         # host → device


@torch.no_grad()
def sum_on_device(grads: Sequence[torch.Tensor]) -> None:
    """Sum on device 0: k - 1 copies in, k - 1 additions there, k - 1 copies out."""
    for g in grads[1:]:
        grads[0] += g.to(grads[0].device)
    for g in grads[1:]:
        g.copy_(grads[0])


@torch.no_grad()
def ring_on_devices(grads: Sequence[torch.Tensor]) -> None:
    """The ring allreduce over devices in one process: 2 (k - 1) steps in which device i
    passes one chunk (1/k of the gradient) to device i + 1. On real GPUs the k copies of a
    step run at the same time, each on its own link."""
    k = len(grads)
    chunks = [torch.tensor_split(g.view(-1), k) for g in grads]   # requires contiguous grads
    for step in range(k - 1):                  # reduce-scatter
        for i in range(k):
            j, c = (i + 1) % k, (i - step) % k
            chunks[j][c].add_(chunks[i][c].to(grads[j].device))
    for step in range(k - 1):                  # all-gather: device i has chunk i + 1 done
        for i in range(k):
            j, c = (i + 1) % k, (i + 1 - step) % k
            chunks[j][c].copy_(chunks[i][c])


AGGREGATORS = {"host": sum_on_host, "device": sum_on_device, "ring": ring_on_devices}

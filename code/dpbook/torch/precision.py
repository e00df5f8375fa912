"""Mixed precision with DDP: bfloat16 compute under ``torch.autocast`` with float32
master weights, and gradients sent in 16 bits by DDP's compression hooks.

``torch.autocast`` runs the matrix products and convolutions of the forward pass in a
16-bit type while the parameters, their gradients and the optimizer stay in float32 (the
*master weights*). A DDP compression hook halves the bytes of every allreduce.
:func:`compare` trains LeNet on Fashion-MNIST in every combination from the same start and
returns the loss curves, the bytes sent and the time per step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Sequence

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .data import fashion_mnist_datasets
from .devices import hardware_line, synchronize
from .dist import group_devices, per_process, process_group, run
from .evaluate import accuracy
from .ddp_hooks import register
from .models import lenet

__all__ = ["Precision", "PRECISIONS", "compare", "train_worker"]


@dataclasses.dataclass(frozen=True)
class Precision:
    """How one run computes and communicates: ``compute`` is the autocast type (``None``:
    float32 everywhere), ``hook`` the type the gradients travel in (a key of
    :data:`dpbook.torch.ddp_hooks.HOOKS`)."""

    name: str
    compute: torch.dtype | None = None
    hook: str = "float32"


#: The runs of the chapter, float32 first (the reference).
PRECISIONS = (Precision("float32"),
              Precision("bf16 compute", compute=torch.bfloat16),
              Precision("bf16 compute + bf16 hook", compute=torch.bfloat16, hook="bf16"),
              Precision("float32 + fp16 hook", hook="fp16"))


def train_worker(rank: int, world_size: int, precisions: Sequence[Precision], steps: int,
                 batch_size: int, lr: float, data: tuple) -> dict:
    """Train LeNet for ``steps`` SGD steps (global batch ``batch_size``) once per precision,
    from the same start on the same batches; returns every run's loss per step,
    bytes and calls per step, seconds per step, the dtypes of the parameters and
    gradients at the end, and the test accuracy."""
    with process_group(rank, world_size, threads=1) as device:
        num_train, num_test, root = data
        train, test = fashion_mnist_datasets(num_train, num_test, root)
        X_all, y_all = train.tensors
        results = []
        for precision in precisions:
            torch.manual_seed(0)
            model = DDP(lenet().to(device))
            counter = register(model, precision.hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            g = torch.Generator().manual_seed(0)          # the same batches in every run
            autocast = (torch.autocast(device.type, dtype=precision.compute)
                        if precision.compute is not None else contextlib.nullcontext())
            losses, seconds = [], 0.0
            for _ in range(steps):
                idx = torch.randint(0, len(X_all), (batch_size,), generator=g)
                X = X_all[idx].chunk(world_size)[rank].to(device)
                y = y_all[idx].chunk(world_size)[rank].to(device)
                tik = time.perf_counter()
                optimizer.zero_grad()
                with autocast:                            # forward in 16 bits
                    loss = F.cross_entropy(model(X), y)
                loss.backward()                           # gradients in float32
                optimizer.step()                          # on the float32 master weights
                synchronize([device])                     # a GPU's work, not its launch
                seconds += time.perf_counter() - tik
                mean = loss.detach().float().clone()
                dist.all_reduce(mean)                     # the loss over all processes
                losses.append(mean.item() / world_size)
            params = list(model.module.parameters())
            with torch.no_grad():
                X_test, y_test = (t.to(device) for t in test.tensors)
                test_acc = accuracy(model.module(X_test), y_test) / len(y_test)
            results.append({"name": precision.name, "losses": losses,
                            "bytes_per_step": counter.bytes / steps,
                            "calls_per_step": counter.calls / steps,
                            "seconds_per_step": seconds / steps,
                            "param_dtype": str(params[0].dtype),
                            "grad_dtype": str(params[0].grad.dtype), "test_acc": test_acc})
        return {"results": results, "batch_size": batch_size,
                "hardware": hardware_line(group_devices(device))}


def compare(nprocs: int, precisions: Sequence[Precision] = PRECISIONS, steps: int = 100,
            batch_size: int = 128, lr: float = 0.1, num_train: int | None = 10_000,
            num_test: int | None = 1000, root=None, timeout: float = 600) -> dict:
    """:func:`train_worker` on ``nprocs`` processes: ``{"results": [{"name", "losses",
    "bytes_per_step", "calls_per_step", "seconds_per_step", "param_dtype", "grad_dtype",
    "test_acc"}, ...], "batch_size", "hardware"}``."""
    per_process(batch_size, nprocs)          # refuses what does not divide
    return run(train_worker, nprocs, list(precisions), steps, batch_size, lr,
               (num_train, num_test, None if root is None else str(root)), timeout=timeout)

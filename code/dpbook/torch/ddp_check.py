"""Checks of DDP against one process: the parameters after a DDP step, the distance
between two checkpoints of the DDP script, and whether ``SyncBatchNorm`` runs here."""
from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .data import random_batch
from .ddp import Config, build_model
from .evaluate import max_abs_difference
from .devices import full_float32
from .dist import per_process, process_group, run

__all__ = ["step_worker", "ddp_step_difference", "sync_batchnorm_status",
           "max_checkpoint_difference"]


def step_worker(rank: int, world_size: int, model: str, batch_size: int, lr: float,
                seed: int) -> dict[str, torch.Tensor]:
    """One DDP SGD step on this process's part of a fixed random batch; returns the
    parameters. Used to check DDP against one process (:func:`ddp_step_difference`)."""
    with process_group(rank, world_size) as device:
        full_float32()                 # like the CPU reference: no TF32 on a GPU
        cfg = Config(model=model, seed=seed, scale="quick")
        net = DDP(build_model(cfg).to(device))
        X, y = random_batch(batch_size, seed)
        X, y = X.chunk(world_size)[rank].to(device), y.chunk(world_size)[rank].to(device)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        F.cross_entropy(net(X), y).backward()      # mean over this process's shard
        optimizer.step()                           # the averaged gradient: the global mean
        return {k: v.cpu() for k, v in net.module.state_dict().items()}


def ddp_step_difference(nprocs: int, model: str = "lenet", batch_size: int = 64,
                        lr: float = 0.1, seed: int = 0, timeout: float = 300
                        ) -> dict[str, float]:
    """Compare one DDP step on ``nprocs`` processes with one step of a single process.

    Returns the largest parameter difference from two single-process references:
    ``"whole"`` takes the whole batch at once; ``"shards"`` runs the ``nprocs`` shards
    through the network one at a time and averages their losses. The two agree unless the
    network has BatchNorm, where DDP computes ``"shards"``: each process normalizes its
    shard with the shard's own statistics.
    """
    per_process(batch_size, nprocs)          # refuses what does not divide
    # parameters; BatchNorm's running stats are buffers
    ddp_state = run(step_worker, nprocs, model, batch_size, lr, seed, timeout=timeout)
    X, y = random_batch(batch_size, seed)
    result = {}
    for reference in ("whole", "shards"):
        net = build_model(Config(model=model, seed=seed, scale="quick"))
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        if reference == "whole":
            loss = F.cross_entropy(net(X), y)
        else:
            loss = sum(F.cross_entropy(net(X_shard), y_shard) for X_shard, y_shard
                       in zip(X.chunk(nprocs), y.chunk(nprocs))) / nprocs
        loss.backward()
        optimizer.step()
        result[reference] = max_abs_difference({k: ddp_state[k] for k, _ in
                                                net.named_parameters()},
                                               dict(net.named_parameters()))
    return result


def _syncbn_worker(rank: int, world_size: int) -> str:
    with process_group(rank, world_size, threads=None) as device:
        bn = nn.SyncBatchNorm(4).to(device)
        try:
            bn(torch.rand(8, 4, 5, 5, device=device))
            message = "ok"
        except Exception as e:  # noqa: BLE001 - the error is the result
            message = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
        return message


def sync_batchnorm_status(nprocs: int = 2, timeout: float = 120) -> str:
    """Run one training-mode ``nn.SyncBatchNorm`` forward pass in a group of ``nprocs``
    processes: ``"ok"``, or the error it raised (on a CPU it needs CUDA)."""
    return run(_syncbn_worker, nprocs, timeout=timeout)


def max_checkpoint_difference(a: str | os.PathLike | dict, b: str | os.PathLike | dict) -> float:
    """The largest absolute difference between the model parameters of two checkpoints
    of the DDP script (:mod:`dpbook.torch.ddp`).

    Either may also be a model's ``state_dict()``:
    ``max_checkpoint_difference(start, checkpoint)`` with
    ``start = build_model(cfg).state_dict()`` is how far training moved the parameters.
    """
    a, b = (x if isinstance(x, dict) else torch.load(x, map_location="cpu")["model"]
            for x in (a, b))
    if a.keys() != b.keys():
        raise ValueError("the checkpoints hold different models")
    return max_abs_difference(a, b)

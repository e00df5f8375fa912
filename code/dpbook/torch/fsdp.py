"""PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on a CPU device mesh, measured
with the counting of :mod:`dpbook.torch.zero`.

``fully_shard`` turns every parameter of a module into a DTensor sharded along dimension 0
over a device mesh (``init_device_mesh("cpu", (N,))`` with gloo works); forward and
backward hooks all-gather a module's parameters before use and reduce-scatter its
gradients, the design of :class:`dpbook.torch.zero.ZeroModel`. :func:`compare` trains
LeNet with it and checks it against one process; :func:`counting` counts the collectives
FSDP2 calls, by wrapping ``torch.distributed``'s functions for the duration.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..versions import require_for
from .evaluate import max_abs_difference
from .data import random_batch
from .zero import OPTIMIZERS, Traffic, reference

require_for(__name__)   # FSDP2 on CPU processes needs a newer torch than the book (versions.yml)

__all__ = ["counting", "shard_lenet", "fsdp_worker", "compare"]


@contextlib.contextmanager
def counting(traffic: Traffic) -> Iterator[Traffic]:
    """Within the block, add every all-gather, reduce-scatter and all-reduce that
    ``torch.distributed`` runs (FSDP2 calls them through the module) to ``traffic``, with
    the bytes of the full tensor. The all-gather and reduce-scatter have two names each:
    ``all_gather_single``/``reduce_scatter_single`` from torch 2.13 on,
    ``all_gather_into_tensor``/``reduce_scatter_tensor`` before; both are counted, and a
    call that one makes to the other counts once."""
    kinds = {"all_gather_single": "all-gather", "all_gather_into_tensor": "all-gather",
             "reduce_scatter_single": "reduce-scatter",
             "reduce_scatter_tensor": "reduce-scatter", "all_reduce": "allreduce"}
    originals = {name: getattr(dist, name) for name in kinds if hasattr(dist, name)}
    depth = [0]

    def counted(name):
        signature = inspect.signature(originals[name])
        position = 1 if kinds[name] == "reduce-scatter" else 0   # the full tensor's argument

        def call(*args, **kwargs):
            if depth[0] == 0:     # reduce-scatter's input; all-gather's output; all_reduce's
                bound = signature.bind(*args, **kwargs)
                full = list(bound.arguments.values())[position]
                traffic.add(kinds[name], full.numel() * full.element_size())
            depth[0] += 1
            try:
                return originals[name](*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    try:
        for name in originals:
            setattr(dist, name, counted(name))
        yield traffic
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def shard_lenet(reshard_after_forward: bool = True) -> torch.nn.Module:
    """LeNet (seed 0) with ``fully_shard`` on each layer that has parameters, then on the
    whole model, over a 1-D CPU mesh of all the processes of the group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from .models import lenet
    torch.manual_seed(0)
    model = lenet()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def _unsharded_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters registered on ``model`` as whole tensors: FSDP2 registers
    the gathered parameters while it uses them, and the sharded DTensors otherwise."""
    from torch.distributed.tensor import DTensor
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if not isinstance(p, DTensor))


def fsdp_worker(rank: int, world_size: int, optimizer: str, steps: int, batch_size: int
                ) -> dict:
    """LeNet under FSDP2, with and without ``reshard_after_forward``; returns, per
    setting, the final parameters, the last step's traffic, the whole-parameter bytes held
    between forward and backward, and each parameter's local shard shape."""
    from torch.distributed.tensor import DTensor
    from .dist import process_group
    cls, kwargs = OPTIMIZERS[optimizer]
    with process_group(rank, world_size):
        results = {}
        for reshard in (True, False):
            model = shard_lenet(reshard)
            opt = cls(model.parameters(), **kwargs)
            traffic = Traffic(world_size)
            held = 0
            for step in range(steps):
                X, y = random_batch(batch_size, seed=1000 + step)
                X, y = X.chunk(world_size)[rank], y.chunk(world_size)[rank]
                last = step == steps - 1
                with counting(traffic) if last else contextlib.nullcontext():
                    opt.zero_grad()
                    loss = F.cross_entropy(model(X), y)
                    held = _unsharded_bytes(model)         # between forward and backward
                    loss.backward()
                    opt.step()
            params = {name: p.full_tensor().detach().clone() for name, p in
                      model.named_parameters()}
            results[reshard] = {
                "params": params, "sent": traffic.sent(), "calls": dict(traffic.calls),
                "held_between": held,
                "shards": {name: (tuple(p.shape), tuple(p.to_local().shape), str(p.placements))
                           for name, p in model.named_parameters() if isinstance(p, DTensor)}}
        return results


def compare(nprocs: int, optimizer: str = "adam", steps: int = 3, batch_size: int = 48,
            timeout: float = 300) -> dict:
    """Train LeNet with FSDP2 on ``nprocs`` processes, ``reshard_after_forward`` on
    (key ``True``) and off (``False``); each result has the ``difference`` from one process
    (:func:`dpbook.torch.zero.reference`), ``sent``/``calls`` of the last step, the bytes of
    whole parameters ``held_between`` forward and backward, and rank 0's ``shards``."""
    from .dist import per_process, run
    per_process(batch_size, nprocs)          # refuses what does not divide
    results = run(fsdp_worker, nprocs, optimizer, steps, batch_size, on="cpu",
                  timeout=timeout)
    ref = reference(optimizer, steps, batch_size)
    for r in results.values():
        r["difference"] = max_abs_difference({k: r["params"][k] for k in ref}, ref)
        del r["params"]
    return results

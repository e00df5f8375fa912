"""Sharded state from birth to resume with FSDP2: build a model on the ``meta`` device,
shard it, materialize only each rank's shards; save model and optimizer state with
``torch.distributed.checkpoint`` (DCP) on N processes and load it on M; gather a full
state dict on rank 0's CPU only, for export.

The recipe (PyTorch's FSDP2 tutorial and ``fully_shard``'s docs):

1. ``with torch.device("meta"): model = mlp(width)``: shapes and dtypes, no storage;
2. ``fully_shard`` each layer, then the model: every parameter becomes a DTensor whose
   local shard (rows of dimension 0) is still on ``meta``;
3. ``model.to_empty(device="cpu")`` allocates the local shards only, uninitialized;
   ``reset_parameters()`` of each layer fills them (:func:`materialize`).

On a CPU mesh DTensor has no distributed random generator (``is_rng_supported_mesh`` is
false: "we only support correct RNG on cuda/cuda-like devices"): every rank draws its
shard from its own generator, so equal seeds give equal shards on every rank.
:func:`materialize` seeds each rank differently; the bounds of ``reset_parameters`` come
from the global shape, so each value still has the distribution of the one-process init.
On CUDA the advice is the opposite: DTensor's ``OffsetBasedRNGTracker`` broadcasts rank
0's generator state (and warns unless every rank called ``torch.manual_seed`` with the
same seed) and starts each shard at its own offset of that one stream.

While it trains, a rank holds its shards of the parameters, two Adam moments of the same
shape, and gathered layers: one at a time in the forward pass (:func:`gathered_layers`
watches it), up to two in the backward pass, where FSDP2 prefetches the next layer's
all-gather by default: :func:`mlp` is deep enough that no layer dominates.

A checkpoint is a folder that DCP writes from every rank at once (:func:`save`): each rank
writes its shards, rank 0 the metadata that says which slice of which tensor is where.
Loading (:func:`load`) asks for the slices the *loading* ranks own, whatever their number:
the state dicts of ``get_state_dict`` (DTensors on an FSDP2 model, plain tensors on a plain
one) say which. The optimizer's state is keyed by parameter name (FQN), not by position.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..versions import require_for
from .data import random_batch

require_for(__name__)   # FSDP2 on CPU processes needs a newer torch than the book (versions.yml)

__all__ = ["mlp", "whole_bytes", "local_bytes", "shard_model", "materialize", "adam",
           "gathered_layers",
           "train", "save", "load", "export", "flat_state", "birth", "save_worker",
           "resume_worker", "resume_one_process", "save_and_resume"]

LR = 1e-3          # Adam's learning rate, everywhere on this page


def mlp(width: int, depth: int = 8) -> nn.Sequential:
    """A classifier for 28 × 28 images with ``depth`` hidden layers of ``width`` units:
    ``784·w + (depth - 1)·w² + 10·w`` weights and ``depth·w + 10`` biases. Deep rather
    than wide, so that no one layer holds most of the parameters (FSDP2 gathers one or
    two layers whole at a time)."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(784, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def whole_bytes(model: nn.Module) -> int:
    """Bytes of all of ``model``'s parameters, whole (the global shape of a DTensor)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def local_bytes(tensors: Any) -> int:
    """Bytes that this rank holds in storage: of a module's parameters, or of the tensors
    in a (nested) state dict; a DTensor counts its local shard, a tensor on ``meta``
    counts 0."""
    from torch.distributed.tensor import DTensor
    if isinstance(tensors, nn.Module):
        tensors = list(tensors.parameters())
    if isinstance(tensors, dict):
        return sum(local_bytes(v) for v in tensors.values())
    if isinstance(tensors, (list, tuple)):
        return sum(local_bytes(v) for v in tensors)
    if isinstance(tensors, torch.Tensor):
        t = tensors.to_local() if isinstance(tensors, DTensor) else tensors
        return 0 if t.is_meta else t.numel() * t.element_size()
    return 0


#: warnings these functions expect and explain, kept off the page: DTensor's random
#: numbers on a CPU mesh (we seed each rank ourselves, see above), and DCP used in one
#: process without a process group (the unsharded reference run, on purpose)
EXPECTED_WARNINGS = ("DTensor random operators may not have complete support on cpu",
                     "torch.distributed is disabled, unavailable or uninitialized")


@contextlib.contextmanager
def _expected_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        for message in EXPECTED_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        yield


def shard_model(model: nn.Module) -> nn.Module:
    """``fully_shard`` on each ``Linear`` of ``model``, then on the whole, over a 1-D CPU
    mesh of all the processes of the group (as :func:`dpbook.torch.fsdp.shard_lenet`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def materialize(model: nn.Module, seed: int, device: str = "cpu") -> nn.Module:
    """Allocate the local shards of a sharded ``meta`` model on ``device`` and initialize
    them with each layer's ``reset_parameters``, from the seed ``seed + rank`` (on a CPU
    mesh each rank draws its shard from its own generator: see the module's docstring)."""
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[]), _expected_warnings():
        torch.manual_seed(seed + dist.get_rank())
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model


@contextlib.contextmanager
def gathered_layers(model: nn.Module) -> Iterator[dict]:
    """Watch the forward passes of a sharded :func:`mlp`: a hook that runs after FSDP2's
    all-gather, before each ``Linear``, records the largest layer gathered whole
    (``layer_bytes``) and the most layers whole at once (``at_once``)."""
    from torch.distributed.tensor import DTensor
    linears = [m for m in model if isinstance(m, nn.Linear)]
    seen = {"layer_bytes": 0, "at_once": 0}

    def hook(module, args):
        whole = [m for m in linears if not isinstance(m.weight, DTensor)]
        seen["at_once"] = max(seen["at_once"], len(whole))
        seen["layer_bytes"] = max(seen["layer_bytes"], local_bytes(module))

    handles = [m.register_forward_pre_hook(hook) for m in linears]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def adam(model: nn.Module) -> torch.optim.Adam:
    """Adam with the page's learning rate."""
    return torch.optim.Adam(model.parameters(), lr=LR)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, batch_size: int,
          rank: int = 0, world_size: int = 1) -> list[float]:
    """Steps ``steps`` (their numbers pick the batches, so that a resumed run sees the
    batches the uninterrupted run would) on this rank's part of each global batch; the
    losses of this rank's part."""
    losses = []
    for step in steps:
        X, y = random_batch(batch_size, seed=1000 + step)
        X, y = X.chunk(world_size)[rank], y.chunk(world_size)[rank]
        opt.zero_grad()
        loss = F.cross_entropy(model(X), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def save(model: nn.Module, opt: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Save model and optimizer state to the folder ``path`` with DCP; every rank calls
    it and writes its own shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    with _expected_warnings():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load(model: nn.Module, opt: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Load a checkpoint of :func:`save`, written by any number of ranks, into ``model``
    and ``opt`` (sharded over any number of ranks, or plain in one process).
    ``get_state_dict`` says which slices this rank needs (and creates the optimizer's
    state if it has none yet); ``dcp.load`` reads them in place; ``set_state_dict`` hands
    the rest (the optimizer's ``param_groups``: learning rate, betas) to the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    with _expected_warnings():
        dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def export(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full (unsharded) model and optimizer state dicts, gathered on rank 0's CPU;
    every rank must call it (it all-gathers), and every other rank gets empty dicts. The
    optimizer's ``step`` counters in it are the optimizer's own tensors, not copies: copy
    (:func:`flat_state`) before the next step, or they count on."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, opt, options=options)


def flat_state(model_sd: dict, optim_sd: dict) -> dict[str, torch.Tensor]:
    """One flat dict of the tensors of a model and an optimizer state dict (FQN keys), e.g.
    ``"1.weight"`` and ``"optim.1.weight.exp_avg"``; plain tensors, on the CPU."""
    from torch.distributed.tensor import DTensor

    def plain(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
    out = {k: plain(v) for k, v in model_sd.items()}
    for name, state in optim_sd.get("state", {}).items():
        for k, v in state.items():
            out[f"optim.{name}.{k}"] = plain(torch.as_tensor(v))
    return out


def birth(width: int, seed: int = 0) -> tuple[nn.Module, dict]:
    """Build :func:`mlp` on ``meta``, shard it, materialize it (in a process group); the
    model, and what this rank holds at each stage (``meta``, ``sharded``,
    ``materialized`` bytes; ``whole``: the whole model's), the shape of its shard of the
    first weight, whether that shard's first row equals rank 0's (``equal_to_rank0``),
    and whether it would with the same seed on every rank (``same_seed_equal``)."""
    with torch.device("meta"):
        model = mlp(width)
    out = {"whole": whole_bytes(model), "meta": local_bytes(model)}
    shard_model(model)
    out["sharded"] = local_bytes(model)
    weight = model[1].weight                            # a DTensor, sharded by rows
    out["shard_shape"] = tuple(weight.to_local().shape)
    materialize(model, seed)
    out["materialized"] = local_bytes(model)
    out["device"] = str(weight.to_local().device)
    out["equal_to_rank0"] = _first_rows_equal(weight)
    bound = 1 / 784 ** 0.5                              # kaiming_uniform_(a=√5): 1/√fan_in
    out["within_bound"] = bool(weight.to_local().abs().max() <= bound)
    out["same_seed_equal"] = _same_seed_shards_equal(width)
    return model, out


def _first_rows_equal(weight) -> list[bool]:
    """Is the first row of each rank's shard of ``weight`` equal to rank 0's? (Rows, not
    shards: the last shard may have fewer rows.)"""
    first = weight.to_local()[0].detach().clone()
    gathered = [torch.empty_like(first) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, first)
    return [torch.equal(g, gathered[0]) for g in gathered]


def _same_seed_shards_equal(width: int) -> bool:
    """Materialize the same model with one seed on every rank (no ``+ rank``): are the
    ranks' shards of the first weight equal?"""
    with torch.device("meta"):
        model = shard_model(mlp(width))
    model.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]), _expected_warnings():
        torch.manual_seed(0)
        model[1].reset_parameters()
    return all(_first_rows_equal(model[1].weight))


def save_worker(rank: int, world_size: int, width: int, path: str, steps: int,
                batch_size: int, seed: int = 0) -> dict:
    """:func:`birth`, ``steps`` steps of Adam, a DCP checkpoint in ``path``, then the
    export. Rank 0 returns the full state (``state``, :func:`flat_state`); every rank
    the bytes of its exported dicts (``exported``) and of the model and optimizer state
    it holds (``held``), what :func:`birth` saw (``birth``) and what
    :func:`gathered_layers` saw in training (``gathered``)."""
    from .dist import process_group
    with process_group(rank, world_size):
        model, born = birth(width, seed)
        opt = adam(model)
        with gathered_layers(model) as gathered:
            losses = train(model, opt, range(steps), batch_size, rank, world_size)
        save(model, opt, path)
        model_sd, optim_sd = export(model, opt)
        return {"state": flat_state(model_sd, optim_sd) if rank == 0 else None,
                "exported": local_bytes([model_sd, optim_sd]), "birth": born,
                "gathered": gathered,
                "held": local_bytes([model, opt.state_dict()["state"]]),
                "losses": losses, "files": sorted(os.listdir(path))}


def resume_worker(rank: int, world_size: int, width: int, path: str, start: int,
                  steps: int, batch_size: int) -> dict:
    """A fresh sharded model (on ``meta``, materialized, *not* initialized: the checkpoint
    overwrites it), loaded from ``path``; rank 0 returns the full state just after loading
    (``loaded``) and after ``steps`` more steps (``after``), numbered from ``start``."""
    from .dist import process_group
    with process_group(rank, world_size):
        with torch.device("meta"):
            model = mlp(width)
        shard_model(model).to_empty(device="cpu")
        opt = adam(model)
        load(model, opt, path)
        loaded = export(model, opt)                     # a collective: every rank
        loaded = flat_state(*loaded) if rank == 0 else None   # copy before training on
        train(model, opt, range(start, start + steps), batch_size, rank, world_size)
        after = export(model, opt)
        return {"loaded": loaded,
                "after": flat_state(*after) if rank == 0 else None,
                "held": local_bytes([model, opt.state_dict()["state"]])}


def resume_one_process(width: int, path: str, start: int, steps: int, batch_size: int
                       ) -> dict:
    """The unsharded reference: a plain model in this process (no process group), loaded
    from the same checkpoint, trained ``steps`` steps on the whole batches; the full state
    after loading (``loaded``) and after the steps (``after``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = mlp(width)
    opt = adam(model)
    load(model, opt, path)
    loaded = flat_state(*get_state_dict(model, opt))
    train(model, opt, range(start, start + steps), batch_size)
    return {"loaded": loaded, "after": flat_state(*get_state_dict(model, opt))}


def save_and_resume(width: int, folder: str | os.PathLike, save_on: int = 2,
                    resume_on: int = 3, steps: int = 2, more: int = 2, batch_size: int = 48,
                    timeout: float = 300) -> dict:
    """Train ``steps`` steps on ``save_on`` processes and save; load on ``resume_on``
    processes and in one process, and train ``more`` steps in both. Returns the saved
    state (``saved``), each resume's ``loaded`` and ``after`` (keys ``resume_on`` and
    ``1``), and the workers' other results (``save``, ``resume``)."""
    from .dist import per_process, run
    per_process(batch_size, save_on)
    per_process(batch_size, resume_on)
    path = os.path.join(os.fspath(folder), f"step{steps}")
    saved = run(save_worker, save_on, width, path, steps, batch_size, on="cpu",
                ranks="all", timeout=timeout)
    resumed = run(resume_worker, resume_on, width, path, steps, more, batch_size,
                  on="cpu", ranks="all", timeout=timeout)
    return {"saved": saved[0]["state"], "save": saved, "resume": resumed,
            resume_on: {k: resumed[0][k] for k in ("loaded", "after")},
            1: resume_one_process(width, path, steps, more, batch_size)}

"""DDP's own knobs, measured on real gloo processes.

:func:`compare` trains LeNet under several settings of
``DistributedDataParallel(bucket_cap_mb=, gradient_as_bucket_view=, static_graph=)`` from
the same parameters on the same batches, and reports for each: the buckets of the first
backward pass and of the later ones (DDP rebuilds them after the first iteration), the
bytes the gradients occupy, the step time (interleaved rounds, slowest process), and the
largest parameter difference from the first setting — the knobs change how DDP
communicates, never what it computes. :func:`unused_parameters` shows what DDP does with a
parameter the forward pass never uses: the error, and the two ways out.

``python -m dpbook.torch.ddp_knobs`` prints both.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .evaluate import max_abs_difference
from .devices import full_float32, hardware_line
from .dist import group_devices, per_process, process_group, run, slowest_seconds
from .ddp_hooks import BucketLog, recording_hook
from .models import lenet

__all__ = ["DEFAULT_SETTINGS", "knobs_worker", "compare", "WithUnusedLayer",
           "unused_worker", "unused_parameters", "UNUSED_SETTINGS", "main"]

#: The settings :func:`compare` measures by default: a ``bucket_cap_mb`` sweep (DDP's
#: default is 25 MB), then the default with each of the two other knobs.
DEFAULT_SETTINGS = ({"bucket_cap_mb": 0.01}, {"bucket_cap_mb": 0.1}, {"bucket_cap_mb": 1},
                    {}, {"gradient_as_bucket_view": True}, {"static_graph": True})


def _name(setting: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items()) or "defaults"


def _gradient_bytes(module: nn.Module, log: BucketLog) -> int:
    """Bytes of the distinct storages holding the gradients or the bucket buffers: with
    ``gradient_as_bucket_view`` the gradients *are* views into the buckets."""
    storages = dict(log.storages)
    for p in module.parameters():
        if p.grad is not None:
            s = p.grad.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def knobs_worker(rank: int, world_size: int, settings: Sequence[dict], batch_size: int,
                 rounds: int, steps: int) -> dict:
    """One DDP LeNet per setting, same start, same batches; returns what each did."""
    with process_group(rank, world_size) as device:
        full_float32()                 # compared in float32: no TF32 on a GPU
        g = torch.Generator().manual_seed(rank)
        X = torch.rand(batch_size // world_size, 1, 28, 28, generator=g).to(device)
        y = torch.randint(0, 10, (batch_size // world_size,), generator=g).to(device)
        runs = []
        for setting in settings:
            torch.manual_seed(0)
            model = DDP(lenet().to(device), **setting)
            log = BucketLog.of(model.module)
            model.register_comm_hook(log, recording_hook)
            runs.append((model, torch.optim.SGD(model.parameters(), lr=0.1), log))

        def step(model, optimizer, log):
            optimizer.zero_grad()
            log.new_iteration()
            F.cross_entropy(model(X), y).backward()
            optimizer.step()

        for run_ in runs:                      # two steps: DDP rebuilds its buckets after one
            step(*run_)
            step(*run_)
        seconds = [[] for _ in runs]
        for _ in range(rounds):                # a slow moment of the machine hits every setting
            for i, run_ in enumerate(runs):
                seconds[i].append(slowest_seconds(
                    lambda: [step(*run_) for _ in range(steps)]) / steps)
        reference = list(runs[0][0].module.parameters())
        results = []
        for setting, (model, _, log), times in zip(settings, runs, seconds):
            data = model._get_ddp_logging_data()
            results.append({
                "name": _name(setting), "setting": setting,
                "first_buckets": log.iterations[0], "buckets": log.iterations[-1],
                "rebuilt": bool(data.get("has_rebuilt_buckets")),
                "logged_bucket_bytes": [int(b) for b in   # DDP's own record, to check ours
                                        str(data.get("rebuilt_bucket_sizes", "")).split(",")
                                        if b.strip()],
                "gradient_bytes": _gradient_bytes(model.module, log),
                "grad_storages": len({p.grad.untyped_storage().data_ptr()
                                      for p in model.module.parameters()}),
                "seconds_per_step": statistics.median(times),
                "difference": max_abs_difference(model.module.parameters(), reference)})
        return {
            "results": results,
            "param_bytes": sum(p.numel() * p.element_size() for p in reference),
            "hardware": hardware_line(group_devices(device))}


def compare(nprocs: int, settings: Sequence[dict] = DEFAULT_SETTINGS, batch_size: int = 128,
            rounds: int = 5, steps: int = 10, timeout: float = 600) -> dict:
    """Run :func:`knobs_worker` on ``nprocs`` processes: ``{"results": [...],
    "param_bytes": ..., "hardware": ...}``, one result per setting (see the module's
    docstring). A setting is a dict of ``DistributedDataParallel`` keyword arguments."""
    per_process(batch_size, nprocs)          # refuses what does not divide
    for setting in settings:
        unknown = set(setting) - {"bucket_cap_mb", "gradient_as_bucket_view", "static_graph",
                                  "find_unused_parameters"}
        if unknown:
            raise ValueError(f"not a DDP knob this comparison measures: {sorted(unknown)}")
    return run(knobs_worker, nprocs, list(settings), batch_size, rounds, steps,
               timeout=timeout)


class WithUnusedLayer(nn.Module):
    """A two-layer network with a third layer that ``forward`` never calls (a leftover
    head, a branch taken only sometimes)."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(784, 64)
        self.unused = nn.Linear(64, 64)
        self.output = nn.Linear(64, 10)

    def forward(self, x):
        return self.output(F.relu(self.hidden(x.flatten(1))))


#: What :func:`unused_parameters` tries: plain DDP, then the two ways out.
UNUSED_SETTINGS = ({}, {"find_unused_parameters": True}, {"static_graph": True})


def unused_worker(rank: int, world_size: int) -> list[dict]:
    """Two steps of :class:`WithUnusedLayer` under each of :data:`UNUSED_SETTINGS`; returns
    the outcome of each (the error's first sentences, or what became of the unused
    layer's gradient)."""
    with process_group(rank, world_size) as device:
        X, y = torch.rand(8, 1, 28, 28).to(device), torch.randint(0, 10, (8,)).to(device)
        outcomes = []
        for setting in UNUSED_SETTINGS:
            torch.manual_seed(0)
            model = DDP(WithUnusedLayer().to(device), **setting)
            try:
                for _ in range(2):
                    F.cross_entropy(model(X), y).backward()
                grad = model.module.unused.weight.grad
                outcomes.append({"name": _name(setting), "ok": True,
                                 "unused_grad": None if grad is None else grad.abs().max().item()})
            except RuntimeError as e:
                sentences = " ".join(str(e).split()).split(". ")
                outcomes.append({"name": _name(setting), "ok": False,
                                 "error": ". ".join(sentences[:3]).strip() + "."})
        return outcomes


def unused_parameters(nprocs: int = 2, timeout: float = 300) -> list[dict]:
    """Run :func:`unused_worker` on ``nprocs`` processes; one outcome per setting."""
    return run(unused_worker, nprocs, timeout=timeout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dpbook.torch.ddp_knobs",
                                     description="Measure DDP's bucket_cap_mb, "
                                                 "gradient_as_bucket_view, static_graph and "
                                                 "find_unused_parameters.")
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    r = compare(args.nprocs, rounds=args.rounds)
    default = next(x for x in r["results"] if x["name"] == "defaults")
    for x in r["results"]:
        print(f"{x['name']:>30}: {len(x['buckets'])} buckets, "
              f"{x['gradient_bytes']:,} gradient bytes, "
              f"{default['seconds_per_step'] / x['seconds_per_step']:.2f}x the defaults' speed")
    print(r["hardware"])
    for outcome in unused_parameters(args.nprocs):
        print(f"{outcome['name']:>30}: {outcome.get('error') or 'ok'}")


if __name__ == "__main__":
    main()

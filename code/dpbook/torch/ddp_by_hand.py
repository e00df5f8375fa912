"""DDP by hand, in four steps: what ``DistributedDataParallel`` does to the gradients.

Each wrapper is an ``nn.Module`` around any model. Like DDP it broadcasts rank 0's
parameters and buffers when it is built (so processes seeded differently start equal),
synchronizes only the parameters that need a gradient, and counts a parameter shared by
two layers (tied weights) once. The training loop calls
:meth:`~DataParallel.finish_gradient_synchronization` after ``backward()`` and before the
optimizer step; afterwards every process holds the *mean* of the processes' gradients::

    model = BucketedDataParallel(net, bucket_cap_mb=1)
    loss_fn(model(X), y).backward()
    model.finish_gradient_synchronization()
    optimizer.step()

==============================  ===========================  ==========================
wrapper                         allreduce calls per step     starts communicating
==============================  ===========================  ==========================
``PerParameterDataParallel``    one per parameter            after backward
``FlatDataParallel``            one                          after backward
``OverlapDataParallel``         one per parameter            as each gradient is ready
``BucketedDataParallel``        one per bucket               as each bucket is full
==============================  ===========================  ==========================

:func:`compare` runs each on real gloo processes against DDP; :func:`benchmark` times
them; ``python -m dpbook.torch.ddp_by_hand --nprocs 2`` does both.
:mod:`dpbook.torch.profiling` records one step of each and shows the overlap.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .evaluate import max_abs_difference
from .devices import full_float32, hardware_line
from .dist import group_devices, process_group, run, slowest_seconds

__all__ = ["DataParallel", "PerParameterDataParallel", "FlatDataParallel",
           "OverlapDataParallel", "BucketedDataParallel", "WRAPPERS", "wrap", "make_buckets",
           "sync_gradients", "compare", "benchmark"]


class DataParallel(nn.Module):
    """What the four wrappers share: broadcast at construction, the parameters to
    synchronize, the counters, and ``forward``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():                  # everybody starts from rank 0's state
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        # parameters() lists a tensor shared by two layers once; frozen ones need nothing
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.calls = 0                         # allreduce calls so far
        self.bytes = 0                         # bytes handed to them

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _allreduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Average ``tensor`` over the processes, in place (divide, then sum, as DDP does)."""
        self.calls += 1
        self.bytes += tensor.numel() * tensor.element_size()
        tensor.div_(self.world_size)
        return dist.all_reduce(tensor, async_op=async_op)

    def finish_gradient_synchronization(self) -> None:
        """Wait until every parameter's ``.grad`` holds the mean over the processes."""
        raise NotImplementedError


def _grad(p: nn.Parameter) -> torch.Tensor:
    """``p.grad``, or zeros if ``p`` took no part in this step (every process must still
    join every allreduce)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


class PerParameterDataParallel(DataParallel):
    """(a) After ``backward()``: one allreduce per parameter, one after another."""

    def finish_gradient_synchronization(self) -> None:
        for p in self.params:
            self._allreduce(_grad(p))


class FlatDataParallel(DataParallel):
    """(b) After ``backward()``: all gradients in one flat buffer, one allreduce."""

    def finish_gradient_synchronization(self) -> None:
        grads = [_grad(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._allreduce(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


class OverlapDataParallel(DataParallel):
    """(c) Overlap: each parameter's allreduce starts, asynchronously, as soon as
    ``backward()`` has accumulated its gradient; the step waits for all of them."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self._pending: list = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p: nn.Parameter) -> None:
        self._pending.append((p, self._allreduce(p.grad, async_op=True)))

    def finish_gradient_synchronization(self) -> None:
        done = {id(p) for p, _ in self._pending}
        for p in self.params:                  # no gradient this step: zeros, same calls
            if id(p) not in done:
                self._pending.append((p, self._allreduce(_grad(p), async_op=True)))
        for _, work in self._pending:
            work.wait()
        self._pending.clear()


def make_buckets(params: Sequence[nn.Parameter], bucket_cap_mb: float
                 ) -> list[list[nn.Parameter]]:
    """Group ``params`` in *reverse* order (the order backward produces their gradients)
    into buckets of at most ``bucket_cap_mb`` megabytes (2**20 bytes); a parameter larger
    than the cap gets a bucket of its own."""
    cap = bucket_cap_mb * 2**20
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class BucketedDataParallel(DataParallel):
    """(d) Buckets: the parameters, in reverse order, grouped into buckets of at most
    ``bucket_cap_mb``; when the last gradient of a bucket is ready, the bucket's flat
    buffer starts its allreduce (asynchronously) while backward goes on."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25):
        super().__init__(module)
        self.buckets = make_buckets(self.params, bucket_cap_mb)
        self._place = {id(p): (i, j) for i, b in enumerate(self.buckets)
                       for j, p in enumerate(b)}          # parameter → (bucket, slot)
        self._buffers = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype,
                                     device=b[0].device) for b in self.buckets]
        self._offsets = [list(itertools.accumulate((p.numel() for p in b), initial=0))
                         for b in self.buckets]
        self._reset()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _reset(self) -> None:
        self._waiting = [len(b) for b in self.buckets]   # gradients still to come
        self._work: dict[int, object] = {}               # bucket → its allreduce

    def _slot(self, i: int, j: int) -> torch.Tensor:
        return self._buffers[i][self._offsets[i][j]:self._offsets[i][j + 1]]

    def _ready(self, p: nn.Parameter) -> None:
        i, j = self._place[id(p)]
        self._slot(i, j).copy_(p.grad.reshape(-1))
        self._waiting[i] -= 1
        if self._waiting[i] == 0:                 # the bucket is full: send it now
            self._work[i] = self._allreduce(self._buffers[i], async_op=True)

    def finish_gradient_synchronization(self) -> None:
        for i, bucket in enumerate(self.buckets):  # buckets some gradient never reached
            if i not in self._work:
                for j, p in enumerate(bucket):
                    self._slot(i, j).copy_(_grad(p).reshape(-1))
                self._work[i] = self._allreduce(self._buffers[i], async_op=True)
        for i, bucket in enumerate(self.buckets):
            self._work[i].wait()
            for j, p in enumerate(bucket):
                _grad(p).copy_(self._slot(i, j).view_as(p))
        self._reset()


#: name → how to wrap a model (``bucket_cap_mb`` for the bucketed one and for DDP)
WRAPPERS: dict[str, Callable[..., nn.Module]] = {
    "per-parameter": lambda m, cap: PerParameterDataParallel(m),
    "flat": lambda m, cap: FlatDataParallel(m),
    "overlap": lambda m, cap: OverlapDataParallel(m),
    "bucketed": lambda m, cap: BucketedDataParallel(m, cap),
    "ddp": lambda m, cap: DDP(m, bucket_cap_mb=cap),
}


def wrap(name: str, module: nn.Module, bucket_cap_mb: float = 25) -> nn.Module:
    """``module`` wrapped by the variant ``name`` (a key of :data:`WRAPPERS`)."""
    if name not in WRAPPERS:
        raise ValueError(f"unknown wrapper {name!r}; choose from {list(WRAPPERS)}")
    return WRAPPERS[name](module, bucket_cap_mb)


def sync_gradients(model: nn.Module) -> None:
    """After ``backward()``: wait for a wrapper's gradient synchronization (DDP needs
    nothing: it has already averaged the gradients during backward)."""
    if isinstance(model, DataParallel):
        model.finish_gradient_synchronization()


def _batches(kind: str, steps: int, batch_size: int, seed: int = 0):
    """``steps`` random batches for the model ``kind`` (the same on every process)."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, 28, 28) if kind == "lenet" else (32,)
    return [(torch.rand(batch_size, *shape, generator=g),
             torch.randint(0, 10, (batch_size,), generator=g)) for _ in range(steps)]


def _model(kind: str, rank: int) -> nn.Module:
    """The models the checks use, each rank seeded *differently* (the wrappers must
    broadcast rank 0's start): ``"mlp"``, or ``"tied"`` (a weight shared by two layers
    and a frozen layer), or ``"lenet"``."""
    torch.manual_seed(100 + rank)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                             nn.Linear(64, 10))
    if kind == "tied":
        first, last = nn.Linear(32, 32), nn.Linear(32, 32)
        last.weight = first.weight             # tied: one tensor, two layers
        frozen = nn.Linear(32, 10)
        frozen.requires_grad_(False)
        return nn.Sequential(first, nn.Tanh(), last, nn.Tanh(), frozen)
    if kind == "lenet":
        from .models import lenet
        return lenet()
    raise ValueError(f"unknown model {kind!r}")


def compare_worker(rank: int, world_size: int, names: Sequence[str], kind: str, steps: int,
                   bucket_cap_mb: float) -> dict:
    """Train ``kind`` for ``steps`` SGD steps with every wrapper in ``names`` and with DDP;
    returns each wrapper's largest parameter difference from DDP and its counts."""
    with process_group(rank, world_size) as device:
        full_float32()                 # compared in float32: no TF32 on a GPU
        results, finals = {}, {}
        for name in [*names, "ddp"]:
            model = wrap(name, _model(kind, rank).to(device), bucket_cap_mb)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for X, y in _batches(kind, steps, 6 * world_size):
                X, y = X.chunk(world_size)[rank].to(device), y.chunk(world_size)[rank].to(device)
                optimizer.zero_grad()
                F.cross_entropy(model(X), y).backward()
                sync_gradients(model)
                optimizer.step()
            inner = model.module
            finals[name] = [p.detach().cpu() for p in inner.parameters()]
            if isinstance(model, DataParallel):
                results[name] = {"calls_per_step": model.calls / steps,
                                 "bytes_per_step": model.bytes / steps,
                                 "buckets": len(getattr(model, "buckets", [])) or None}
        start = [p.detach() for p in _model(kind, 0).parameters()]
        for name in names:
            results[name]["max_difference"] = max_abs_difference(finals[name], finals["ddp"])
        results["moved"] = max_abs_difference(finals["ddp"], start)
        return results


def compare(nprocs: int, names: Sequence[str] = ("per-parameter", "flat", "overlap", "bucketed"),
            kind: str = "mlp", steps: int = 5, bucket_cap_mb: float = 0.01,
            timeout: float = 120) -> dict:
    """Each wrapper in ``names`` against DDP on ``nprocs`` gloo processes: ``{name:
    {"max_difference", "calls_per_step", "bytes_per_step", "buckets"}, "moved": …}``
    (``moved``: how far DDP's parameters went from the start, to judge the differences)."""
    unknown = [n for n in names if n not in WRAPPERS or n == "ddp"]
    if unknown:
        raise ValueError(f"unknown wrapper(s) {unknown}; choose from {list(WRAPPERS)[:-1]}")
    return run(compare_worker, nprocs, list(names), kind, steps, bucket_cap_mb,
               timeout=timeout)


def bench_worker(rank: int, world_size: int, names: Sequence[str], batch_size: int,
                 rounds: int, steps: int, bucket_cap_mb: float) -> dict:
    """LeNet, ``rounds`` rounds in which every wrapper takes ``steps`` timed steps in turn
    (so a slow moment of the machine hits all of them); returns the median steps
    per second of each."""
    from .models import lenet
    with process_group(rank, world_size) as device:
        models = {}
        for name in names:
            torch.manual_seed(0)
            model = wrap(name, lenet().to(device), bucket_cap_mb)
            models[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
        g = torch.Generator().manual_seed(rank)
        X = torch.rand(batch_size // world_size, 1, 28, 28, generator=g).to(device)
        y = torch.randint(0, 10, (batch_size // world_size,), generator=g).to(device)

        def step(model, optimizer):
            optimizer.zero_grad()
            F.cross_entropy(model(X), y).backward()
            sync_gradients(model)
            optimizer.step()

        for model, optimizer in models.values():
            step(model, optimizer)                       # warm-up (DDP builds its buckets)
            step(model, optimizer)
        speeds = {name: [] for name in names}
        for _ in range(rounds):
            for name, (model, optimizer) in models.items():
                seconds = slowest_seconds(lambda: [step(model, optimizer) for _ in range(steps)])
                speeds[name].append(steps / seconds)
        return {
            "steps_per_sec": {n: statistics.median(s) for n, s in speeds.items()},
            "hardware": hardware_line(group_devices(device))}


def benchmark(nprocs: int, names: Sequence[str] = tuple(WRAPPERS), batch_size: int = 128,
              rounds: int = 5, steps: int = 10, bucket_cap_mb: float = 25,
              timeout: float = 600) -> dict:
    """Median steps per second of each wrapper (and DDP) training LeNet on ``nprocs``
    processes: ``{"steps_per_sec": {name: …}, "hardware": …}``."""
    return run(bench_worker, nprocs, list(names), batch_size, rounds, steps, bucket_cap_mb,
               timeout=timeout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dpbook.torch.ddp_by_hand",
                                     description="Check the hand-written DDP wrappers "
                                                 "against DDP and time them.")
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-cap-mb", type=float, default=25)
    args = parser.parse_args(argv)
    print(json.dumps(compare(args.nprocs), indent=1))
    bench = benchmark(args.nprocs, rounds=args.rounds, bucket_cap_mb=args.bucket_cap_mb)
    ddp = bench["steps_per_sec"]["ddp"]
    for name, speed in bench["steps_per_sec"].items():
        print(f"{name:>14}: {speed:7.1f} steps/s, {speed / ddp:.2f}x DDP")
    print(bench["hardware"])


if __name__ == "__main__":
    main()

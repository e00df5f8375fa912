"""DDP by hand, in four steps: what ``DistributedDataParallel`` does to the gradients.

Each wrapper is an ``nn.Module`` around any model. Like DDP it broadcasts rank 0's
parameters and buffers when it is built (so processes seeded differently start equal),
synchronizes only the parameters that need a gradient, and counts a parameter shared by
two layers (tied weights) once. After ``backward()`` every process holds the *mean* of
the processes' gradients: the first gradient hook of a backward queues a callback in
autograd's engine (as picotron does; DDP's reducer queues its own from the hook that
makes the last bucket ready), which runs at the end of that backward and calls
:meth:`~DataParallel.finish_gradient_synchronization`, so the training loop looks like
DDP's. A backward that raises midway never reaches its callback: the next ``forward``
drops what it left half done (waiting for the allreduces it launched), so the next step
synchronizes as usual. That recovery needs the callback (with ``finish_in_backward=False``
the next backward is refused as a second one) and a backward that raised at the same point
on every rank (a rank that fails alone waits for allreduces no other rank joins, until the
group's timeout, as DDP would). With ``finish_in_backward=False`` the loop calls that
method itself after ``backward()`` (the teaching step before the callback); called after
the callback has run, it does nothing. To accumulate gradients over micro-batches, run
all but the last backward inside :meth:`~DataParallel.no_sync`, as with DDP::

    model = BucketedDataParallel(net, bucket_cap_mb=1)
    with model.no_sync():
        loss_fn(model(X1), y1).backward()      # gradients accumulate locally
    loss_fn(model(X2), y2).backward()          # sends; the callback waits at its end
    optimizer.step()

==============================  ===========================  ==========================
wrapper                         allreduce calls per step     starts communicating
==============================  ===========================  ==========================
``PerParameterDataParallel``    one per parameter            after backward
``FlatDataParallel``            one                          after backward
``OverlapDataParallel``         one per parameter            as each gradient is ready
``BucketedDataParallel``        one per bucket               as each bucket is full
==============================  ===========================  ==========================

(c) and (d) launch their allreduces in a fixed order, the same on every process (gloo and
NCCL match collectives by the order of the calls): the next one only when all before it
are launched.

:func:`compare` runs each on real gloo processes against DDP; :func:`benchmark` times
them; ``python -m dpbook.torch.ddp_by_hand --nprocs 2`` does both.
:mod:`dpbook.torch.profiling` records one step of each and shows the overlap.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .data import random_batch
from .evaluate import max_abs_difference
from .devices import full_float32, hardware_line
from .dist import group_devices, process_group, run, slowest_seconds

__all__ = ["DataParallel", "PerParameterDataParallel", "FlatDataParallel",
           "OverlapDataParallel", "BucketedDataParallel", "WRAPPERS", "wrap", "make_buckets",
           "sync_gradients", "compare", "backward_events", "benchmark"]


class DataParallel(nn.Module):
    """What the four wrappers share: broadcast at construction, the parameters to
    synchronize, the counters, ``forward``, ``no_sync``, the gradient hooks and the
    callback that finishes the synchronization at the end of backward (unless
    ``finish_in_backward`` is False: then the training loop calls
    :meth:`finish_gradient_synchronization`).

    A module takes one wrapper for its lifetime: the gradient hooks stay on its
    parameters (nothing removes them), so after wrapping it again the first wrapper's
    hooks would still send every gradient, even inside the second's ``no_sync()``."""

    def __init__(self, module: nn.Module, finish_in_backward: bool = True):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():                  # everybody starts from rank 0's state
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        # parameters() lists a tensor shared by two layers once; frozen ones need none
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.calls = 0                         # allreduce calls so far
        self.bytes = 0                         # bytes handed to them
        self.require_backward_grad_sync = True     # False inside no_sync()
        self._sync_backward = True             # decided in forward, as DDP does
        self._arrived: set[int] = set()        # parameters whose gradient is final
        self.finish_in_backward = finish_in_backward
        self._queued = False                   # the callback of this backward is queued
        self._pending = False                  # gradients to synchronize
        self.events: list | None = None        # a list: record hooks and callback
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def forward(self, *args, **kwargs):
        if self._queued:                       # the last backward raised before its end
            self._drop_unfinished()
        self._sync_backward = self.require_backward_grad_sync
        self._pending |= self._sync_backward
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """The backward pass of a forward run inside accumulates gradients locally and
        sends nothing (as with DDP, the forward decides); the next forward and backward
        outside, and ``finish_gradient_synchronization``, send the sum."""
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True

    def _allreduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Average ``tensor`` over the processes, in place (scale by 1/N, then sum)."""
        self.calls += 1
        self.bytes += tensor.numel() * tensor.element_size()
        tensor.div_(self.world_size)
        return dist.all_reduce(tensor, async_op=async_op)

    def finish_gradient_synchronization(self) -> None:
        """Wait until every parameter's ``.grad`` holds the mean over the processes.
        Does nothing when there is nothing to synchronize (the callback has already
        finished, or every backward since ran inside ``no_sync()``)."""
        if self._pending:
            self._pending = False
            self._finish()

    def _finish(self) -> None:
        """Send what is left and wait: each wrapper's own way."""
        raise NotImplementedError

    def _drop_unfinished(self) -> None:
        """A backward raised after its first gradient hook, so autograd never ran the
        callback: forget that backward's half-done synchronization (its gradients are
        partial; the next step starts from ``zero_grad()``)."""
        self._queued = False
        self._pending = False
        self._clear()

    def _clear(self) -> None:
        """Forget the gradients that arrived; (c) and (d) wait for what they launched
        (the waits return when every process launched the same allreduces, that is, when
        every rank's backward raised at the same point)."""
        self._arrived.clear()

    def _ready(self, p: nn.Parameter) -> None:
        """(c) and (d) start communicating here; (a) and (b) wait for the end."""

    def _arrive(self, p: nn.Parameter) -> None:
        """(c) and (d): note that ``p.grad`` is final, once per synchronization."""
        if id(p) in self._arrived:
            raise RuntimeError("a second backward() before the synchronization: run the "
                               "earlier micro-batches' forward inside model.no_sync()")
        self._arrived.add(id(p))

    def _on_gradient(self, p: nn.Parameter) -> None:
        """Autograd calls this once ``p.grad`` is final in a backward pass."""
        if self.events is not None:
            self.events.append(("hook", p, self.calls))
        if not self._sync_backward:
            return                             # forward ran in no_sync(): accumulate
        self._pending = True
        if self.finish_in_backward and not self._queued:
            self._queued = True                # the first gradient of this backward
            Variable._execution_engine.queue_callback(self._end_of_backward)
        self._ready(p)

    def _end_of_backward(self) -> None:
        """Autograd runs this after the last gradient of the backward pass."""
        if self.events is not None:
            self.events.append(("callback", None, self.calls))
        self._queued = False
        self.finish_gradient_synchronization()


def _grad(p: nn.Parameter) -> torch.Tensor:
    """``p.grad``, or zeros if ``p`` took no part in this step (every process must still
    join every allreduce)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


class PerParameterDataParallel(DataParallel):
    """(a) After ``backward()``: one allreduce per parameter, one after another."""

    def _finish(self) -> None:
        for p in self.params:
            self._allreduce(_grad(p))


class FlatDataParallel(DataParallel):
    """(b) After ``backward()``: all gradients in one flat buffer, one allreduce."""

    def _finish(self) -> None:
        grads = [_grad(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._allreduce(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


class OverlapDataParallel(DataParallel):
    """(c) Overlap: each parameter's allreduce starts, asynchronously, as soon as
    ``backward()`` has accumulated its gradient and its turn has come (the parameters in
    reverse order); the step waits for all of them."""

    def __init__(self, module: nn.Module, finish_in_backward: bool = True):
        super().__init__(module, finish_in_backward)
        self.order = self.params[::-1]         # launch order, the same on every process
        self._work: list = []                  # allreduces launched, in that order

    def _ready(self, p: nn.Parameter) -> None:
        self._arrive(p)
        while len(self._work) < len(self.order):   # start all whose turn has come
            q = self.order[len(self._work)]
            if id(q) not in self._arrived:
                break
            self._work.append(self._allreduce(q.grad, async_op=True))

    def _finish(self) -> None:
        for p in self.order[len(self._work):]:  # the rest, in order (zeros if unused)
            self._work.append(self._allreduce(_grad(p), async_op=True))
        self._clear()

    def _clear(self) -> None:
        for work in self._work:
            work.wait()
        self._work.clear()
        self._arrived.clear()


def make_buckets(params: Sequence[nn.Parameter], bucket_cap_mb: float
                 ) -> list[list[nn.Parameter]]:
    """DDP's rule: take ``params`` in *reverse* order (the order backward produces their
    gradients), add each to the open bucket of its dtype and device, and close that
    bucket once it holds ``bucket_cap_mb`` megabytes (2**20 bytes) or more, so a bucket
    can end larger than the cap. Returns the buckets in the order of their first
    parameter, as torch sorts them (with one dtype: the order they closed)."""
    cap = bucket_cap_mb * 2**20
    buckets, open_ = [], {}                    # (dtype, device) → [parameters, bytes]
    for p in reversed(list(params)):
        key = (p.dtype, p.device)
        bucket = open_.setdefault(key, [[], 0])
        bucket[0].append(p)
        bucket[1] += p.numel() * p.element_size()
        if bucket[1] >= cap:                   # reached the cap: close it
            buckets.append(open_.pop(key)[0])
    buckets += [ps for ps, _ in open_.values()]
    position = {id(p): i for i, p in enumerate(reversed(list(params)))}
    return sorted(buckets, key=lambda bucket: position[id(bucket[0])])


class BucketedDataParallel(DataParallel):
    """(d) Buckets: the parameters grouped by :func:`make_buckets`; when the last
    gradient of a bucket is ready, and every bucket before it has started, the bucket's
    flat buffer starts its allreduce (asynchronously) while backward goes on."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25,
                 finish_in_backward: bool = True):
        super().__init__(module, finish_in_backward)
        self.buckets = make_buckets(self.params, bucket_cap_mb)
        self._place = {id(p): (i, j) for i, b in enumerate(self.buckets)
                       for j, p in enumerate(b)}          # parameter → (bucket, slot)
        self._buffers = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype,
                                     device=b[0].device)   # one dtype and device each
                         for b in self.buckets]
        self._offsets = [list(itertools.accumulate((p.numel() for p in b), initial=0))
                         for b in self.buckets]
        self._reset()

    def _reset(self) -> None:
        self._waiting = [len(b) for b in self.buckets]   # gradients still to come
        self._work: list = []                  # allreduces of buckets 0, 1, … launched
        self._arrived.clear()

    def _clear(self) -> None:
        for work in self._work:                # waited for: they write into the buffers
            work.wait()
        self._reset()

    def _slot(self, i: int, j: int) -> torch.Tensor:
        return self._buffers[i][self._offsets[i][j]:self._offsets[i][j + 1]]

    def _ready(self, p: nn.Parameter) -> None:
        self._arrive(p)
        i, j = self._place[id(p)]
        self._slot(i, j).copy_(p.grad.reshape(-1))
        self._waiting[i] -= 1
        n = len(self._work)                       # send full buckets, in index order
        while n < len(self.buckets) and self._waiting[n] == 0:
            self._work.append(self._allreduce(self._buffers[n], async_op=True))
            n += 1

    def _finish(self) -> None:
        for i in range(len(self._work), len(self.buckets)):   # the rest, in order
            for j, p in enumerate(self.buckets[i]):          # zeros if no gradient
                self._slot(i, j).copy_(_grad(p).reshape(-1))
            self._work.append(self._allreduce(self._buffers[i], async_op=True))
        for i, bucket in enumerate(self.buckets):
            self._work[i].wait()
            for j, p in enumerate(bucket):
                _grad(p).copy_(self._slot(i, j).view_as(p))
        self._reset()


#: name → how to wrap a model (``bucket_cap_mb`` for the bucketed one and for DDP;
#: ``finish_in_backward`` for the four by hand: DDP always finishes in backward)
WRAPPERS: dict[str, Callable[..., nn.Module]] = {
    "per-parameter": lambda m, cap, fin: PerParameterDataParallel(m, fin),
    "flat": lambda m, cap, fin: FlatDataParallel(m, fin),
    "overlap": lambda m, cap, fin: OverlapDataParallel(m, fin),
    "bucketed": lambda m, cap, fin: BucketedDataParallel(m, cap, fin),
    "ddp": lambda m, cap, fin: DDP(m, bucket_cap_mb=cap),
}


def wrap(name: str, module: nn.Module, bucket_cap_mb: float = 25,
         finish_in_backward: bool = True) -> nn.Module:
    """``module`` wrapped by the variant ``name`` (a key of :data:`WRAPPERS`)."""
    if name not in WRAPPERS:
        raise ValueError(f"unknown wrapper {name!r}; choose from {list(WRAPPERS)}")
    return WRAPPERS[name](module, bucket_cap_mb, finish_in_backward)


def sync_gradients(model: nn.Module) -> None:
    """After ``backward()``: wait for a wrapper's gradient synchronization. Needed only
    with ``finish_in_backward=False``; otherwise (and for DDP) the gradients are already
    averaged when backward returns, and this does nothing."""
    if isinstance(model, DataParallel):
        model.finish_gradient_synchronization()


class _RankBranch(nn.Module):
    """An MLP whose middle layer only rank 0 uses: on the other ranks its parameters
    get no gradient, and their allreduces come late."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.first, self.middle, self.last = (nn.Linear(32, 64), nn.Linear(64, 64),
                                              nn.Linear(64, 10))

    def forward(self, x):
        h = torch.relu(self.first(x))
        if self.rank == 0:
            h = torch.relu(self.middle(h))
        return self.last(h)


def _model(kind: str, rank: int) -> nn.Module:
    """The models the checks use, each rank seeded *differently* (the wrappers must
    broadcast rank 0's start): ``"mlp"``, ``"tied"`` (a weight shared by two layers
    and a frozen layer), ``"branch"`` (a layer only rank 0 uses) or ``"lenet"``."""
    torch.manual_seed(100 + rank)
    if kind == "branch":
        return _RankBranch(rank)
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
                   bucket_cap_mb: float, micro_batches: int = 1, explicit: bool = False,
                   no_sync: bool = True) -> dict:
    """Train ``kind`` for ``steps`` SGD steps with every wrapper in ``names`` and with DDP,
    each step ``micro_batches`` backward passes (all but the last inside ``no_sync``);
    returns each wrapper's largest parameter difference from DDP and its counts. With
    ``explicit``, the wrappers have no callback and the loop finishes the
    synchronization itself. With ``no_sync=False`` every backward synchronizes."""
    with process_group(rank, world_size) as device:
        full_float32()                 # compared in float32: no TF32 on a GPU
        results, finals = {}, {}
        for name in [*names, "ddp"]:
            module = _model(kind, rank).to(device)
            model = (DDP(module, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=True)
                     if name == "ddp" and kind == "branch"
                     else wrap(name, module, bucket_cap_mb,
                               finish_in_backward=not explicit))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            shape = (1, 28, 28) if kind == "lenet" else (32,)
            for step in range(steps):                  # the same batches on every rank
                X, y = random_batch(6 * world_size, step, shape)
                X, y = X.chunk(world_size)[rank].to(device), y.chunk(world_size)[rank].to(device)
                optimizer.zero_grad()
                for i, (Xi, yi) in enumerate(zip(X.chunk(micro_batches),
                                                 y.chunk(micro_batches))):
                    last = i == micro_batches - 1 or not no_sync
                    with contextlib.nullcontext() if last else model.no_sync():
                        (F.cross_entropy(model(Xi), yi) / micro_batches).backward()
                if explicit:                   # the wrappers without their callback
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
            micro_batches: int = 1, explicit: bool = False, no_sync: bool = True,
            timeout: float = 120) -> dict:
    """Each wrapper in ``names`` against DDP on ``nprocs`` gloo processes, each step
    ``micro_batches`` backward passes (all but the last inside ``no_sync``), the loop
    with no call after backward (with ``explicit``: the wrappers without their callback,
    and a call to ``finish_gradient_synchronization``): ``{name:
    {"max_difference", "calls_per_step", "bytes_per_step", "buckets"}, "moved": …}``
    (``moved``: how far DDP's parameters went from the start, to judge the differences)."""
    unknown = [n for n in names if n not in WRAPPERS or n == "ddp"]
    if unknown:
        raise ValueError(f"unknown wrapper(s) {unknown}; choose from {list(WRAPPERS)[:-1]}")
    return run(compare_worker, nprocs, list(names), kind, steps, bucket_cap_mb,
               micro_batches, explicit, no_sync, timeout=timeout)


def events_worker(rank: int, world_size: int, name: str, bucket_cap_mb: float) -> list:
    """One backward pass of the ``"mlp"`` model wrapped by ``name``, with
    :attr:`DataParallel.events` on: rank 0's ``(event, parameter, allreduces started)``
    in order, the hooks' and the callback's, then ``"returned"`` after ``backward()``."""
    with process_group(rank, world_size):
        module = _model("mlp", rank)
        names = {id(p): n for n, p in module.named_parameters()}
        model = wrap(name, module, bucket_cap_mb)
        model.events = []
        X, y = random_batch(4 * world_size, 0, (32,))
        X, y = X.chunk(world_size)[rank], y.chunk(world_size)[rank]
        F.cross_entropy(model(X), y).backward()
        model.events.append(("returned", None, model.calls))
        return [(event, names[id(p)] if p is not None else "", calls)
                for event, p, calls in model.events]


def backward_events(nprocs: int, name: str = "bucketed", bucket_cap_mb: float = 0.01,
                    timeout: float = 120) -> list:
    """``events_worker`` on ``nprocs`` gloo processes: in which order autograd
    calls the wrapper's gradient hooks and its end-of-backward callback."""
    if name not in WRAPPERS or name == "ddp":
        raise ValueError(f"unknown wrapper {name!r}; choose from {list(WRAPPERS)[:-1]}")
    return run(events_worker, nprocs, name, bucket_cap_mb, on="cpu", timeout=timeout)


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
            F.cross_entropy(model(X), y).backward()   # finishes the synchronization
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

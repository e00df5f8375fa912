"""Activation memory in PyTorch, measured: the peak of a training step (the profiler's
memory events on the CPU, the allocator's statistics on CUDA), the memory in use
through a step, event by event (the same profiler events), the bytes autograd saves for
the backward pass (``saved_tensors_hooks``), the values a model's layers produce per
example (the input of :func:`dpbook.sharding.activation_bytes`), and activation
checkpointing per block (``torch.utils.checkpoint``, non-reentrant; the recomputation
leaves BatchNorm's running statistics as the forward pass left them)."""
from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
from typing import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from .models import Residual

__all__ = ["peak_bytes", "MemoryTimeline", "memory_timeline", "saved_bytes",
           "layer_output_values", "step_peak", "Checkpointed", "checkpoint_blocks",
           "train_sgd"]


def peak_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Run ``fn()`` once and return the most bytes it had allocated at one time on
    ``device``, above what was allocated when it started.

    On CUDA the caching allocator counts: ``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats``. On the CPU no allocator keeps statistics, so the
    profiler records every allocation and free (``profile_memory=True``),
    :func:`memory_timeline` adds them up in time order, and the peak is the curve's
    maximum."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    if device.type != "cpu":
        raise ValueError(f"peak_bytes measures 'cpu' or 'cuda' devices, got {device}")
    return max([0, *memory_timeline(fn).allocated])


@dataclasses.dataclass
class MemoryTimeline:
    """The memory in use while a function ran, one entry per allocation or free on the
    CPU, in time order (what :func:`memory_timeline` returns)."""

    #: bytes allocated after each event, above what was allocated when the run started
    allocated: list[int]
    #: time of each event, in seconds after the first event the profiler recorded
    seconds: list[float]
    #: for each phase asked for, the events ``[start, stop)`` that fall inside it
    phases: dict[str, tuple[int, int]]


def memory_timeline(fn: Callable[[], object], phases: Sequence[str] = (),
                    min_bytes: int = 0) -> MemoryTimeline:
    """Run ``fn()`` once under the profiler with ``profile_memory=True`` and return the
    bytes allocated on the CPU after every allocation (+) and free (-), added up in time
    order: the curve whose maximum is :func:`peak_bytes`.

    ``phases`` names ranges that ``fn`` marks with ``torch.profiler.record_function``
    (``"forward"``, ``"backward"``, ``"step"``, say); the first range of each name gives
    the events it holds. ``min_bytes`` leaves out the events that allocate or free fewer
    bytes (an optimizer's step makes hundreds of 4- and 8-byte scalars); their bytes
    still count, in the next event kept. Plotted against the event's index, the curve
    looks the same on every run; against its time, it moves with whatever else the
    machine runs."""
    if min_bytes < 0:
        raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
    from .profiling import _quiet_stderr
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():               # only the profiler's profiler_start/stop lines:
        prof.start()                    # what fn writes to stderr still shows
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e for e in events if e.name() == "[memory]"
                     and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    t0 = min((e.start_ns() for e in events), default=0)
    times, allocated, now = [], [], 0
    for e in memory:                      # + allocation, - free
        now += e.nbytes()
        if abs(e.nbytes()) >= min_bytes:
            times.append(e.start_ns())
            allocated.append(now)
    ranges = {}
    for name in phases:
        marks = sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == name)
        if not marks:
            raise ValueError(f"fn marked no record_function range {name!r}")
        start, end = marks[0]
        ranges[name] = (bisect.bisect_left(times, start),
                        bisect.bisect_left(times, end))
    return MemoryTimeline(allocated, [(t - t0) / 1e9 for t in times], ranges)


def saved_bytes(net: nn.Module, X: torch.Tensor, y: torch.Tensor | None = None) -> int:
    """Bytes of the distinct tensors autograd saves for the backward pass of
    ``cross_entropy(net(X), y)`` (of ``net(X)`` alone without ``y``), parameters excluded:
    the activations. A tensor saved by two operations (a ReLU's output, which the next
    layer saves as its input) counts once, as do views of one storage."""
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = net(X)
        if y is not None:
            F.cross_entropy(out, y)
    return sum(seen.values())


def layer_output_values(net: nn.Module, example: torch.Tensor) -> int:
    """Values per example that the model of :mod:`dpbook.sharding` counts: the input plus
    the output of every leaf module (a layer with no sub-modules), for one ``example``
    of shape ``(1, ...)``. Functions called in a ``forward`` (``F.relu``, the residual
    addition) are not modules and are not counted."""
    if example.shape[0] != 1:
        raise ValueError(f"pass one example, shape (1, ...), got {tuple(example.shape)}")
    total = [example.numel()]
    hooks = [m.register_forward_hook(lambda m, i, out: total.append(out.numel()))
             for m in net.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            net(example)
    finally:
        for h in hooks:
            h.remove()
    return sum(total)


def step_peak(net: nn.Module, X: torch.Tensor, y: torch.Tensor) -> int:
    """Peak bytes of one forward and backward pass of ``net`` above what was held before
    it (the parameters, the batch): activations, temporaries and the new gradients."""
    net.zero_grad(set_to_none=True)

    def step():
        F.cross_entropy(net(X), y).backward()

    return peak_bytes(step, X.device)


class Checkpointed(nn.Module):
    """Run ``block`` under activation checkpointing: the forward pass keeps only the
    block's input; the backward pass runs the block again to get what it needs
    (``torch.utils.checkpoint.checkpoint``, ``use_reentrant=False``, PyTorch's
    recommended form).

    The recomputation runs in training mode, so BatchNorm would update its running
    statistics (and ``num_batches_tracked``) a second time. ``context_fn`` gives the
    recomputation a context that copies the block's BatchNorm buffers before it and
    writes them back after, so a checkpointed model ends with the same ``state_dict()``
    as the plain one: parameters and buffers."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, X, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(),
                                              _restored_norm_buffers(self.block)))


@contextlib.contextmanager
def _restored_norm_buffers(block: nn.Module) -> Iterator[None]:
    """Copy the buffers of every BatchNorm in ``block`` (running mean and variance,
    ``num_batches_tracked``) on entry and write them back on exit, also when the
    recomputation stops early (non-reentrant checkpointing stops it by raising)."""
    buffers = [b for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
               for b in m.buffers()]
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)


def checkpoint_blocks(net: nn.Module, block_type: type[nn.Module] = Residual) -> nn.Module:
    """A copy of ``net`` in which every ``block_type`` module (by default ResNet's
    ``Residual``) runs under :class:`Checkpointed`. The parameters are copies, in the
    same order: ``parameters()`` of both models pair up."""
    net = copy.deepcopy(net)

    def wrap(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, block_type):
                setattr(module, name, Checkpointed(child))
            else:
                wrap(child)

    if isinstance(net, block_type):
        return Checkpointed(net)
    wrap(net)
    return net


def train_sgd(net: nn.Module, batches, lr: float = 0.05) -> nn.Module:
    """A few steps of plain SGD on ``batches`` (pairs ``(X, y)``), in place."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for X, y in batches:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(X), y).backward()
        opt.step()
    return net

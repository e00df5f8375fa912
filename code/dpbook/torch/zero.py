"""ZeRO from scratch: the optimizer state (stage 1), the gradients (stage 2) and the
parameters (stage 3, FSDP) sharded over the processes of a group.

Every parameter is sharded on its own, one shard per parameter as in PyTorch's FSDP2
(FSDP2 cuts dimension 0 and pads whole rows; we flatten, pad single values with zeros to a
multiple of N and cut N equal slices); rank r owns slice r (:class:`Shard`).
Two collectives do all the communication, the two halves of the ring allreduce:
reduce-scatter (each rank gets the sum of its own slice) and all-gather (each rank gets
every slice). :class:`Traffic` counts what they carry.

Gloo and NCCL match collectives by the order in which the ranks call them, so every rank
reduce-scatters the gradients in one fixed order, the reverse of the parameters' order (as
DDP launches its buckets): a gradient that is ready out of turn waits, and at the end of
the backward pass a parameter that got no gradient on this rank sends zeros in its turn
(``_InOrder``). A parameter that one rank uses and another does not therefore gets
the mean over all ranks, as with DDP. Stage 3 gathers a unit's parameters when forward or
backward reaches the unit, so there every rank must run the same units (FSDP2's rule too).

* :class:`ZeroOptimizer` (stages 1 and 2) is a ``torch.optim.Optimizer`` that wraps any
  optimizer class: it keeps the inner optimizer's state for this rank's slices only.
  Stage 1 reduce-scatters the full gradients in ``step()``; stage 2 reduce-scatters each
  gradient the moment backward has produced it and frees it. Then the inner optimizer
  updates the slices, and an all-gather gives every rank every updated parameter.
* :class:`ZeroModel` (stage 3) keeps only slices of the parameters between uses: it
  all-gathers a layer's parameters before its forward, frees them after, all-gathers them
  again before its backward, and reduce-scatters their gradients. Train it with any
  optimizer over :meth:`ZeroModel.shards`; an optimizer over ``ZeroModel.parameters()``
  stops at its first step with a message that says so. ``prefetch=True`` issues each
  unit's all-gather one unit early (:func:`prefetch_schedule`).
* Both take a ``reduce_dtype`` (the dtype the gradients are summed in) and a
  ``no_sync()`` for gradient accumulation without a reduce-scatter per micro-batch;
  :func:`accumulation` measures what each way of accumulating costs.

Elementwise optimizers (SGD, momentum, Adam, AdamW) give the same step sharded or not; one
that needs the whole gradient (gradient clipping by the global norm) needs one more
allreduce, of the norm.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .data import random_batch
from .evaluate import max_abs_difference
from .models import seeded

__all__ = ["Traffic", "Shard", "reduce_scatter_mean", "all_gather", "ZeroOptimizer",
           "ZeroModel", "held_bytes", "OPTIMIZERS", "stage_worker", "reference",
           "compare", "accumulation_worker", "accumulation", "prefetch_schedule"]


@dataclasses.dataclass
class Traffic:
    """What the collectives of one rank carried: calls and full-tensor bytes per kind, and
    the bytes this rank *sends* with ring algorithms, (N-1)/N of a reduce-scatter's or an
    all-gather's full tensor and 2 (N-1)/N of an allreduce's."""

    world_size: int
    calls: dict = dataclasses.field(default_factory=dict)
    full_bytes: dict = dataclasses.field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.full_bytes[kind] = self.full_bytes.get(kind, 0) + nbytes

    def sent(self) -> float:
        n = self.world_size
        share = {"reduce-scatter": (n - 1) / n, "all-gather": (n - 1) / n,
                 "allreduce": 2 * (n - 1) / n}
        return sum(share[k] * b for k, b in self.full_bytes.items())

    def reset(self) -> None:
        self.calls.clear()
        self.full_bytes.clear()


class Shard:
    """Where rank ``rank``'s slice of a parameter of ``numel`` values lies: the parameter,
    flattened and padded to ``padded`` = N ⌈numel / N⌉ values, is cut into N slices of
    ``size``; ours is ``[start, start + size)`` (partly or wholly padding on the last ranks).

    >>> s = Shard(10, rank=2, world_size=3); (s.padded, s.size, s.start, s.real)
    (12, 4, 8, 2)
    """

    def __init__(self, numel: int, rank: int, world_size: int):
        self.numel, self.world_size = numel, world_size
        self.size = math.ceil(numel / world_size)
        self.padded = self.size * world_size
        self.start = rank * self.size
        self.real = max(0, min(numel - self.start, self.size))   # values that are not padding

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` flattened and padded with zeros to ``padded`` values."""
        return F.pad(t.reshape(-1), (0, self.padded - self.numel))

    def slice(self, t: torch.Tensor) -> torch.Tensor:
        """Our slice of ``t`` (the parameter itself, or its gradient): a copy, padded."""
        return self.pad(t)[self.start:self.start + self.size].clone()


def _collective(kind: str):
    """``dist.reduce_scatter_single`` / ``all_gather_single`` (torch >= 2.13), or their older
    names ``reduce_scatter_tensor`` / ``all_gather_into_tensor``: same arguments."""
    new = {"reduce_scatter": "reduce_scatter_single", "all_gather": "all_gather_single"}
    old = {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_into_tensor"}
    return getattr(dist, new[kind], None) or getattr(dist, old[kind])


def reduce_scatter_mean(full: torch.Tensor, shard: Shard, traffic: Traffic | None = None
                        ) -> torch.Tensor:
    """Every rank passes its whole tensor (a gradient); each gets back the mean over the
    ranks of its own slice. One reduce-scatter. It sums in the gradient's dtype: in
    bfloat16 that rounds at every addition (FSDP2's ``MixedPrecisionPolicy(reduce_dtype=
    torch.float32)`` sums in float32, at twice the bytes)."""
    out, work = _reduce_scatter_start(full, shard, traffic)
    work.wait()
    return out.div_(shard.world_size)


def _reduce_scatter_start(full: torch.Tensor, shard: Shard, traffic: Traffic | None = None,
                          group=None):
    """Start the reduce-scatter of ``full`` (summing) without waiting: (output, work)."""
    padded = shard.pad(full).contiguous()
    out = torch.empty(shard.size, dtype=full.dtype, device=full.device)
    work = _collective("reduce_scatter")(out, padded, op=dist.ReduceOp.SUM, group=group,
                                         async_op=True)
    if traffic is not None:
        traffic.add("reduce-scatter", padded.numel() * padded.element_size())
    return out, work


def all_gather(part: torch.Tensor, shard: Shard, traffic: Traffic | None = None
               ) -> torch.Tensor:
    """Every rank passes its slice; each gets back the whole flat tensor (``numel``
    values, the padding dropped). One all-gather."""
    out = torch.empty(shard.padded, dtype=part.dtype, device=part.device)
    _collective("all_gather")(out, part.contiguous())
    if traffic is not None:
        traffic.add("all-gather", out.numel() * out.element_size())
    return out[:shard.numel]


class _InOrder:
    """Reduce-scatters the gradients of ``order`` in that order on every rank, once per
    backward pass, and hands each mean slice to ``done(p, slice)``.

    :meth:`ready` (from a post-accumulate-grad hook) takes the parameter's gradient and
    starts every reduce-scatter whose turn has come; one that is ready out of turn waits
    for those before it. The first :meth:`ready` of a backward pass queues :meth:`finish`
    with the autograd engine, as DDP does, so it runs when the backward pass ends: it
    starts the rest in order, zeros for a parameter without a gradient, and waits for
    all. With a ``group`` of their own (stage 3) the collectives do not block: the
    all-gathers of the backward pass, on the default group, must not wait for a rank that
    is behind in the order; a finished one is collected at the next :meth:`ready`.
    Without (stages 1 and 2) each one is waited for at once.

    A parameter that no rank used gets a zero gradient, where one process would leave its
    ``.grad`` at None: plain SGD leaves it alone, momentum and weight decay still move it.
    DDP tells the two apart with one more allreduce, of a bitmap of the parameters used.

    With ``dtype`` (the *reduce dtype*, e.g. ``torch.float32`` while the gradients are
    bfloat16) each gradient is cast to it before the reduce-scatter, which then sums in
    it. :meth:`keep` (gradient accumulation without communication, ``no_sync``) adds the
    gradient to a whole one kept in :attr:`kept` instead; the next :meth:`ready` of the
    parameter sends the sum."""

    def __init__(self, order: list, shards: dict, traffic: Traffic, done: Callable,
                 group=None, after: Callable | None = None,
                 dtype: torch.dtype | None = None):
        self.order, self.shards, self.traffic, self.done = order, shards, traffic, done
        self.group, self.after = group, after      # after: called at the end of finish()
        self.dtype = dtype             # the reduce dtype (None: the gradient's own)
        self.grads: dict = {}          # gradients taken from the parameters, not yet sent
        self.kept: dict = {}           # whole gradients kept between micro-batches
        self.next = 0                  # the next turn in ``order``
        self.flight: list = []         # started, not yet collected: (parameter, out, work)
        self.queued = False

    def ready(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        kept = self.kept.pop(p, None)
        self.grads[p] = grad if kept is None else kept.add_(grad)
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.queued = True
        self._start(everything=False)

    def keep(self, p: torch.Tensor) -> None:
        """Add ``p``'s gradient to its kept whole gradient and send nothing."""
        grad, p.grad = p.grad, None
        self.kept[p] = grad if p not in self.kept else self.kept[p].add_(grad)
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_kept)
            self.queued = True

    def _end_kept(self) -> None:
        self.queued = False
        if self.after is not None:
            self.after()

    def _start(self, everything: bool) -> None:
        while self.next < len(self.order):
            p = self.order[self.next]
            grad = self.grads.pop(p, None)
            if grad is None and p.grad is not None:      # stage 1: no hooks, all in step
                grad, p.grad = p.grad, None
            if grad is None:
                if not everything:
                    return                                # not its turn yet: wait
                grad = self.kept.pop(p, None)      # kept from earlier micro-batches
                if grad is None:
                    grad = torch.zeros(self.shards[p].numel, dtype=p.dtype,
                                       device=p.device)
            if self.dtype is not None:
                grad = grad.to(self.dtype)         # the reduce dtype: sum in it
            out, work = _reduce_scatter_start(grad, self.shards[p], self.traffic,
                                              self.group)
            self.flight.append((p, out, work))
            self.next += 1
            self._collect(wait=self.group is None)

    def _collect(self, wait: bool) -> None:
        """Hand on the finished reduce-scatters, oldest first (all of them with ``wait``),
        which frees their inputs, the padded full gradients."""
        while self.flight and (wait or self.flight[0][2].is_completed()):
            p, out, work = self.flight.pop(0)
            work.wait()
            self.done(p, out.div_(self.shards[p].world_size))

    def finish(self) -> None:
        self._start(everything=True)
        self._collect(wait=True)
        self.next, self.queued = 0, False
        if self.after is not None:
            self.after()


class _NoSync:
    """``no_sync()`` and ``kept()``, gradient accumulation without a reduce-scatter per
    micro-batch, for :class:`ZeroOptimizer` and :class:`ZeroModel`. The class sets
    ``self._sync = True`` and an ``_InOrder`` as ``self._in_order``; its gradient hooks
    call ``_in_order.keep`` instead of ``_in_order.ready`` while ``_sync`` is False."""

    _sync: bool
    _in_order: _InOrder

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep whole gradients (:meth:`kept`: their memory, in the
        gradients' dtype, the compute dtype of a ``ZeroModel``) and send nothing; the
        first backward pass after it adds them to its own and reduce-scatters the sum
        (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``). For a stage 1
        ``ZeroOptimizer`` it changes nothing: stage 1 sends only in ``step()``."""
        self._sync, before = False, self._sync
        try:
            yield
        finally:
            self._sync = before

    def kept(self) -> list[torch.Tensor]:
        """The whole gradients kept by :meth:`no_sync`, not yet sent (none at stage 1,
        whose gradients wait in the parameters' ``.grad`` until ``step()``)."""
        return list(self._in_order.kept.values())


class ZeroOptimizer(_NoSync, torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around ``optimizer_class(**defaults)``: each rank keeps the
    optimizer state of its own slice of every parameter, 1/N of the whole.

    Call it like the optimizer it wraps: ``loss.backward(); opt.step(); opt.zero_grad()``,
    *without* DDP (it does the communication). The ranks must start from the same
    parameters. ``param_groups`` holds the full parameters, so a learning-rate scheduler
    works unchanged; ``step()`` passes their hyperparameters to the inner optimizer.
    ``state_dict()`` is this rank's shard of the state.

    ``reduce_dtype`` (e.g. ``torch.float32`` for a bfloat16 model) is the dtype the
    gradients are reduce-scattered in. Gradient accumulation over k micro-batches: stage 1
    keeps whole gradients anyway and sends once, in ``step()``; stage 2 sends a
    reduce-scatter per micro-batch, unless the first k - 1 backward passes run under
    :meth:`no_sync`, which keeps their whole gradients (stage 1's memory) until the last.
    """

    def __init__(self, params: Iterable[torch.Tensor], optimizer_class: type, stage: int = 1,
                 reduce_dtype: torch.dtype | None = None, **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer does stages 1 and 2; for stage 3 use "
                             f"ZeroModel (got stage={stage})")
        if not dist.is_initialized():
            raise RuntimeError("ZeroOptimizer needs a process group (dist.init_process_group)")
        params = [p for p in params if p.requires_grad]
        with torch.no_grad():          # like DDP: every rank starts from rank 0's parameters
            for p in params:
                dist.broadcast(p, 0)
        super().__init__(params, defaults)
        self.stage = stage
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.traffic = Traffic(world_size)
        self.shards = {p: Shard(p.numel(), rank, world_size) for p in params}
        # This rank's slice of every parameter, in float32: what the inner optimizer updates.
        self.slices = {p: s.slice(p.detach()).float().requires_grad_()
                       for p, s in self.shards.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self.slices[p] for p in g["params"]]} for g in self.param_groups]
        self.inner = optimizer_class(groups, **defaults)
        # reduce-scatter in the reverse of the parameters' order, on every rank the same
        self._in_order = _InOrder(params[::-1], self.shards, self.traffic, self._add_grad,
                                  dtype=reduce_dtype)
        self._sync = True
        self._hooks = []
        if stage == 2:      # reduce-scatter each gradient as soon as backward produces it
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, p: torch.Tensor) -> None:
        if self._sync:
            self._in_order.ready(p)
        else:
            self._in_order.keep(p)

    def _add_grad(self, p: torch.Tensor, part: torch.Tensor) -> None:
        """The mean slice of ``p``'s gradient into its slice's ``.grad``; the full gradient
        was taken from ``p`` (freed). With k backward passes before ``step()`` (gradient
        accumulation) the slices add up, but stage 2 then sends k reduce-scatters per step
        where DDP with ``no_sync()`` sends one allreduce."""
        s = self.slices[p]
        part = part.float()
        s.grad = part if s.grad is None else s.grad.add_(part)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        if self.stage == 1:    # every parameter in its turn, zeros for a missing .grad
            self._in_order.finish()
        self.inner.step()
        for p, shard in self.shards.items():
            p.copy_(all_gather(self.slices[p].to(p.dtype), shard, self.traffic).view_as(p))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """This rank's part of the optimizer state (its slices'): a sharded checkpoint, one
        file per rank, loaded back by the same rank with :meth:`load_state_dict`."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)


class ZeroModel(_NoSync, nn.Module):
    """ZeRO stage 3 (FSDP) around ``module``: between uses, each rank holds only its slice
    of every parameter (:meth:`shards`, float32: the master weights).

    Every submodule that owns parameters is a *unit*: a forward pre-hook all-gathers its
    parameters, a forward hook frees them, a hook on the unit's output all-gathers them
    again when backward reaches the unit, and a hook on each parameter reduce-scatters its
    gradient into the slice's ``.grad`` and frees the rest. With ``compute_dtype`` (e.g.
    ``torch.bfloat16``) the parameters travel and compute in that type and their gradients
    come back in it, while the slices and the optimizer state stay float32;
    ``reduce_dtype`` (e.g. ``torch.float32``) is the dtype the gradients are
    reduce-scattered in (default: the compute dtype). :meth:`full_state_dict` gathers a
    checkpoint.

    With ``prefetch=True`` a unit's all-gather is started (``async_op=True``) one unit
    early: in the forward pass when the unit before it (in the order of ``units``)
    starts, in the backward pass when the unit after it (in the order the forward pass
    ran them) starts its backward. It then travels while that unit computes, and two
    units are gathered at a time (FSDP2's implicit backward prefetch and its
    ``set_modules_to_forward_prefetch``). Every rank issues the same all-gathers in the
    same order, since every rank runs the same units. ``events`` records the last
    step: ``("gather", i)`` when unit i's all-gather is issued, ``("forward", i)`` /
    ``("backward", i)`` when its compute starts.

    Gradient accumulation: each backward pass reduce-scatters, k per step, into the
    slices' ``.grad``; under :meth:`no_sync` the whole gradients are kept instead
    (:meth:`kept`) and the next backward pass outside it sends their sum.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, prefetch: bool = False):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ZeroModel needs a process group (dist.init_process_group)")
        self.module = module
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self.prefetch = prefetch
        with torch.no_grad():          # like DDP: every rank starts from rank 0's parameters
            for p in module.parameters():
                dist.broadcast(p, 0)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.traffic = Traffic(world_size)
        self.units: list[nn.Module] = []
        self.events: list[tuple[str, int]] = []     # the last step's, see the docstring
        self._shard: dict[nn.Parameter, Shard] = {}
        self._slice: dict[nn.Parameter, torch.Tensor] = {}
        self._dtype: dict[nn.Parameter, torch.dtype] = {}
        self._shape: dict[nn.Parameter, torch.Size] = {}
        self._pending: dict[nn.Module, int] = {}
        self._flight: dict[nn.Module, list] = {}    # all-gathers started, not yet waited
        self._ran: list[nn.Module] = []             # the units in the order forward ran
        self._sync = True
        owner: dict[nn.Parameter, str] = {}
        self._names: list[str] = []         # the units' names, for the profiler's marks
        for name, unit in module.named_modules():
            own = [p for p in unit.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            for p in own:
                if p in owner:
                    raise ValueError(f"a parameter of {name!r} also belongs to "
                                     f"{owner[p]!r}: shared (tied) parameters are not "
                                     "supported by this ZeroModel")
                owner[p] = name
                shard = Shard(p.numel(), rank, world_size)
                self._shard[p] = shard
                self._slice[p] = shard.slice(p.detach()).float().requires_grad_()
                self._dtype[p] = compute_dtype or p.dtype
                self._shape[p] = p.shape
                p._dpbook_sharded = True     # an optimizer over these stops: see below
                p.register_post_accumulate_grad_hook(self._make_grad_hook(unit))
            self.units.append(unit)
            self._names.append(name)
            unit.register_forward_pre_hook(lambda m, args: self._before_forward(m))
            unit.register_forward_hook(self._after_forward)
            self._free(unit)
        self._index = {unit: i for i, unit in enumerate(self.units)}
        # The reduce-scatters in the reverse of the parameters' order on every rank, on a
        # group of their own: the all-gathers of the backward pass need not wait for them.
        # One collective on it now, on every rank: NCCL creates a group's communicator at
        # its first collective, which must not be a reduce-scatter only some ranks start.
        scatter_group = dist.new_group()
        dist.all_reduce(torch.zeros(1, device=next(iter(self._shard)).device),
                        group=scatter_group)
        self._in_order = _InOrder(list(self._shard)[::-1], self._shard, self.traffic,
                                  self._add_grad, group=scatter_group,
                                  after=self._free_all, dtype=reduce_dtype)
        _refuse_full_parameters_once()

    def _before_forward(self, unit: nn.Module) -> None:
        """The unit's parameters whole (waiting for a prefetched all-gather); with
        prefetch, start the next unit's all-gather before this one computes."""
        i = self._index[unit]
        with _mark(f"ZeroModel::pre_forward ({self._names[i]})"):    # for the profiler
            self._gather(unit)
            self._ran.append(unit)
            if self.prefetch and i + 1 < len(self.units):
                self._start_gather(self.units[i + 1])
        self.events.append(("forward", i))

    def _after_forward(self, unit: nn.Module, args, out) -> None:
        """Free the unit's parameters; gather them again when backward reaches the unit,
        i.e. when the gradient of its output arrives (a hook on the output tensor)."""
        with _mark(f"ZeroModel::post_forward ({self._names[self._index[unit]]})"):
            self._free(unit)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            outs[0].register_hook(lambda grad: self._before_backward(unit))

    def _before_backward(self, unit: nn.Module) -> None:
        """As :meth:`_before_forward`, in the reverse of the order forward ran."""
        i, k = self._index[unit], self._ran.index(unit)
        with _mark(f"ZeroModel::pre_backward ({self._names[i]})"):
            self._gather(unit)
            if self.prefetch and k > 0:
                self._start_gather(self._ran[k - 1])
        self.events.append(("backward", i))

    def _own(self, unit: nn.Module) -> list[nn.Parameter]:
        return [p for p in unit.parameters(recurse=False) if p in self._shard]

    @torch.no_grad()
    def _start_gather(self, unit: nn.Module) -> None:
        """Start the all-gathers of the unit's parameters (``async_op=True``), unless
        they are in flight already."""
        if unit in self._flight:
            return
        i = self._index[unit]
        self.events.append(("gather", i))
        mark = _mark(f"ZeroModel::all_gather ({self._names[i]})")
        mark.__enter__()
        started = []
        for p in self._own(unit):
            shard, part = self._shard[p], self._slice[p].to(self._dtype[p])
            out = torch.empty(shard.padded, dtype=part.dtype, device=part.device)
            work = _collective("all_gather")(out, part, async_op=True)
            self.traffic.add("all-gather", out.numel() * out.element_size())
            started.append((p, part, out, work))      # part: alive until the wait
        self._flight[unit] = started
        mark.__exit__(None, None, None)

    @torch.no_grad()
    def _gather(self, unit: nn.Module) -> None:
        """The unit's parameters whole: wait for its all-gathers (started now if no
        prefetch started them)."""
        self._start_gather(unit)
        for p, part, out, work in self._flight.pop(unit):
            work.wait()
            p.data = out[:self._shard[p].numel].view(self._shape[p])
        self._pending[unit] = len(self._own(unit))

    def _free(self, unit: nn.Module) -> None:
        for p in self._own(unit):      # an empty tensor of the parameter's shape would
            p.data = torch.empty(0, dtype=self._dtype[p], device=p.device)  # be numel bytes

    def _make_grad_hook(self, unit: nn.Module) -> Callable:
        def hook(p: nn.Parameter) -> None:
            if self._sync:
                self._in_order.ready(p)    # takes p.grad (+ kept); reduce-scatters in turn
            else:
                self._in_order.keep(p)     # adds p.grad to the kept whole gradient
            self._pending[unit] -= 1
            if self._pending[unit] == 0:      # the unit's backward is done: free
                self._free(unit)
        return hook

    def _add_grad(self, p: nn.Parameter, part: torch.Tensor) -> None:
        s = self._slice[p]
        part = part.float()
        s.grad = part if s.grad is None else s.grad.add_(part)

    def _free_all(self) -> None:
        """At the end of the backward pass: wait for an all-gather still in flight (a
        unit prefetched that backward did not reach) and free every unit, also one that
        a parameter without a gradient (unused on this rank) kept gathered."""
        for unit in list(self._flight):
            self._gather(unit)
        for unit in self.units:
            self._free(unit)

    def forward(self, *args, **kwargs):
        self.events, self._ran = [], []
        if self.compute_dtype is not None:      # the inputs in the parameters' type
            args, kwargs = _cast_floats(args, kwargs, self.compute_dtype)
        return self.module(*args, **kwargs)

    def shards(self) -> list[torch.Tensor]:
        """This rank's float32 slices of the parameters: give them to the optimizer."""
        return list(self._slice.values())

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, in float32, on every rank (one all-gather each): a
        checkpoint that loads into the unsharded model. Every rank then holds the whole
        model, which a model that needs stage 3 may not fit; PyTorch's
        ``torch.distributed.checkpoint`` saves the shards instead (and can reshard them
        for another N), or gathers them to rank 0's CPU with ``get_model_state_dict(model,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True))``."""
        out = {}
        for name, p in self.module.named_parameters():
            if p in self._shard:
                full = all_gather(self._slice[p].detach(), self._shard[p])
                out[name] = full.view(self._shape[p])
        return out


def prefetch_schedule(num_units: int, prefetch: bool = True) -> list[tuple[str, int]]:
    """The order of one training step of :class:`ZeroModel` over ``num_units`` units
    that run one after the other, as its ``ZeroModel.events`` records it: all-gathers
    issued (``("gather", i)``) and units starting to compute (``("forward", i)``,
    ``("backward", i)``).

    >>> prefetch_schedule(2)[:4]                 # the forward pass
    [('gather', 0), ('gather', 1), ('forward', 0), ('forward', 1)]
    """
    order: list[tuple[str, int]] = []
    for i in range(num_units):
        if not (prefetch and i > 0):       # with prefetch, the unit before issued it
            order.append(("gather", i))
        if prefetch and i + 1 < num_units:
            order.append(("gather", i + 1))
        order.append(("forward", i))
    for i in reversed(range(num_units)):
        if not (prefetch and i < num_units - 1):
            order.append(("gather", i))
        if prefetch and i > 0:
            order.append(("gather", i - 1))
        order.append(("backward", i))
    return order


def _mark(name: str):
    """A range named ``name`` in a ``torch.profiler`` trace (FSDP2 marks its steps the
    same way: ``FSDP::pre_forward (0)``)."""
    return torch.profiler.record_function(name)


_REFUSING = []


def _refuse_full_parameters(optimizer, args, kwargs) -> None:
    """A global optimizer step pre-hook: stop an optimizer that was given the parameters
    of a :class:`ZeroModel`, which never get a ``.grad`` (it would train nothing)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_dpbook_sharded", False):
                raise RuntimeError(
                    f"{type(optimizer).__name__} was given the parameters of a ZeroModel "
                    "(model.parameters()). Between uses they hold nothing and their "
                    "gradients go to this rank's float32 slices, so this optimizer would "
                    "train nothing. Give it the slices: e.g. torch.optim.SGD("
                    "model.shards(), lr=...)")


def _refuse_full_parameters_once() -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    if not _REFUSING:
        _REFUSING.append(register_optimizer_step_pre_hook(_refuse_full_parameters))


def _cast_floats(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """The floating-point tensors among ``args`` and ``kwargs`` cast to ``dtype``."""
    def cast(t):
        return t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def held_bytes(tensors: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes of the storage behind each category's tensors, e.g. ``{"params": [...],
    "grads": [...], "optimizer": [...]}``; a storage shared by several tensors (or counted
    in an earlier category) counts once, a freed one (size 0) not at all."""
    seen, out = set(), {}
    for category, ts in tensors.items():
        total = 0
        for t in ts:
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        out[category] = total
    return out


# ---------------------------------------------------------------- the experiment

#: The optimizers :func:`compare` knows: name → (class, keyword arguments).
OPTIMIZERS = {"adam": (torch.optim.Adam, {"lr": 1e-3}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
              "sgd-momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}


def _train(stage: int, optimizer: str, steps: int, batch_size: int, rank: int,
           world_size: int, compute_dtype: torch.dtype | None = None,
           reduce_dtype: torch.dtype | None = None, prefetch: bool = False) -> dict:
    """``steps`` steps of LeNet at ``stage`` (0: DDP) on this rank's share of each batch;
    the final parameters, one step's traffic and the bytes held, by category."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from .ddp_hooks import register
    from .models import lenet
    cls, kwargs = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    model = lenet()
    counter = None
    if stage == 0:
        model = DDP(model, gradient_as_bucket_view=True)
        counter = register(model)                     # counts the allreduce bytes
        opt = cls(model.parameters(), **kwargs)
    elif stage in (1, 2):
        opt = ZeroOptimizer(model.parameters(), cls, stage=stage, reduce_dtype=reduce_dtype,
                            **kwargs)
    else:
        model = ZeroModel(model, compute_dtype, reduce_dtype, prefetch)
        opt = cls(model.shards(), **kwargs)
    traffic = opt.traffic if stage in (1, 2) else model.traffic if stage == 3 else None
    held: dict[str, int] = {}

    def snapshot():
        slices = (list(opt.slices.values()) if stage in (1, 2)
                  else model.shards() if stage == 3 else [])
        now = held_bytes({
            "params": list(model.parameters()),
            "slices": slices,
            "grads": [p.grad for p in model.parameters()] + [s.grad for s in slices],
            "optimizer": [t for state in (opt.inner if stage in (1, 2) else opt).state.values()
                          for t in state.values() if torch.is_tensor(t) and t.dim() > 0]})
        for k, v in now.items():
            held[k] = max(held.get(k, 0), v)

    for step in range(steps):
        if step == steps - 1:                          # count the last step only
            if traffic is not None:
                traffic.reset()
            if counter is not None:
                counter.bytes = counter.calls = 0
        X, y = random_batch(batch_size, seed=1000 + step)
        X, y = X.chunk(world_size)[rank], y.chunk(world_size)[rank]
        opt.zero_grad()
        F.cross_entropy(model(X), y).backward()
        if step == steps - 1:
            snapshot()
        opt.step()
        if step == steps - 1:
            snapshot()
    if stage == 0:
        traffic = Traffic(world_size)
        traffic.full_bytes["allreduce"] = counter.bytes
        traffic.calls["allreduce"] = counter.calls
        params = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    elif stage == 3:
        params = model.full_state_dict()
    else:
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"params": params, "sent": traffic.sent(), "calls": dict(traffic.calls),
            "held": held, "events": getattr(model, "events", None)}


def stage_worker(rank: int, world_size: int, stages: list[int], optimizer: str, steps: int,
                 batch_size: int, compute_dtype: str | None, reduce_dtype: str | None = None,
                 prefetch: bool = False) -> dict:
    """Every stage of ``stages`` in turn on this process group; returns the results."""
    from .dist import process_group
    dtype = getattr(torch, compute_dtype) if compute_dtype else None
    reduce = getattr(torch, reduce_dtype) if reduce_dtype else None
    with process_group(rank, world_size):
        return {stage: _train(stage, optimizer, steps, batch_size, rank, world_size,
                              dtype if stage == 3 else None, reduce, prefetch)
                for stage in stages}


def reference(optimizer: str, steps: int, batch_size: int) -> dict[str, torch.Tensor]:
    """The same training in one process on the whole batches: what every stage must equal."""
    from .models import lenet
    cls, kwargs = OPTIMIZERS[optimizer]
    with seeded(0):
        model = lenet()
    opt = cls(model.parameters(), **kwargs)
    for step in range(steps):
        X, y = random_batch(batch_size, seed=1000 + step)
        opt.zero_grad()
        F.cross_entropy(model(X), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def compare(nprocs: int, stages: Iterable[int] = (0, 1, 2, 3), optimizer: str = "adam",
            steps: int = 3, batch_size: int = 48, compute_dtype: str | None = None,
            timeout: float = 300, reduce_dtype: str | None = None, prefetch: bool = False
            ) -> dict:
    """Train LeNet ``steps`` steps with each ZeRO ``stage`` (0: DDP) on ``nprocs``
    processes and in one process. Per stage: ``difference`` (largest parameter difference
    from the one-process run), ``sent`` (bytes one rank sent in the last step, ring
    collectives), ``calls`` (collectives of that step), ``held`` (bytes rank 0 held per
    category: full ``params``, its float32 ``slices``, ``grads``, ``optimizer`` state),
    and for stage 3 the ``events`` of its last step (``ZeroModel.events``).
    ``compute_dtype`` and ``prefetch`` apply to stage 3, ``reduce_dtype`` to stages 1-3."""
    from .dist import per_process, run
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {list(OPTIMIZERS)}")
    per_process(batch_size, nprocs)          # refuses what does not divide
    stages = list(stages)
    results = run(stage_worker, nprocs, stages, optimizer, steps, batch_size, compute_dtype,
                  reduce_dtype, prefetch, on="cpu", timeout=timeout)
    ref = reference(optimizer, steps, batch_size)
    for r in results.values():
        r["difference"] = max_abs_difference({k: r["params"][k] for k in ref}, ref)
        del r["params"]
    return results


# ---------------------------------------------------------------- gradient accumulation

def _accumulate(stage: int, keep: bool, k: int, steps: int, batch_size: int, rank: int,
                world_size: int) -> dict:
    """``steps`` steps of LeNet (SGD with momentum) at ``stage`` (2 or 3), each over k
    micro-batches of this rank's share; with ``keep`` the first k - 1 backward passes run
    under ``no_sync``. The final parameters, the last step's traffic and the most bytes
    held at once, after any backward pass, by whole gradients kept (``kept``) and by the
    gradients of the slices (``slices``)."""
    from .models import lenet
    cls, kwargs = OPTIMIZERS["sgd-momentum"]
    torch.manual_seed(0)
    model = lenet()
    if stage == 2:
        opt = owner = ZeroOptimizer(model.parameters(), cls, stage=2, **kwargs)
        slices = list(opt.slices.values())
    elif stage == 3:
        model = owner = ZeroModel(model)
        opt = cls(model.shards(), **kwargs)
        slices = model.shards()
    else:
        raise ValueError(f"accumulation is shown for stages 2 and 3, not {stage}")
    held = {"kept": 0, "slices": 0}
    for step in range(steps):
        last = step == steps - 1
        if last:
            owner.traffic.reset()
        X, y = random_batch(batch_size, seed=1000 + step)
        X, y = X.chunk(world_size)[rank], y.chunk(world_size)[rank]
        opt.zero_grad()
        for i, (Xi, yi) in enumerate(zip(X.chunk(k), y.chunk(k))):
            quiet = keep and i < k - 1
            with owner.no_sync() if quiet else contextlib.nullcontext():
                (F.cross_entropy(model(Xi), yi) / k).backward()   # mean over k micro-batches
            if last:
                now = held_bytes({"kept": owner.kept(), "slices": [s.grad for s in slices]})
                held = {c: max(held[c], now[c]) for c in held}
        opt.step()
    params = (model.full_state_dict() if stage == 3
              else {n: v.detach().clone() for n, v in model.named_parameters()})
    return {"params": params, "sent": owner.traffic.sent(),
            "calls": dict(owner.traffic.calls), "full_bytes": dict(owner.traffic.full_bytes),
            "held": held}


def accumulation_worker(rank: int, world_size: int, cases: list[tuple[int, bool]], k: int,
                        steps: int, batch_size: int) -> dict:
    """Every ``(stage, keep)`` of ``cases`` in turn on this process group."""
    from .dist import process_group
    with process_group(rank, world_size):
        return {case: _accumulate(*case, k, steps, batch_size, rank, world_size)
                for case in cases}


def accumulation(nprocs: int, k: int, cases: Iterable[tuple[int, bool]] = (
        (2, False), (2, True), (3, False), (3, True)), steps: int = 2, batch_size: int = 48,
        timeout: float = 300) -> dict:
    """Gradient accumulation over ``k`` micro-batches under ZeRO-2 and ZeRO-3, per
    ``(stage, keep)``: ``keep=False`` reduce-scatters after every micro-batch (k per
    step), ``keep=True`` keeps whole gradients (``no_sync``) and sends once. Each result:
    ``difference`` from one process on the whole batches (:func:`reference`, SGD with
    momentum), ``sent``/``calls``/``full_bytes`` (per kind) of the last step, ``held``
    bytes (see ``_accumulate``)."""
    from .dist import per_process, run
    per_process(batch_size, nprocs * k)          # refuses what does not divide
    results = run(accumulation_worker, nprocs, list(cases), k, steps, batch_size, on="cpu",
                  timeout=timeout)
    ref = reference("sgd-momentum", steps, batch_size)
    for r in results.values():
        r["difference"] = max_abs_difference({n: r["params"][n] for n in ref}, ref)
        del r["params"]
    return results

"""The precision of the reduction: in which dtype gradients add up, across processes and
across micro-batches.

Three dtypes, chosen separately: the *compute* dtype (the forward and backward products,
bfloat16 under mixed precision), the *reduce* dtype (the allreduce or reduce-scatter
that adds the processes' gradients) and the *accumulation* dtype (the buffer that adds
the micro-batches' gradients before a step). :func:`reduce_drift` adds bfloat16
gradients of 2, 4, 8 … gloo processes with a real all-reduce, once in bfloat16 (gloo
adds bfloat16 in bfloat16) and once in float32, and measures both against the float64
sum; :func:`accumulation_drift` adds k micro-batches' bfloat16 gradients of a model
whose parameters are bfloat16, once in ``.grad`` (bfloat16, what autograd does) and once
in a float32 ``main_grad`` (:class:`MainGrad`, as Megatron and picotron do).
FSDP2's ``MixedPrecisionPolicy(reduce_dtype=…)`` is measured in
:func:`dpbook.torch.overlap.fsdp_reduce_dtype` (it needs torch 2.9, as
:mod:`dpbook.torch.fsdp`; this module runs with the book's oldest torch).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .data import random_batch
from .dist import process_group, run
from .models import seeded

__all__ = ["relative_error", "fake_gradients", "reduce_drift", "MainGrad",
           "accumulation_drift"]


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    """``|x - reference| / |reference|`` (Euclidean norms), computed in float64."""
    reference = reference.double()
    return ((x.double() - reference).norm() / reference.norm()).item()


def fake_gradients(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s bfloat16 "gradient" of ``n`` entries: a part shared by every
    rank plus as large a part of its own (gradients of different batches agree in part),
    of the size gradients have (about 1e-3)."""
    shared = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    own = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1 + rank))
    return (1e-3 * (shared + own)).to(torch.bfloat16)


def drift_worker(rank: int, world_size: int, sizes: Sequence[int], n: int, seed: int
                 ) -> dict:
    """For every group size r in ``sizes``: the ranks 0 … r-1 all-reduce their bfloat16
    gradients in bfloat16 and in float32; returns rank 0's relative errors against the
    float64 sum (which every rank can compute, the gradients being seeded)."""
    with process_group(rank, world_size):
        out = {}
        for r in sizes:
            group = dist.new_group(list(range(r)))          # every rank must call it
            if rank >= r:
                continue
            grad = fake_gradients(rank, n, seed)
            exact = sum(fake_gradients(i, n, seed).double() for i in range(r))
            in_bf16 = grad.clone()
            dist.all_reduce(in_bf16, group=group)           # gloo adds in bfloat16
            in_fp32 = grad.float()
            dist.all_reduce(in_fp32, group=group)           # the same values, in float32
            out[r] = {"bf16": relative_error(in_bf16, exact),
                      "fp32": relative_error(in_fp32, exact),
                      "dtype": str(in_bf16.dtype)}
        return out


def reduce_drift(sizes: Sequence[int] = (2, 4, 8), n: int = 100_000, seed: int = 0,
                 timeout: float = 300) -> dict:
    """``drift_worker`` on ``max(sizes)`` gloo processes: ``{r: {"bf16", "fp32"}}``,
    the relative error of each all-reduce of r ranks against the float64 sum."""
    results = run(drift_worker, max(sizes), list(sizes), n, seed, timeout=timeout)
    return {r: v for r, v in results.items()}


class MainGrad:
    """A float32 ``main_grad`` buffer beside every parameter of ``model`` (bfloat16
    parameters): a post-accumulate-grad hook adds each backward's ``p.grad`` to it, in
    float32, and frees ``p.grad``, so the micro-batches add up in float32 although
    autograd computes in bfloat16. ``to_grad`` writes the sum into ``.grad`` (cast to
    the parameter's dtype, for the optimizer), ``zero`` starts the next step.

    A model takes one ``MainGrad`` for its lifetime: the hooks stay on its parameters
    (nothing removes them), so a second ``MainGrad``'s hooks would run after the
    first's, which has already freed ``p.grad``."""

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            p.register_post_accumulate_grad_hook(self._add)

    @staticmethod
    def _add(p: nn.Parameter) -> None:
        p.main_grad += p.grad                  # in float32
        p.grad = None                          # the next backward starts a new .grad

    def to_grad(self) -> None:
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)

    def zero(self) -> None:
        for p in self.params:
            p.main_grad.zero_()


def _mlp() -> nn.Module:
    with seeded(0):                            # the reader's random state untouched
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(),
                             nn.Linear(128, 10))


def accumulation_drift(ks: Sequence[int] = (1, 4, 16, 64), micro_batch: int = 8) -> dict:
    """For every k in ``ks``: k micro-batches of ``micro_batch`` examples through an MLP
    whose parameters are bfloat16 (each loss divided by k). Returns the relative error,
    against the float64 sum of the same micro-batch gradients, of the sum autograd
    accumulates in ``.grad`` (bfloat16) and of the float32 :class:`MainGrad`."""
    out = {}
    for k in ks:
        X, y = random_batch(k * micro_batch, seed=k)
        X = X.to(torch.bfloat16)
        plain, main = _mlp().to(torch.bfloat16), _mlp().to(torch.bfloat16)
        params = list(plain.parameters())
        exact = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
        buffers = MainGrad(main)
        for Xi, yi in zip(X.split(micro_batch), y.split(micro_batch)):
            loss = F.cross_entropy(plain(Xi).float(), yi) / k
            grads = torch.autograd.grad(loss, params, retain_graph=True)
            for e, g in zip(exact, grads):                 # the same bf16 gradients
                e += g.double()
            loss.backward()                                # .grad += in bfloat16
            (F.cross_entropy(main(Xi).float(), yi) / k).backward()   # main_grad +=
        flat = torch.cat([e.reshape(-1) for e in exact])
        out[k] = {"bf16": relative_error(torch.cat([p.grad.reshape(-1) for p in params]),
                                         flat),
                  "fp32": relative_error(torch.cat([p.main_grad.reshape(-1)
                                                    for p in main.parameters()]), flat),
                  "grad_dtype": str(params[0].grad.dtype),
                  "main_grad_dtype": str(next(main.parameters()).main_grad.dtype)}
    return out


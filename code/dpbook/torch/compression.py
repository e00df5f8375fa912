"""Gradient compression: 2-bit quantization with a threshold and error feedback.

MXNet's ``--gc-type 2bit``, the thresholded scheme of Strom (2015, "Scalable distributed DNN
training using commodity GPU cloud computing"), the paper MXNet's gradient-compression
guide cites: every gradient entry is sent as one of three values, ``+t``, ``0`` or ``-t``,
two bits each — 16× fewer bytes than float32. (Seide et al. 2014, "1-bit SGD", send the
sign with error feedback.) What rounding throws away is not lost: it stays in a
per-process *residual* and is added to the next step's gradient (error feedback), so a
small gradient entry is sent once it has added up to the threshold.

:func:`two_bit_hook` does it inside DistributedDataParallel (``register_comm_hook``):
each process quantizes its bucket, the packed codes are all-gathered (2-bit codes cannot
be summed by an allreduce), and every process decodes and averages them.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

__all__ = ["quantize_2bit", "dequantize_2bit", "pack_2bit", "unpack_2bit", "TwoBitState",
           "two_bit_hook"]


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes in {0, 1, 2} (int) into bytes, four codes per uint8."""
    codes = codes.to(torch.uint8).view(-1)
    pad = (-codes.numel()) % 4
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    c = codes.view(-1, 4)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def unpack_2bit(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of :func:`pack_2bit`: the first ``numel`` codes, as uint8."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.view(-1, 1) >> shifts) & 3).view(-1)[:numel]


@torch.no_grad()
def quantize_2bit(grad: torch.Tensor, residual: torch.Tensor, threshold: float
                  ) -> torch.Tensor:
    """Packed 2-bit codes of ``grad + residual``; the rounding error goes into ``residual``.

    An entry ``v`` of ``grad + residual`` becomes ``+t`` if ``v >= t``, ``-t`` if
    ``v <= -t``, else 0; ``residual`` (updated in place) keeps ``v`` minus that value, so
    every entry of it stays within (-t, t) as long as the gradient entries do.
    """
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    v = grad.view(-1) + residual.view(-1)
    q = (v >= threshold).to(torch.int8) - (v <= -threshold).to(torch.int8)   # -1, 0, +1
    residual.view(-1).copy_(v - q * threshold)
    return pack_2bit(q + 1)                                                 # 0, 1, 2


def dequantize_2bit(packed: torch.Tensor, numel: int, threshold: float,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``-t, 0, +t`` that the packed codes stand for."""
    return (unpack_2bit(packed, numel).to(dtype) - 1) * threshold


@dataclasses.dataclass
class TwoBitState:
    """What :func:`two_bit_hook` keeps between steps: the threshold, one flat residual
    per *parameter* (``residuals[param]``), and, as a
    :class:`~dpbook.torch.ddp_hooks.Counter` does, the collectives this process has
    started (``calls``) and the bytes it handed to them (``bytes``).

    Residuals are not kept per bucket: DDP rebuilds its buckets after the first iteration
    (in the order the gradients arrived), so the parameters behind a bucket index change.
    """

    threshold: float
    residuals: dict = dataclasses.field(default_factory=dict)
    calls: int = 0
    bytes: int = 0


def two_bit_hook(state, bucket):   # no annotations: DDP checks them, and this module's are strings
    """A DDP communication hook: 2-bit quantize this bucket, all-gather the codes, average.

    ``state`` is a :class:`TwoBitState`, ``bucket`` a ``dist.GradBucket``; returns a
    ``torch.futures.Future`` of the averaged bucket.

    Register it with ``ddp_model.register_comm_hook(TwoBitState(threshold), two_bit_hook)``.
    Like DDP's own allreduce, the result is the *average* over the processes.
    """
    grad = bucket.buffer()                 # this bucket's gradients, flat, in params' order
    params = bucket.parameters()
    residuals = [state.residuals.setdefault(p, p.new_zeros(p.numel())) for p in params]
    residual = torch.cat(residuals)
    if residual.numel() != grad.numel():
        raise RuntimeError(f"bucket {bucket.index()} holds {grad.numel()} gradient entries, "
                           f"its parameters {residual.numel()}")
    packed = quantize_2bit(grad, residual, state.threshold)
    for r, new in zip(residuals, residual.split([r.numel() for r in residuals])):
        r.copy_(new)                       # back to each parameter's own residual
    state.calls += 1
    state.bytes += packed.numel()              # uint8: one byte per 4 codes
    world_size = dist.get_world_size()
    gathered = [torch.empty_like(packed) for _ in range(world_size)]
    future = dist.all_gather(gathered, packed, async_op=True).get_future()

    def decode(_):
        total = sum(dequantize_2bit(p, grad.numel(), state.threshold, grad.dtype)
                    for p in gathered)
        grad.copy_(total / world_size)
        return grad

    return future.then(decode)

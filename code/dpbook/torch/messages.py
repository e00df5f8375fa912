"""Every point-to-point message of a run, recorded: :func:`recording` sees each call of
``torch.distributed``'s send/receive functions while a block runs, and :func:`record`
runs one of :data:`dpbook.torch.allreduce.ALGORITHMS` on a few gloo processes and keeps,
for every process, what it sent and received, when, and its tensor at that moment (the
ring replay of the communication page; the process check of the exercises).
"""
from __future__ import annotations

import contextlib
import inspect
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from .allreduce import ALGORITHMS
from .devices import hardware_line
from .dist import process_group, run

__all__ = ["recording", "trace_worker", "record"]


#: the point-to-point functions of torch.distributed and the name of their peer argument
_P2P = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


@contextlib.contextmanager
def recording(on_message: Callable[[str, int, torch.Tensor], None]) -> Iterator[None]:
    """Within the block, call ``on_message(kind, peer, tensor)`` before every
    point-to-point call of ``torch.distributed`` (``kind`` is ``send``, ``isend``,
    ``recv`` or ``irecv``), once per call (``dist.send`` calls ``dist.isend`` inside),
    also through ``P2POp``/``batch_isend_irecv``: the functions are replaced in
    ``torch.distributed`` and in the module that defines them, and restored afterwards."""
    from torch.distributed import distributed_c10d as c10d
    originals = {name: getattr(c10d, name) for name in _P2P}
    inside: list[str] = []

    def wrap(name, original):
        signature = inspect.signature(original)

        def recorded(*args, **kwargs):
            if inside:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            peer = bound.get(_P2P[name])
            if peer is None:
                peer = bound.get("group_" + _P2P[name])
            on_message(name, peer, bound["tensor"])
            inside.append(name)
            try:
                return original(*args, **kwargs)
            finally:
                inside.pop()
        return recorded

    try:
        for name, original in originals.items():
            setattr(c10d, name, wrap(name, original))
            setattr(dist, name, getattr(c10d, name))
        yield
    finally:
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)


def trace_worker(rank: int, world_size: int, name: str, numel: int) -> dict | None:
    """Run ``ALGORITHMS[name]`` once on a tensor of ``numel`` small integers and keep every
    message this process sent or posted to receive: when (seconds since a barrier), to or
    from whom, which values of the tensor (offset and count; ``None`` for a receive
    buffer), the values sent, and the whole tensor at that moment. Rank 0 returns all
    processes' records."""
    with process_group(rank, world_size):
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 10, (numel,), generator=g).float()
        initial, events = x.tolist(), []
        base = x.untyped_storage().data_ptr()

        def on_message(kind, peer, tensor):
            mine = tensor.untyped_storage().data_ptr() == base
            events.append({"time": time.time() - start, "kind": kind, "peer": peer,
                           "offset": tensor.storage_offset() - x.storage_offset() if mine
                           else None, "count": tensor.numel(),
                           "values": tensor.tolist() if kind in ("send", "isend") else None,
                           "state": x.tolist()})

        dist.barrier()
        start = time.time()
        with recording(on_message):
            ALGORITHMS[name](x)
        mine = {"rank": rank, "initial": initial, "final": x.tolist(), "events": events}
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            sizes = [c.numel() for c in torch.tensor_split(x, world_size)]
            return {"algorithm": name, "processes": world_size, "numel": numel,
                    "chunks": [[sum(sizes[:i]), n] for i, n in enumerate(sizes)],
                    "ranks": everyone,
                    "hardware": hardware_line([torch.device("cpu")] * world_size)}
    return None


def record(name: str = "ring", nprocs: int = 4, numel: int = 8) -> dict:
    """The trace of one real run of ``ALGORITHMS[name]`` on ``nprocs`` gloo processes
    (:func:`trace_worker`): what the ring replay of the communication page plays."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}: choose one of {', '.join(ALGORITHMS)}")
    if numel < 1:
        raise ValueError(f"need at least one value, got {numel}")
    return run(trace_worker, nprocs, name, numel, on="cpu")

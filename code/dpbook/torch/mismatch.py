"""A bug for ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` to find: the ranks call different
collectives. Every rank but the last all-reduces a tensor; the last one broadcasts it.

Started by a launcher, one process per rank, on the CPU (gloo)::

    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node=2 \\
        -m dpbook.torch.mismatch --timeout 3

Without ``DETAIL`` nothing compares the ranks' collectives: each waits for data that never
comes, until ``--timeout`` seconds have passed. With it, every collective is first
compared across the ranks, and a mismatch is an error that names both sides.

``--ddp`` runs ``ddp_worker`` instead: DDP around one small layer, one forward and
backward pass, no bug. The multi-machine page runs it under ``DETAIL`` to check what that
mode does to DDP.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import sys

import torch
import torch.distributed as dist

from .dist import process_group, rank_from_env

__all__ = ["worker", "ddp_worker", "main", "rank_errors"]


def worker(rank: int, world_size: int, local_rank: int = 0, timeout: float = 3) -> None:
    """Join the group, then run the buggy step on a group whose collectives give up
    after ``timeout`` seconds (joining keeps the default, longer bound)."""
    with process_group(rank, world_size, local_rank, on="cpu"):
        group = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
        x = torch.full((4,), float(rank))
        if rank == world_size - 1:
            dist.broadcast(x, src=0, group=group)      # the bug: another collective
        else:
            dist.all_reduce(x, group=group)
        print(f"rank {rank}: {x.tolist()}", flush=True)


def ddp_worker(rank: int, world_size: int, local_rank: int = 0) -> None:
    """Join the group, wrap one ``nn.Linear`` in DDP, run one forward and backward pass
    (DDP all-reduces the gradients), print "ok"."""
    with process_group(rank, world_size, local_rank, on="cpu"):
        net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        net(torch.ones(3, 4)).sum().backward()         # DDP all-reduces the gradients
        print(f"rank {rank}: ok", flush=True)
        del net                   # DDP goes before its group (as dpbook.torch.ddp_minimal)


#: the message of a rank's uncaught error (torchrun prefixes every line with ``[rankN]:``)
_ERROR = re.compile(r"^\[rank(\d+)\]: ?\w*Error: (.*)$")


def rank_errors(output: str) -> dict[int, str]:
    """The error each rank died of, from a launcher's output: ``{rank: message}``,
    shortened to what a reader needs (no source paths in brackets, no device options).

    >>> rank_errors("[rank1]: RuntimeError: [/x/unbound_buffer.cc:78] Timed out\\n")
    {1: 'Timed out'}
    """
    errors = {}
    for line in output.splitlines():
        m = _ERROR.match(line.strip())
        if m:
            message = re.sub(r"^\[[^\]\s]+:\d+\] ", "", m.group(2))     # [file.cc:78]
            # a collective's fingerprint lists its tensors' full options: keep the start
            message = re.sub(r", TensorDtypes=.*?(?=, but Rank|\.Collectives)", ", …)",
                             message)
            message = re.sub(r"\.(?=[A-Z])", ". ", message)      # "….Collectives differ"
            errors[int(m.group(1))] = " ".join(message.split())
    return errors


def main(argv: list[str] | None = None) -> None:
    """The command line: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=3,
                   help="seconds a collective waits for the other ranks")
    p.add_argument("--ddp", action="store_true",
                   help="run ddp_worker (DDP, no bug) instead of the mismatch")
    args = p.parse_args(argv)
    placement = rank_from_env()
    if placement is None:
        sys.exit("start it with a launcher: torchrun --nproc-per-node=2 -m "
                 "dpbook.torch.mismatch")
    rank, world_size, local_rank = placement
    if args.ddp:
        ddp_worker(rank, world_size, local_rank)
    else:
        worker(rank, world_size, local_rank, args.timeout)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)                 # as dpbook.torch.ddp: no teardown (pytorch/pytorch#179291)


if __name__ == "__main__":
    main()

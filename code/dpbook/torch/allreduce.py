"""Allreduce written by hand over ``torch.distributed`` point-to-point messages.

Three algorithms, each called by every process of the group on its own tensor ``x`` (1-D,
contiguous); afterwards every process holds the elementwise sum, in place — the contract
of ``dist.all_reduce(x)``:

``naive_allreduce``  every process sends ``x`` to rank 0, which sums and sends the sum back
``ring_allreduce``   reduce-scatter then all-gather around a ring, ``x`` cut in N chunks
``tree_allreduce``   reduce up a binomial tree to rank 0, broadcast back down it

With N processes and n bytes, one message costing α + nβ (latency α, β seconds per byte):

====================  ==========================  =====================
algorithm             messages in sequence        bytes per message
====================  ==========================  =====================
naive                 2 (N - 1)                   n
ring                  2 (N - 1)                   n / N
tree                  2 ⌈log₂ N⌉                  n
====================  ==========================  =====================

(:mod:`dpbook.costmodel` has the formulas.) :func:`check` and :func:`benchmark` start the
processes and check or time the algorithms; ``python -m dpbook.torch.allreduce --nprocs 4``
does the same. :mod:`dpbook.torch.messages` records every point-to-point message of a
real run: the ring replayed on the communication page.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .dist import process_group, run, slowest_seconds
from .devices import hardware_line

__all__ = ["naive_allreduce", "ring_allreduce", "tree_allreduce", "gloo_allreduce",
           "ALGORITHMS", "check_worker", "bench_worker", "check", "benchmark"]


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
    """Send ``send`` to ``dst`` while receiving ``recv`` from ``src`` (both at once)."""
    if send.numel() == 0 and recv.numel() == 0:      # an empty chunk: nothing to say
        return
    requests = []
    if send.numel():
        requests.append(dist.isend(send, dst))
    if recv.numel():
        requests.append(dist.irecv(recv, src))
    for request in requests:
        request.wait()


@torch.no_grad()
def naive_allreduce(x: torch.Tensor) -> torch.Tensor:
    """Everything to rank 0, which adds it up and sends the sum to everybody."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        buffer = _receive_buffer(x.numel(), x.dtype, x.device)
        for src in range(1, world_size):         # N - 1 messages of n bytes, one by one
            dist.recv(buffer, src)
            x += buffer
        for dst in range(1, world_size):         # and N - 1 more on the way back
            dist.send(x, dst)
    else:
        dist.send(x, 0)
        dist.recv(x, 0)
    return x


@functools.lru_cache(maxsize=4)
def _receive_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer of ``numel`` elements, kept from call to call (as gloo and NCCL
    keep theirs): fresh memory on every call would cost page faults every time. All three
    algorithms use it, so the benchmark compares algorithms, not allocation policies."""
    return torch.empty(numel, dtype=dtype, device=device)


@torch.no_grad()
def ring_allreduce(x: torch.Tensor) -> torch.Tensor:
    """Reduce-scatter, then all-gather, each in N - 1 steps around the ring 0 → 1 → … → 0.

    ``x`` is cut into N chunks (sizes differ by at most one element). In every step each
    process sends one chunk to its right neighbour and receives one from its left, so all
    N links are busy at once and each carries only n / N bytes per step.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        return x
    chunks = torch.tensor_split(x, world_size)            # views into x
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    buffer = _receive_buffer(chunks[0].numel(), x.dtype, x.device)   # the largest chunk
    # Reduce-scatter: in step s, send chunk (rank - s) and add the received chunk
    # (rank - s - 1) into ours. Afterwards chunk (rank + 1) holds the sum over all ranks.
    for step in range(world_size - 1):
        send = chunks[(rank - step) % world_size]
        mine = chunks[(rank - step - 1) % world_size]
        received = buffer[:mine.numel()]
        _exchange(send, right, received, left)
        mine += received
    # All-gather: pass the finished chunks around; each received chunk overwrites ours.
    for step in range(world_size - 1):
        send = chunks[(rank + 1 - step) % world_size]
        mine = chunks[(rank - step) % world_size]
        _exchange(send, right, mine, left)
    return x


@torch.no_grad()
def _bidirectional_ring_allreduce(x: torch.Tensor) -> torch.Tensor:
    """Two rings at once: the first half of ``x`` goes around 0 → 1 → … → 0 as in
    :func:`ring_allreduce`, the second half the other way round, so both directions of
    every link carry data. The same 2 (N - 1) steps, each with two messages of n / 2N
    values (one to each neighbour) instead of one of n / N: on full-duplex links that
    halves the bandwidth term. Not among :data:`ALGORITHMS`: the answer to an exercise
    (its check is :func:`dpbook.torch.exercises.check_ring_allreduce`)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        return x
    rings = []                       # (chunks, our position on the ring, next, previous)
    for half, direction in zip(torch.tensor_split(x, 2), (1, -1)):
        rings.append((torch.tensor_split(half, world_size), (direction * rank) % world_size,
                      (rank + direction) % world_size, (rank - direction) % world_size))
    for gather in (False, True):     # reduce-scatter, then all-gather, as in the ring
        for step in range(world_size - 1):
            requests, additions = [], []
            for tag, (chunks, position, after, before) in enumerate(rings):
                if gather:
                    send = chunks[(position + 1 - step) % world_size]
                    received = chunks[(position - step) % world_size]
                else:
                    send = chunks[(position - step) % world_size]
                    mine = chunks[(position - step - 1) % world_size]
                    received = torch.empty_like(mine)
                    additions.append((mine, received))
                if send.numel():     # tags keep the two rings apart when N = 2
                    requests.append(dist.isend(send, after, tag=tag))
                if received.numel():
                    requests.append(dist.irecv(received, before, tag=tag))
            for request in requests:
                request.wait()
            for mine, received in additions:
                mine += received
    return x


@torch.no_grad()
def tree_allreduce(x: torch.Tensor) -> torch.Tensor:
    """Sum up a binomial tree to rank 0 in ⌈log₂ N⌉ rounds, then broadcast back down it.

    In the round with distance d = 1, 2, 4, …, rank r with r % 2d == d sends its partial
    sum to r - d and drops out; r % 2d == 0 receives from r + d (if it exists) and adds.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    buffer = _receive_buffer(x.numel(), x.dtype, x.device)
    distance = 1
    while distance < world_size:                  # reduce: half the senders drop out
        if rank % (2 * distance) == distance:
            dist.send(x, rank - distance)
            break
        if rank + distance < world_size:
            dist.recv(buffer, rank + distance)
            x += buffer
        distance *= 2
    distance = 1
    while distance < world_size:
        distance *= 2
    while distance > 1:                           # broadcast: the same tree, downwards
        distance //= 2
        if rank % (2 * distance) == 0 and rank + distance < world_size:
            dist.send(x, rank + distance)
        elif rank % (2 * distance) == distance:
            dist.recv(x, rank - distance)
    return x


def gloo_allreduce(x: torch.Tensor) -> torch.Tensor:
    """The library's own: ``dist.all_reduce`` (gloo on a CPU, nccl on GPUs)."""
    dist.all_reduce(x)
    return x


#: name → function, in the order the chapter introduces them.
ALGORITHMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "naive": naive_allreduce, "ring": ring_allreduce, "tree": tree_allreduce,
    "all_reduce": gloo_allreduce}


def _rank_data(rank: int, numel: int, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s tensor: small integers stored as float32, so every order of
    summation gives the same, exact sum."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-100, 100, (numel,), generator=g).float()


def check_worker(rank: int, world_size: int, names: Sequence[str], sizes: Sequence[int]
                 ) -> dict[str, float]:
    """Run every algorithm on every size; return the largest error of each, over all ranks.

    Every rank checks its own result against the true sum, which it can compute because
    the data of every rank comes from a known seed.
    """
    with process_group(rank, world_size):
        errors = {}
        for name in names:
            worst = 0.0
            for numel in sizes:
                x = _rank_data(rank, numel)
                expected = sum(_rank_data(r, numel) for r in range(world_size))
                ALGORITHMS[name](x)
                worst = max(worst, (x - expected).abs().max().item() if numel else 0.0)
            error = torch.tensor([worst])
            dist.all_reduce(error, op=dist.ReduceOp.MAX)     # the worst over all ranks
            errors[name] = error.item()
        return errors


def bench_worker(rank: int, world_size: int,
                 algorithms: dict[str, Callable[[torch.Tensor], torch.Tensor]],
                 sizes: Sequence[int], repeats: int) -> dict:
    """Time every algorithm (label → function) at every size (bytes of float32) and
    return the results.

    One warm-up call of each algorithm, then ``repeats`` rounds in which every algorithm
    runs once in turn (so a slow moment of the machine hits all of them, not just the one
    that happened to be running). Each call starts from the same input (ones, restored
    before the clock starts), is started together (barrier) and timed by the slowest
    rank; the median over the rounds is kept.
    """
    with process_group(rank, world_size):
        results = []
        for nbytes in sizes:
            data = torch.ones(nbytes // 4)
            x = data.clone()                  # an allreduce works in place: x grows N-fold
            times: dict[str, list[float]] = {label: [] for label in algorithms}
            correct = dict.fromkeys(algorithms, True)
            for fn in algorithms.values():
                x.copy_(data)
                fn(x)                                     # warm-up (connections, caches)
            for _ in range(repeats):
                for label, fn in algorithms.items():
                    x.copy_(data)             # every call sums ones: the sum stays N, finite
                    times[label].append(slowest_seconds(lambda: fn(x)))
                    correct[label] &= bool((x == world_size).all())   # after the clock
            results += [{"algorithm": label, "processes": world_size, "bytes": nbytes,
                         "seconds": statistics.median(times[label]),
                         "correct": correct[label]} for label in algorithms]
        return {"results": results,
                "hardware": hardware_line([torch.device("cpu")] * world_size)}


def check(nprocs: int, names: Sequence[str] = tuple(ALGORITHMS),
          sizes: Sequence[int] = (1, 2, 3, 5, 7, 1000, 1001, 65_537),
          timeout: float = 300) -> dict[str, float]:
    """The largest difference from the true sum of each algorithm, on ``nprocs``
    processes, over all ``sizes`` (numbers of elements; 0.0 means exact)."""
    return run(check_worker, nprocs, list(names), list(sizes), on="cpu", timeout=timeout)


def benchmark(nprocs: int, sizes: Sequence[int], names: Sequence[str] = tuple(ALGORITHMS),
              repeats: int = 5, timeout: float = 600,
              algorithms: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None
              ) -> dict:
    """Median seconds per allreduce of each algorithm and size (bytes) on ``nprocs``
    processes: ``{"results": [{"algorithm", "processes", "bytes", "seconds", "correct"}, …],
    "hardware": …}`` (``correct``: every timed call on this rank ended with the sum).

    ``names`` picks from ``ALGORITHMS``; or pass ``algorithms``, label → function, to
    time functions of your own. The functions travel to the worker processes by
    pickling, so they must be importable: defined at module level in a file, not in a
    notebook or as a lambda.
    """
    if algorithms is None:
        unknown = [name for name in names if name not in ALGORITHMS]
        if unknown:
            raise ValueError(f"unknown algorithm(s) {unknown}; choose from {list(ALGORITHMS)}")
        algorithms = {name: ALGORITHMS[name] for name in names}
    return run(bench_worker, nprocs, dict(algorithms), list(sizes), repeats, on="cpu",
               timeout=timeout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dpbook.torch.allreduce",
                                     description="Check and time the hand-written allreduce "
                                                 "algorithms against dist.all_reduce.")
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**10, 2**20, 2**24],
                        help="message sizes in bytes")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(json.dumps(check(args.nprocs)))
    bench = benchmark(args.nprocs, args.sizes, repeats=args.repeats)
    for r in bench["results"]:
        print(f"{r['algorithm']:>10} {r['bytes']:>10} B {r['seconds'] * 1e3:9.3f} ms")
    print(bench["hardware"])


if __name__ == "__main__":
    main()

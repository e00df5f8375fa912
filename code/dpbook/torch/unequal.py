"""Unequal devices: split every minibatch in proportion to each device's speed.

With an even split, every step waits for the slowest device. MXNet's ``work_load_list``
gave each device a share of the batch instead; here the shares come from measured
throughput. :func:`compare_splits` runs one process per "device" (gloo, one thread each),
slows some of them down on purpose — a device ``s`` times slower sleeps ``s - 1`` times as
long as its computation took — and trains first with an even split, measuring every
device's examples per second, then with the split those measurements suggest::

    python -m dpbook.torch.unequal --slowdowns 1 3 --batch-size 256 --steps 20

The loss of each device is *summed* over its shard and divided by the whole batch size,
and the gradients are summed (not averaged) across devices: then any split, even or not,
takes exactly the step one device would take on the whole minibatch.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Sequence

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ..devices import split_sizes
from .data import random_batch
from .dist import process_group, run
from .devices import hardware_line
from .models import lenet

__all__ = ["weighted_step", "split_worker", "compare_splits"]


def weighted_step(net: torch.nn.Module, X: torch.Tensor, y: torch.Tensor, batch_size: int,
                  lr: float, slowdown: float = 1.0) -> tuple[float, float]:
    """One SGD step on this process's shard ``(X, y)`` of a minibatch of ``batch_size``.

    Returns ``(compute, wait)`` seconds: the local forward and backward (stretched by
    ``slowdown``), and the allreduce, which includes waiting for slower processes.
    """
    tik = time.perf_counter()
    loss = F.cross_entropy(net(X), y, reduction="sum") / batch_size   # this shard's part
    net.zero_grad()
    loss.backward()
    compute = time.perf_counter() - tik
    if slowdown > 1:                        # pretend this device is `slowdown` times slower
        time.sleep((slowdown - 1) * compute)
        compute *= slowdown
    tik = time.perf_counter()
    grads = parameters_to_vector(p.grad for p in net.parameters())
    dist.all_reduce(grads)                  # the sum over shards: the whole batch's gradient
    wait = time.perf_counter() - tik
    with torch.no_grad():
        vector_to_parameters(parameters_to_vector(net.parameters()) - lr * grads,
                             net.parameters())
    return compute, wait


def split_worker(rank: int, world_size: int, slowdowns: Sequence[float], batch_size: int,
                 steps: int, lr: float) -> dict:
    """Train LeNet on a fixed random batch: ``steps`` steps with an even split, measuring
    each rank's examples/s, then ``steps`` steps from the same start with the split in
    proportion to those measurements. Returns both runs' timings."""
    with process_group(rank, world_size):
        X, y = random_batch(batch_size, seed=0)
        results, weights = {}, None
        for split in ("even", "weighted"):
            torch.manual_seed(0)
            net = lenet()                    # the same start for both runs
            sizes = split_sizes(batch_size, world_size, weights)
            X_shard, y_shard = X.split(sizes)[rank], y.split(sizes)[rank]
            weighted_step(copy.deepcopy(net), X_shard, y_shard, batch_size, lr,
                          slowdowns[rank])   # warm-up, on a copy: the run starts from net
            computes, waits, steps_s = [], [], []
            for _ in range(steps):
                dist.barrier()
                tik = time.perf_counter()
                compute, wait = weighted_step(net, X_shard, y_shard, batch_size, lr,
                                              slowdowns[rank])
                steps_s.append(time.perf_counter() - tik)
                computes.append(compute)
                waits.append(wait)
            mine = {"examples": sizes[rank], "compute": statistics.median(computes),
                    "wait": statistics.median(waits), "step": statistics.median(steps_s),
                    "examples_per_sec": sizes[rank] / statistics.median(computes)}
            ranks = [None] * world_size
            dist.all_gather_object(ranks, mine)
            params = torch.cat([p.detach().view(-1) for p in net.parameters()])
            results[split] = {"sizes": sizes, "ranks": ranks,
                              "step_seconds": max(r["step"] for r in ranks),
                              "params": params}
            weights = [r["examples_per_sec"] for r in ranks]   # for the weighted run
        difference = (results["even"].pop("params")
                      - results["weighted"].pop("params")).abs().max().item()
        return {"slowdowns": list(slowdowns), "batch_size": batch_size, "steps": steps,
                **results, "max_param_difference": difference,
                "hardware": hardware_line([torch.device("cpu")] * world_size)}


def compare_splits(slowdowns: Sequence[float], batch_size: int = 256, steps: int = 20,
                   lr: float = 0.1, timeout: float = 300) -> dict:
    """Run :func:`split_worker` with one process per entry of ``slowdowns``."""
    if any(s < 1 for s in slowdowns):
        raise ValueError(f"slowdowns must be >= 1 (1 = full speed), got {list(slowdowns)}")
    return run(split_worker, len(slowdowns), list(slowdowns), batch_size, steps, lr,
               on="cpu", timeout=timeout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dpbook.torch.unequal",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--slowdowns", type=float, nargs="+", default=[1, 3])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    r = compare_splits(args.slowdowns, args.batch_size, args.steps)
    for split in ("even", "weighted"):
        print(f"{split:>8}: sizes {r[split]['sizes']}, "
              f"{r[split]['step_seconds'] * 1e3:.1f} ms per step")
    print(r["hardware"])


if __name__ == "__main__":
    main()

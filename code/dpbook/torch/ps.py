"""A parameter server over ``torch.distributed`` point-to-point messages, and stale SGD.

Rank 0 is the *server*: it holds the parameters of a small MLP as one flat vector. Ranks
1..W are *workers*: each pulls the parameters, computes a gradient on its own minibatch
and pushes it back. The workers run the same code in both modes; only the server differs:

* ``sync`` (MXNet's ``dist_sync``): wait for one gradient from **every** worker, average,
  update, send the new parameters to all. W workers = one SGD step on W minibatches.
* ``async`` (MXNet's ``dist_async``): take the gradient of **whichever** worker is ready
  (``dist.recv`` without a source), apply it at once, reply to that worker only. No
  barrier, but a gradient may have been computed on parameters that are several updates
  old: its *staleness*, which the server records.

:func:`train_stale` simulates a staleness of exactly ``tau`` in one process.

Run it from the command line (1 server + 2 workers on 127.0.0.1, gloo)::

    python -m dpbook.torch.ps --mode sync --workers 2 --num-grads 400
    python -m dpbook.torch.ps --mode async --workers 2 --num-grads 400 --delays 0 0.04
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import time
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .data import fashion_mnist_datasets
from .dist import process_group, run
from .evaluate import accuracy
from .models import seeded

__all__ = ["PSConfig", "mlp", "load_arrays", "worker_batches", "flat_grad", "server_sync",
           "server_async", "worker", "ps_process", "run_ps", "sgd_reference",
           "train_stale"]


@dataclasses.dataclass
class PSConfig:
    """One parameter-server run. Sync and async runs with the same ``num_grads`` see the
    same number of examples: sync makes ``num_grads / W`` updates, async ``num_grads``."""

    mode: str = "sync"                 # "sync" | "async"
    num_grads: int = 400               # gradients the workers compute, in total
    batch_size: int = 64               # per worker and gradient
    lr: float = 0.1
    num_hiddens: int = 256
    delays: tuple[float, ...] = ()     # extra seconds per gradient, worker 1, 2, ... (stragglers)
    seed: int = 0


def mlp(num_hiddens: int = 256, seed: int = 0) -> nn.Sequential:
    """784 → ``num_hiddens`` → ReLU → 10, initialized from ``seed``: 203,530 parameters
    for 256 hidden units (small enough to send as one message per step)."""
    with seeded(seed):
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, num_hiddens), nn.ReLU(),
                             nn.Linear(num_hiddens, 10))


def load_arrays(num_train: int | None = None, num_test: int | None = None, root=None,
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Fashion-MNIST as four tensors ``X_train, y_train, X_test, y_test`` (fixed subsets)."""
    train, test = fashion_mnist_datasets(num_train, num_test, root, seed)
    return (*train.tensors, *test.tensors)


def worker_batches(X: torch.Tensor, y: torch.Tensor, worker: int, num_workers: int,
                   batch_size: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless minibatches of worker ``worker`` (1..W): it owns every W-th example and
    reshuffles them each epoch, from a generator of its own (the same in every run)."""
    shard = torch.arange(worker - 1, len(X), num_workers)
    g = torch.Generator().manual_seed(seed * 1000 + worker)
    while True:
        order = shard[torch.randperm(len(shard), generator=g)]
        for i in range(0, len(order) - batch_size + 1, batch_size):   # full batches only
            idx = order[i:i + batch_size]
            yield X[idx], y[idx]


def flat_grad(net: nn.Module, X: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The gradient of the mean loss on ``(X, y)`` as one flat vector, and the loss."""
    net.zero_grad(set_to_none=True)
    loss = F.cross_entropy(net(X), y)
    loss.backward()
    return parameters_to_vector(p.grad for p in net.parameters()), loss.item()


def server_sync(w: torch.Tensor, num_workers: int, num_steps: int, lr: float) -> dict:
    """The synchronous server: ``num_steps`` updates, each with one gradient per worker."""
    n = len(w)
    msg = torch.empty(n + 1)                      # parameters + a flag: 1 go on, 0 stop
    grads = [torch.empty(n) for _ in range(num_workers)]
    workers = range(1, num_workers + 1)
    for _ in range(num_steps):
        msg[:n], msg[n] = w, 1
        for q in [dist.isend(msg, dst=r) for r in workers]:   # every worker pulls
            q.wait()
        for q in [dist.irecv(g, src=r) for g, r in zip(grads, workers)]:
            q.wait()                              # the barrier: wait for the slowest worker
        w.add_(torch.stack(grads).mean(0), alpha=-lr)
    msg[n] = 0
    for r in workers:
        dist.send(msg, dst=r)                     # stop
    return {"updates": num_steps, "staleness": {r: {0: num_steps} for r in workers}}


def server_async(w: torch.Tensor, num_workers: int, num_grads: int, lr: float) -> dict:
    """The asynchronous server: apply ``num_grads`` gradients one by one, as they come."""
    n, workers = len(w), range(1, num_workers + 1)
    msgs = {r: torch.empty(n + 1) for r in workers}   # parameters + flag, one buffer per worker
    sending, pulled = {}, {}                      # r → send in flight; r → version it pulled
    grad, version = torch.empty(n), 0             # version: updates applied so far
    staleness = {r: collections.Counter() for r in workers}

    def send(r: int, go: int) -> None:            # the current parameters to worker r
        if r in sending:
            sending[r].wait()                     # r has the previous message: buffer free
        msgs[r][:n], msgs[r][n] = w, go
        sending[r] = dist.isend(msgs[r], dst=r)   # no waiting: receive meanwhile
        pulled[r] = version

    for r in workers:
        send(r, 1)
    sent = num_workers                            # pulls handed out
    for _ in range(num_grads):
        src = dist.recv(grad)                     # from whichever worker is ready first
        staleness[src][version - pulled[src]] += 1    # updates since this worker pulled
        w.add_(grad, alpha=-lr)
        version += 1
        if sent < num_grads:                      # more work to hand out: to this worker only
            send(src, 1)
            sent += 1
    for r in workers:                             # every worker now waits for a message
        send(r, 0)
    for q in sending.values():
        q.wait()
    return {"updates": version, "staleness": {r: dict(sorted(c.items()))
                                              for r, c in staleness.items()}}


def worker(net: nn.Module, batches: Iterator, delay: float = 0.0) -> int:
    """A worker, for both servers: pull, compute a gradient, push, until told to stop.
    ``delay`` seconds of sleep per gradient imitate a slower device. Returns the pushes."""
    n = sum(p.numel() for p in net.parameters())
    msg, pushed = torch.empty(n + 1), 0
    while True:
        dist.recv(msg, src=0)                     # pull
        if msg[n] == 0:
            return pushed
        vector_to_parameters(msg[:n], net.parameters())
        grad, _ = flat_grad(net, *next(batches))
        if delay:
            time.sleep(delay)
        dist.send(grad, dst=0)                    # push
        pushed += 1


@torch.no_grad()
def _loss(net: nn.Module, w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> float:
    vector_to_parameters(w, net.parameters())
    return F.cross_entropy(net(X), y).item()


@torch.no_grad()
def _test_accuracy(net: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    return accuracy(net(X), y) / len(y)


def ps_process(rank: int, world_size: int, configs: Sequence[PSConfig],
               data: tuple[int | None, int | None, str | None]) -> list[dict]:
    """One process of :func:`run_ps`: rank 0 serves, the others work, for every config in
    turn (one process group for all runs: starting processes costs seconds). The server
    returns one result per config (see :func:`run_ps`); a worker returns ``[]``."""
    # a lost message fails within 60 s; one thread each: W + 1 processes share the cores
    with process_group(rank, world_size, timeout=60):
        num_train, num_test, root = data
        X, y, X_test, y_test = load_arrays(num_train, num_test, root)
        num_workers, results = world_size - 1, []
        for cfg in configs:
            net = mlp(cfg.num_hiddens, cfg.seed)  # the same start on every process
            dist.barrier()
            if rank > 0:
                delay = cfg.delays[rank - 1] if rank <= len(cfg.delays) else 0.0
                worker(net, worker_batches(X, y, rank, num_workers, cfg.batch_size,
                                           cfg.seed), delay)
                continue
            w = parameters_to_vector(net.parameters()).detach().clone()
            tik = time.perf_counter()
            if cfg.mode == "sync":
                stats = server_sync(w, num_workers, cfg.num_grads // num_workers, cfg.lr)
            else:
                stats = server_async(w, num_workers, cfg.num_grads, cfg.lr)
            seconds = time.perf_counter() - tik
            vector_to_parameters(w, net.parameters())
            results.append({**dataclasses.asdict(cfg), **stats, "num_workers": num_workers,
                            "seconds": seconds, "updates_per_sec": stats["updates"] / seconds,
                            "examples_per_sec": cfg.num_grads * cfg.batch_size / seconds,
                            "test_acc": _test_accuracy(net, X_test, y_test),
                            "params": w})
        for r in results:
            r["grads_per_worker"] = {k: sum(h.values()) for k, h in r["staleness"].items()}
            total = collections.Counter()
            for h in r["staleness"].values():
                total.update(h)
            r["staleness_all"] = dict(sorted(total.items()))
        return results


def run_ps(configs: Sequence[PSConfig], num_workers: int = 2, num_train: int | None = None,
           num_test: int | None = None, root=None, timeout: float = 300) -> list[dict]:
    """Run every config with 1 server + ``num_workers`` workers (gloo, 127.0.0.1).

    Returns one dict per config: its settings, ``seconds`` (the server's wall time),
    ``updates_per_sec``, ``examples_per_sec``, ``test_acc``, the staleness histograms
    ``staleness[r]`` (staleness → gradients of worker r) and ``staleness_all``,
    ``grads_per_worker`` and the final ``params`` (a flat tensor).
    """
    for cfg in configs:                           # fail here, not in a child process
        if cfg.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', not {cfg.mode!r}")
        if cfg.mode == "sync" and cfg.num_grads % num_workers:
            raise ValueError(f"sync: num_grads {cfg.num_grads} does not divide by "
                             f"{num_workers} workers")
        if cfg.num_grads < num_workers:
            raise ValueError(f"num_grads {cfg.num_grads} < {num_workers} workers")
    return run(ps_process, num_workers + 1, list(configs), (num_train, num_test, root),
               on="cpu", timeout=timeout)


def sgd_reference(cfg: PSConfig, num_workers: int, X: torch.Tensor, y: torch.Tensor
                  ) -> torch.Tensor:
    """Plain minibatch SGD in one process on the workers' batches, concatenated: what
    ``sync`` with ``num_workers`` workers should compute. Returns the flat parameters."""
    net = mlp(cfg.num_hiddens, cfg.seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=cfg.lr)
    streams = [worker_batches(X, y, r, num_workers, cfg.batch_size, cfg.seed)
               for r in range(1, num_workers + 1)]
    for _ in range(cfg.num_grads // num_workers):
        batches = [next(s) for s in streams]
        loss = F.cross_entropy(net(torch.cat([b[0] for b in batches])),
                               torch.cat([b[1] for b in batches]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return parameters_to_vector(net.parameters()).detach()


def train_stale(tau: int, lr: float, num_steps: int, X: torch.Tensor, y: torch.Tensor,
                X_test: torch.Tensor, y_test: torch.Tensor, batch_size: int = 64,
                num_hiddens: int = 256, seed: int = 0, eval_every: int = 50,
                num_eval: int = 1024) -> dict:
    """SGD where the gradient applied at step t was computed on the parameters of step
    ``t - tau`` (of step 0 while ``t < tau``): an async server's staleness, held fixed.

    Every ``eval_every`` steps (and at steps 0 and ``num_steps``) records the loss of the
    *current* parameters on the first ``num_eval`` training examples; stops early if it is
    no longer finite (diverged).
    Same model, data order and seed for every ``tau``; ``tau = 0`` is plain SGD.
    """
    net = mlp(num_hiddens, seed)
    w = parameters_to_vector(net.parameters()).detach().clone()   # the current parameters
    past = collections.deque(maxlen=tau + 1)      # w_{t-tau}, ..., w_t
    batches = worker_batches(X, y, 1, 1, batch_size, seed)
    steps, losses = [0], [_loss(net, w, X[:num_eval], y[:num_eval])]
    for t in range(num_steps):
        past.append(w.clone())
        vector_to_parameters(past[0], net.parameters())          # the gradient at w_{t-tau}
        grad, _ = flat_grad(net, *next(batches))
        w.add_(grad, alpha=-lr)
        if (t + 1) % eval_every == 0 or t + 1 == num_steps:
            steps.append(t + 1)
            losses.append(_loss(net, w, X[:num_eval], y[:num_eval]))  # the loss at w_{t+1}
            if not math.isfinite(losses[-1]):
                break
    vector_to_parameters(w, net.parameters())
    diverged = not math.isfinite(losses[-1])
    return {"tau": tau, "lr": lr, "steps": steps, "losses": losses, "diverged": diverged,
            "test_acc": _test_accuracy(net, X_test, y_test), "params": w}


def main(argv: list[str] | None = None) -> None:
    """The command line: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m dpbook.torch.ps",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sync", "async"], default="sync")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-grads", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--delays", type=float, nargs="*", default=[])
    parser.add_argument("--num-train", type=int, default=None)
    parser.add_argument("--data", default=None, help="Fashion-MNIST folder")
    args = parser.parse_args(argv)
    cfg = PSConfig(args.mode, args.num_grads, args.batch_size, args.lr,
                   delays=tuple(args.delays))
    [r] = run_ps([cfg], args.workers, num_train=args.num_train, root=args.data)
    print(f"{r['mode']}: {r['updates']} updates in {r['seconds']:.2f} s "
          f"({r['updates_per_sec']:.0f} updates/s, {r['examples_per_sec']:.0f} examples/s), "
          f"test acc {r['test_acc']:.3f}, staleness {r['staleness_all']}, "
          f"gradients per worker {r['grads_per_worker']}")


if __name__ == "__main__":
    main()

"""When communication hides: the measurements behind the overlap page.

* :func:`compute_rate`: in this process, on one thread, the seconds of a LeNet training
  step and of its backward pass per batch size, and a line through the step times (a
  fixed cost per step plus a cost per example).
* :func:`sweep`: on ``nprocs`` gloo processes, ``dist.all_reduce`` timed at a few sizes
  (for the α–β fit of :mod:`dpbook.costmodel`) and one DDP step of LeNet per per-device
  batch, with its allreduce and without (``no_sync``): the share of the step that the
  communication took.
* :func:`prefetch`: :class:`dpbook.torch.zero.ZeroModel` with and without prefetch, and
  FSDP2 (``fully_shard``) with its default and with forward prefetch, trained on the same
  batches and profiled for one step (rank 0's ``torch.profiler`` trace, read by
  :mod:`dpbook.torch.profiling`).
* :func:`fsdp_reduce_dtype`: one step of LeNet under FSDP2 with
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=…)``, float32 against
  bfloat16 reduce-scatters: the dtypes, the bytes and the error of the averaged gradient.

FSDP2 (:mod:`dpbook.torch.fsdp`, imported only where used) needs torch 2.9 on gloo.

    python -m dpbook.torch.overlap          # the sweep on 2 processes, printed
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F

from .data import random_batch
from .dist import process_group, run, slowest_seconds
from .models import lenet

__all__ = ["compute_rate", "sweep_worker", "sweep", "prefetch_worker", "prefetch",
           "PREFETCH_CONFIGS", "fsdp_reduce_dtype_worker", "fsdp_reduce_dtype"]


def _median_seconds(fn, repeats: int) -> float:
    fn()                                              # warm-up
    times = []
    for _ in range(repeats):
        tik = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tik)
    return statistics.median(times)


def compute_rate(batches: Sequence[int], repeats: int = 5) -> dict:
    """LeNet on one thread of this process: per batch size, the median seconds of a
    training step (forward, backward, SGD) and of the backward pass alone; and the
    least-squares line ``step = fixed + per_example · batch``. Returns ``{"batches",
    "step", "backward", "fixed", "per_example", "backward_per_example"}`` (the last from
    the largest batch)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                          # one thread, like one process
    try:
        torch.manual_seed(0)
        model = lenet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        step, backward = [], []
        for b in batches:
            X, y = random_batch(b, seed=b)

            def train():
                opt.zero_grad()
                F.cross_entropy(model(X), y).backward()
                opt.step()

            loss = F.cross_entropy(model(X), y)            # forward once, then
            backward.append(_median_seconds(lambda: loss.backward(retain_graph=True),
                                            repeats))        # backward alone
            step.append(_median_seconds(train, repeats))
    finally:
        torch.set_num_threads(threads)
    per_example, fixed = np.polyfit(np.array(batches, float), np.array(step), 1)
    return {"batches": list(batches), "step": step, "backward": backward,
            "fixed": max(0.0, float(fixed)), "per_example": float(per_example),
            "backward_per_example": backward[-1] / batches[-1]}


def sweep_worker(rank: int, world_size: int, batches: Sequence[int], sizes: Sequence[int],
                 repeats: int) -> dict:
    """``dist.all_reduce`` of each of ``sizes`` bytes, then a DDP step of LeNet at each
    per-device batch of ``batches``, with and without its allreduce; medians over
    ``repeats`` of the slowest rank's time (:func:`dpbook.torch.dist.slowest_seconds`),
    the two kinds of step taken in turn so that a slow moment hits both."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    with process_group(rank, world_size):
        allreduce = []
        for nbytes in sizes:
            x = torch.ones(nbytes // 4)
            dist.all_reduce(x)                                      # warm-up
            times = [slowest_seconds(lambda: dist.all_reduce(x)) for _ in range(repeats)]
            allreduce.append({"algorithm": "ring", "processes": world_size,
                              "bytes": nbytes, "seconds": statistics.median(times)})
        torch.manual_seed(0)
        model = DDP(lenet())            # LeNet's 0.5 MB of gradients: one bucket
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        steps = []
        for b in batches:
            X, y = random_batch(b, seed=rank)

            def step():
                opt.zero_grad()
                F.cross_entropy(model(X), y).backward()     # the allreduce, in DDP's hook
                opt.step()

            def local_step():
                with model.no_sync():                       # the same step, no allreduce
                    step()

            step()
            local_step()
            synced, local = [], []
            for _ in range(repeats):
                synced.append(slowest_seconds(step))
                local.append(slowest_seconds(local_step))
            steps.append({"batch": b, "step": statistics.median(synced),
                          "local": statistics.median(local)})
        return {"allreduce": allreduce, "steps": steps}


def sweep(nprocs: int, batches: Sequence[int], sizes: Sequence[int] = (2**12, 2**16, 2**19,
          2**22), repeats: int = 5, timeout: float = 300) -> dict:
    """Run :func:`sweep_worker` on ``nprocs`` CPU processes. Returns ``{"allreduce":
    [measurements for costmodel.fit], "steps": [{"batch", "step", "local", "share"}]}``,
    ``share`` = (step - local) / step, the measured share of communication."""
    out = run(sweep_worker, nprocs, list(batches), list(sizes), repeats, on="cpu",
              timeout=timeout)
    for s in out["steps"]:
        s["share"] = (s["step"] - s["local"]) / s["step"]
    return out


#: The settings :func:`prefetch` compares: name → (kind, prefetch).
PREFETCH_CONFIGS = {"ZeroModel": ("zero", False), "ZeroModel, prefetch": ("zero", True),
                    "FSDP2": ("fsdp2", False), "FSDP2, forward prefetch": ("fsdp2", True)}


def _build(kind: str, prefetch: bool) -> tuple[torch.nn.Module, list]:
    """LeNet (seed 0) under ZeroModel or FSDP2; the parameters to optimize."""
    if kind == "zero":
        from .zero import ZeroModel
        torch.manual_seed(0)
        model = ZeroModel(lenet(), prefetch=prefetch)
        return model, model.shards()
    from .fsdp import shard_lenet          # FSDP2: a newer torch (versions.yml)
    model = shard_lenet()
    if prefetch:      # FSDP2 prefetches in backward by itself, in forward when asked
        units = [m for m in model if any(True for _ in m.parameters())]
        for unit, following in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([following])
    return model, list(model.parameters())


def prefetch_worker(rank: int, world_size: int, names: Sequence[str], batch_size: int,
                    repeats: int) -> dict:
    """Per setting of :data:`PREFETCH_CONFIGS`: LeNet trained on the same batches (two
    warm-up steps, one profiled step, ``repeats`` timed steps); rank 0's Chrome trace of
    the profiled step, ZeroModel's ``events`` of it, the median step time (slowest
    rank) and the final parameters."""
    import json
    import os
    import tempfile
    from pathlib import Path
    from .profiling import _quiet_stderr
    from .zero import OPTIMIZERS
    cls, kwargs = OPTIMIZERS["sgd-momentum"]
    with process_group(rank, world_size):
        results = {}
        for name in names:
            model, params = _build(*PREFETCH_CONFIGS[name])
            opt = cls(params, **kwargs)
            count = [0]

            def step():
                X, y = random_batch(batch_size, seed=1000 + count[0])
                count[0] += 1
                X, y = X.chunk(world_size)[rank], y.chunk(world_size)[rank]
                opt.zero_grad()
                F.cross_entropy(model(X), y).backward()
                opt.step()

            step()
            step()
            dist.barrier()
            trace = None
            if rank == 0:
                with _quiet_stderr(), torch.profiler.profile() as prof:
                    step()
                with tempfile.TemporaryDirectory() as folder:
                    path = os.path.join(folder, "trace.json")
                    prof.export_chrome_trace(path)
                    trace = json.loads(Path(path).read_text())
            else:
                step()
            events = list(getattr(model, "events", []))
            seconds = statistics.median(slowest_seconds(step) for _ in range(repeats))
            if hasattr(model, "full_state_dict"):
                state = model.full_state_dict()
            else:
                state = {k: p.full_tensor().detach().clone()
                         for k, p in model.named_parameters()}
            results[name] = {"trace": trace, "events": events, "seconds": seconds,
                             "params": state}
        return results


def prefetch(nprocs: int = 2, names: Sequence[str] = tuple(PREFETCH_CONFIGS),
             batch_size: int = 64, repeats: int = 5, timeout: float = 300) -> dict:
    """Run :func:`prefetch_worker` on ``nprocs`` CPU processes; returns its results per
    setting (``trace`` of rank 0, ``events``, ``seconds``, ``params``)."""
    unknown = [n for n in names if n not in PREFETCH_CONFIGS]
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; choose from "
                         f"{list(PREFETCH_CONFIGS)}")
    return run(prefetch_worker, nprocs, list(names), batch_size, repeats, on="cpu",
               timeout=timeout)


def fsdp_reduce_dtype_worker(rank: int, world_size: int,
                             reduce_dtypes: Sequence[torch.dtype], batch_size: int
                             ) -> dict:
    """LeNet under FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=…)`` for each of ``reduce_dtypes``: one forward and backward; returns
    the dtypes of the stored parameters, of the first layer's output (the compute dtype)
    and of the gradients, the reduce-scatter bytes, and the relative error of the
    averaged gradient against the float64 mean of the processes' bfloat16 gradients
    (computed without FSDP on a bfloat16 copy of the model)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from .fsdp import counting
    from .reduce_precision import relative_error
    from .zero import Traffic
    with process_group(rank, world_size):
        X, y = random_batch(batch_size, seed=0)
        X, y = X.chunk(world_size)[rank], y.chunk(world_size)[rank]
        torch.manual_seed(0)
        local = lenet().to(torch.bfloat16)                 # this rank's own gradient
        F.cross_entropy(local(X.to(torch.bfloat16)).float(), y).backward()
        mine = torch.cat([p.grad.double().reshape(-1) for p in local.parameters()])
        every = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine)
        exact = sum(every) / world_size                     # the mean, in float64
        out = {}
        for reduce_dtype in reduce_dtypes:
            torch.manual_seed(0)
            model = lenet()
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                          reduce_dtype=reduce_dtype)
            mesh = init_device_mesh("cpu", (world_size,))
            for layer in model:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            used = []
            model[0].register_forward_hook(lambda m, i, o: used.append(str(o.dtype)))
            traffic = Traffic(world_size)
            with counting(traffic):
                F.cross_entropy(model(X).float(), y).backward()
            grads = [p.grad.full_tensor() for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            out[str(reduce_dtype)] = {
                "param_dtype": str(next(model.parameters()).dtype),
                "compute_dtype": used[0], "grad_dtype": str(grads[0].dtype),
                "reduce_scatter_bytes": traffic.full_bytes.get("reduce-scatter", 0),
                "error": relative_error(flat, exact)}
        return out


def fsdp_reduce_dtype(nprocs: int = 2, reduce_dtypes: Sequence[torch.dtype] = (
        torch.float32, torch.bfloat16), batch_size: int = 64, timeout: float = 300
        ) -> dict:
    """:func:`fsdp_reduce_dtype_worker` on ``nprocs`` gloo processes (torch 2.9 or
    later, as :mod:`dpbook.torch.fsdp`): ``{str(reduce_dtype): {"param_dtype",
    "compute_dtype", "grad_dtype", "reduce_scatter_bytes", "error"}}`` from rank 0."""
    from . import fsdp  # noqa: F401  (checks the torch floor of FSDP2 on CPU)
    return run(fsdp_reduce_dtype_worker, nprocs, list(reduce_dtypes), batch_size,
               on="cpu", timeout=timeout)


def main() -> None:
    from .. import costmodel
    rate = compute_rate([1, 16, 64])
    out = sweep(2, [1, 4, 16, 64])
    alpha, beta = costmodel.fit(out["allreduce"])
    nbytes = 4 * sum(p.numel() for p in lenet().parameters())
    comm = costmodel.predict("ring", nbytes, 2, alpha, beta)
    print(f"alpha {alpha * 1e6:.1f} us, 1/beta {1 / beta / 1e9:.2f} GB/s, "
          f"allreduce of LeNet {comm * 1e3:.2f} ms")
    for s in out["steps"]:
        predicted = costmodel.communication_share(s["batch"], comm, rate["per_example"],
                                                  rate["fixed"])
        print(f"batch {s['batch']:>4}: measured {s['share']:6.1%}, "
              f"predicted {predicted:6.1%}")


if __name__ == "__main__":
    main()

"""Train on Fashion-MNIST with DistributedDataParallel: one process per device.

Run it with ``torchrun`` (the launcher PyTorch recommends), or let it start its own
processes; ``--batch-size`` is the *global* minibatch, split evenly across the processes::

    # 2 processes on this machine: gloo on CPUs, nccl with one GPU per process
    torchrun --standalone --nproc_per_node=2 -m dpbook.torch.ddp --epochs 2 --batch-size 256

    # the same without torchrun (torch.multiprocessing.spawn)
    python -m dpbook.torch.ddp --nprocs 2 --epochs 2 --batch-size 256

    # two machines with 4 GPUs each: the same command on both
    torchrun --nnodes=2 --nproc_per_node=4 \\
        --rdzv-backend=c10d --rdzv-endpoint=host0:29400 -m dpbook.torch.ddp

    # or let SLURM / Open MPI start one process per GPU (see dist.rank_from_env)
    MASTER_ADDR=host0 MASTER_PORT=29500 srun --ntasks-per-node=4 python -m dpbook.torch.ddp

Every process builds the same model from the same seed, reads its own part of every
epoch through ``DistributedSampler`` (reshuffled by ``set_epoch``), and DDP averages the
gradients with an allreduce during ``backward``. Only rank 0 prints and writes the
checkpoint; every process tears its process group down, even on errors. The process
plumbing (starting processes, joining and leaving the group, the launchers' variables)
is in :mod:`dpbook.torch.dist`; the checks of DDP against one process are in
:mod:`dpbook.torch.ddp_check`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ..tools import atomic_write
from .data import fashion_mnist_datasets
from . import ddp_hooks
from .devices import get_scale, hardware_line
from .dist import group_devices, per_process, process_group, rank_from_env, run
from .evaluate import accuracy
from .models import lenet, resnet18, seeded

__all__ = ["Config", "build_model", "train_worker", "train_epoch", "save_checkpoint",
           "resume", "crash_if_asked", "spawn_train", "parser", "main"]


@dataclasses.dataclass
class Config:
    """What one DDP training run does. ``None`` sizes come from the scale.

    Every field is a command-line flag of the script (``--batch-size 256``, ``--resume``):
    see :func:`parser`; :meth:`to_args` writes a config back as flags.
    """

    model: str = "resnet18"           # "resnet18" (width from the scale) or "lenet"
    batch_size: int = 256             # the global minibatch, over all processes
    lr: float = 0.1
    epochs: int | None = None
    scale: str | None = None          # quick | cpu | full; default: $DPBOOK_SCALE
    num_train: int | None = None
    num_test: int | None = None
    max_steps: int | None = None      # stop each epoch after this many steps (for timing)
    seed: int = 0
    data: str | None = None           # Fashion-MNIST folder (default: $DPBOOK_DATA / cache)
    threads: int | None = None        # torch threads per process (default: cores / processes)
    checkpoint: str | None = None     # rank 0 saves here after every epoch
    resume: bool = False              # start from `checkpoint` if it exists
    out: str | None = None            # rank 0 writes the results here (JSON)
    crash_rank: int | None = None     # for the failure demo: this rank kills itself …
    crash_epoch: int | None = None    # … at the start of this epoch, in the first attempt
    comm_hook: str = "float32"        # how gradients travel: a name in ddp_hooks.HOOKS
    threshold: float = 0.01           # the 2-bit threshold (compression.two_bit_hook)
    device: str = "auto"              # "auto": a GPU per process if there are enough; "cpu"

    def to_args(self) -> list[str]:
        """The script's flags for this config (only those that differ from the defaults):
        ``parser().parse_args(cfg.to_args())`` gives ``cfg`` back."""
        args = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else f"--no-{flag[2:]}")
            else:
                args += [flag, str(value)]
        return args


def build_model(cfg: Config) -> nn.Module:
    """The model of ``cfg``, initialized from ``cfg.seed`` (the same on every process)."""
    if cfg.model not in ("resnet18", "lenet"):
        raise ValueError(f"unknown model {cfg.model!r}: choose 'resnet18' or 'lenet'")
    with seeded(cfg.seed):
        return (resnet18(width=get_scale(cfg.scale).resnet_width)
                if cfg.model == "resnet18" else lenet())


def _datasets(cfg: Config) -> tuple[TensorDataset, TensorDataset]:
    scale = get_scale(cfg.scale)
    big = cfg.model == "resnet18"
    num_train = cfg.num_train or (scale.resnet_num_train if big else scale.num_train)
    num_test = cfg.num_test or (scale.resnet_num_test if big else scale.num_test)
    return fashion_mnist_datasets(num_train, num_test, cfg.data, cfg.seed)


def _epochs(cfg: Config) -> int:
    scale = get_scale(cfg.scale)
    return cfg.epochs or (scale.resnet_epochs if cfg.model == "resnet18" else scale.num_epochs)


def _log(rank: int, world_size: int, message: str) -> None:
    if rank == 0:                                 # one voice for the whole group
        print(f"[rank 0/{world_size}] {message}", flush=True)


@torch.no_grad()
def _evaluate(module: nn.Module, test: TensorDataset, rank: int, world_size: int,
              device: torch.device, batch_size: int) -> float:
    """Accuracy on the test set, each process taking every world_size-th example."""
    module.eval()
    shard = torch.utils.data.Subset(test, range(rank, len(test), world_size))
    counts = torch.zeros(2, device=device)       # correct, examples
    for X, y in DataLoader(shard, batch_size):
        X, y = X.to(device), y.to(device)
        counts += torch.tensor([accuracy(module(X), y), len(y)], device=device)
    dist.all_reduce(counts)                       # sum over processes
    module.train()
    return (counts[0] / counts[1]).item()


def train_worker(rank: int, world_size: int, cfg: Config, local_rank: int | None = None
                 ) -> dict:
    """One process of a DDP training run (started by :func:`spawn_train` or by torchrun);
    returns the run's results (the same on every rank)."""
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // world_size)
    with process_group(rank, world_size, local_rank, threads, on=cfg.device) as device:
        share = per_process(cfg.batch_size, world_size)
        train, test = _datasets(cfg)
        sampler = DistributedSampler(train, num_replicas=world_size, rank=rank,
                                     shuffle=True, seed=cfg.seed)
        train_iter = DataLoader(train, share, sampler=sampler)
        net = build_model(cfg).to(device)
        optimizer = torch.optim.SGD(net.parameters(), lr=cfg.lr)
        start_epoch = resume(cfg, net, optimizer, device, rank, world_size)
        net = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
        sent = ddp_hooks.register(net, cfg.comm_hook, cfg.threshold)   # counts bytes
        _log(rank, world_size, f"backend {dist.get_backend()}, {world_size} process(es) on "
             f"{device.type}, {threads} thread(s) each, global batch {cfg.batch_size} = "
             f"{world_size} x {share}")
        history = []
        for epoch in range(start_epoch, _epochs(cfg)):
            crash_if_asked(cfg, rank, epoch)
            sampler.set_epoch(epoch)              # a new shuffle, the same on every process
            loss, examples, seconds, steps = train_epoch(net, optimizer, train_iter,
                                                         device, cfg.max_steps)
            for buffer in net.module.buffers():   # BatchNorm running stats: take rank 0's
                dist.broadcast(buffer, src=0)
            test_acc = _evaluate(net.module, test, rank, world_size, device, share)
            history.append({"epoch": epoch + 1, "train_loss": loss, "test_acc": test_acc,
                            "seconds": seconds, "examples_per_sec": examples / seconds,
                            "bytes_sent": sent.bytes})
            # a launch check of a few steps says so: its accuracy is about chance (0.1)
            cut = (f", first {steps} of {len(train_iter)} steps (--max-steps)"
                   if steps < len(train_iter) else "")
            _log(rank, world_size, f"epoch {epoch + 1}{cut}: loss {loss:.3f}, test acc "
                 f"{test_acc:.3f}, {seconds:.1f} s, {examples / seconds:.0f} examples/s")
            if rank == 0 and cfg.checkpoint:      # one writer; others would race on the file
                save_checkpoint(cfg.checkpoint, net.module, optimizer, epoch + 1, cfg)
        hardware = hardware_line(group_devices(device))
        _log(rank, world_size, hardware)
        return {"world_size": world_size, "backend": dist.get_backend(), "threads": threads,
                "history": history, "hardware": hardware, "config": dataclasses.asdict(cfg)}


def train_epoch(net: DDP, optimizer: torch.optim.Optimizer, train_iter: DataLoader,
                device: torch.device, max_steps: int | None = None
                ) -> tuple[float, int, float, int]:
    """One epoch on this process's part of the data: ``(mean training loss over all
    processes, examples over all processes, seconds of the slowest process, steps)``."""
    totals = torch.zeros(2, device=device)        # summed loss, examples
    steps = 0
    dist.barrier()
    tik = time.perf_counter()
    for step, (X, y) in enumerate(train_iter):
        if max_steps is not None and step >= max_steps:
            break
        X, y = X.to(device), y.to(device)
        loss = F.cross_entropy(net(X), y)
        optimizer.zero_grad()
        loss.backward()                           # DDP allreduces (averages) the gradients here
        optimizer.step()
        totals += torch.stack([loss.detach() * len(y),
                               torch.tensor(float(len(y)), device=device)])
        steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()                                # the epoch ends when the slowest process ends
    seconds = time.perf_counter() - tik
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item(), int(totals[1].item()), seconds, steps


def save_checkpoint(path: str, net: nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
                    cfg: Config) -> None:
    """Rank 0's checkpoint after ``epoch`` epochs: model, optimizer, epoch and config,
    written atomically (a crash while saving leaves the previous checkpoint whole)."""
    state = {"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
             "config": dataclasses.asdict(cfg)}
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def resume(cfg: Config, net: nn.Module, optimizer: torch.optim.Optimizer,
           device: torch.device, rank: int, world_size: int) -> int:
    """With ``cfg.resume`` and an existing ``cfg.checkpoint``: load the model and optimizer
    on every process and return the epochs already done; else 0."""
    if not (cfg.resume and cfg.checkpoint and os.path.exists(cfg.checkpoint)):
        return 0
    state = torch.load(cfg.checkpoint, map_location=device)
    net.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    _log(rank, world_size, f"resumed from {cfg.checkpoint} after epoch {state['epoch']}")
    return state["epoch"]


def crash_if_asked(cfg: Config, rank: int, epoch: int) -> None:
    """The failure demo: rank ``cfg.crash_rank`` kills itself at the start of epoch
    ``cfg.crash_epoch``, in torchrun's first attempt only (a restart then runs through)."""
    if (rank == cfg.crash_rank and epoch + 1 == cfg.crash_epoch
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        print(f"[rank {rank}] killing myself at epoch {epoch + 1}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)      # as if the machine had died


def spawn_train(nprocs: int, cfg: Config, timeout: float = 1800) -> dict:
    """Run :func:`train_worker` in ``nprocs`` new processes on this machine
    (:func:`dpbook.torch.dist.run`); return rank 0's results (also written to ``cfg.out``
    if it is set)."""
    results = run(train_worker, nprocs, cfg, on=cfg.device, timeout=timeout)
    _write_results(cfg, results)
    return results


def _write_results(cfg: Config, results: dict) -> None:
    if cfg.out:
        atomic_write(cfg.out, lambda path: Path(path).write_text(json.dumps(results, indent=1)))


def parser() -> argparse.ArgumentParser:
    """The script's command line: one flag per :class:`Config` field, plus ``--nprocs``."""
    p = argparse.ArgumentParser(prog="python -m dpbook.torch.ddp",
                                description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, default=None,
                   help="start this many processes (without torchrun, srun or mpirun)")
    p.add_argument("--model", choices=("resnet18", "lenet"), default="resnet18")
    p.add_argument("--batch-size", type=int, default=256,
                   help="the global minibatch, split evenly over the processes")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, help="default: from the scale")
    p.add_argument("--scale", choices=("quick", "cpu", "full"), help="default: $DPBOOK_SCALE")
    p.add_argument("--num-train", type=int, help="training examples (default: from the scale)")
    p.add_argument("--num-test", type=int, help="test examples (default: from the scale)")
    p.add_argument("--max-steps", type=int, help="stop each epoch after this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="the Fashion-MNIST folder (default: $DPBOOK_DATA or the cache)")
    p.add_argument("--threads", type=int, help="torch threads per process "
                                               "(default: cores / processes)")
    p.add_argument("--checkpoint", help="rank 0 saves here after every epoch")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=False,
                   help="start from --checkpoint if it exists")
    p.add_argument("--out", help="rank 0 writes the results here (JSON)")
    p.add_argument("--crash-rank", type=int, help="failure demo: this rank kills itself ...")
    p.add_argument("--crash-epoch", type=int, help="... at the start of this epoch")
    p.add_argument("--comm-hook", choices=list(ddp_hooks.HOOKS), default="float32",
                   help="how the gradients travel (fp16, bf16, 2bit: compressed)")
    p.add_argument("--threshold", type=float, default=0.01, help="the 2-bit threshold")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto",
                   help="auto: one GPU per process when this machine has enough, else the "
                        "CPU; cpu: CPU processes (e.g. several 'nodes' on one machine)")
    return p


def main(argv: list[str] | None = None) -> None:
    """The command line: see the module docstring."""
    args = vars(parser().parse_args(argv))
    nprocs = args.pop("nprocs")
    cfg = Config(**args)
    placement = rank_from_env()
    if placement is not None:                  # started by torchrun, srun or mpirun
        rank, world_size, local_rank = placement
        results = train_worker(rank, world_size, cfg, local_rank)
        if rank == 0:
            _write_results(cfg, results)
        # as dist._run_child: skip the interpreter's teardown, where a gloo thread can
        # abort the process after a good run (torch 2.14; pytorch/pytorch#179291)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        spawn_train(nprocs or 1, cfg)


if __name__ == "__main__":
    sys.exit(main())

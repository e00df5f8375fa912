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

    # or let SLURM / Open MPI start one process per GPU (see rank_from_env)
    MASTER_ADDR=host0 MASTER_PORT=29500 srun --ntasks-per-node=4 python -m dpbook.torch.ddp

Every process builds the same model from the same seed, reads its own part of every
epoch through ``DistributedSampler`` (reshuffled by ``set_epoch``), and DDP averages the
gradients with an allreduce during ``backward``. Only rank 0 prints and writes the
checkpoint; every process tears its process group down, even on errors.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from .. import data as _data
from ..launch import free_port
from .data import to_tensors
from .devices import get_scale, hardware_line
from .models import lenet, resnet18
from .train import accuracy

__all__ = ["Config", "free_port", "launch", "run", "init_process", "train_worker", "spawn_train",
           "torchrun_command", "max_difference", "rank_from_env",
           "register_comm_hook", "build_model", "step_worker", "ddp_step_difference", "sync_batchnorm_status"]


@dataclasses.dataclass
class Config:
    """What one DDP training run does. ``None`` sizes come from the scale."""

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
    comm_hook: str | None = None      # compress the gradients: "fp16" or "2bit"
    threshold: float = 0.01           # the 2-bit threshold (compression.two_bit_hook)


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 300) -> None:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` new processes and wait for all of them.

    Picks a free port for the rendezvous on 127.0.0.1 (``MASTER_ADDR``/``MASTER_PORT``,
    inherited by the children only). Raises the first child's error, or ``TimeoutError``
    after ``timeout`` seconds; either way no child is left running.
    """
    if nprocs < 1:
        raise ValueError(f"need at least one process, got {nprocs}")
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        context = mp.start_processes(fn, args=(nprocs, *args), nprocs=nprocs, join=False,
                                     start_method="spawn")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=0.5):     # raises if a child failed
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} processes still running after {timeout} s")
    finally:
        for p in context.processes:              # reap everything, whatever happened
            if p.is_alive():
                p.kill()
            p.join()


def init_process(rank: int, world_size: int, local_rank: int | None = None,
                 timeout: float = 120) -> torch.device:
    """Join the process group (rendezvous at ``MASTER_ADDR:MASTER_PORT``); return our device.

    The device is GPU ``local_rank`` when there are GPUs, else the CPU; the backend is the
    one PyTorch recommends for it (nccl for CUDA, gloo for the CPU).
    """
    local_rank = rank if local_rank is None else local_rank
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = dist.get_default_backend_for_device(device)
    timeout = datetime.timedelta(seconds=timeout)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            store=_attempt_store(rank, world_size, timeout))
    return device


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """Under torchrun, the rendezvous store with keys private to this restart attempt.

    After ``torchrun --max-restarts`` restarts a group, the store can still hold the
    addresses the dead group published, and the new group's gloo may connect to them
    ("Connection refused"). A key prefix per attempt keeps the rounds apart. ``None``
    (the default ``env://`` rendezvous) outside torchrun.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"   # torchrun hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, is_master=not agent and rank == 0, timeout=timeout,
                          multi_tenant=not agent)
    return dist.PrefixStore(f"dpbook/attempt-{attempt}", store)


def build_model(cfg: Config) -> nn.Module:
    """The model of ``cfg``, initialized from ``cfg.seed`` (the same on every process)."""
    torch.manual_seed(cfg.seed)
    if cfg.model == "resnet18":
        return resnet18(width=get_scale(cfg.scale).resnet_width)
    if cfg.model == "lenet":
        return lenet()
    raise ValueError(f"unknown model {cfg.model!r}: choose 'resnet18' or 'lenet'")


def _datasets(cfg: Config) -> tuple[TensorDataset, TensorDataset]:
    scale = get_scale(cfg.scale)
    big = cfg.model == "resnet18"
    num_train = cfg.num_train or (scale.resnet_num_train if big else scale.num_train)
    num_test = cfg.num_test or (scale.resnet_num_test if big else scale.num_test)
    X_train, y_train, X_test, y_test = _data.read_fashion_mnist(cfg.data)
    return (TensorDataset(*to_tensors(*_data.subset(X_train, y_train, num_train, cfg.seed))),
            TensorDataset(*to_tensors(*_data.subset(X_test, y_test, num_test, cfg.seed))))


def _save_atomically(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


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


def train_worker(rank: int, world_size: int, cfg: Config, local_rank: int | None = None) -> None:
    """One process of a DDP training run (started by :func:`launch` or by torchrun)."""
    device = init_process(rank, world_size, local_rank)
    try:
        threads = cfg.threads or max(1, (os.cpu_count() or 1) // world_size)
        if device.type == "cpu":
            torch.set_num_threads(threads)
        scale = get_scale(cfg.scale)
        epochs = cfg.epochs or (scale.resnet_epochs if cfg.model == "resnet18"
                                else scale.num_epochs)
        if cfg.batch_size % world_size:
            raise ValueError(f"batch size {cfg.batch_size} does not divide by "
                             f"{world_size} processes")
        per_process = cfg.batch_size // world_size
        train, test = _datasets(cfg)
        sampler = DistributedSampler(train, num_replicas=world_size, rank=rank,
                                     shuffle=True, seed=cfg.seed)
        train_iter = DataLoader(train, per_process, sampler=sampler)

        net = build_model(cfg).to(device)
        optimizer = torch.optim.SGD(net.parameters(), lr=cfg.lr)
        start_epoch = 0
        if cfg.resume and cfg.checkpoint and os.path.exists(cfg.checkpoint):
            state = torch.load(cfg.checkpoint, map_location=device)
            net.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start_epoch = state["epoch"]
            _log(rank, world_size, f"resumed from {cfg.checkpoint} after epoch {start_epoch}")
        net = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
        count_bytes = register_comm_hook(net, cfg.comm_hook, cfg.threshold)
        hardware = hardware_line([device] * world_size)    # one device per process
        _log(rank, world_size, f"backend {dist.get_backend()}, {world_size} process(es), "
             f"{threads} thread(s) each, global batch {cfg.batch_size} = "
             f"{world_size} x {per_process}")
        history, steps_taken = [], 0
        for epoch in range(start_epoch, epochs):
            if (rank == cfg.crash_rank and epoch + 1 == cfg.crash_epoch
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
                print(f"[rank {rank}] killing myself at epoch {epoch + 1}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)   # as if the machine had died
            sampler.set_epoch(epoch)              # a new shuffle, the same on every process
            totals = torch.zeros(2, device=device)  # summed loss, examples
            dist.barrier()
            tik = time.perf_counter()
            for step, (X, y) in enumerate(train_iter):
                if cfg.max_steps is not None and step >= cfg.max_steps:
                    break
                steps_taken += 1
                X, y = X.to(device), y.to(device)
                loss = F.cross_entropy(net(X), y)
                optimizer.zero_grad()
                loss.backward()                   # DDP allreduces (averages) the gradients here
                optimizer.step()
                totals += torch.stack([loss.detach() * len(y),
                                       torch.tensor(float(len(y)), device=device)])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()                        # the epoch ends when the slowest process ends
            seconds = time.perf_counter() - tik
            dist.all_reduce(totals)
            for buffer in net.module.buffers():   # BatchNorm running stats: take rank 0's
                dist.broadcast(buffer, src=0)
            test_acc = _evaluate(net.module, test, rank, world_size, device, per_process)
            record = {"epoch": epoch + 1, "train_loss": (totals[0] / totals[1]).item(),
                      "test_acc": test_acc, "seconds": seconds,
                      "examples_per_sec": totals[1].item() / seconds,
                      "bytes_sent": count_bytes(steps_taken)}
            history.append(record)
            _log(rank, world_size, f"epoch {epoch + 1}: loss {record['train_loss']:.3f}, "
                 f"test acc {test_acc:.3f}, {seconds:.1f} s, "
                 f"{record['examples_per_sec']:.0f} examples/s")
            if rank == 0 and cfg.checkpoint:      # one writer; others would race on the file
                _save_atomically({"epoch": epoch + 1, "model": net.module.state_dict(),
                                  "optimizer": optimizer.state_dict(),
                                  "config": dataclasses.asdict(cfg)}, cfg.checkpoint)
        _log(rank, world_size, hardware)
        if rank == 0 and cfg.out:
            Path(cfg.out).write_text(json.dumps({
                "world_size": world_size, "backend": dist.get_backend(),
                "threads": threads, "history": history, "hardware": hardware,
                "config": dataclasses.asdict(cfg)}, indent=1))
    finally:
        dist.destroy_process_group()


def register_comm_hook(net: DDP, kind: str | None, threshold: float = 0.01
                       ) -> Callable[[int], int]:
    """Make DDP send ``kind`` of gradients: ``None`` (float32, DDP's own allreduce),
    ``"fp16"`` (PyTorch's ``fp16_compress_hook``) or ``"2bit"``
    (:func:`dpbook.torch.compression.two_bit_hook`). Returns a function of the number of
    steps taken that tells how many bytes of gradients this process has handed to the
    collectives in them."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from .compression import TwoBitState, payload_bytes, two_bit_hook
    if kind not in (None, "fp16", "2bit"):
        raise ValueError(f"unknown comm_hook {kind!r}: choose 'fp16' or '2bit' (or None)")
    numel = sum(p.numel() for p in net.parameters() if p.requires_grad)
    if kind is None:
        return lambda steps: steps * payload_bytes(numel, "none")
    if kind == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return lambda steps: steps * payload_bytes(numel, "fp16")
    state = TwoBitState(threshold)                      # "2bit"
    net.register_comm_hook(state, two_bit_hook)
    return lambda steps: state.bytes_sent               # counted by the hook itself


def torchrun_command(script_args: Sequence[str], nproc_per_node: int = 1, nnodes: int = 1,
                     node_rank: int = 0, endpoint: str | None = None,
                     max_restarts: int = 0, is_host: bool | None = None,
                     run_id: str = "dpbook", rdzv: str = "c10d") -> list[str]:
    """The ``torchrun`` command line that runs ``python -m dpbook.torch.ddp *script_args``.

    With ``nnodes=1`` and no ``endpoint`` it is ``--standalone``. Otherwise every node
    runs the same command with the same c10d rendezvous ``endpoint`` (``host:port`` of one
    of the nodes). The c10d rendezvous numbers the nodes in the order they arrive, so
    ``node_rank`` is only passed for the static one (``rdzv="static"``: ``--node-rank``
    with ``--master-addr``/``--master-port``, no restarts across nodes). ``is_host`` says
    which node serves the c10d rendezvous; on real machines torchrun works it out from the
    host name, but "nodes" that share one machine must be told.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}",
           f"--max-restarts={max_restarts}"]
    if nnodes == 1 and endpoint is None:
        cmd.append("--standalone")
    elif rdzv == "static":
        host, port = endpoint.rsplit(":", 1)
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={host}",
                f"--master-port={port}"]
    elif rdzv == "c10d":
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={run_id}"]
        if is_host is not None:
            cmd.append(f"--rdzv-conf=is_host={str(is_host).lower()}")
    else:
        raise ValueError(f"rdzv must be 'c10d' or 'static', not {rdzv!r}")
    return cmd + ["-m", "dpbook.torch.ddp", *script_args]


def max_difference(a: str | os.PathLike | dict, b: str | os.PathLike | dict) -> float:
    """The largest absolute difference between the model parameters of two checkpoints.

    Either may also be a model's ``state_dict()``: ``max_difference(start, checkpoint)``
    with ``start = build_model(cfg).state_dict()`` is how far training moved the parameters.
    """
    a, b = (x if isinstance(x, dict) else torch.load(x, map_location="cpu")["model"]
            for x in (a, b))
    if a.keys() != b.keys():
        raise ValueError("the checkpoints hold different models")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def spawn_train(nprocs: int, cfg: Config, timeout: float = 1800) -> dict:
    """Run :func:`train_worker` in ``nprocs`` processes; return rank 0's results."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dataclasses.replace(cfg, out=cfg.out or os.path.join(tmp, "results.json"))
        launch(train_worker, nprocs, cfg, timeout=timeout)
        return json.loads(Path(cfg.out).read_text())


def run(worker: Callable[..., None], nprocs: int, *args: Any, timeout: float = 300) -> Any:
    """Start ``worker(rank, nprocs, *args, out)`` in ``nprocs`` processes (:func:`launch`)
    and return what rank 0 wrote to the file ``out`` (JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        launch(worker, nprocs, *args, out, timeout=timeout)
        return json.loads(Path(out).read_text())


def step_worker(rank: int, world_size: int, model: str, batch_size: int, lr: float,
                seed: int, out: str) -> None:
    """One DDP SGD step on this process's part of a fixed random batch; rank 0 saves the
    parameters to ``out``. Used to check DDP against one process (:func:`ddp_step_difference`)."""
    device = init_process(rank, world_size)
    try:
        torch.set_num_threads(1)
        if device.type == "cuda":     # full float32 like the CPU reference: no TF32 convolutions
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        cfg = Config(model=model, seed=seed, scale="quick")
        net = DDP(build_model(cfg).to(device))
        X, y = _fixed_batch(batch_size, seed)
        X, y = X.chunk(world_size)[rank].to(device), y.chunk(world_size)[rank].to(device)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        F.cross_entropy(net(X), y).backward()      # mean over this process's shard
        optimizer.step()                           # the averaged gradient: the global mean
        if rank == 0:
            _save_atomically({k: v.cpu() for k, v in net.module.state_dict().items()}, out)
    finally:
        dist.destroy_process_group()


def _fixed_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch_size, 1, 28, 28, generator=g), torch.randint(0, 10, (batch_size,),
                                                                         generator=g)


def ddp_step_difference(nprocs: int, model: str = "lenet", batch_size: int = 64,
                        lr: float = 0.1, seed: int = 0, timeout: float = 300
                        ) -> dict[str, float]:
    """Compare one DDP step on ``nprocs`` processes with one step of a single process.

    Returns the largest parameter difference from two single-process references:
    ``"whole"`` takes the whole batch at once; ``"shards"`` runs the ``nprocs`` shards
    through the network one at a time and averages their losses. The two agree unless the
    network has BatchNorm, where DDP computes ``"shards"``: each process normalizes its
    shard with the shard's own statistics.
    """
    if batch_size % nprocs:
        raise ValueError(f"batch size {batch_size} does not divide by {nprocs} processes")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "params.pt")
        launch(step_worker, nprocs, model, batch_size, lr, seed, out, timeout=timeout)
        ddp_state = torch.load(out)     # parameters; BatchNorm's running stats are buffers
    X, y = _fixed_batch(batch_size, seed)
    result = {}
    for reference in ("whole", "shards"):
        net = build_model(Config(model=model, seed=seed, scale="quick"))
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        if reference == "whole":
            loss = F.cross_entropy(net(X), y)
        else:
            loss = sum(F.cross_entropy(net(X_shard), y_shard) for X_shard, y_shard
                       in zip(X.chunk(nprocs), y.chunk(nprocs))) / nprocs
        loss.backward()
        optimizer.step()
        result[reference] = max((ddp_state[name] - p).abs().max().item()
                                for name, p in net.named_parameters())
    return result


def _syncbn_worker(rank: int, world_size: int, out: str) -> None:
    device = init_process(rank, world_size)
    try:
        bn = nn.SyncBatchNorm(4).to(device)
        try:
            bn(torch.rand(8, 4, 5, 5, device=device))
            message = "ok"
        except Exception as e:  # noqa: BLE001 - the error is the result
            message = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
        if rank == 0:
            Path(out).write_text(message)
    finally:
        dist.destroy_process_group()


def sync_batchnorm_status(nprocs: int = 2, timeout: float = 120) -> str:
    """Run one training-mode ``nn.SyncBatchNorm`` forward pass in a group of ``nprocs``
    processes: ``"ok"``, or the error it raised (on a CPU it needs CUDA)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "status.txt")
        launch(_syncbn_worker, nprocs, out, timeout=timeout)
        return Path(out).read_text()


#: Where launchers put (rank, world size, local rank): torchrun, Open MPI's mpirun, SLURM.
LAUNCHER_VARIABLES = (("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                      ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                       "OMPI_COMM_WORLD_LOCAL_RANK"),
                      ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))


def rank_from_env(environ: dict[str, str] | None = None) -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` from the launcher's variables, or ``None``.

    torchrun sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT``);
    ``mpirun`` and ``srun`` set their own names — then ``MASTER_ADDR`` and ``MASTER_PORT``
    must be exported by the job script. The first launcher found wins.
    """
    env = os.environ if environ is None else environ
    for rank, size, local in LAUNCHER_VARIABLES:
        if rank in env and size in env:
            return int(env[rank]), int(env[size]), int(env.get(local, 0))
    return None


def main(argv: list[str] | None = None) -> None:
    """The command line: see the module docstring."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    parser = argparse.ArgumentParser(prog="python -m dpbook.torch.ddp",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=None,
                        help="start this many processes (without torchrun)")
    for name, f in fields.items():
        flag = "--" + name.replace("_", "-")
        if f.type in ("bool",):
            parser.add_argument(flag, action="store_true")
        else:
            kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
            parser.add_argument(flag, type=kind, default=f.default)
    args = vars(parser.parse_args(argv))
    nprocs = args.pop("nprocs")
    cfg = Config(**args)
    placement = rank_from_env()
    if placement is not None:                  # started by torchrun, srun or mpirun
        rank, world_size, local_rank = placement
        train_worker(rank, world_size, cfg, local_rank)
    else:
        spawn_train(nprocs or 1, cfg)


if __name__ == "__main__":
    sys.exit(main())

"""Process plumbing for every multi-process demo: start processes, join a process group,
always leave it, collect rank 0's result; and the launchers' side (torchrun, SLURM, MPI).

A demo is a worker function ``worker(rank, world_size, *args, out)``: it joins the group
with :func:`process_group`, does its part, and rank 0 writes its result to the file
``out``. :func:`run` starts ``nprocs`` copies of it and returns what rank 0 wrote::

    def worker(rank, world_size, out):
        with process_group(rank, world_size) as device:
            x = torch.ones(3, device=device)
            torch.distributed.all_reduce(x)
            if rank == 0:
                Path(out).write_text(json.dumps(x.tolist()))

    run(worker, 2)          # [2.0, 2.0, 2.0]

The DDP training script (:mod:`dpbook.torch.ddp`) is one such worker; the
communication chapter's allreduce, parameter server and unequal split are others.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..launch import free_port

__all__ = ["free_port", "spawn", "run", "read_json", "init_process", "process_group",
           "slowest_seconds", "LAUNCHER_VARIABLES", "rank_from_env", "torchrun_command"]


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 300,
          start_method: str = "spawn") -> None:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` new processes and wait for all of them.

    Picks a free port for the rendezvous on 127.0.0.1 (``MASTER_ADDR``/``MASTER_PORT``,
    inherited by the children only). Raises the first child's error, or ``TimeoutError``
    after ``timeout`` seconds; either way no child is left running. ``start_method`` is
    multiprocessing's: ``spawn`` starts fresh interpreters (each imports torch anew),
    ``forkserver`` forks them from a server that imported what
    ``multiprocessing.set_forkserver_preload`` named, once.
    """
    if nprocs < 1:
        raise ValueError(f"need at least one process, got {nprocs}")
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        context = mp.start_processes(fn, args=(nprocs, *args), nprocs=nprocs, join=False,
                                     start_method=start_method)
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


def read_json(path: str) -> Any:
    """What :func:`run` returns by default: the JSON rank 0 wrote."""
    return json.loads(Path(path).read_text())


def run(worker: Callable[..., None], nprocs: int, *args: Any, timeout: float = 300,
        read: Callable[[str], Any] = read_json) -> Any:
    """Start ``worker(rank, nprocs, *args, out)`` in ``nprocs`` processes (:func:`spawn`)
    and return ``read(out)``: by default the JSON rank 0 wrote to the file ``out``.

    ``out`` lives in a temporary folder that is gone when ``run`` returns, so ``read``
    must load everything it needs (e.g. ``torch.load``). Files beside ``out`` (say
    ``out + ".params.pt"``) are in the same folder and go with it.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        spawn(worker, nprocs, *args, out, timeout=timeout)
        return read(out)


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


@contextlib.contextmanager
def process_group(rank: int, world_size: int, local_rank: int | None = None,
                  threads: int | None = 1, timeout: float = 120) -> Iterator[torch.device]:
    """``with process_group(rank, world_size) as device:`` joins the group
    (:func:`init_process`) and leaves it at the end, whatever happens inside.

    On a CPU each process uses ``threads`` threads (default 1: the processes share the
    machine's cores; ``None`` leaves PyTorch's default).
    """
    device = init_process(rank, world_size, local_rank, timeout)
    try:
        if device.type == "cpu" and threads is not None:
            torch.set_num_threads(threads)
        yield device
    finally:
        dist.destroy_process_group()


def slowest_seconds(fn: Callable[[], Any]) -> float:
    """Call ``fn()`` on every process of the group, started together (a barrier), and
    return the seconds the *slowest* process took: a collective step is only as fast as
    its slowest member. Waits for the GPU before reading the clock."""
    dist.barrier()
    tik = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    device = (torch.device("cuda", torch.cuda.current_device())   # NCCL sums GPU tensors
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    took = torch.tensor([time.perf_counter() - tik], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


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


def torchrun_command(script_args: Sequence[str], nproc_per_node: int = 1, nnodes: int = 1,
                     node_rank: int = 0, endpoint: str | None = None,
                     max_restarts: int = 0, is_host: bool | None = None,
                     run_id: str = "dpbook", rdzv: str = "c10d",
                     module: str = "dpbook.torch.ddp") -> list[str]:
    """The ``torchrun`` command line that runs ``python -m <module> *script_args``
    (by default the DDP training script, :mod:`dpbook.torch.ddp`).

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
    return cmd + ["-m", module, *script_args]

"""Process plumbing for every multi-process demo: where the processes run (one device
policy), start them, join a process group, always leave it, and hand back what the
workers returned; and the launchers' side (torchrun, SLURM, MPI).

A demo is a worker function ``worker(rank, world_size, *args)``: it joins the group with
:func:`process_group`, does its part and *returns* its result. :func:`run` starts
``nprocs`` copies of it and returns what rank 0's copy returned (``ranks="all"``: a list,
one entry per rank)::

    def worker(rank, world_size):
        with process_group(rank, world_size) as device:
            x = torch.ones(3, device=device)
            torch.distributed.all_reduce(x)
            return x.tolist()

    run(worker, 2)          # [2.0, 2.0, 2.0]

**Where the processes run** is decided in one place, :func:`placement`, from what the
demo asks for (``on="auto"``: a GPU per process when there are enough GPUs; ``on="cpu"``:
processes on the CPU) and what the machine has. :func:`run` prints the decision once per
kernel, e.g. ``4 processes on the CPU (gloo): this machine has 1 GPU, fewer than 4``.
No rank ever asks for a GPU that does not exist, and a group that runs on GPUs also has
gloo for CPU tensors (backend ``"cpu:gloo,cuda:nccl"``).

The DDP training script (:mod:`dpbook.torch.ddp`) is one such worker; the
communication chapter's allreduce, parameter server and unequal split are others.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..launch import free_port

__all__ = ["free_port", "Placement", "placement", "launcher_placement", "spawn", "run",
           "init_process", "process_group", "per_process", "group_devices",
           "slowest_seconds", "LAUNCHER_VARIABLES", "rank_from_env", "torchrun_command"]

#: What a demo may ask for: ``"auto"`` (one GPU per process if the machine has enough,
#: else the CPU) or ``"cpu"`` (the demo is about CPU processes, or moves CPU tensors).
ON = ("auto", "cpu")

#: Set (to the port) for the children of :func:`spawn`: the parent hosts the store there.
_HOSTED = "DPBOOK_HOSTED_STORE_PORT"
_GROUPS = 0                      # process groups this process has joined through a store


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the ranks of one group run: ``devices[rank]`` (``"cpu"`` or ``"cuda:i"``),
    the backend string for ``init_process_group``, and why."""

    devices: tuple[str, ...]
    backend: str
    why: str

    @property
    def nprocs(self) -> int:
        return len(self.devices)

    def device(self, rank: int) -> torch.device:
        return torch.device(self.devices[rank])

    def __str__(self) -> str:
        n = self.nprocs
        procs = f"{n} process" + ("es" if n != 1 else "")
        if self.devices[0] == "cpu":
            return f"{procs} on the CPU (gloo): {self.why}"
        return (f"{procs} on {', '.join(self.devices)} (NCCL; gloo for CPU tensors): "
                f"{self.why}")


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("s" if n != 1 else "")


def placement(nprocs: int, on: str = "auto", num_gpus: int | None = None) -> Placement:
    """The device policy: where ``nprocs`` processes of a demo run.

    ``on="cpu"``: every rank on the CPU, gloo. ``on="auto"``: rank ``r`` on GPU ``r`` when
    the machine has at least ``nprocs`` GPUs (NCCL for CUDA tensors, gloo for CPU ones);
    otherwise the CPU, because NCCL refuses two ranks on one GPU. ``num_gpus`` defaults to
    ``torch.cuda.device_count()``.

    >>> print(placement(2, num_gpus=0))
    2 processes on the CPU (gloo): this machine has no GPU
    >>> print(placement(4, num_gpus=1))
    4 processes on the CPU (gloo): this machine has 1 GPU, fewer than 4
    >>> print(placement(2, num_gpus=8))
    2 processes on cuda:0, cuda:1 (NCCL; gloo for CPU tensors): one GPU per process
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"need at least one process, got {nprocs!r}")
    if on not in ON:
        raise ValueError(f"on must be one of {ON}, not {on!r}")
    num_gpus = torch.cuda.device_count() if num_gpus is None else num_gpus
    cpu = ("cpu",) * nprocs
    if on == "cpu":
        unused = (f" (this machine's {_gpus(num_gpus)} "
                  f"{'stays' if num_gpus == 1 else 'stay'} unused)") if num_gpus else ""
        return Placement(cpu, "gloo", "this demo runs CPU processes" + unused)
    if num_gpus == 0:
        return Placement(cpu, "gloo", "this machine has no GPU")
    if nprocs > num_gpus:
        return Placement(cpu, "gloo",
                         f"this machine has {_gpus(num_gpus)}, fewer than {nprocs}")
    return Placement(tuple(f"cuda:{r}" for r in range(nprocs)), "cpu:gloo,cuda:nccl",
                     "one GPU per process")


def launcher_placement(rank: int, world_size: int, local_rank: int,
                       local_world_size: int | None = None, on: str = "auto",
                       num_gpus: int | None = None) -> tuple[torch.device, str]:
    """(device, backend) of a process started by a launcher (torchrun, mpirun, srun):
    GPU ``local_rank`` when this node has a GPU for each of its ``local_world_size``
    processes, else the CPU. Every node decides alone, so nodes with too few GPUs must
    be told ``on="cpu"`` (the ``--device cpu`` of :mod:`dpbook.torch.ddp`)."""
    local_world_size = world_size if local_world_size is None else local_world_size
    node = placement(local_world_size, on, num_gpus)
    return node.device(local_rank), node.backend


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 300,
          start_method: str = "spawn") -> None:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` new processes and wait for all of them.

    This process hosts the rendezvous: a ``TCPStore`` on 127.0.0.1 and a port the system
    picks while binding it, so no other program can take the port between the choice and
    the bind (as it can with a port picked first and bound later by rank 0). The children
    find it in ``MASTER_ADDR``/``MASTER_PORT`` (set for them only) and join it as clients
    (:func:`init_process`). Raises the first child's error, or ``TimeoutError``
    after ``timeout`` seconds; either way no child is left running. ``start_method`` is
    multiprocessing's: ``spawn`` starts fresh interpreters (each imports torch anew),
    ``forkserver`` forks them from a server that imported what
    ``multiprocessing.set_forkserver_preload`` named, once.
    """
    if nprocs < 1:
        raise ValueError(f"need at least one process, got {nprocs}")
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout),
                          wait_for_workers=False)          # port 0: the system picks one
    context = None
    try:
        # The port travels as an argument, not in this process's environment: a fork
        # server started by an earlier call would hand its children that call's port.
        context = mp.start_processes(_joining_the_store, nprocs=nprocs, join=False,
                                     args=(store.port, fn, nprocs, *args),
                                     start_method=start_method)
        deadline = time.monotonic() + timeout
        while not context.join(timeout=0.5):     # raises if a child failed
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} processes still running after {timeout} s")
    finally:
        # reap everything, whatever happened
        for p in context.processes if context else ():
            if p.is_alive():
                p.kill()
            p.join()
        del store


def _joining_the_store(rank: int, port: int, fn: Callable[..., Any], nprocs: int,
                       *args: Any) -> None:
    """A child of :func:`spawn`: point ``MASTER_ADDR``/``MASTER_PORT`` at the parent's
    store (:func:`init_process` joins it as a client), then run ``fn(rank, nprocs, *args)``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{_HOSTED: str(port)})
    fn(rank, nprocs, *args)


# Set in a child of `run` (the parent decided where every rank goes); read by init_process.
_RUN_PLACEMENT: Placement | None = None
_SAID: set[str] = set()          # placements already printed in this process


def _run_child(rank: int, nprocs: int, worker: Callable[..., Any], where: Placement,
               folder: str, keep: bool, args: tuple) -> None:
    """What every process of :func:`run` does: call the worker, save what it returned."""
    global _RUN_PLACEMENT
    _RUN_PLACEMENT = where
    result = worker(rank, nprocs, *args)
    if keep or rank == 0:
        torch.save(result, os.path.join(folder, f"rank-{rank}.pt"))
    # Leave without the interpreter's teardown: there, a gloo thread that still holds a
    # finished collective's tensors can need the GIL and abort the process ("terminate
    # called without an active exception", now and then, with torch 2.8 and 2.14;
    # pytorch/pytorch#179291). The result is saved; exit code 0 tells `spawn` so.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(worker: Callable[..., Any], nprocs: int, *args: Any, on: str = "auto",
        ranks: str = "first", timeout: float = 300, verbose: bool = True) -> Any:
    """Start ``worker(rank, nprocs, *args)`` in ``nprocs`` processes (:func:`spawn`) and
    return what rank 0's worker returned, or with ``ranks="all"`` a list of what every
    rank returned.

    Where the processes run is :func:`placement`'s decision for ``on``; with ``verbose``
    it is printed the first time this process sees it. Results travel back through
    ``torch.save``, so tensors, dicts and dataclasses arrive as they were (CUDA tensors
    on the CPU).
    """
    if ranks not in ("first", "all"):
        raise ValueError(f"ranks must be 'first' or 'all', not {ranks!r}")
    where = placement(nprocs, on)
    if verbose and str(where) not in _SAID:
        _SAID.add(str(where))
        print(where, flush=True)
    with tempfile.TemporaryDirectory() as folder:
        spawn(_run_child, nprocs, worker, where, folder, ranks == "all", args,
              timeout=timeout)
        load = [os.path.join(folder, f"rank-{r}.pt")
                for r in (range(nprocs) if ranks == "all" else [0])]
        results = [torch.load(path, map_location="cpu", weights_only=False)
                   for path in load]
    return results if ranks == "all" else results[0]


def init_process(rank: int, world_size: int, local_rank: int | None = None,
                 timeout: float = 120, on: str = "auto") -> torch.device:
    """Join the process group (rendezvous at ``MASTER_ADDR:MASTER_PORT``); return our device.

    In a process of :func:`run` the device and backend are the ones :func:`placement`
    chose in the parent; under a launcher they come from :func:`launcher_placement`
    (``LOCAL_WORLD_SIZE`` processes on this node, ``on`` as asked).
    """
    if _RUN_PLACEMENT is not None:
        device, backend = _RUN_PLACEMENT.device(rank), _RUN_PLACEMENT.backend
    else:
        local_rank = rank if local_rank is None else local_rank
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        device, backend = launcher_placement(rank, world_size, local_rank, local_world_size,
                                             on)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout)
    # device_id binds NCCL to this rank's GPU at once (without it NCCL warns once per
    # rank that it does not know the device, and connects at the first collective)
    store = _attempt_store(rank, world_size, timeout) or _hosted_store(timeout)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            store=store,
                            device_id=device if device.type == "cuda" else None)
    return device


@contextlib.contextmanager
def process_group(rank: int, world_size: int, local_rank: int | None = None,
                  threads: int | None = 1, timeout: float = 120,
                  on: str = "auto") -> Iterator[torch.device]:
    """``with process_group(rank, world_size) as device:`` joins the group
    (:func:`init_process`) and leaves it at the end, whatever happens inside.

    On a CPU each process uses ``threads`` threads (default 1: the processes share the
    machine's cores; ``None`` leaves PyTorch's default).
    """
    device = init_process(rank, world_size, local_rank, timeout, on)
    try:
        if device.type == "cpu" and threads is not None:
            torch.set_num_threads(threads)
        yield device
    finally:
        dist.destroy_process_group()


def per_process(batch_size: int, nprocs: int) -> int:
    """Each process's share of a global batch of ``batch_size`` examples; a batch that
    does not divide evenly is refused (every demo here gives every process as many).

    >>> per_process(256, 4)
    64
    """
    if nprocs < 1 or batch_size % nprocs:
        raise ValueError(f"batch size {batch_size} does not divide by {nprocs} processes")
    return batch_size // nprocs


def group_devices(device: torch.device) -> list[torch.device]:
    """The device of every rank of the group, in rank order (a collective: every rank
    calls it with its own device). What a hardware line of the group should list."""
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, str(device))
    return [torch.device(d) for d in everyone]


def slowest_seconds(fn: Callable[[], Any], device: torch.device | None = None) -> float:
    """Call ``fn()`` on every process of the group, started together (a barrier), and
    return the seconds the *slowest* process took: a collective step is only as fast as
    its slowest member. Waits for this process's GPU (``device``, default the current
    one when this process uses CUDA) before reading the clock."""
    if device is None:
        on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
    dist.barrier()
    tik = time.perf_counter()
    fn()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    took = torch.tensor([time.perf_counter() - tik], dtype=torch.float64)  # gloo's part
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _hosted_store(timeout: datetime.timedelta):
    """In a child of :func:`spawn`, a client of the store its parent hosts, with keys
    private to this group (a worker may join and leave more than one); else ``None``.

    The groups are told apart by how many this process has joined, so every rank must
    join the same groups in the same order (every worker of the book does); a group that
    only some ranks join would wait for the others until ``timeout``."""
    global _GROUPS
    port = os.environ.get("MASTER_PORT")
    if port is None or os.environ.get(_HOSTED) != port:
        return None
    _GROUPS += 1
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(port), None, False, timeout)
    return dist.PrefixStore(f"dpbook/group-{_GROUPS}", store)


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

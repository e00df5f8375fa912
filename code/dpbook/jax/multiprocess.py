"""Data parallelism over several JAX processes (one per machine), with ``jax.distributed``.

Run one process per machine, each with its own ``--process-id``; here, two processes on
this machine with two emulated CPU devices each make four global devices::

    python -m dpbook.jax.multiprocess --coordinator 127.0.0.1:1234 --num-processes 2 --process-id 0 &
    python -m dpbook.jax.multiprocess --coordinator 127.0.0.1:1234 --num-processes 2 --process-id 1

Every process runs the same program (JAX's multi-controller model). Each one loads only
its own part of the global minibatch; ``jax.make_array_from_process_local_data`` makes
the pieces one global array sharded over all devices, and one jitted SGD step — with the
all-reduce XLA inserts, across processes — updates the replicated parameters. Each
process then checks the step against a single-device step on the whole minibatch.

It is a script: :func:`worker` sets the number of emulated CPU devices and the CPU
collectives, which JAX reads once, before its backend starts. Start it in a fresh process
without ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .. import data as _data
from .data import to_arrays

__all__ = ["worker", "command", "main"]


def command(coordinator: str, num_processes: int, process_id: int, local_devices: int = 2,
            batch_size: int = 64, out: str | None = None) -> list[str]:
    """The command line that starts process ``process_id`` (for ``dpbook.launch.run_local``)."""
    cmd = [sys.executable, "-m", "dpbook.jax.multiprocess", "--coordinator", coordinator,
           "--num-processes", str(num_processes), "--process-id", str(process_id),
           "--local-devices", str(local_devices), "--batch-size", str(batch_size)]
    return cmd + (["--out", out] if out else [])


def worker(coordinator: str, num_processes: int, process_id: int, local_devices: int = 2,
           batch_size: int = 64, lr: float = 0.3, root: str | None = None,
           timeout: int = 60) -> dict:
    """One process: join the group, take one data-parallel step, compare with one device."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from . import scratch
    from .devices import hardware_line

    # Before JAX creates its CPU backend: the emulated devices of this process, and gloo
    # for the collectives between CPU processes (GPUs would use NCCL). CPU devices even on
    # a machine with GPUs, so that every machine runs (and checks) the same 2 x 2 devices.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout)
    try:
        devices = jax.devices()                   # global: every process's devices
        if batch_size % (num_processes * len(jax.local_devices())):
            raise ValueError(f"batch {batch_size} does not divide by {len(devices)} devices")
        mesh = Mesh(np.array(devices), ("data",))
        replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

        # The same global minibatch in every process (first examples of Fashion-MNIST)…
        X_all, y_all, _, _ = _data.read_fashion_mnist(root)
        X, y = to_arrays(X_all[:batch_size], y_all[:batch_size])   # (B, 28, 28, 1), (B,)
        # …of which this process holds, and loads onto its devices, only its own rows.
        per_process = batch_size // num_processes
        rows = slice(process_id * per_process, (process_id + 1) * per_process)
        X_global = jax.make_array_from_process_local_data(sharded, X[rows], X.shape)
        y_global = jax.make_array_from_process_local_data(sharded, y[rows], y.shape)

        init = scratch.init_lenet_params(jax.random.key(0))
        host_params = [np.asarray(p) for p in init]
        params = [jax.make_array_from_process_local_data(replicated, p, p.shape)
                  for p in host_params]

        @jax.jit
        def step(params, X, y):
            grads = jax.grad(scratch.loss_fn)(params, X, y)   # XLA adds the all-reduce
            return [p - lr * g / X.shape[0] for p, g in zip(params, grads)]

        new = jax.block_until_ready(step(params, X_global, y_global))
        mine = [np.asarray(p.addressable_data(0)) for p in new]

        # The reference: one step of the whole minibatch on one local device.
        local = jax.local_devices()[0]
        [ref], _ = scratch.train_batch(X, y, [scratch.get_params(host_params, local)],
                                       [local], lr)
        diff = max(float(np.abs(a - np.asarray(b)).max()) for a, b in zip(mine, ref))
        return {"process_id": process_id, "num_processes": jax.process_count(),
                "local_devices": [str(d) for d in jax.local_devices()],
                "global_devices": [str(d) for d in devices],
                "rows": [rows.start, rows.stop], "batch_size": batch_size,
                "max_difference": diff, "hardware": hardware_line(devices)}
    finally:
        jax.distributed.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpbook.jax.multiprocess",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", required=True, help="host:port of process 0")
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--local-devices", type=int, default=2,
                        help="emulated CPU devices in this process")
    parser.add_argument("--batch-size", type=int, default=64, help="the global minibatch")
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--data", default=None, help="Fashion-MNIST folder")
    parser.add_argument("--out", default=None, help="write the result here (JSON)")
    parser.add_argument("--timeout", type=int, default=60,
                        help="seconds to wait for the other processes")
    args = parser.parse_args(argv)
    result = worker(args.coordinator, args.num_processes, args.process_id,
                    args.local_devices, args.batch_size, args.lr, args.data, args.timeout)
    line = (f"process {result['process_id']}/{result['num_processes']}: "
            f"local {result['local_devices']}, rows {result['rows'][0]}:{result['rows'][1]} "
            f"of {result['batch_size']}; {len(result['global_devices'])} global devices; "
            f"step vs one device: max difference {result['max_difference']:.1e}")
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

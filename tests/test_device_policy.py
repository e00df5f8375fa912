"""The device policy (dpbook.torch.dist.placement) on simulated machines: 0, 1, 2 and 8
GPUs, without a GPU. Every multi-process demo of the book is started with
``torch.cuda.device_count`` patched and ``dist.spawn`` replaced by a stand-in that keeps
where the processes would run and stops there; the test checks the backend and the
device of every rank. No rank may ask for a GPU that does not exist, two ranks never
share a GPU, and a demo that moves CPU tensors never gets a group without gloo."""
from __future__ import annotations

import pytest
import torch

from dpbook.torch import (accumulation, allreduce, ddp_by_hand, ddp, ddp_check, ddp_knobs,
                          dist, fsdp, messages, precision, profiling, ps, unequal, zero)

GPUS = (0, 1, 2, 8)


class _Started(Exception):
    """Raised by the stand-in spawn: the processes would start now."""


# name → (how the chapter starts it, number of processes, on): "cpu" demos move CPU
# tensors or are about CPU processes; "auto" demos use a GPU per process when they can.
DEMOS = {
    "allreduce.check": (lambda: allreduce.check(4), 4, "cpu"),
    "allreduce.benchmark": (lambda: allreduce.benchmark(2, [1024]), 2, "cpu"),
    "messages.record": (lambda: messages.record("ring", 4), 4, "cpu"),
    "ps.run_ps": (lambda: ps.run_ps([ps.PSConfig()], num_workers=2), 3, "cpu"),
    "unequal.compare_splits": (lambda: unequal.compare_splits([1, 2]), 2, "cpu"),
    "zero.compare": (lambda: zero.compare(3), 3, "cpu"),
    "fsdp.compare": (lambda: fsdp.compare(2), 2, "cpu"),
    "ddp_by_hand.compare": (lambda: ddp_by_hand.compare(3), 3, "auto"),
    "ddp_by_hand.benchmark": (lambda: ddp_by_hand.benchmark(2), 2, "auto"),
    "profiling.profile": (lambda: profiling.profile(2), 2, "auto"),
    "accumulation.compare": (lambda: accumulation.compare(2), 2, "auto"),
    "precision.compare": (lambda: precision.compare(2), 2, "auto"),
    "ddp_knobs.compare": (lambda: ddp_knobs.compare(2), 2, "auto"),
    "ddp_knobs.unused_parameters": (lambda: ddp_knobs.unused_parameters(2), 2, "auto"),
    "ddp_check.ddp_step_difference": (lambda: ddp_check.ddp_step_difference(2), 2, "auto"),
    "ddp_check.sync_batchnorm_status": (lambda: ddp_check.sync_batchnorm_status(2), 2, "auto"),
    "ddp.spawn_train": (lambda: ddp.spawn_train(4, ddp.Config(model="lenet")), 4, "auto"),
    "ddp.spawn_train(device=cpu)": (
        lambda: ddp.spawn_train(2, ddp.Config(model="lenet", device="cpu")), 2, "cpu"),
}


@pytest.fixture
def machine(monkeypatch):
    """``machine(g)``: torch sees ``g`` GPUs; ``dist.spawn`` records and stops."""
    started = []

    def fake_spawn(fn, nprocs, *args, **kwargs):
        assert fn is dist._run_child
        started.append((nprocs, args[1]))          # args: worker, placement, folder, ...
        raise _Started

    def simulate(num_gpus):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: num_gpus > 0)
        monkeypatch.setattr(dist, "spawn", fake_spawn)
        return started
    return simulate


def _check(where: dist.Placement, nprocs: int, on: str, num_gpus: int) -> None:
    assert where.nprocs == nprocs
    gpus = [d for d in where.devices if d != "cpu"]
    assert len(set(gpus)) == len(gpus), f"two ranks share a GPU: {where.devices}"
    assert all(int(d.split(":")[1]) < num_gpus for d in gpus), where.devices
    if on == "cpu" or num_gpus < nprocs:
        assert where.devices == ("cpu",) * nprocs and where.backend == "gloo", where
    else:                                          # a GPU each, and gloo for CPU tensors
        assert where.devices == tuple(f"cuda:{r}" for r in range(nprocs))
        assert where.backend == "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize("num_gpus", GPUS)
@pytest.mark.parametrize("demo", DEMOS)
def test_every_demo_runs_where_the_policy_says(demo, num_gpus, machine, capsys,
                                              monkeypatch):
    start, nprocs, on = DEMOS[demo]
    started = machine(num_gpus)
    monkeypatch.setattr(dist, "_SAID", set())     # run() prints its decision afresh
    with pytest.raises(_Started):
        start()
    [(n, where)] = started
    assert n == nprocs
    _check(where, nprocs, on, num_gpus)
    assert capsys.readouterr().out == f"{where}\n"


@pytest.mark.parametrize("num_gpus", GPUS)
def test_the_printed_line_says_where_and_why(num_gpus):
    line = str(dist.placement(4, num_gpus=num_gpus))
    if num_gpus >= 4:
        assert line == ("4 processes on cuda:0, cuda:1, cuda:2, cuda:3 (NCCL; gloo for CPU "
                        "tensors): one GPU per process")
    elif num_gpus:
        assert line == (f"4 processes on the CPU (gloo): this machine has {num_gpus} GPU"
                        f"{'s' if num_gpus > 1 else ''}, fewer than 4")
    else:
        assert line == "4 processes on the CPU (gloo): this machine has no GPU"
    cpu = str(dist.placement(2, "cpu", num_gpus=num_gpus))
    assert cpu.startswith("2 processes on the CPU (gloo): this demo runs CPU processes")


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="at least one process"):
        dist.placement(0)
    with pytest.raises(ValueError, match="on must be one of"):
        dist.placement(2, "gpu")
    with pytest.raises(ValueError, match="ranks must be"):
        dist.run(print, 2, ranks="some")


@pytest.mark.parametrize("num_gpus", GPUS)
def test_a_child_joins_with_the_parents_decision(num_gpus, monkeypatch):
    """What ``init_process`` does in a process of ``run``: the rank's device and the
    group's backend come from the parent's placement; CUDA is touched only for a GPU."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend)))
    where = dist.placement(2, num_gpus=num_gpus)
    monkeypatch.setattr(dist, "_RUN_PLACEMENT", where)
    device = dist.init_process(1, 2)
    assert device == where.device(1)
    assert ("init", where.backend) in calls
    assert any(c[0] == "set_device" for c in calls) == (device.type == "cuda")


@pytest.mark.parametrize("num_gpus", GPUS)
@pytest.mark.parametrize("nproc_per_node", (1, 2, 8))
def test_launched_processes(num_gpus, nproc_per_node):
    """Under torchrun: local rank r takes GPU r when the node has a GPU per process."""
    for local_rank in range(nproc_per_node):
        device, backend = dist.launcher_placement(local_rank, nproc_per_node, local_rank,
                                                  nproc_per_node, num_gpus=num_gpus)
        if num_gpus >= nproc_per_node:
            assert device == torch.device("cuda", local_rank)
            assert backend == "cpu:gloo,cuda:nccl"
        else:
            assert device == torch.device("cpu") and backend == "gloo"
        # two "nodes" on one machine are told --device cpu: they never share a GPU
        device, backend = dist.launcher_placement(local_rank, 2 * nproc_per_node, local_rank,
                                                  nproc_per_node, on="cpu",
                                                  num_gpus=num_gpus)
        assert device == torch.device("cpu") and backend == "gloo"

"""Concise data parallelism in PyTorch: DataParallel (dpbook.torch.concise) and DDP
(dpbook.torch.ddp, several gloo processes on loopback)."""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch
from torch import nn

from book import ROOT
from dpbook import torch as dp
from dpbook.torch import concise, ddp, ddp_check, dist

pytestmark = pytest.mark.multiprocess     # every test leaves no process behind

CPU = torch.device("cpu")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(),
                             reason="checks what nn.DataParallel does without CUDA")


@pytest.mark.pins         # pins a framework's behaviour (see pytest.ini)
@NO_CUDA
def test_data_parallel_is_a_no_op_on_cpu():
    """Sentinel: if PyTorch ever makes DataParallel do something on CPUs, the book must change."""
    torch.manual_seed(0)
    module = dp.lenet()
    net = nn.DataParallel(module, device_ids=[CPU, CPU])
    assert net.device_ids == []
    X = torch.rand(6, 1, 28, 28)
    assert torch.equal(net(X), module(X))
    assert "device_ids=[]" in concise.data_parallel_info(net)
    assert "plain module" in concise.data_parallel_info(module)


def test_init_resnet18_is_reproducible():
    a, b = concise.init_resnet18(4, seed=3), concise.init_resnet18(4, seed=3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = concise.init_resnet18(4, seed=4)
    assert not torch.equal(a["0.weight"], c["0.weight"])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_evaluate_accuracy_gpus_equals_one_device(k):
    torch.manual_seed(0)
    net = dp.resnet18(width=4)
    net.train()
    data = [(torch.rand(10, 1, 28, 28), torch.randint(0, 10, (10,))) for _ in range(3)]
    acc = dp.evaluate_accuracy_gpus(net, data, [CPU] * k)
    assert acc == pytest.approx(dp.evaluate_accuracy(net, data, CPU))
    assert net.training, "the network's mode is restored"


def test_train_smoke_same_init_same_losses_on_cpu(fashion_mnist_dir):
    """A smoke test of ``concise.train``: without CUDA it trains the plain module (what
    ``nn.DataParallel`` would run), so runs asked for 1 and 2 devices are the same
    computation from the same initial state, and each says so."""
    scale = dp.get_scale("quick")
    init = concise.init_resnet18(scale.resnet_width, seed=0)
    runs = [concise.train(k, 64, 0.1, init_state=init, scale=scale, root=fashion_mnist_dir,
                          animator=dp.Animator(legend=["train loss", "test acc"], path=False,
                                               live=False)) for k in (1, 2)]
    for r in runs:
        assert len(r.epoch_times) == scale.resnet_epochs and 0.1 <= r.test_acc <= 1
        assert "devices (" in r.hardware
    if not torch.cuda.is_available():   # on a CPU both runs are the same computation
        assert runs[0].train_loss == pytest.approx(runs[1].train_loss, rel=1e-6)
        assert all(r.extra["replicas"] == 1 and not isinstance(r.model, nn.DataParallel)
                   and "no GPU" in r.extra["data_parallel"] for r in runs)
    else:                               # on GPUs the wrapper runs, over distinct GPUs
        for k, r in zip((1, 2), runs):
            assert isinstance(r.model, nn.DataParallel)
            assert r.extra["replicas"] == min(k, torch.cuda.device_count())
            assert "nn.DataParallel" in r.extra["data_parallel"]


# --- DistributedDataParallel: real processes, gloo on loopback -------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs, batch_size", [(2, 64), (3, 48)])
def test_ddp_step_equals_single_process_step(nprocs, batch_size):
    diff = ddp_check.ddp_step_difference(nprocs, "lenet", batch_size=batch_size)
    assert diff["whole"] < 1e-6     # DDP averages the same gradients; float32 rounding only
    assert diff["shards"] < 1e-6    # without BatchNorm, shards change nothing


@pytest.mark.timeout(300)
def test_ddp_with_batchnorm_normalizes_each_shard():
    diff = ddp_check.ddp_step_difference(2, "resnet18", batch_size=32)
    assert diff["shards"] < 1e-5 < diff["whole"]   # local BatchNorm statistics per process


@pytest.mark.timeout(300)
def test_spawn_train_checkpoint_and_resume(fashion_mnist_dir, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    cfg = ddp.Config(model="lenet", epochs=1, batch_size=64, scale="quick", max_steps=4,
                     data=str(fashion_mnist_dir), checkpoint=str(ckpt))
    first = ddp.spawn_train(2, cfg)
    assert first["world_size"] == 2 and first["backend"] == "gloo"
    assert [h["epoch"] for h in first["history"]] == [1]
    saved = torch.load(ckpt)
    assert saved["epoch"] == 1
    resumed = ddp.spawn_train(2, ddp.Config(**{**cfg.__dict__, "epochs": 2, "resume": True}))
    assert [h["epoch"] for h in resumed["history"]] == [2]     # epoch 1 is not redone
    assert torch.load(ckpt)["epoch"] == 2


def test_script_flags_round_trip():
    """The script's command line is written out; Config.to_args is its inverse."""
    fields = {f.name for f in dataclasses.fields(ddp.Config)}
    defaults = vars(ddp.parser().parse_args([]))
    assert defaults.pop("nprocs") is None and set(defaults) == fields
    assert ddp.Config(**defaults) == ddp.Config()
    cfg = ddp.Config(model="lenet", batch_size=64, lr=0.3, epochs=2, scale="quick",
                     resume=True, comm_hook="2bit", threshold=0.02, data="/data", crash_rank=1)
    args = vars(ddp.parser().parse_args(cfg.to_args()))
    args.pop("nprocs")
    assert ddp.Config(**args) == cfg
    with pytest.raises(SystemExit):
        ddp.parser().parse_args(["--model", "vgg"])        # a typo fails at once


def _leaves_on_error(rank, world_size):
    import torch.distributed
    try:
        with dist.process_group(rank, world_size):
            assert torch.distributed.is_initialized()
            raise KeyError("inside the block")
    except KeyError:
        pass
    return torch.distributed.is_initialized()


@pytest.mark.timeout(120)
def test_process_group_is_left_even_on_error():
    assert dist.run(_leaves_on_error, 2, timeout=60) is False


def _sleeper(rank, world_size):
    time.sleep(60)


def _failer(rank, world_size):
    if rank == 1:
        raise RuntimeError("worker 1 fails on purpose")
    time.sleep(60)


def _two_groups(rank, world_size):
    sums = []
    for _ in range(2):                       # join, leave, join again: keys must not clash
        with dist.process_group(rank, world_size):
            x = torch.tensor([rank + 1.0])
            torch.distributed.all_reduce(x)
            sums.append(x.item())
    return sums, os.environ["MASTER_PORT"]


@pytest.mark.timeout(120)
def test_spawn_hosts_the_rendezvous_on_a_bound_port():
    """The parent binds the store's port before a child starts: nothing can take it in
    between (CI once lost a port picked early to another test's connection)."""
    ports = []
    real = torch.distributed.TCPStore

    def recording(*args, **kwargs):
        store = real(*args, **kwargs)
        ports.append(store.port)
        return store

    with mock.patch.object(torch.distributed, "TCPStore", recording):
        sums, port = dist.run(_two_groups, 2, on="cpu", timeout=60, verbose=False)
    assert sums == [3.0, 3.0]
    assert ports and int(port) == ports[0] != 0
    assert "MASTER_PORT" not in os.environ or os.environ["MASTER_PORT"] != port


def _port_of_the_store(rank, world_size):
    with dist.process_group(rank, world_size):
        x = torch.tensor([1.0])
        torch.distributed.all_reduce(x)
    assert x.item() == world_size


@pytest.mark.timeout(180)
def test_spawn_twice_through_one_fork_server():
    """A fork server outlives the call that started it and its children inherit its
    environment: the second call's children must still find the second call's store (the
    port travels as an argument, not in the environment)."""
    from dpbook.torch import exercises
    with exercises._forkserver() as method:     # the book's user of a fork server
        if method != "forkserver":
            pytest.skip("no forkserver start method on this platform")
        for _ in range(2):
            dist.spawn(_port_of_the_store, 2, timeout=90, start_method=method)


@pytest.mark.timeout(120)
def test_spawn_times_out_and_reaps():
    tik = time.monotonic()
    with pytest.raises(TimeoutError):
        dist.spawn(_sleeper, 2, timeout=3)
    assert time.monotonic() - tik < 30


@pytest.mark.timeout(120)
def test_spawn_reports_a_failing_worker_and_reaps():
    with pytest.raises(Exception, match="worker 1 fails on purpose"):
        dist.spawn(_failer, 2, timeout=60)


@pytest.mark.timeout(300)
def test_torchrun_command_line(fashion_mnist_dir):
    env = dict(os.environ, DPBOOK_DATA=str(fashion_mnist_dir), DPBOOK_SCALE="quick")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "dpbook.torch.ddp", "--model", "lenet", "--epochs", "1", "--max-steps", "3",
           "--batch-size", "64"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rank 1/" not in result.stdout
    assert "[rank 0/2] epoch 1, first 3 of " in result.stdout     # says it stopped early
    assert "hardware | " in result.stdout


# --- The minimal DDP script, shown whole where the chapter's DDP part starts ---------

MINIMAL = ROOT / "code/dpbook/torch/ddp_minimal.py"


def test_minimal_ddp_script_is_short_and_shown_whole():
    lines = MINIMAL.read_text(encoding="utf8").splitlines()
    assert len(lines) <= 30, f"{len(lines)} lines: the page promises a short script"
    assert max(map(len, lines)) <= 80         # fits the site's code column unwrapped
    for lang in ("en", "zh"):
        page = (ROOT / f"chapters/{lang}/concise/pytorch.md").read_text(encoding="utf8")
        assert ("```{literalinclude} ../../../code/dpbook/torch/ddp_minimal.py\n```"
                in page)                                   # the whole file, no :lines:
        assert ("torchrun --standalone --nproc_per_node=2 -m dpbook.torch.ddp_minimal"
                in page)                                   # the command line, shown


def _run_minimal(nprocs: int, data_dir, **env) -> list[float]:
    """Run the script with torchrun at the quick scale; return rank 0's losses."""
    env = dict(os.environ, DPBOOK_DATA=str(data_dir), DPBOOK_SCALE="quick", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nprocs}", "-m", "dpbook.torch.ddp_minimal"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # one line per epoch, from rank 0 alone: "epoch 1: loss 2.2876 (rank 0)"
    epochs = [line.split(":")[0] for line in lines]
    assert epochs == ["epoch 1", "epoch 2", "epoch 3"], lines
    assert all(line.endswith("(rank 0)") for line in lines), lines
    return [float(line.split()[3]) for line in lines]


def _learns(losses: list[float]) -> bool:
    falls = losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.05
    return all(math.isfinite(v) for v in losses) and falls


@pytest.mark.timeout(300)
def test_minimal_ddp_script_trains_with_torchrun_on_cpus(fashion_mnist_dir):
    """Two gloo processes on the CPU (GPUs hidden): rank 0 alone prints; the loss
    falls."""
    losses = _run_minimal(2, fashion_mnist_dir, CUDA_VISIBLE_DEVICES="")
    assert _learns(losses), losses


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_minimal_ddp_script_trains_with_torchrun_on_gpus(fashion_mnist_dir):
    """NCCL, one process per GPU (at most two), each on the GPU of its LOCAL_RANK."""
    losses = _run_minimal(min(torch.cuda.device_count(), 2), fashion_mnist_dir)
    assert _learns(losses), losses


@pytest.mark.pins         # pins a framework's behaviour (see pytest.ini)
@NO_CUDA
@pytest.mark.timeout(120)
def test_sync_batchnorm_needs_a_gpu():
    """Sentinel: SyncBatchNorm refuses CPU tensors (the chapter says it is GPU only); on a
    machine with a GPU for each process the group runs on them and it works."""
    import torch
    status = ddp_check.sync_batchnorm_status(2)
    assert status == "ok" if torch.cuda.device_count() >= 2 else "GPU" in status, status

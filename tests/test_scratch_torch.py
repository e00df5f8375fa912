"""From-scratch data parallelism in PyTorch (dpbook.torch.scratch)."""
from __future__ import annotations

import pytest
import torch

from dpbook import torch as dp
from dpbook.torch import scratch
from dpbook.torch.data import random_batch as batch

CPU = torch.device("cpu")
# k devices sum gradients in another order than one device: float32 rounding only.
TOL = 1e-5


def devices_for(k):
    return dp.get_devices(k) if torch.cuda.device_count() >= k else [CPU] * k


def test_lenet_by_hand_equals_nn_lenet():
    params = scratch.init_lenet_params(0)
    assert sum(p.numel() for p in params) == dp.num_params(dp.lenet()) == 129_068
    assert not params[6].any(), "the output layer starts at zero"
    g = torch.Generator().manual_seed(1)
    params = [p + 0.1 * torch.randn(p.shape, generator=g) for p in params]  # every layer matters
    net = dp.lenet()
    layers = [m for m in net if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    with torch.no_grad():
        for layer, (W, b) in zip(layers, zip(params[::2], params[1::2])):
            layer.weight.copy_(W if W.dim() == 4 else W.T)
            layer.bias.copy_(b)
    X, _ = batch(8)
    torch.testing.assert_close(scratch.lenet_forward(X, params), net(X))


def test_get_params_makes_real_copies():
    params = scratch.init_lenet_params(0)
    replicas = [scratch.get_params(params, CPU) for _ in range(3)]
    for i, p in enumerate(params):
        ptrs = {p.data_ptr()} | {r[i].data_ptr() for r in replicas}
        assert len(ptrs) == 4, "replicas must not share memory with each other or the source"
        assert all(r[i].requires_grad and r[i].is_leaf for r in replicas)
    with torch.no_grad():
        replicas[0][0].add_(1)
    assert not torch.equal(replicas[0][0], replicas[1][0])


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_allreduce_updates_every_tensor(k):
    data = [torch.full((2, 3), float(i + 1), device=d) for i, d in enumerate(devices_for(k))]
    originals = list(data)                      # the same tensor objects
    scratch.allreduce(data)
    expected = k * (k + 1) / 2
    for t in originals:                         # check each device's own tensor
        assert torch.equal(t.cpu(), torch.full((2, 3), expected))
    assert all(a is b for a, b in zip(data, originals)), "allreduce works in place"


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [64, 30])        # 30 does not divide by 4 or 8
def test_k_device_step_equals_one_device_step(k, n):
    X, y = batch(n, seed=k)
    g = torch.Generator().manual_seed(k)
    # Random weights (not the zero output layer of the init), so every layer gets a gradient.
    init = [p + 0.1 * torch.randn(p.shape, generator=g) for p in scratch.init_lenet_params(1)]
    reference = [scratch.get_params(init, CPU)]
    ref_loss = scratch.train_batch(X, y, reference, [CPU], lr=0.3)
    devices = devices_for(k)
    replicas = [scratch.get_params(init, d) for d in devices]
    loss = scratch.train_batch(X, y, replicas, devices, lr=0.3)
    for ref, p in zip(reference[0], replicas[0]):
        torch.testing.assert_close(p.detach().cpu(), ref.detach(), atol=TOL, rtol=0)
    for replica in replicas[1:]:                # replicas stay identical, bit for bit
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(replica, replicas[0]))
    assert all(not torch.equal(a, b) for a, b in zip(replicas[0], init))  # every param moved
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)   # the summed batch loss


def test_train_runs_and_matches_across_device_counts(fashion_mnist_dir):
    scale = dp.get_scale("quick")
    results = [scratch.train(k, 128, 0.3, num_epochs=2, scale=scale, root=fashion_mnist_dir,
                             animator=dp.Animator(legend=["train loss", "test acc"],
                                                     path=False, live=False)) for k in (1, 2)]
    for r in results:
        assert set(r.animator.series()) == {"train loss", "test acc"}
        losses = r.animator.series()["train loss"][1]
        assert len(losses) == 2 and losses[1] < losses[0]
        assert 0.2 < r.test_acc <= 1 and len(r.epoch_times) == 2   # chance: 0.1
        assert "devices (" in r.hardware
    # Same data, same initial parameters, equivalent steps: the first epoch's losses agree
    # to rounding. (Later epochs may drift apart: training amplifies 1e-7 differences.)
    first = [r.animator.series()["train loss"][1][0] for r in results]
    assert first[0] == pytest.approx(first[1], rel=1e-5)

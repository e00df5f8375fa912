"""dpbook.torch: devices, batch splitting, models, data loaders, evaluation."""
from __future__ import annotations

import pytest
import torch

from dpbook import torch as dp
from dpbook.data import FASHION_MNIST_MEAN, FASHION_MNIST_STD

from helpers import PARAMS, RESNET18_PARAMS   # pinned: a model change must be deliberate


def test_try_gpu_falls_back_to_cpu():
    n = torch.cuda.device_count()
    assert dp.try_gpu(n) == torch.device("cpu")         # GPU n never exists
    devices = dp.try_all_gpus()
    assert devices, "try_all_gpus must never return an empty list"
    if n == 0:
        assert devices == [torch.device("cpu")] and dp.try_gpu() == torch.device("cpu")
    else:
        assert devices == [torch.device(f"cuda:{i}") for i in range(n)]


def test_get_devices(monkeypatch):
    monkeypatch.delenv("DPBOOK_NUM_DEVICES", raising=False)
    n = torch.cuda.device_count()
    assert len(dp.get_devices()) == max(n, 2)
    monkeypatch.setenv("DPBOOK_NUM_DEVICES", "1")
    assert len(dp.get_devices()) == 1
    if n == 0:
        assert dp.get_devices(3) == [torch.device("cpu")] * 3
    with pytest.raises(ValueError):
        dp.get_devices(0)


@pytest.mark.parametrize("num_gpus", [1, 2])
def test_more_devices_than_gpus_are_replicas_that_share_them(monkeypatch, num_gpus):
    """One GPU still shows data parallelism: replica i goes to GPU i % g, and the reader
    is told that the replicas share a GPU (simulated GPUs: nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
    devices = dp.get_devices(3)
    assert devices == [torch.device(f"cuda:{i % num_gpus}") for i in range(3)]
    assert dp.devices_note(devices).startswith("3 replicas on cuda:0")
    assert dp.devices_note([torch.device(f"cuda:{i}") for i in range(num_gpus)]) is None
    monkeypatch.delenv("DPBOOK_NUM_DEVICES", raising=False)
    assert len(dp.get_devices()) == 2                        # one GPU: 2 replicas by default


@pytest.mark.parametrize("n, k, sizes", [(8, 2, [4, 4]), (10, 4, [3, 3, 2, 2]), (4, 4, [1] * 4)])
def test_split_batch(n, k, sizes):
    X = torch.arange(n * 3.0).reshape(n, 3)
    y = torch.arange(n)
    devices = dp.get_devices(k) if torch.cuda.device_count() >= k else [torch.device("cpu")] * k
    Xs, ys = dp.split_batch(X, y, devices)
    assert [len(x) for x in Xs] == [len(t) for t in ys] == sizes
    assert [x.device for x in Xs] == devices
    torch.testing.assert_close(torch.cat([x.cpu() for x in Xs]), X)   # order kept
    torch.testing.assert_close(torch.cat([t.cpu() for t in ys]), y)


def test_split_batch_refuses():
    cpu = [torch.device("cpu")] * 4
    with pytest.raises(ValueError, match="batch of 3"):
        dp.split_batch(torch.zeros(3, 2), torch.zeros(3), cpu)
    with pytest.raises(ValueError, match="X has 4 examples and y has 3"):
        dp.split_batch(torch.zeros(4, 2), torch.zeros(3), cpu)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_lenets(name):
    net = getattr(dp, name)()
    assert dp.num_params(net) == PARAMS[name]
    assert net(torch.zeros(5, 1, 28, 28)).shape == (5, 10)


@pytest.mark.parametrize("width", sorted(RESNET18_PARAMS))
def test_resnet18(width):
    net = dp.resnet18(num_classes=10, in_channels=1, width=width)
    assert dp.num_params(net) == RESNET18_PARAMS[width]
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    first = net[0]
    assert (first.kernel_size, first.stride) == ((3, 3), (1, 1))
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in net.modules())


def test_timer_synchronizes(monkeypatch):
    import dpbook.torch.devices as devices
    calls = []
    monkeypatch.setattr(devices, "synchronize", lambda r=None: calls.append(r))
    timer = dp.Timer()
    timer.stop()
    assert calls == [None, None]                 # before starting and before reading
    assert timer.times[0] >= 0


def test_hardware_line_names_devices_and_torch():
    line = dp.hardware_line([torch.device("cpu")] * 2)
    assert "devices (2): [cpu, cpu]" in line and f"torch {torch.__version__}" in line


def test_accuracy_and_evaluate():
    class Constant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, X):
            return torch.nn.functional.one_hot(torch.zeros(len(X), dtype=torch.long), 10).float()

    assert dp.accuracy(torch.eye(3), torch.tensor([0, 1, 0])) == 2.0
    X, y = torch.zeros(10, 1, 28, 28), torch.tensor([0] * 7 + [1] * 3)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=4)
    net = Constant().train()
    assert dp.evaluate_accuracy(net, data) == pytest.approx(0.7)
    assert net.training                         # restored after evaluation


def test_load_data_fashion_mnist(fashion_mnist_dir):
    train_iter, test_iter = dp.load_data_fashion_mnist(64, 256, 128, root=fashion_mnist_dir)
    X, y = next(iter(train_iter))
    assert X.shape == (64, 1, 28, 28) and X.dtype == torch.float32 and y.dtype == torch.int64
    assert 0 <= X.min() and X.max() <= 1
    assert len(train_iter.dataset) == 256 and len(test_iter.dataset) == 128
    again, _ = dp.load_data_fashion_mnist(64, 256, 128, root=fashion_mnist_dir)
    torch.testing.assert_close(next(iter(again))[0], X)    # same seed, same batches
    standard, _ = dp.load_data_fashion_mnist(64, 256, 128, root=fashion_mnist_dir,
                                             normalize=True)
    torch.testing.assert_close(next(iter(standard))[0],
                               (X - FASHION_MNIST_MEAN) / FASHION_MNIST_STD)


def test_building_the_books_models_leaves_the_readers_generator_alone():
    """The helpers that build a model from a seed (the concise chapter's ResNet state, the
    DDP script's model, the parameter server's MLP, the exercises' models) draw inside
    `seeded`, so a notebook's next random numbers do not depend on whether it called one."""
    from dpbook.torch import concise, ddp, exercises, ps, zero
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    concise.init_resnet18(4)
    ddp.build_model(ddp.Config(model="lenet"))
    ps.mlp(16)
    exercises._step_model(), exercises._accumulation_model()
    zero.reference(next(iter(zero.OPTIMIZERS)), 1, 6)
    assert torch.equal(torch.rand(3), expected)
    with dp.seeded(0):
        a = torch.rand(2)
    with dp.seeded(0):
        assert torch.equal(torch.rand(2), a)

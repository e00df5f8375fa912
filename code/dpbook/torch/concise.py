"""Concise data parallelism in PyTorch with ``nn.DataParallel``: the concise chapter's code.

``nn.DataParallel`` does in one wrapper what the from-scratch chapter wrote by hand: on
every forward pass it *scatters* the minibatch across its GPUs, *replicates* the module
onto each of them, runs the replicas in parallel threads and *gathers* the outputs on
the first GPU; backward sums the replicas' gradients into the original parameters.

Without CUDA it does none of this: ``DataParallel.__init__`` sets ``device_ids = []`` and
``forward`` just calls the module. :func:`data_parallel_info` detects that, so a chapter
run on a CPU says so instead of pretending.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from .. import config
from ..plot import Animator, training_animator
from ..tools import Accumulator, TrainResult
from .data import load_data_fashion_mnist
from .devices import Timer, get_devices, get_scale, hardware_line
from .models import resnet18, seeded
from .evaluate import evaluate_accuracy_gpus

__all__ = ["init_resnet18", "data_parallel_info", "train"]


def init_resnet18(width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The initial state of ``resnet18(width=width)`` drawn from ``seed`` (a state dict).

    Every run of the chapter loads this same state, so runs with different device counts
    or batch sizes start from identical parameters (d2l re-initialises between runs).
    """
    with seeded(seed):
        return copy.deepcopy(resnet18(width=width).state_dict())


def data_parallel_info(net: nn.Module) -> str:
    """Describe what ``net`` (maybe an ``nn.DataParallel``) really runs on."""
    if not isinstance(net, nn.DataParallel):
        return "a plain module: one device"
    if not net.device_ids:
        return ("nn.DataParallel with device_ids=[]: no CUDA device, so it calls the "
                "module once, on the whole batch")
    if len(net.device_ids) == 1:
        return (f"nn.DataParallel over GPU {net.device_ids[0]} alone: it calls the module "
                "directly, with nothing to scatter or gather")
    return (f"nn.DataParallel over GPUs {net.device_ids}: scatter, replicate, run in "
            f"parallel, gather on cuda:{net.output_device}")


def train(num_devices: int, batch_size: int, lr: float,
          init_state: dict[str, torch.Tensor] | None = None, num_epochs: int | None = None,
          scale: config.Scale | None = None, root=None, seed: int = 0,
          animator: Animator | None = None) -> TrainResult:
    """Train the ResNet-18 variant on Fashion-MNIST with ``nn.DataParallel``.

    The network has ``scale.resnet_width`` channels in its first stage and starts from
    ``init_state`` (default: :func:`init_resnet18` with ``seed``). With CUDA it is wrapped
    in ``nn.DataParallel`` over the GPUs of ``num_devices`` devices; without CUDA the
    wrapper would only call the module (see :func:`data_parallel_info`), so the plain
    module is trained on the CPU. ``extra["data_parallel"]`` says which happened,
    ``extra["replicas"]`` counts the replicas that ran, and ``model`` is what was trained.
    The minibatch is the *global* one: DataParallel splits it across the GPUs. Each
    epoch's time covers training only (synchronized); the test accuracy is computed with
    :func:`~dpbook.torch.evaluate.evaluate_accuracy_gpus`.
    """
    scale = scale or get_scale()
    num_epochs = num_epochs or scale.resnet_epochs
    devices = get_devices(num_devices)
    train_iter, test_iter = load_data_fashion_mnist(
        batch_size, scale.resnet_num_train, scale.resnet_num_test, root=root, seed=seed)
    net = resnet18(width=scale.resnet_width)
    net.load_state_dict(init_resnet18(scale.resnet_width, seed) if init_state is None else init_state)
    net = net.to(devices[0])
    if devices[0].type == "cuda":
        # nn.DataParallel takes each GPU once: k replicas on one GPU are one replica here
        net = nn.DataParallel(net, device_ids=list(dict.fromkeys(devices)))
        ran_on, replicas = data_parallel_info(net), len(net.device_ids)
    else:   # the wrapper would call the module unchanged: train the module itself
        ran_on = ("no GPU: the plain module on the CPU, the step nn.DataParallel "
                  "would run here")
        replicas = 1
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    if animator is None:
        animator = training_animator(
            num_epochs, f"batch {batch_size}, lr {lr}, {replicas} replica(s)")
    timer = Timer(devices, start=False)
    for epoch in range(num_epochs):
        net.train()
        metric = Accumulator(2)      # summed loss, examples
        timer.start()
        for X, y in train_iter:
            X, y = X.to(devices[0]), y.to(devices[0])
            loss = F.cross_entropy(net(X), y)     # DataParallel scatters X, gathers outputs
            optimizer.zero_grad()
            loss.backward()                       # gradients summed into net.module
            optimizer.step()
            metric.add(loss.detach() * len(y), len(y))   # float(): a sync point
        timer.stop()
        test_acc = evaluate_accuracy_gpus(net, test_iter, devices)
        animator.add(epoch + 1, (metric[0] / metric[1], test_acc))
    return TrainResult(num_devices, batch_size, lr, test_acc, metric[0] / metric[1],
                       list(timer.times), hardware_line(devices), model=net,
                       animator=animator,
                       extra={"data_parallel": ran_on,
                              "replicas": replicas})

"""Data parallelism from scratch, in PyTorch: the code of the from-scratch chapter.

One data-parallel step (``train_batch``):

1. split the minibatch into one shard per device          (``split_batch``)
2. forward and backward on every device, own params copy  (``lenet_forward``)
3. sum the gradients of all devices, on every device      (``allreduce``)
4. the same SGD update on every device                    (``sgd``)

Because every device starts from the same parameters and applies the same summed
gradient, the replicas stay identical, and the step equals one single-device step on the
whole minibatch.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.nn import functional as F

from .. import config
from ..plot import Animator, training_animator
from ..tools import Accumulator, TrainResult, cosine_lr
from .data import load_data_fashion_mnist
from .devices import Timer, get_devices, get_scale, hardware_line, split_batch
from .evaluate import evaluate_accuracy

__all__ = ["init_lenet_params", "lenet_forward", "get_params", "allreduce", "sgd",
           "train_batch", "train"]


def init_lenet_params(seed: int = 0) -> list[torch.Tensor]:
    """LeNet's parameters drawn from ``seed``, on the CPU.

    Hidden layers: He initialization (normal, variance 2 / fan_in), which keeps the scale
    of ReLU activations steady. Output layer and biases: zero, so the first logits are
    all zero (every class equally likely) and the first steps stay small even with a large
    learning rate. Shapes: conv1 (20, 1, 3, 3), conv2 (50, 20, 5, 5), dense (800, 128),
    dense (128, 10), each followed by its bias: 129,068 numbers, like ``dpbook.torch.lenet()``.
    """
    g = torch.Generator().manual_seed(seed)

    def he(*shape, fan_in):
        return torch.randn(*shape, generator=g) * (2 / fan_in) ** 0.5

    return [he(20, 1, 3, 3, fan_in=1 * 3 * 3), torch.zeros(20),
            he(50, 20, 5, 5, fan_in=20 * 5 * 5), torch.zeros(50),
            he(800, 128, fan_in=800), torch.zeros(128),
            torch.zeros(128, 10), torch.zeros(10)]


def lenet_forward(X: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """LeNet written with raw parameters: (B, 1, 28, 28) images → (B, 10) logits."""
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    H = F.avg_pool2d(F.relu(F.conv2d(X, W1, b1)), kernel_size=2)   # (B, 20, 13, 13)
    H = F.avg_pool2d(F.relu(F.conv2d(H, W2, b2)), kernel_size=2)   # (B, 50, 4, 4)
    H = F.relu(H.flatten(1) @ W3 + b3)                              # (B, 128)
    return H @ W4 + b4                                              # (B, 10)


def get_params(params: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """A copy of ``params`` on ``device`` that records gradients.

    ``copy=True`` matters: ``Tensor.to(device)`` returns the *same* tensor when it is
    already on ``device`` — on a CPU-only machine every replica would then be one tensor.
    """
    return [p.detach().to(device, copy=True).requires_grad_() for p in params]


@torch.no_grad()
def allreduce(data: Sequence[torch.Tensor]) -> None:
    """Sum the tensors (one per device) and write the sum into **every** tensor, in place.

    Naive algorithm: add everything into ``data[0]`` on its device, then copy the result
    back to each other device.
    """
    for i in range(1, len(data)):
        data[0] += data[i].to(data[0].device)      # collect on device 0
    for i in range(1, len(data)):
        data[i].copy_(data[0].to(data[i].device))  # broadcast back: update every device


@torch.no_grad()
def sgd(params: Sequence[torch.Tensor], lr: float, batch_size: int) -> None:
    """Minibatch SGD on one device: ``p -= lr * grad / batch_size``, then clear the grads."""
    for p in params:
        p -= lr * p.grad / batch_size
        p.grad.zero_()


def train_batch(X: torch.Tensor, y: torch.Tensor, device_params: Sequence[Sequence[torch.Tensor]],
                devices: Sequence[torch.device], lr: float) -> torch.Tensor:
    """One data-parallel SGD step on the minibatch ``(X, y)``; returns the summed loss.

    ``device_params[i]`` is the replica on ``devices[i]``. Each device's loss is a *sum*
    over its shard; dividing the allreduced gradient by the whole batch size then gives
    exactly the gradient of the mean loss over the minibatch, even for unequal shards.
    """
    X_shards, y_shards = split_batch(X, y, devices)
    losses = [F.cross_entropy(lenet_forward(X_shard, params), y_shard, reduction="sum")
              for X_shard, y_shard, params in zip(X_shards, y_shards, device_params)]
    for loss in losses:          # backward on each device (asynchronous on GPUs)
        loss.backward()
    for i in range(len(device_params[0])):      # allreduce every parameter's gradient
        allreduce([params[i].grad for params in device_params])
    for params in device_params:                # the same update on every device
        sgd(params, lr, X.shape[0])
    return sum(loss.detach().to(devices[0]) for loss in losses)


def train(num_devices: int, batch_size: int, lr: float, num_epochs: int | None = None,
          scale: config.Scale | None = None, root=None, seed: int = 0,
          animator: Animator | None = None) -> TrainResult:
    """Train LeNet on Fashion-MNIST with :func:`train_batch` on ``num_devices`` devices.

    The data size and (by default) the epochs come from ``scale``. Parameters start from
    ``init_lenet_params(seed)``, so runs with different device counts are comparable.
    The images are standardized (mean 0, variance 1). The learning rate rises linearly
    to ``lr`` over the first fifth of the steps (warm-up), then decays to nearly 0 along
    a cosine (:func:`dpbook.tools.cosine_lr`), so the last epochs settle instead of jumping
    around.
    Returns a :class:`dpbook.tools.TrainResult` (``model``: the per-device parameters);
    each epoch's time covers training only (synchronized), not evaluation.
    """
    scale = scale or get_scale()
    num_epochs = num_epochs or scale.num_epochs
    devices = get_devices(num_devices)
    train_iter, test_iter = load_data_fashion_mnist(batch_size, scale.num_train,
                                                    scale.num_test, root=root, seed=seed,
                                                    normalize=True)
    init = init_lenet_params(seed)
    device_params = [get_params(init, d) for d in devices]
    if animator is None:
        animator = training_animator(
            num_epochs, f"{num_devices} device(s), batch {batch_size}, lr {lr}")
    timer, step, num_steps = Timer(devices, start=False), 0, num_epochs * len(train_iter)
    warmup_steps = num_steps // 5     # as in dpbook.jax.scratch.train
    for epoch in range(num_epochs):
        metric = Accumulator(2)      # summed loss, examples
        timer.start()
        for X, y in train_iter:
            step_lr = cosine_lr(lr, step, num_steps, warmup_steps)
            loss = train_batch(X, y, device_params, devices, step_lr)
            metric.add(loss, y.numel())      # float(loss): a sync point, once per step
            step += 1
        timer.stop()
        test_acc = evaluate_accuracy(lambda X: lenet_forward(X, device_params[0]),
                                     test_iter, devices[0])
        animator.add(epoch + 1, (metric[0] / metric[1], test_acc))
    return TrainResult(num_devices, batch_size, lr, test_acc, metric[0] / metric[1],
                       list(timer.times), hardware_line(devices), model=device_params,
                       animator=animator)

"""The book's models in PyTorch: two LeNets and a ResNet-18 for 28×28 images."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["lenet", "lenet5", "Residual", "resnet18", "num_params", "seeded"]


def lenet(num_classes: int = 10) -> nn.Sequential:
    """The LeNet of the from-scratch chapter (and d2l's multi-GPU section).

    conv 20 (3×3) → ReLU → avg-pool → conv 50 (5×5) → ReLU → avg-pool → dense 128 → ReLU
    → dense ``num_classes``. 129,068 parameters for 10 classes.
    """
    return nn.Sequential(
        nn.Conv2d(1, 20, kernel_size=3), nn.ReLU(),          # (B, 20, 26, 26)
        nn.AvgPool2d(kernel_size=2, stride=2),               # (B, 20, 13, 13)
        nn.Conv2d(20, 50, kernel_size=5), nn.ReLU(),         # (B, 50, 9, 9)
        nn.AvgPool2d(kernel_size=2, stride=2),               # (B, 50, 4, 4)
        nn.Flatten(),                                        # (B, 800)
        nn.Linear(50 * 4 * 4, 128), nn.ReLU(),
        nn.Linear(128, num_classes))


def lenet5(num_classes: int = 10) -> nn.Sequential:
    """d2l's LeNet-5 (sigmoid activations, average pooling). 61,706 parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 6, kernel_size=5, padding=2), nn.Sigmoid(),   # (B, 6, 28, 28)
        nn.AvgPool2d(kernel_size=2, stride=2),                     # (B, 6, 14, 14)
        nn.Conv2d(6, 16, kernel_size=5), nn.Sigmoid(),             # (B, 16, 10, 10)
        nn.AvgPool2d(kernel_size=2, stride=2),                     # (B, 16, 5, 5)
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120), nn.Sigmoid(),
        nn.Linear(120, 84), nn.Sigmoid(),
        nn.Linear(84, num_classes))


class Residual(nn.Module):
    """A ResNet basic block: two 3×3 convolutions with BatchNorm and a shortcut.

    With ``use_1x1conv`` the shortcut is a 1×1 convolution (to change channels/stride).
    """

    def __init__(self, in_channels: int, out_channels: int, use_1x1conv: bool = False,
                 strides: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, stride=strides)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.conv3 = (nn.Conv2d(in_channels, out_channels, 1, stride=strides)
                      if use_1x1conv else None)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, X):
        Y = F.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        if self.conv3 is not None:
            X = self.conv3(X)
        return F.relu(Y + X)


def resnet18(num_classes: int = 10, in_channels: int = 1, width: int = 64) -> nn.Sequential:
    """ResNet-18 for small images: a 3×3 stride-1 first convolution and no max-pool.

    The four stages have ``width``, 2·``width``, 4·``width``, 8·``width`` channels
    (``width=64`` is the standard network; the CPU scale trains a narrower one).
    """
    def stage(c_in, c_out, first):
        return nn.Sequential(
            Residual(c_in, c_out) if first else Residual(c_in, c_out, True, strides=2),
            Residual(c_out, c_out))

    w = width
    return nn.Sequential(
        nn.Conv2d(in_channels, w, kernel_size=3, stride=1, padding=1),  # (B, w, 28, 28)
        nn.BatchNorm2d(w), nn.ReLU(),
        stage(w, w, first=True),           # (B, w, 28, 28)
        stage(w, 2 * w, first=False),      # (B, 2w, 14, 14)
        stage(2 * w, 4 * w, first=False),  # (B, 4w, 7, 7)
        stage(4 * w, 8 * w, first=False),  # (B, 8w, 4, 4)
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(),  # (B, 8w)
        nn.Linear(8 * w, num_classes))


def num_params(net: nn.Module) -> int:
    """Number of trainable parameters (BatchNorm running statistics are buffers, not counted)."""
    return sum(p.numel() for p in net.parameters() if p.requires_grad)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """``with seeded(0): net = lenet()``: draw from ``seed`` inside the block and leave
    the caller's random generator as it was (``torch.random.fork_rng``), so building a
    model the same way every time does not change the reader's next random numbers."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield

"""The book's models in Flax (linen, NHWC): the same networks as ``dpbook.torch.models``."""
from __future__ import annotations

from functools import partial

import jax
from flax import linen as nn

__all__ = ["LeNet", "LeNet5", "LeNetBN", "Residual", "ResNet18", "num_params"]


class LeNet(nn.Module):
    """conv 20 (3×3) → ReLU → avg-pool → conv 50 (5×5) → ReLU → avg-pool → 128 → 10.

    129,068 parameters for 10 classes, like ``dpbook.torch.lenet``.
    """
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):                                   # (B, 28, 28, 1)
        x = nn.relu(nn.Conv(20, (3, 3), padding="VALID")(x))  # (B, 26, 26, 20)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))           # (B, 13, 13, 20)
        x = nn.relu(nn.Conv(50, (5, 5), padding="VALID")(x))  # (B, 9, 9, 50)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))           # (B, 4, 4, 50)
        x = x.reshape((x.shape[0], -1))                      # (B, 800)
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(self.num_classes)(x)


class LeNet5(nn.Module):
    """d2l's LeNet-5 (sigmoid, average pooling). 61,706 parameters."""
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):                                        # (B, 28, 28, 1)
        x = nn.sigmoid(nn.Conv(6, (5, 5), padding=2)(x))          # (B, 28, 28, 6)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))                # (B, 14, 14, 6)
        x = nn.sigmoid(nn.Conv(16, (5, 5), padding="VALID")(x))   # (B, 10, 10, 16)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))                # (B, 5, 5, 16)
        x = x.reshape((x.shape[0], -1))
        x = nn.sigmoid(nn.Dense(120)(x))
        x = nn.sigmoid(nn.Dense(84)(x))
        return nn.Dense(self.num_classes)(x)


# PyTorch's BatchNorm defaults: running = 0.9 * running + 0.1 * batch, eps = 1e-5.
_BatchNorm = partial(nn.BatchNorm, momentum=0.9, epsilon=1e-5)


class LeNetBN(nn.Module):
    """:class:`LeNet` with BatchNorm after both convolutions and the hidden dense layer.

    A small model with BatchNorm for the concise chapter and its tests (ResNet-18 has the
    same kind of layers, but compiles far more slowly on a CPU). ``axis_name`` makes
    BatchNorm compute its statistics over all devices of that axis (synchronized
    BatchNorm); the model then only runs inside ``pmap``/``shard_map``, except in ``init``.
    """
    num_classes: int = 10
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):                # (B, 28, 28, 1)
        bn = partial(_BatchNorm, use_running_average=not train, axis_name=self.axis_name)
        x = nn.relu(bn()(nn.Conv(20, (3, 3), padding="VALID")(x)))   # (B, 26, 26, 20)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))                  # (B, 13, 13, 20)
        x = nn.relu(bn()(nn.Conv(50, (5, 5), padding="VALID")(x)))   # (B, 9, 9, 50)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))                  # (B, 4, 4, 50)
        x = x.reshape((x.shape[0], -1))                             # (B, 800)
        x = nn.relu(bn()(nn.Dense(128)(x)))
        return nn.Dense(self.num_classes)(x)


class Residual(nn.Module):
    """A ResNet basic block; ``use_1x1conv`` gives the shortcut a 1×1 convolution."""
    channels: int
    use_1x1conv: bool = False
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = True):
        s = (self.strides, self.strides)
        y = nn.Conv(self.channels, (3, 3), strides=s, padding=1)(x)
        y = nn.relu(_BatchNorm(use_running_average=not train)(y))
        y = nn.Conv(self.channels, (3, 3), padding=1)(y)
        y = _BatchNorm(use_running_average=not train)(y)
        if self.use_1x1conv:
            x = nn.Conv(self.channels, (1, 1), strides=s)(x)
        return nn.relu(y + x)


class ResNet18(nn.Module):
    """ResNet-18 for 28×28 images: 3×3 stride-1 stem, no max-pool, stages of
    ``width``, 2·``width``, 4·``width``, 8·``width`` channels (like ``dpbook.torch.resnet18``).
    """
    num_classes: int = 10
    width: int = 64

    @nn.compact
    def __call__(self, x, train: bool = True):               # (B, 28, 28, C)
        w = self.width
        x = nn.Conv(w, (3, 3), padding=1)(x)
        x = nn.relu(_BatchNorm(use_running_average=not train)(x))
        for i, channels in enumerate((w, 2 * w, 4 * w, 8 * w)):  # 28, 14, 7, 4 pixels
            first = i == 0
            x = Residual(channels, use_1x1conv=not first, strides=1 if first else 2)(x, train)
            x = Residual(channels)(x, train)
        x = x.mean(axis=(1, 2))                               # (B, 8w)
        return nn.Dense(self.num_classes)(x)


def num_params(params) -> int:
    """Number of parameters in a pytree (pass ``variables['params']``, not batch_stats)."""
    return sum(x.size for x in jax.tree_util.tree_leaves(params))

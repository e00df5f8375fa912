"""Fashion-MNIST as PyTorch DataLoaders, without torchvision."""
from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from .. import data as _data

__all__ = ["load_data_fashion_mnist", "fashion_mnist_datasets", "to_tensors", "random_batch"]


def to_tensors(X, y, normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (N, 28, 28) → float32 (N, 1, 28, 28) in [0, 1], or standardized with
    ``normalize`` (:func:`dpbook.data.pixels`); labels → int64."""
    X = torch.from_numpy(_data.pixels(X, normalize)).unsqueeze(1)
    return X, torch.from_numpy(y.astype("int64"))


def fashion_mnist_datasets(num_train: int | None = None, num_test: int | None = None,
                           root: str | os.PathLike | None = None, seed: int = 0,
                           normalize: bool = False) -> tuple[TensorDataset, TensorDataset]:
    """``(train, test)`` Fashion-MNIST as two ``TensorDataset``: fixed subsets of
    ``num_train`` / ``num_test`` examples (``None``: everything), drawn with ``seed``."""
    X_train, y_train, X_test, y_test = _data.read_fashion_mnist(root)
    return (TensorDataset(*to_tensors(*_data.subset(X_train, y_train, num_train, seed),
                                      normalize=normalize)),
            TensorDataset(*to_tensors(*_data.subset(X_test, y_test, num_test, seed),
                                      normalize=normalize)))


def random_batch(batch_size: int, seed: int = 0, shape: tuple[int, ...] = (1, 28, 28)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of random inputs ``(batch_size, *shape)`` in [0, 1) (default: images
    ``(1, 28, 28)``) and labels 0…9, the same for a given seed on every process: the one
    batch maker of the multi-process checks, which need no dataset."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(batch_size, *shape, generator=g),
            torch.randint(0, 10, (batch_size,), generator=g))


def load_data_fashion_mnist(batch_size: int, num_train: int | None = None,
                            num_test: int | None = None,
                            root: str | os.PathLike | None = None, seed: int = 0,
                            normalize: bool = False) -> tuple[DataLoader, DataLoader]:
    """``(train_iter, test_iter)`` over Fashion-MNIST.

    ``num_train`` / ``num_test`` take a fixed subset (``None``: everything), e.g. the
    sizes of :func:`dpbook.torch.devices.get_scale`. The training loader reshuffles every epoch
    from a generator seeded with ``seed``, so two runs see the same batches.
    ``normalize`` standardizes the images (see :func:`to_tensors`).
    """
    train, test = fashion_mnist_datasets(num_train, num_test, root, seed, normalize)
    generator = torch.Generator().manual_seed(seed)
    return (DataLoader(train, batch_size, shuffle=True, generator=generator),
            DataLoader(test, batch_size, shuffle=False))

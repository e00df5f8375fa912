"""Fashion-MNIST as PyTorch DataLoaders, without torchvision."""
from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from .. import data as _data

__all__ = ["load_data_fashion_mnist", "to_tensors"]


def to_tensors(X, y, normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (N, 28, 28) → float32 (N, 1, 28, 28) in [0, 1], or standardized with
    ``normalize`` (:func:`dpbook.data.pixels`); labels → int64."""
    X = torch.from_numpy(_data.pixels(X, normalize)).unsqueeze(1)
    return X, torch.from_numpy(y.astype("int64"))


def load_data_fashion_mnist(batch_size: int, num_train: int | None = None,
                            num_test: int | None = None,
                            root: str | os.PathLike | None = None, seed: int = 0,
                            normalize: bool = False) -> tuple[DataLoader, DataLoader]:
    """``(train_iter, test_iter)`` over Fashion-MNIST.

    ``num_train`` / ``num_test`` take a fixed subset (``None``: everything), e.g. the
    sizes of :func:`dpbook.torch.get_scale`. The training loader reshuffles every epoch
    from a generator seeded with ``seed``, so two runs see the same batches.
    ``normalize`` standardizes the images (see :func:`to_tensors`).
    """
    X_train, y_train, X_test, y_test = _data.read_fashion_mnist(root)
    train = TensorDataset(*to_tensors(*_data.subset(X_train, y_train, num_train, seed),
                                      normalize=normalize))
    test = TensorDataset(*to_tensors(*_data.subset(X_test, y_test, num_test, seed),
                                     normalize=normalize))
    generator = torch.Generator().manual_seed(seed)
    return (DataLoader(train, batch_size, shuffle=True, generator=generator),
            DataLoader(test, batch_size, shuffle=False))

"""Fashion-MNIST as numpy minibatches for JAX (NHWC, float32)."""
from __future__ import annotations

import os

import numpy as np

from .. import data as _data

__all__ = ["load_data_fashion_mnist", "to_arrays", "random_batch"]


def to_arrays(X: np.ndarray, y: np.ndarray, normalize: bool = False
              ) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (N, 28, 28) → float32 (N, 28, 28, 1) in [0, 1], or standardized with
    ``normalize`` (:func:`dpbook.data.pixels`); labels → int32."""
    return _data.pixels(X, normalize)[..., None], y.astype(np.int32)


def load_data_fashion_mnist(batch_size: int, num_train: int | None = None,
                            num_test: int | None = None,
                            root: str | os.PathLike | None = None, seed: int = 0,
                            drop_last: bool = True, normalize: bool = False
                            ) -> tuple[_data.ArrayLoader, _data.ArrayLoader]:
    """``(train_iter, test_iter)`` yielding numpy ``(X, y)`` batches.

    The training loader reshuffles every epoch (seeded) and by default drops the last
    partial batch, so every step has the same shape and jit compiles once. The test
    loader keeps every example. ``normalize`` standardizes the images (see
    :func:`to_arrays`).
    """
    X_train, y_train, X_test, y_test = _data.read_fashion_mnist(root)
    train = to_arrays(*_data.subset(X_train, y_train, num_train, seed), normalize=normalize)
    test = to_arrays(*_data.subset(X_test, y_test, num_test, seed), normalize=normalize)
    return (_data.ArrayLoader(*train, batch_size, shuffle=True, seed=seed, drop_last=drop_last),
            _data.ArrayLoader(*test, batch_size, shuffle=False))


def random_batch(batch_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A fixed random minibatch shaped like Fashion-MNIST's, for tests and checks that
    need no data set: ``X`` float32 (batch_size, 28, 28, 1) uniform in [0, 1), ``y`` int32
    labels 0..9, both drawn from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    X = rng.random((batch_size, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, batch_size).astype(np.int32)
    return X, y

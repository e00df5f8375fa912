"""Unequal shards in JAX: padding plus a mask, and the masked data-parallel step.

Every device runs the same compiled program, so every device's block has the same shape.
An uneven split of a minibatch (a batch that does not divide, or shares by ``weights``)
becomes padding plus a mask (:func:`pad_batch`), and :func:`masked_train_step` divides the
summed loss by the number of *real* examples: it takes the same step as one device on the
unpadded minibatch (``tests/test_comm_jax.py``). The allreduce half of the communication
chapter is :mod:`dpbook.jax.allreduce`.
"""
from __future__ import annotations

from functools import cache
from typing import Callable, Sequence

import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from .state import AXIS, TrainState

__all__ = ["pad_batch", "padding_waste", "masked_loss_sum", "masked_train_step",
           "make_masked_train_step"]


def pad_batch(X: np.ndarray, y: np.ndarray, sizes: Sequence[int]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lay out a minibatch for devices that get ``sizes[i]`` real examples each.

    ``sizes`` come e.g. from :func:`dpbook.devices.split_sizes` (even, or by ``weights``).
    Every device's block gets ``m = max(sizes)`` rows: device i's ``sizes[i]`` examples
    (in order), then zeros. Returns ``X`` (N * m, ...), ``y`` (N * m,) and a float32
    ``mask`` (N * m,) that is 1 for a real example and 0 for padding. Split along the
    first axis over N devices, block i lands on device i. The padding is zeros, a valid
    input, so the masked-out losses are finite and their gradients exactly zero.
    """
    sizes = [int(s) for s in sizes]
    if len(X) != len(y):
        raise ValueError(f"X has {len(X)} examples and y has {len(y)}")
    if not sizes or min(sizes) < 1:
        raise ValueError(f"every device needs at least one example, got sizes {sizes}")
    if sum(sizes) != len(X):
        raise ValueError(f"sizes {sizes} add up to {sum(sizes)}, but the batch has "
                         f"{len(X)} examples")
    n, m = len(sizes), max(sizes)
    X_pad = np.zeros((n * m, *X.shape[1:]), dtype=X.dtype)
    y_pad = np.zeros((n * m, *y.shape[1:]), dtype=y.dtype)
    mask = np.zeros(n * m, dtype=np.float32)
    start = 0
    for i, size in enumerate(sizes):          # device i: rows i*m .. i*m + size - 1
        X_pad[i * m:i * m + size] = X[start:start + size]
        y_pad[i * m:i * m + size] = y[start:start + size]
        mask[i * m:i * m + size] = 1
        start += size
    return X_pad, y_pad, mask


def padding_waste(sizes: Sequence[int]) -> float:
    """The fraction of the padded batch that is padding: computed, then thrown away."""
    return 1 - sum(sizes) / (len(sizes) * max(sizes))


def masked_loss_sum(params, state: TrainState, X, y, mask):
    """The *sum* of the cross-entropy over the real examples of ``X`` (mask 1).

    A sum, not a mean: dividing by the number of real examples of *all* devices happens
    after the allreduce, in :func:`masked_train_step`.
    """
    logits = state.apply_fn({"params": params}, X)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)   # (m,)
    return (losses * mask).sum()


def masked_train_step(state: TrainState, X, y, mask):
    """One device's part of a data-parallel step on padded blocks; for ``shard_map``.

    X (m, ...), y (m,), mask (m,): this device's block. The gradient of the mean loss over
    all real examples is the sum over devices of the gradients of the masked loss sums,
    divided by the total number of real examples: ``psum`` the gradients and the mask,
    then divide. For models without BatchNorm: the padding would enter its statistics.
    Returns the new state and the mean loss over the real examples, both replicated.
    """
    params = lax.pcast(state.params, AXIS, to="varying")   # grads stay per-device
    loss_sum, grads = jax.value_and_grad(masked_loss_sum)(params, state, X, y, mask)
    count = lax.psum(mask.sum(), AXIS)                     # real examples on all devices
    grads = jax.tree.map(lambda g: lax.psum(g, AXIS) / count, grads)   # allreduce
    loss = lax.psum(loss_sum, AXIS) / count
    return state.apply_gradients(grads=grads), loss


@cache
def make_masked_train_step(mesh: Mesh) -> Callable:
    """:func:`masked_train_step` on ``mesh``, jitted: state ``P()``, X, y, mask ``P(AXIS)``."""
    step = jax.shard_map(masked_train_step, mesh=mesh,
                         in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)), out_specs=(P(), P()))
    return jax.jit(step)

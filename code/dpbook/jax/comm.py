"""Communication in JAX: a ring allreduce written with ``lax.ppermute``, and unequal shards.

Two ideas of the communication chapter, the JAX way:

* :func:`ring_allreduce` sums an array over the devices of a ``shard_map`` axis by hand:
  a reduce-scatter then an all-gather around a ring, ``2 (N - 1)`` steps that each pass
  one chunk of ``n / N`` values to the right-hand neighbour (``lax.ppermute``). It gives
  ``lax.psum``'s result, up to the order of the float additions
  (:func:`ring_vs_psum`, ``tests/test_comm_jax.py``).
* Every device runs the same compiled program, so every device's block has the same
  shape. An uneven split of a minibatch becomes padding plus a mask (:func:`pad_batch`),
  and :func:`masked_train_step` divides the summed loss by the number of *real* examples:
  it takes the same step as one device on the unpadded minibatch.
"""
from __future__ import annotations

import re
from collections import Counter
from functools import cache
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .concise import AXIS, TrainState, make_mesh
from .devices import Timer

__all__ = ["ring_allreduce", "psum_allreduce", "make_allreduce", "place_rows", "ring_vs_psum",
           "time_allreduce", "collective_ops", "pad_batch",
           "padding_waste", "masked_loss_sum", "masked_train_step", "make_masked_train_step"]


def ring_allreduce(x: jax.Array, axis_name: str = AXIS) -> jax.Array:
    """Sum ``x`` over the devices of ``axis_name`` with a ring; call it inside ``shard_map``.

    ``x`` is this device's array, of any shape. Flattened and padded with zeros to a
    multiple of N (the axis size), it becomes N chunks of ``ceil(x.size / N)`` values.
    Reduce-scatter: at step s, device i sends chunk (i - s) mod N to device i + 1, which
    adds it to its own copy of that chunk; after N - 1 steps, device i holds the full sum
    of chunk (i + 1) mod N. All-gather: N - 1 more steps pass the finished chunks around
    the ring. The padding is sliced off at the end. Every sum is computed once and then
    copied, so all devices end with bit-identical results.
    """
    n = lax.axis_size(axis_name)            # a Python int: the loops below unroll
    if n == 1:
        return x
    i = lax.axis_index(axis_name)           # this device's place in the ring (traced)
    size = x.size
    chunk = -(-size // n)                   # ceil(size / N)
    chunks = jnp.pad(x.reshape(-1), (0, n * chunk - size)).reshape(n, chunk)   # (N, chunk)
    to_the_right = [(j, (j + 1) % n) for j in range(n)]      # (source, destination) pairs
    for s in range(n - 1):                  # reduce-scatter: N - 1 steps
        received = lax.ppermute(chunks[(i - s) % n], axis_name, to_the_right)   # (chunk,)
        chunks = chunks.at[(i - 1 - s) % n].add(received)   # left neighbour's partial sum
    for s in range(n - 1):                  # all-gather: N - 1 steps
        received = lax.ppermute(chunks[(i + 1 - s) % n], axis_name, to_the_right)
        chunks = chunks.at[(i - s) % n].set(received)        # a finished chunk
    return chunks.reshape(-1)[:size].reshape(x.shape)


def psum_allreduce(x: jax.Array, axis_name: str = AXIS) -> jax.Array:
    """The built-in allreduce, ``lax.psum``, with :func:`ring_allreduce`'s signature."""
    return lax.psum(x, axis_name)


def make_allreduce(allreduce: Callable, mesh: Mesh) -> Callable:
    """``allreduce`` (e.g. :func:`ring_allreduce`) on every device of a 1-D ``mesh``, jitted.

    Takes an array (N, ...) split along ``AXIS`` (row i on device i, see
    :func:`place_rows`) and returns (N, ...): row i is device i's result, so after an
    allreduce every row holds the sum of all the input rows.
    """
    def per_device(block):                  # (1, ...): this device's row
        return allreduce(block[0], AXIS)[None]
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def place_rows(x, mesh: Mesh) -> jax.Array:
    """Put row i of ``x`` (N, ...) on device i of ``mesh``."""
    return jax.device_put(x, NamedSharding(mesh, P(AXIS)))


def ring_vs_psum(devices: Sequence[jax.Device], size: int, seed: int = 0) -> float:
    """The largest absolute difference between :func:`ring_allreduce` and ``lax.psum``.

    Each device starts with ``size`` standard normal float32 values; the result compares
    every device's copy of the two sums. They differ only by the order of additions
    (around 1e-6 for a few devices), while a wrong chunk index gives an error of order 1.
    """
    mesh = make_mesh(devices)
    rng = np.random.default_rng(seed)
    x = place_rows(rng.standard_normal((len(devices), size), dtype=np.float32), mesh)
    ring = make_allreduce(ring_allreduce, mesh)(x)
    psum = make_allreduce(psum_allreduce, mesh)(x)
    return float(jnp.abs(ring - psum).max())


def time_allreduce(jitted: Callable, x: jax.Array, num_repeats: int) -> float:
    """Seconds per call of ``jitted(x)``: one warm-up call (it compiles), then the mean of
    ``num_repeats`` calls, the timer stopped after the last result is computed."""
    jax.block_until_ready(jitted(x))
    timer = Timer()
    for _ in range(num_repeats):
        out = jitted(x)
    return timer.stop(out) / num_repeats      # waits for the devices


_COLLECTIVES = ("all-reduce", "collective-permute", "all-gather", "reduce-scatter", "all-to-all")


def collective_ops(jitted: Callable, *args) -> dict[str, int]:
    """How many instructions of each collective kind XLA compiled for ``jitted(*args)``.

    E.g. ``{'collective-permute': 6}`` for the ring on 4 devices. An asynchronous pair
    (``all-reduce-start`` / ``all-reduce-done``) counts once.
    """
    text = jitted.lower(*args).compile().as_text()
    kinds = re.findall(r" (" + "|".join(_COLLECTIVES) + r")(?:-start)?\(", text)
    return dict(Counter(kinds))


def pad_batch(X: np.ndarray, y: np.ndarray, sizes: Sequence[int]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lay out a minibatch for devices that get ``sizes[i]`` real examples each.

    ``sizes`` come e.g. from :func:`dpbook.split_sizes` (even, or by ``weights``).
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

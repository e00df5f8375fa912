"""Allreduce in JAX: a ring allreduce written with ``lax.ppermute``, against ``lax.psum``.

:func:`ring_allreduce` sums an array over the devices of a ``shard_map`` axis by hand:
a reduce-scatter then an all-gather around a ring, ``2 (N - 1)`` steps that each pass one
chunk of ``n / N`` values to the right-hand neighbour (``lax.ppermute``). It gives
``lax.psum``'s result, up to the order of the float additions (:func:`ring_vs_psum`,
``tests/test_comm_jax.py``). What XLA compiles for each is counted by
:func:`dpbook.jax.hlo.collective_ops`. The second half of the communication chapter,
unequal shards, is :mod:`dpbook.jax.unequal`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..tools import benchmark
from .devices import Timer
from .state import AXIS, make_mesh

__all__ = ["ring_allreduce", "psum_allreduce", "make_allreduce", "place_rows", "ring_vs_psum",
           "time_allreduce"]


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
    ``num_repeats`` calls, each timed on its own until its result is computed
    (:func:`dpbook.tools.benchmark` with the JAX :class:`~dpbook.jax.devices.Timer`)."""
    return benchmark(lambda: jitted(x), num_repeats, timer=Timer(start=False)).avg()

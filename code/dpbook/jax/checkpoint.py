"""Sharded checkpoints in JAX with Orbax: save a training state sharded over one mesh,
restore it onto a mesh of another number of devices.

``orbax.checkpoint.StandardCheckpointer`` saves a pytree of ``jax.Array`` s: each process
writes the shards its devices hold, one copy of each (a replicated array once: Orbax
picks one replica of every shard), into one TensorStore per checkpoint, with the global
shape and dtype. Restoring needs a *target*: a pytree of ``jax.ShapeDtypeStruct`` with
the shapes, dtypes and shardings wanted now (:func:`abstract_state`, with the shapes
from ``jax.eval_shape``, which computes nothing); each device then reads only the slices
its new sharding asks for. Without a target Orbax returns nested dicts (no
``TrainState``), placed with the shardings saved in the checkpoint, that is, on the old
mesh's devices.

The state is that of :mod:`dpbook.jax.fsdp`: LeNet with Adam, each array split along its
largest dimension that the number of devices divides (``fsdp_spec``), replicated when
none does. :func:`new_state` makes it born sharded: ``jax.jit(init,
out_shardings=...)`` returns every array already in its sharding, JAX's counterpart of
PyTorch's ``meta`` device. Works with the book's oldest jax (0.8.2) and
orbax-checkpoint 0.12.8.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from . import fsdp
from .data import random_batch

__all__ = ["abstract_state", "save", "restore", "init", "initial_state", "new_state", "place",
           "train", "shardings_equal", "max_abs_difference"]


def abstract_state(state: Any, shardings: Any) -> Any:
    """The restore target: ``state``'s structure with a ``jax.ShapeDtypeStruct`` (shape,
    dtype and the sharding from the matching leaf of ``shardings``) for every array."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), state,
        shardings)


def save(path: str | os.PathLike, state: Any) -> None:
    """Write ``state``'s arrays, from the shards the devices hold, to the new folder
    ``path`` (it must not exist yet); returns when the checkpoint is complete."""
    with ocp.StandardCheckpointer() as checkpointer:      # waits for the write on exit
        checkpointer.save(os.path.abspath(path), state)


def restore(path: str | os.PathLike, target: Any) -> Any:
    """The state saved in ``path``, as ``target`` (:func:`abstract_state`) describes it:
    its structure, and each array placed with the target's sharding."""
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(os.path.abspath(path), target)


@functools.lru_cache(maxsize=4)
def initial_state(seed: int = 0):
    """A fresh LeNet + Adam state (:func:`dpbook.jax.fsdp.create_adam_state`) from
    ``seed``, on the default device; made by one jitted function (optax initializes the
    moments array by array, which takes seconds run eagerly on a CPU), once per seed,
    immutable, so shared."""
    return jax.jit(init)(jax.random.key(seed))


def init(key: jax.Array):
    """A fresh LeNet + Adam ``TrainState`` (:func:`dpbook.jax.fsdp.create_adam_state`)
    from ``key``; to be traced (``jax.jit``, ``jax.eval_shape``), not run eagerly."""
    from .models import LeNet
    return fsdp.create_adam_state(LeNet(), key)


def new_state(mesh: jax.sharding.Mesh, seed: int = 0):
    """A fresh state born sharded on ``mesh``, and its shardings: ``jax.eval_shape``
    gives the state's shapes without computing it, :func:`dpbook.jax.fsdp.state_shardings`
    a sharding for each, and ``jax.jit(init, out_shardings=...)`` returns each array
    already split that way (no whole state is placed from one device)."""
    key = jax.random.key(seed)
    shardings = fsdp.state_shardings(jax.eval_shape(init, key), mesh)
    return jax.jit(init, out_shardings=shardings)(key), shardings


def place(state: Any, mesh: jax.sharding.Mesh):
    """``state`` placed with :func:`dpbook.jax.fsdp.state_shardings` on ``mesh``, and the
    shardings."""
    shardings = fsdp.state_shardings(state, mesh)
    return jax.device_put(state, shardings), shardings


def train(state: Any, mesh: jax.sharding.Mesh, steps: Sequence[int], batch_size: int):
    """Run the FSDP step (:func:`dpbook.jax.fsdp.make_step`) on ``mesh`` for the global
    batches numbered ``steps`` (the same batches whatever the mesh); the new state and
    the losses."""
    step_fn = fsdp.make_step(mesh, state)
    losses = []
    for step in steps:
        X, y = random_batch(batch_size, seed=1000 + step)
        state, loss = step_fn(state, X, y)
        losses.append(float(loss))
    return state, losses


def shardings_equal(tree: Any, shardings: Any) -> bool:
    """Does every array of ``tree`` have the sharding of the matching leaf of
    ``shardings`` (same devices in the same mesh, same spec)?"""
    return all(a.sharding == s
               for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def max_abs_difference(a: Any, b: Any) -> float:
    """The largest absolute difference between the arrays of two pytrees of one
    structure (gathered to the host)."""
    return max(float(np.abs(np.asarray(u) - np.asarray(v)).max())
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

"""FSDP in JAX by sharding alone: place the training state across the devices, jit the
single-device step, and let XLA insert the collectives.

The concise chapter's ``jit`` method replicates the state (``P()``) and splits the batch
(``P(AXIS)``); XLA then sums the gradients with one all-reduce. Here each array of the
state (parameters and Adam's moments) is split along the same axis as the batch
(:func:`fsdp_spec`: its largest dimension that divides by the number of devices; an array
with none stays replicated, like small biases), and the step is the same function, jitted
with those shardings in and out. XLA's partitioner then gathers each parameter where the
computation needs it whole and hands each device only its slice of the new state. The
mesh's axis is *Auto* (the partitioner chooses), not Explicit as in :func:`dpbook.jax.state.make_mesh`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .state import AXIS, TrainState, loss_fn

__all__ = ["make_auto_mesh", "fsdp_spec", "state_shardings", "create_adam_state",
           "train_step", "make_step", "bytes_per_device"]


def make_auto_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D mesh named ``AXIS`` over ``devices`` whose axis XLA's partitioner handles."""
    return jax.make_mesh((len(devices),), (AXIS,), axis_types=(AxisType.Auto,),
                         devices=devices)


def fsdp_spec(shape: Sequence[int], num_devices: int) -> P:
    """Shard the largest dimension of ``shape`` that ``num_devices`` divides; ``P()``
    (replicated) if none does.

    >>> [tuple(fsdp_spec(shape, 4)) for shape in ((800, 128), (5, 5, 20, 50), (10,))]
    [('devices', None), (None, None, 'devices', None), ()]
    """
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[d] % num_devices == 0:
            return P(*(AXIS if i == d else None for i in range(len(shape))))
    return P()


def state_shardings(state, mesh: Mesh, fsdp: bool = True):
    """A ``NamedSharding`` for every leaf of ``state``: :func:`fsdp_spec` with ``fsdp``,
    replicated (plain data parallelism) without."""
    n = mesh.shape[AXIS]
    return jax.tree.map(
        lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), n) if fsdp else P()), state)


def create_adam_state(model, key: jax.Array, lr: float = 1e-3,
                      input_shape: Sequence[int] = (1, 28, 28, 1)) -> TrainState:
    """``model`` initialized from ``key`` with ``optax.adam(lr)``: two moments per
    parameter, the state that sharding is for."""
    variables = jax.jit(model.init)(key, jnp.ones(input_shape, jnp.float32))
    state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                              tx=optax.adam(lr), batch_stats=variables.get("batch_stats"))
    return state.replace(step=jnp.asarray(state.step))     # an array, so it can be placed


def train_step(state: TrainState, X, y):
    """The single-device step (the concise chapter's ``jit_train_step``): no collectives."""
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, state, X, y)
    return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss


def make_step(mesh: Mesh, state, fsdp: bool = True) -> Callable:
    """:func:`train_step` jitted for ``state`` sharded (``fsdp``) or replicated on ``mesh``
    and a batch split along ``AXIS``; the new state keeps the same shardings."""
    shardings, split = state_shardings(state, mesh, fsdp), NamedSharding(mesh, P(AXIS))
    return jax.jit(train_step, in_shardings=(shardings, split, split),
                   out_shardings=(shardings, NamedSharding(mesh, P())))


def bytes_per_device(tree) -> dict[int, int]:
    """Bytes of ``tree``'s arrays that each device holds (device id → bytes), summed over
    the shards placed on it."""
    out: dict[int, int] = {}
    for a in jax.tree.leaves(tree):
        for shard in a.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out

"""The data-parallel training step of a real run: accumulation, mixed precision, donation.

The concise chapter's ``shard_map`` step (:func:`dpbook.jax.concise.shard_map_train_step`)
with the three things every real training run adds, each one argument of
:func:`make_step`:

``micro_batches``  gradient accumulation: each device splits its share of the batch into
                   ``k`` micro-batches and sums their gradients with ``lax.scan``; one
                   cross-device mean follows, whatever ``k`` is.
``compute_dtype``  mixed precision: the forward and backward passes run in this type
                   (bfloat16), the parameters, their gradients and the optimizer state stay
                   float32 (the master weights).
``comm_dtype``     the type of the gradients on the wire: bfloat16 halves the bytes of the
                   all-reduce, like DDP's ``bf16_compress_hook``.
``donate``         buffer donation (``donate_argnums``): the new state may be written into
                   the buffers of the old one.

With ``micro_batches=1`` and float32 it is the concise chapter's step, and with any ``k``
it takes the same step as the whole batch at once (tests/test_inside_jax.py). Models
without BatchNorm only: BatchNorm's statistics of a micro-batch are not those of the batch.
"""
from __future__ import annotations

from functools import cache, partial
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from .state import AXIS, TrainState

__all__ = ["cast", "mixed_loss", "accumulated_grads", "train_step", "make_step"]


def cast(tree, dtype):
    """``tree`` with its floating-point leaves cast to ``dtype`` (integers untouched)."""
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def mixed_loss(params, apply_fn: Callable, X, y, compute_dtype=jnp.float32):
    """Mean cross-entropy with the model run in ``compute_dtype``.

    The float32 ``params`` are cast on the way in, so their gradients come back float32;
    the logits are cast back to float32 before the softmax, whose sums need the precision.
    """
    logits = apply_fn({"params": cast(params, compute_dtype)}, X.astype(compute_dtype))
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def accumulated_grads(params, apply_fn: Callable, X, y, micro_batches: int,
                      compute_dtype=jnp.float32):
    """The mean loss and mean gradient over ``X``, computed ``micro_batches`` examples'
    shares at a time: ``lax.scan`` runs one micro-batch per iteration and adds its
    gradient to a running sum, so only one micro-batch's activations are alive at once."""
    if len(X) % micro_batches:
        raise ValueError(f"{len(X)} examples per device do not split into "
                         f"{micro_batches} equal micro-batches")
    Xs = X.reshape(micro_batches, -1, *X.shape[1:])      # (k, B/k, 28, 28, 1)
    ys = y.reshape(micro_batches, -1)
    grad_fn = jax.value_and_grad(mixed_loss)

    def one_micro_batch(total, batch):
        loss, grads = grad_fn(params, apply_fn, *batch, compute_dtype)
        return jax.tree.map(jnp.add, total, grads), loss

    zeros = jax.tree.map(jnp.zeros_like, params)
    total, losses = lax.scan(one_micro_batch, zeros, (Xs, ys))
    return losses.mean(), jax.tree.map(lambda g: g / micro_batches, total)


def train_step(state: TrainState, X, y, *, micro_batches: int = 1,
               compute_dtype=jnp.float32, comm_dtype=jnp.float32):
    """One data-parallel step inside ``shard_map``: accumulate, average once, update.

    ``lax.pcast`` marks the replicated parameters as varying (see the concise chapter):
    otherwise their gradients would already be summed over the devices.
    """
    if state.batch_stats is not None:
        raise ValueError("make_step supports models without BatchNorm: a micro-batch's "
                         "statistics are not the batch's")
    params = lax.pcast(state.params, AXIS, to="varying")
    loss, grads = accumulated_grads(params, state.apply_fn, X, y, micro_batches,
                                    compute_dtype)
    grads = lax.pmean(cast(grads, comm_dtype), AXIS)      # the one all-reduce
    grads = cast(grads, jnp.float32)                       # master weights stay float32
    return state.apply_gradients(grads=grads), lax.pmean(loss, AXIS)


@cache
def make_step(mesh: Mesh, micro_batches: int = 1, compute_dtype=jnp.float32,
              comm_dtype=jnp.float32, donate: bool = False) -> Callable:
    """:func:`train_step` on ``mesh``, jitted: ``step(state, X, y) -> (state, loss)`` with
    the state replicated and the batch split along ``AXIS`` (place both with
    ``jax.device_put``). ``donate=True`` donates the state: after the call, the old state's
    arrays are deleted and must not be used again. Cached per argument set."""
    body = partial(train_step, micro_batches=micro_batches, compute_dtype=compute_dtype,
                   comm_dtype=comm_dtype)
    step = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                         out_specs=(P(), P()))
    return jax.jit(step, donate_argnums=(0,) if donate else ())

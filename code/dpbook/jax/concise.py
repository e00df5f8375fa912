"""Concise data parallelism in JAX: the code of the concise chapter.

One training step, three ways to run it on several devices:

``pmap``       the classic API: one copy of the state per device (a leading device axis),
               ``lax.pmean`` averages the gradients.
``shard_map``  today's explicit API: the same per-device code over a ``Mesh``;
               ``lax.pcast`` marks the parameters as varying before differentiating.
``jit``        plain ``jax.jit`` on arrays with a ``NamedSharding``: the batch is split
               across the mesh, the state is replicated, XLA inserts the allreduce.

All three take the same step as one device on the whole minibatch (checked in
``tests/test_concise_jax.py``). Models come from :mod:`dpbook.jax.models`; the state
(:class:`dpbook.jax.state.TrainState`, which carries a BatchNorm model's statistics), the
loss and the mesh from :mod:`dpbook.jax.state`, and what XLA compiled from
:mod:`dpbook.jax.hlo`.
"""
from __future__ import annotations

from functools import cache, partial
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import config
from ..plot import Animator, training_animator
from ..tools import TrainResult, benchmark
from .data import load_data_fashion_mnist
from .devices import Timer, get_devices, get_scale, hardware_line
from .models import LeNet
from .state import (AXIS, TrainState, create_train_state, evaluate_accuracy, loss_fn,
                    make_mesh, predict)

__all__ = ["METHODS", "shard_batch", "replicate", "unreplicate", "pmap_train_step",
           "make_pmap_train_step", "shard_map_train_step", "make_shard_map_train_step",
           "jit_train_step", "make_jit_train_step", "DataParallel", "make_data_parallel",
           "first_copy", "local_batch_stats", "local_and_averaged", "time_steps", "train"]

METHODS = ("pmap", "shard_map", "jit")


def shard_batch(X: np.ndarray, y: np.ndarray, num_devices: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Reshape a minibatch for ``pmap``: (B, ...) → (num_devices, B // num_devices, ...).

    ``pmap`` maps over the leading axis, so every device needs a shard of the same size;
    a batch that does not divide evenly is refused (``ValueError``) rather than trimmed.
    """
    if len(X) != len(y):
        raise ValueError(f"X has {len(X)} examples and y has {len(y)}")
    if num_devices < 1:
        raise ValueError(f"need at least one device, got {num_devices}")
    if len(X) % num_devices:
        raise ValueError(f"a batch of {len(X)} examples does not split evenly across "
                         f"{num_devices} devices; use a multiple of {num_devices}")
    per_device = len(X) // num_devices
    return (X.reshape(num_devices, per_device, *X.shape[1:]),
            y.reshape(num_devices, per_device, *y.shape[1:]))


def replicate(tree, devices: Sequence[jax.Device]):
    """One copy of every array of ``tree`` per device, stacked: (...) → (n, ...), copy i on
    ``devices[i]`` — the layout ``pmap`` wants for arguments mapped over axis 0.

    Like ``flax.jax_utils.replicate``, but on the mesh that ``pmap`` itself uses (axis
    ``AXIS``): with Flax's (axis ``'_device_put_sharded'``) the step compiles a second
    time when it is fed its own output; and the copies are stacked on the host, which
    compiles nothing.
    """
    sharding = NamedSharding(Mesh(np.array(devices), (AXIS,)), P(AXIS))
    return jax.tree.map(
        lambda x: jax.device_put(np.stack([np.asarray(x)] * len(devices)), sharding), tree)


def unreplicate(tree):
    """The first device's copy of a stacked pytree: (n, ...) → (...), on ``devices[0]``.

    ``flax.jax_utils.unreplicate`` (Flax 0.12.8) keeps the shape (1, ...) when n == 1.
    """
    return jax.tree.map(lambda x: x.addressable_shards[0].data.reshape(x.shape[1:]), tree)


def pmap_train_step(state: TrainState, X, y):
    """One device's part of a step under ``jax.pmap``; X (B/n, 28, 28, 1), y (B/n,).

    The loss is a mean over this device's examples, so the mean of the devices'
    gradients (``pmean``, an allreduce) is the gradient of the mean over the whole batch.
    Every device then applies the same update to its copy of the state.
    """
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, state, X, y)
    grads = lax.pmean(grads, axis_name=AXIS)              # allreduce: the sync point
    loss = lax.pmean(loss, axis_name=AXIS)
    batch_stats = lax.pmean(batch_stats, axis_name=AXIS)  # None stays None
    return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss


def make_pmap_train_step(devices: Sequence[jax.Device]) -> Callable:
    """``pmap_train_step`` on ``devices``: state stacked (n, ...), batch (n, B/n, ...).

    Returns ``(state, loss)``: the state keeps its device axis, the loss (the same on
    every device after ``pmean``) comes back once (``out_axes=None``).
    """
    return jax.pmap(pmap_train_step, axis_name=AXIS, devices=devices, out_axes=(0, None))


def shard_map_train_step(state: TrainState, X, y):
    """``pmap_train_step`` for ``jax.shard_map``: one line more, ``lax.pcast``.

    shard_map tracks which values vary across devices. The state comes in replicated
    (unvarying), and the gradient w.r.t. an unvarying input is *already summed* over the
    devices; ``pmean`` of that sum would then return it unchanged — n times the mean.
    Casting the parameters to varying first keeps each device's gradient its own.
    """
    params = lax.pcast(state.params, AXIS, to="varying")  # grads stay per-device
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, state, X, y)
    grads = lax.pmean(grads, axis_name=AXIS)              # allreduce: the sync point
    loss = lax.pmean(loss, axis_name=AXIS)
    batch_stats = lax.pmean(batch_stats, axis_name=AXIS)
    return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss


@cache
def make_shard_map_train_step(mesh: Mesh) -> Callable:
    """``shard_map_train_step`` on ``mesh``, jitted: state replicated ``P()``, batch ``P(AXIS)``.

    Inputs keep their global shapes: X (B, 28, 28, 1) sharded along the batch axis;
    inside, each device sees its block (B/n, 28, 28, 1). Cached per mesh: every
    ``shard_map`` call makes a new function, and ``jit`` would compile it anew.
    """
    step = jax.shard_map(shard_map_train_step, mesh=mesh,
                         in_specs=(P(), P(AXIS), P(AXIS)), out_specs=(P(), P()))
    return jax.jit(step)


def jit_train_step(state: TrainState, X, y):
    """A single-device step on the whole minibatch: no device axis, no collectives.

    Jitted with the batch sharded across a mesh (:func:`make_jit_train_step`), the same
    code runs data-parallel: XLA splits the work and inserts the allreduce itself.
    """
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, state, X, y)
    return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss


def make_jit_train_step(mesh: Mesh) -> Callable:
    """``jit_train_step`` for a state replicated on ``mesh`` and a batch split along ``AXIS``."""
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    return jax.jit(jit_train_step, in_shardings=(replicated, split, split),
                   out_shardings=(replicated, replicated))


class DataParallel(NamedTuple):
    """One method's four moves: place the state, place a batch, step, get the state back."""
    place_state: Callable[[TrainState], Any]
    place_batch: Callable[[np.ndarray, np.ndarray], tuple]
    step: Callable                         # (state, X, y) -> (state, loss)
    get_state: Callable[[Any], TrainState]  # one copy, on devices[0]


def make_data_parallel(method: str, devices: Sequence[jax.Device]) -> DataParallel:
    """The :class:`DataParallel` of ``method`` (``'pmap'``, ``'shard_map'`` or ``'jit'``)."""
    devices = list(devices)
    if not devices:
        raise ValueError("need at least one device")
    if method == "pmap":
        return DataParallel(
            place_state=lambda state: replicate(state, devices),            # (n, ...)
            place_batch=lambda X, y: shard_batch(X, y, len(devices)),        # (n, B/n, ...)
            step=make_pmap_train_step(devices),
            get_state=unreplicate)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    mesh = make_mesh(devices)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    step = make_shard_map_train_step(mesh) if method == "shard_map" else make_jit_train_step(mesh)
    return DataParallel(
        place_state=lambda state: jax.device_put(state, replicated),
        place_batch=lambda X, y: _put_split(X, y, split),
        step=step,
        get_state=first_copy)


def first_copy(tree):
    """The first device's copy of a pytree replicated over a mesh, as single-device arrays.

    Not ``jax.device_put(x, device)``: in JAX 0.10 its result keeps the mesh in its type,
    and a later ``jit`` that mixes it with unsharded arrays fails.
    """
    return jax.tree.map(lambda x: x.addressable_shards[0].data, tree)


def _put_split(X, y, sharding: NamedSharding):
    shard_batch(X, y, sharding.mesh.size)         # same checks and errors as for pmap
    return jax.device_put((X, y), sharding)       # (B, ...), split along the batch axis


def local_batch_stats(state: TrainState, X):
    """The BatchNorm statistics after one training-mode forward pass on ``X`` only.

    Flax keeps running averages: ``new = 0.9 * old + 0.1 * (statistic of X)``.
    """
    _, updates = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats},
                                X, train=True, mutable=["batch_stats"])
    return updates["batch_stats"]


def local_and_averaged(state: TrainState, X):
    """Per device, inside ``pmap``/``shard_map`` over ``AXIS``: the BatchNorm statistics of
    this device's examples ``X`` (:func:`local_batch_stats`), and their mean over the
    devices (``lax.pmean``)."""
    local = local_batch_stats(state, X)
    return local, lax.pmean(local, AXIS)


def time_steps(method: str, devices: Sequence[jax.Device], state: TrainState, X, y,
               num_steps: int) -> dict:
    """Time ``num_steps`` steps of ``method`` on one minibatch; compile excluded.

    :func:`dpbook.tools.benchmark`: one warm-up step compiles and runs first; every timed
    step then starts from the same placed state and the timer waits for its result
    (``Timer.stop`` blocks on it), so the time covers the work, not just its dispatch.
    """
    dpar = make_data_parallel(method, devices)
    state = dpar.place_state(state)
    batch_size = len(y)
    X, y = dpar.place_batch(X, y)
    timer = benchmark(lambda: dpar.step(state, X, y), num_steps, timer=Timer(start=False))
    seconds = timer.avg()
    return {"method": method, "num_devices": len(devices), "batch_size": batch_size,
            "ms_per_step": 1e3 * seconds, "examples_per_sec": batch_size / seconds}


def train(num_devices: int, batch_size: int, lr: float, method: str = "pmap",
          num_epochs: int | None = None, scale: config.Scale | None = None, root=None,
          seed: int = 0, animator: Animator | None = None, model=None) -> TrainResult:
    """Train ``model`` (default ``LeNet()``) on Fashion-MNIST with ``method`` on
    ``num_devices`` devices; returns a :class:`dpbook.tools.TrainResult` whose ``model``
    is the trained state (one copy, on the first device).

    The global minibatch is ``batch_size`` (each device gets ``batch_size / num_devices``).
    One untimed warm-up step compiles first; the step is functional, so its result is
    simply dropped.
    """
    scale = scale or get_scale()
    num_epochs = num_epochs or scale.num_epochs
    devices = get_devices(num_devices)
    model = model or LeNet()
    train_iter, test_iter = load_data_fashion_mnist(batch_size, scale.num_train,
                                                    scale.num_test, root=root, seed=seed)
    dpar = make_data_parallel(method, devices)
    state = dpar.place_state(create_train_state(model, jax.random.key(seed), lr))
    if animator is None:
        animator = training_animator(
            num_epochs, f"{method}, {num_devices} device(s), batch {batch_size}, lr {lr}")
    jax.block_until_ready(dpar.step(state, *dpar.place_batch(*next(iter(train_iter)))))
    timer = Timer(start=False)
    for epoch in range(num_epochs):
        losses = []
        timer.start()
        for X, y in train_iter:
            state, loss = dpar.step(state, *dpar.place_batch(X, y))
            losses.append(loss)          # no float() here: keep the dispatch asynchronous
        timer.stop(state)
        train_loss = float(np.mean(jax.device_get(losses)))
        test_acc = evaluate_accuracy(partial(predict, dpar.get_state(state)), test_iter)
        animator.add(epoch + 1, (train_loss, test_acc))
    return TrainResult(num_devices=num_devices, batch_size=batch_size, lr=lr,
                       test_acc=test_acc, train_loss=train_loss,
                       epoch_times=list(timer.times), hardware=hardware_line(devices),
                       model=dpar.get_state(state), animator=animator, method=method)

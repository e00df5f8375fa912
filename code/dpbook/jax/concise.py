"""Concise data parallelism in JAX: the code of the concise chapter.

One training step, three ways to run it on several devices:

``pmap``       the classic API: one copy of the state per device (a leading device axis),
               ``lax.pmean`` averages the gradients.
``shard_map``  today's explicit API: the same per-device code over a ``Mesh``;
               ``lax.pcast`` marks the parameters as varying before differentiating.
``jit``        plain ``jax.jit`` on arrays with a ``NamedSharding``: the batch is split
               across the mesh, the state is replicated, XLA inserts the allreduce.

All three take the same step as one device on the whole minibatch (checked in
``tests/test_concise_jax.py``). Models come from :mod:`dpbook.jax.models`, plus
:class:`LeNetBN`; a model with BatchNorm carries its statistics in :class:`TrainState`.
"""
from __future__ import annotations

import re
from functools import cache, partial
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn, struct
from flax.training import train_state
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .. import config
from ..plot import Animator, training_animator
from ..tools import Accumulator
from .data import load_data_fashion_mnist
from .devices import Timer, get_devices, get_scale, hardware_line
from .models import LeNet

__all__ = ["AXIS", "METHODS", "LeNetBN", "TrainState", "create_train_state", "shard_batch",
           "replicate", "unreplicate", "loss_fn", "pmap_train_step", "make_pmap_train_step",
           "make_mesh", "shard_map_train_step", "make_shard_map_train_step", "jit_train_step",
           "make_jit_train_step", "DataParallel", "make_data_parallel", "first_copy",
           "max_difference", "allreduce_ops", "local_batch_stats", "evaluate_accuracy",
           "time_steps", "train"]

#: The name of the device axis, for ``pmap``'s ``axis_name`` and the mesh.
AXIS = "devices"
METHODS = ("pmap", "shard_map", "jit")


class LeNetBN(nn.Module):
    """``dp.LeNet`` with BatchNorm after both convolutions and the hidden dense layer.

    A small model with BatchNorm for the chapter and its tests (ResNet-18 has the same
    kind of layers, but compiles far more slowly on a CPU). ``axis_name`` makes
    BatchNorm compute its statistics over all devices of that axis (synchronized
    BatchNorm); the model then only runs inside ``pmap``/``shard_map``, except in ``init``.
    """
    num_classes: int = 10
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):                # (B, 28, 28, 1)
        bn = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                     epsilon=1e-5, axis_name=self.axis_name)  # PyTorch's defaults
        x = nn.relu(bn()(nn.Conv(20, (3, 3), padding="VALID")(x)))   # (B, 26, 26, 20)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))                  # (B, 13, 13, 20)
        x = nn.relu(bn()(nn.Conv(50, (5, 5), padding="VALID")(x)))   # (B, 9, 9, 50)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))                  # (B, 4, 4, 50)
        x = x.reshape((x.shape[0], -1))                             # (B, 800)
        x = nn.relu(bn()(nn.Dense(128)(x)))
        return nn.Dense(self.num_classes)(x)


class TrainState(train_state.TrainState):
    """Flax's ``TrainState`` (step, params, optimizer state) plus BatchNorm statistics.

    ``batch_stats`` is ``None`` for a model without BatchNorm (LeNet); ``None`` is an
    empty pytree, so ``pmap``, ``pmean`` and ``device_put`` pass it through untouched.
    """
    batch_stats: Any = struct.field(default=None)


@partial(jax.jit, static_argnames=("model", "input_shape"))
def _init_variables(model, key, input_shape):
    return model.init(key, jnp.ones(input_shape, jnp.float32))


def create_train_state(model, key: jax.Array, lr: float,
                       input_shape: Sequence[int] = (1, 28, 28, 1)) -> TrainState:
    """Initialize ``model`` from ``key`` and pair it with minibatch SGD (``optax.sgd``).

    ``model.init`` is jitted, once per model and input shape: run eagerly, every
    operation compiles on its own, which is slow on a CPU. The state lives on the default device; the data-parallel methods place it.
    """
    variables = _init_variables(model, key, tuple(input_shape))
    return TrainState.create(apply_fn=model.apply, params=variables["params"],
                             tx=optax.sgd(lr), batch_stats=variables.get("batch_stats"))


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


def loss_fn(params, state: TrainState, X, y):
    """Mean cross-entropy over the examples in ``X``, and the new BatchNorm statistics.

    Differentiated w.r.t. ``params`` (the first argument); the statistics (``None``
    without BatchNorm) are an auxiliary output, computed from these examples only.
    """
    if state.batch_stats is None:
        logits, batch_stats = state.apply_fn({"params": params}, X), None
    else:
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                         X, train=True, mutable=["batch_stats"])
        batch_stats = updates["batch_stats"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, batch_stats


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


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D mesh named ``AXIS`` over ``devices``, with an *Explicit* axis.

    Explicit (the default of ``jax.make_mesh`` in this JAX) puts the sharding in each
    array's type: ``jax.typeof(X)`` reads ``float32[256@devices,28,28,1]``, and JAX
    refuses, instead of silently moving, an array whose sharding does not match.
    """
    return jax.make_mesh((len(devices),), (AXIS,), axis_types=(AxisType.Explicit,),
                         devices=devices)


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


def max_difference(a, b) -> float:
    """The largest absolute difference between two pytrees of arrays of the same structure."""
    diffs = jax.tree.map(lambda u, v: float(np.abs(np.asarray(u) - np.asarray(v)).max()), a, b)
    return max(jax.tree.leaves(diffs))


def allreduce_ops(jitted: Callable, *args) -> list[str]:
    """The all-reduce instructions XLA compiled for ``jitted(*args)``, as result types.

    E.g. ``['(f32[20], f32[3,3,1,20], ..., f32[])']``: one entry per all-reduce, listing
    the arrays it sums (XLA fuses many small ones into one).
    """
    text = jitted.lower(*args).compile().as_text()
    ops = re.findall(r"= (\(.*?\)|\S+) all-reduce(?:-start)?\(", text)
    return [re.sub(r"\{[^}]*\}|/\*.*?\*/", "", op) for op in ops]


def local_batch_stats(state: TrainState, X):
    """The BatchNorm statistics after one training-mode forward pass on ``X`` only.

    Flax keeps running averages: ``new = 0.9 * old + 0.1 * (statistic of X)``.
    """
    _, updates = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats},
                                X, train=True, mutable=["batch_stats"])
    return updates["batch_stats"]


@jax.jit
def _predict(state: TrainState, X):
    if state.batch_stats is None:
        logits = state.apply_fn({"params": state.params}, X)
    else:
        logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats},
                                X, train=False)
    return jnp.argmax(logits, axis=1)


def evaluate_accuracy(state: TrainState, data_iter) -> float:
    """Accuracy of ``state`` (one copy, on one device) on ``data_iter``."""
    metric = Accumulator(2)     # correct, examples
    for X, y in data_iter:
        metric.add(int((np.asarray(_predict(state, X)) == y).sum()), len(y))
    return metric[0] / metric[1]


def time_steps(method: str, devices: Sequence[jax.Device], state: TrainState, X, y,
               num_steps: int) -> dict:
    """Time ``num_steps`` steps of ``method`` on one minibatch; compile excluded.

    One warm-up step compiles and runs first; the timer then waits for the last state
    (``Timer.stop`` blocks on it), so the time covers the work, not just its dispatch.
    """
    dpar = make_data_parallel(method, devices)
    state = dpar.place_state(state)
    batch_size = len(y)
    X, y = dpar.place_batch(X, y)
    jax.block_until_ready(dpar.step(state, X, y))          # warm-up: compile
    timer = Timer()
    for _ in range(num_steps):
        state, loss = dpar.step(state, X, y)
    seconds = timer.stop(state) / num_steps                # waits for the devices
    return {"method": method, "num_devices": len(devices), "batch_size": batch_size,
            "ms_per_step": 1e3 * seconds, "examples_per_sec": batch_size / seconds}


def train(num_devices: int, batch_size: int, lr: float, method: str = "pmap",
          num_epochs: int | None = None, scale: config.Scale | None = None, root=None,
          seed: int = 0, animator: Animator | None = None, model=None) -> dict:
    """Train ``model`` (default ``LeNet()``) on Fashion-MNIST with ``method`` on
    ``num_devices`` devices; returns the results like ``dpbook.jax.scratch.train``.

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
        test_acc = evaluate_accuracy(dpar.get_state(state), test_iter)
        animator.add(epoch + 1, (train_loss, test_acc))
    return {"method": method, "num_devices": num_devices, "batch_size": batch_size, "lr": lr,
            "test_acc": test_acc, "train_loss": train_loss,
            "sec_per_epoch": timer.avg(), "epoch_times": list(timer.times),
            "state": dpar.get_state(state), "animator": animator,
            "hardware": hardware_line(devices)}

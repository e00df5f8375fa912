"""The training state and its basics, shared by the JAX chapters.

The axis name ``AXIS`` and the 1-D mesh over it (:func:`make_mesh`), Flax's
``TrainState`` with BatchNorm statistics (:class:`TrainState`,
:func:`create_train_state`), the mean cross-entropy loss of a state (:func:`loss_fn`),
and the measurements every chapter takes of a result: the accuracy of a predictor
(:func:`evaluate_accuracy`) and the distance between two pytrees
(:func:`max_abs_difference`). Used by :mod:`dpbook.jax.concise`,
:mod:`dpbook.jax.allreduce`, :mod:`dpbook.jax.unequal` and :mod:`dpbook.jax.scratch`.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state
from jax.sharding import AxisType, Mesh

from ..tools import Accumulator

__all__ = ["AXIS", "TrainState", "create_train_state", "cross_entropy", "loss_fn", "make_mesh", "predict",
           "evaluate_accuracy", "max_abs_difference"]

#: The name of the device axis, for ``pmap``'s ``axis_name`` and the mesh.
AXIS = "devices"


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


def cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits`` against integer labels ``y``, through one-hot labels.

    The same loss as ``optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()``,
    but its gradient has no scatter. With the batch sharded over an *Explicit* mesh, JAX
    0.11 cannot give the scatter of the integer-label version's gradient a sharding and
    stops with a ``ShardingTypeError`` (seen with jax 0.11.2; jax-ml/jax#31795).
    """
    labels = jax.nn.one_hot(y, logits.shape[-1], dtype=logits.dtype)
    return optax.softmax_cross_entropy(logits, labels).mean()


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
    loss = cross_entropy(logits, y)
    return loss, batch_stats


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D mesh named ``AXIS`` over ``devices``, with an *Explicit* axis.

    Explicit (the default of ``jax.make_mesh`` in this JAX) puts the sharding in each
    array's type: ``jax.typeof(X)`` reads ``float32[256@devices,28,28,1]``, and JAX
    refuses, instead of silently moving, an array whose sharding does not match.
    """
    return jax.make_mesh((len(devices),), (AXIS,), axis_types=(AxisType.Explicit,),
                         devices=devices)


@jax.jit
def predict(state: TrainState, X) -> jax.Array:
    """The predicted classes (B,) of ``state``'s model for ``X``, in evaluation mode
    (BatchNorm uses its running statistics)."""
    if state.batch_stats is None:
        logits = state.apply_fn({"params": state.params}, X)
    else:
        logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats},
                                X, train=False)
    return jnp.argmax(logits, axis=1)


def evaluate_accuracy(predict: Callable[[np.ndarray], Any], data_iter: Iterable) -> float:
    """The fraction of the examples of ``data_iter`` that ``predict`` classifies right.

    ``predict`` maps a batch of images ``X`` (numpy) to the predicted classes (B,), e.g.
    ``functools.partial(dpbook.jax.state.predict, state)``, which computes them on the
    device of ``state``. The classes come back to the host to be compared with ``y``.
    """
    metric = Accumulator(2)     # correct, examples
    for X, y in data_iter:
        metric.add(int((np.asarray(predict(X)) == np.asarray(y)).sum()), len(y))
    return metric[0] / metric[1]


def max_abs_difference(a, b) -> float:
    """The largest absolute difference between two pytrees of arrays of the same structure."""
    diffs = jax.tree.map(lambda u, v: float(np.abs(np.asarray(u) - np.asarray(v)).max()), a, b)
    return max(jax.tree.leaves(diffs))

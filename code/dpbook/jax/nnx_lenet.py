"""LeNet in Flax NNX, and its data-parallel step with ``jax.jit`` over a mesh.

Flax has two module APIs. Linen (``flax.linen``, the rest of this book) keeps a module
stateless: ``init`` returns the parameters and every call takes them. NNX (``flax.nnx``)
keeps them in the module, like PyTorch. The Flax documentation encourages new users to
use NNX (https://flax.readthedocs.io, docs_nnx/index.rst) and keeps Linen supported.

:class:`LeNet` is :class:`dpbook.jax.models.LeNet` layer for layer; :func:`from_linen`
copies a Linen LeNet's parameters into it, so both start equal and, after a step, must
still be equal (tests/test_inside_jax.py).
"""
from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

from .state import cross_entropy

__all__ = ["LeNet", "LINEN_NAMES", "from_linen", "to_linen", "train_step", "make_step"]


class LeNet(nnx.Module):
    """conv 20 (3×3) → ReLU → avg-pool → conv 50 (5×5) → ReLU → avg-pool → 128 → 10."""

    def __init__(self, num_classes: int = 10, *, rngs: nnx.Rngs):
        self.conv0 = nnx.Conv(1, 20, (3, 3), padding="VALID", rngs=rngs)
        self.conv1 = nnx.Conv(20, 50, (5, 5), padding="VALID", rngs=rngs)
        self.dense0 = nnx.Linear(800, 128, rngs=rngs)
        self.dense1 = nnx.Linear(128, num_classes, rngs=rngs)

    def __call__(self, x):                                               # (B, 28, 28, 1)
        x = nnx.avg_pool(nnx.relu(self.conv0(x)), (2, 2), strides=(2, 2))  # (B, 13, 13, 20)
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), (2, 2), strides=(2, 2))  # (B, 4, 4, 50)
        x = x.reshape((x.shape[0], -1))                                  # (B, 800)
        return self.dense1(nnx.relu(self.dense0(x)))


#: NNX attribute → Linen's automatic name of the same layer.
LINEN_NAMES = {"conv0": "Conv_0", "conv1": "Conv_1", "dense0": "Dense_0", "dense1": "Dense_1"}


def from_linen(params, num_classes: int = 10) -> LeNet:
    """An NNX :class:`LeNet` holding a copy of a Linen LeNet's ``params``. Both APIs store a
    convolution kernel as (height, width, in, out) and a dense one as (in, out)."""
    model = LeNet(num_classes, rngs=nnx.Rngs(0))
    for attribute, name in LINEN_NAMES.items():
        layer = getattr(model, attribute)
        for p in ("kernel", "bias"):
            if getattr(layer, p).shape != params[name][p].shape:
                raise ValueError(f"{name}.{p}: Linen has {params[name][p].shape}, "
                                 f"NNX {getattr(layer, p).shape}")
            getattr(layer, p)[...] = params[name][p]
    return model


def to_linen(model: LeNet) -> dict:
    """The parameters of an NNX :class:`LeNet` as a Linen LeNet's ``params`` dict."""
    return {name: {p: getattr(getattr(model, attribute), p)[...] for p in ("kernel", "bias")}
            for attribute, name in LINEN_NAMES.items()}


def train_step(graphdef, state, X, y):
    """One step of a model and its ``nnx.Optimizer``, both given as ``nnx.split`` parts.

    The functional form lets plain ``jax.jit`` compile it: ``nnx.merge`` rebuilds the
    objects inside the traced function and ``nnx.state`` takes their new state out.
    """
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
        return cross_entropy(model(X), y)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss


def make_step(graphdef) -> Callable:
    """``step(state, X, y) -> (state, loss)``: :func:`train_step` for ``graphdef``, jitted.

    Data parallelism comes from the arrays alone, as with the concise chapter's ``jit``: a
    state placed replicated and a batch split along the mesh (``jax.device_put`` with a
    ``NamedSharding``) make XLA compile a per-device step and the gradient all-reduce.
    """
    return jax.jit(lambda state, X, y: train_step(graphdef, state, X, y))

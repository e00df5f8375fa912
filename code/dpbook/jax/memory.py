"""Activation memory in JAX: LeNet with every hidden layer under ``nn.remat`` and a
``jax.checkpoint`` policy, which says which values of the layer the forward pass keeps
for the backward pass (``jax.checkpoint_policies``: ``nothing_saveable`` keeps only the
layer's input, ``dots_saveable`` also the outputs of its matrix products and
convolutions, ``everything_saveable`` all of it, as without ``remat``)."""
from __future__ import annotations

from typing import Callable

from flax import linen as nn

__all__ = ["PolicyLeNet"]


class PolicyLeNet(nn.Module):
    """:class:`dpbook.jax.fsdp.RematLeNet` with a checkpoint ``policy``: each hidden layer
    (convolution or dense, its ReLU and pooling) under ``nn.remat(..., policy=policy)``.
    ``policy=None`` is ``RematLeNet`` (JAX's default, which saves nothing inside the
    layer). The parameters have LeNet's names and shapes, so one state runs every
    variant."""
    policy: Callable | None = None
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):                                   # (B, 28, 28, 1)
        def conv(layer, x):                                  # convolution, ReLU, pooling
            return nn.avg_pool(nn.relu(layer(x)), (2, 2), strides=(2, 2))

        def dense(layer, x):
            return nn.relu(layer(x))

        conv = nn.remat(conv, policy=self.policy)            # recomputed in backward,
        dense = nn.remat(dense, policy=self.policy)          # except what policy saves
        x = conv(nn.Conv(20, (3, 3), padding="VALID"), x)    # (B, 13, 13, 20)
        x = conv(nn.Conv(50, (5, 5), padding="VALID"), x)    # (B, 4, 4, 50)
        x = dense(nn.Dense(128), x.reshape((x.shape[0], -1)))
        return nn.Dense(self.num_classes)(x)                 # the last layer: no ReLU

"""Evaluation: the accuracy of a model on a data set, on one device or split across
several (d2l's ``evaluate_accuracy_gpus``)."""
from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from ..tools import Accumulator
from .devices import split_batch

__all__ = ["accuracy", "evaluate_accuracy", "evaluate_accuracy_gpus", "max_abs_difference"]


def max_abs_difference(a, b) -> float:
    """The largest absolute difference between two sets of tensors (two models'
    parameters, say): sequences compared in order, or dicts compared key by key."""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            raise ValueError("the two dicts hold different tensors")
        a, b = list(a.values()), [b[k] for k in a]
    a, b = list(a), list(b)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} tensors against {len(b)}")
    return max((float((x.detach().double() - y.detach().double()).abs().max())
                for x, y in zip(a, b) if x.numel()), default=0.0)


def accuracy(y_hat: torch.Tensor, y: torch.Tensor) -> float:
    """Number of correct predictions (not the fraction: sums add up across shards)."""
    return float((y_hat.argmax(dim=1) == y).sum())


@torch.no_grad()
def evaluate_accuracy(net, data_iter, device: torch.device | None = None) -> float:
    """Accuracy of ``net`` on ``data_iter``, computed on ``device``.

    ``net`` is a module (evaluated in eval mode, then restored; ``device`` defaults to
    its parameters') or any function from a batch of images to logits.
    """
    module = net if isinstance(net, torch.nn.Module) else None
    if device is None:
        device = next(module.parameters()).device if module is not None else torch.device("cpu")
    was_training = module is not None and module.training
    if module is not None:
        module.eval()
    metric = Accumulator(2)  # correct, examples
    for X, y in data_iter:
        X, y = X.to(device), y.to(device)
        metric.add(accuracy(net(X), y), y.numel())
    if module is not None:
        module.train(was_training)
    return metric[0] / metric[1]


@torch.no_grad()
def evaluate_accuracy_gpus(net: nn.Module, data_iter, devices: Sequence[torch.device]) -> float:
    """Accuracy of ``net`` with every test batch split across ``devices``.

    Each device evaluates its shard with its own copy of the module (a real copy on every
    GPU other than the module's; on a CPU all "devices" share the module). Work is queued
    on all GPUs before any result is read, so they evaluate side by side.
    """
    module = net.module if isinstance(net, nn.DataParallel) else net
    home = next(module.parameters()).device
    replicas = [module if d == home else copy.deepcopy(module).to(d) for d in devices]
    was_training = module.training
    for replica in replicas:
        replica.eval()
    metric = Accumulator(2)      # correct predictions, examples
    try:
        for X, y in data_iter:
            X_shards, y_shards = split_batch(X, y, devices[:len(X)])
            outputs = [replica(X_shard) for replica, X_shard in zip(replicas, X_shards)]
            for y_hat, y_shard in zip(outputs, y_shards):   # reading the result syncs
                metric.add(accuracy(y_hat, y_shard), y_shard.numel())
    finally:
        module.train(was_training)
    return metric[0] / metric[1]

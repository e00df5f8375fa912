"""Evaluation helpers shared by the PyTorch chapters."""
from __future__ import annotations

import torch

from ..tools import Accumulator

__all__ = ["accuracy", "evaluate_accuracy"]


def accuracy(y_hat: torch.Tensor, y: torch.Tensor) -> float:
    """Number of correct predictions (not the fraction: sums add up across shards)."""
    return float((y_hat.argmax(dim=1) == y).sum())


@torch.no_grad()
def evaluate_accuracy(net: torch.nn.Module, data_iter, device: torch.device | None = None
                      ) -> float:
    """Accuracy of ``net`` on ``data_iter``, computed on ``device`` (default: the net's)."""
    if device is None:
        device = next(net.parameters()).device
    was_training = net.training
    net.eval()
    metric = Accumulator(2)  # correct, examples
    for X, y in data_iter:
        X, y = X.to(device), y.to(device)
        metric.add(accuracy(net(X), y), y.numel())
    net.train(was_training)
    return metric[0] / metric[1]

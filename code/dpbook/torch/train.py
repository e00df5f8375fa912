"""Evaluation helpers shared by the PyTorch chapters."""
from __future__ import annotations

import torch

from ..tools import Accumulator

__all__ = ["accuracy", "evaluate_accuracy"]


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

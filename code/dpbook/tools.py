"""Timer, Accumulator and cosine_lr: small tools every training loop uses."""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

__all__ = ["Timer", "Accumulator", "cosine_lr"]


class Timer:
    """Record wall-clock times with :func:`time.perf_counter`.

    GPUs (and JAX on any device) run asynchronously: the Python call returns before the
    work is done. ``sync`` is called before every reading so a time covers the work and not
    just its launch. ``dpbook.torch.Timer`` passes one that synchronizes CUDA; for
    ``dpbook.jax.Timer`` pass the result to wait for: ``timer.stop(result)``.
    """

    def __init__(self, sync: Callable[[Any], Any] | None = None, *, start: bool = True):
        self.times: list[float] = []
        self._sync = sync
        self._tik: float | None = None
        if start:
            self.start()

    def start(self) -> None:
        """Start (or restart) the timer."""
        self._wait(None)
        self._tik = time.perf_counter()

    def stop(self, result: Any = None) -> float:
        """Wait for ``result`` (and the device), record the time since :meth:`start`, return it."""
        if self._tik is None:
            raise RuntimeError("Timer.stop() called before Timer.start()")
        self._wait(result)
        self.times.append(time.perf_counter() - self._tik)
        self._tik = None
        return self.times[-1]

    def _wait(self, result: Any) -> None:
        if self._sync is not None:
            self._sync(result)

    def avg(self) -> float:
        """The average recorded time."""
        return sum(self.times) / len(self.times)

    def median(self) -> float:
        """The median recorded time: what a benchmark reports, robust to a slow outlier."""
        return statistics.median(self.times)

    def sum(self) -> float:
        """The sum of the recorded times."""
        return sum(self.times)

    def cumsum(self) -> list[float]:
        """The running sums of the recorded times."""
        out, total = [], 0.0
        for t in self.times:
            total += t
            out.append(total)
        return out


class Accumulator:
    """Sum ``n`` quantities over many calls to :meth:`add` (losses, correct counts, sizes)."""

    def __init__(self, n: int):
        self.data = [0.0] * n

    def add(self, *args: float) -> None:
        if len(args) != len(self.data):
            raise ValueError(f"Accumulator holds {len(self.data)} values, add() got {len(args)}")
        self.data = [a + float(b) for a, b in zip(self.data, args)]

    def reset(self) -> None:
        self.data = [0.0] * len(self.data)

    def __getitem__(self, idx: int) -> float:
        return self.data[idx]


def cosine_lr(lr: float, step: int, num_steps: int, warmup_steps: int = 0) -> float:
    """The learning rate for ``step`` (0, 1, …) of ``num_steps``: a linear warm-up over
    the first ``warmup_steps`` steps, from ``lr / warmup_steps`` up to ``lr``, then ``lr``
    decayed along half a cosine to nearly 0 at the last step.

    With a constant learning rate the last steps keep jumping around the minimum, so the
    final accuracy depends on where the last step happened to land; decaying the rate
    lets the last epochs settle. The warm-up keeps a large learning rate from throwing
    the still random parameters far off in the first steps, where gradients are largest.
    """
    if not 0 <= step < num_steps:
        raise ValueError(f"step {step} is outside 0 … {num_steps - 1}")
    if not 0 <= warmup_steps < num_steps:
        raise ValueError(f"warmup_steps must be in 0 … {num_steps - 1}, got {warmup_steps}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    t = (step - warmup_steps) / (num_steps - warmup_steps)
    return lr * 0.5 * (1 + math.cos(math.pi * t))

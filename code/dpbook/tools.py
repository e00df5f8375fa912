"""Small tools every training loop uses: Timer, benchmark, Accumulator, cosine_lr,
TrainResult and atomic_write."""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from typing import Any, Callable

__all__ = ["Timer", "benchmark", "Accumulator", "cosine_lr", "TrainResult", "atomic_write"]


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


def benchmark(fn: Callable[[], Any], repeats: int, warmup: int = 1,
              timer: Timer | None = None) -> Timer:
    """Call ``fn()`` ``warmup`` times untimed (compilation, caches, connections), then
    ``repeats`` times, each timed on its own; return the :class:`Timer` with the times
    (``.median()``, ``min(.times)``, ``.avg()``).

    Pass the framework's timer (``dp.Timer(start=False)``) so every reading waits for the
    device: the value ``fn`` returns is what ``Timer.stop`` waits for (JAX arrays).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    timer = Timer(start=False) if timer is None else timer
    for _ in range(warmup):
        timer.start()
        timer.stop(fn())
    timer.times.clear()                       # the warm-up calls do not count
    for _ in range(repeats):
        timer.start()
        timer.stop(fn())
    return timer


class Accumulator:
    """Sum ``n`` quantities over many calls to ``add`` (losses, correct counts, sizes)."""

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


@dataclasses.dataclass
class TrainResult:
    """What a training run of the book returns (every ``train`` function, both frameworks).

    ``model`` is what was trained: the per-device parameters (from scratch), the module
    (PyTorch, concise) or the train state (JAX, concise). ``extra`` holds what only one
    method reports (e.g. what ``nn.DataParallel`` ran on).
    """

    num_devices: int
    batch_size: int
    lr: float
    test_acc: float
    train_loss: float
    epoch_times: list[float]
    hardware: str
    model: Any = None
    animator: Any = None
    method: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def sec_per_epoch(self) -> float:
        """The mean wall time of an epoch (training only; evaluation not included)."""
        return sum(self.epoch_times) / len(self.epoch_times)


def atomic_write(path: str | os.PathLike, write: Callable[[str], Any]) -> str:
    """Call ``write(tmp)`` to write a file beside ``path``, then rename it to ``path``:
    a reader (another process, a restarted run) never sees half a file. Returns ``path``."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    root, ext = os.path.splitext(path)
    tmp = f"{root}.tmp{os.getpid()}{ext}"     # same folder: the rename is atomic
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path

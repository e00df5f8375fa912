"""Devices for PyTorch: find them, time on them, split a batch across them."""
from __future__ import annotations

from typing import Sequence

import torch

from .. import config, devices as _core, tools

__all__ = ["try_gpu", "try_all_gpus", "get_devices", "synchronize", "Timer", "get_scale",
           "hardware_line", "split_batch"]


def try_gpu(i: int = 0) -> torch.device:
    """GPU ``i`` if it exists, else the CPU."""
    if torch.cuda.device_count() >= i + 1:
        return torch.device(f"cuda:{i}")
    return torch.device("cpu")


def try_all_gpus() -> list[torch.device]:
    """All GPUs, or ``[device('cpu')]`` when there are none (never an empty list)."""
    gpus = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    return gpus or [torch.device("cpu")]


def get_devices(n: int | None = None) -> list[torch.device]:
    """The ``n`` devices a chapter trains on.

    ``n`` defaults to ``$DPBOOK_NUM_DEVICES``, else every GPU, else 2. With GPUs these are
    ``cuda:0 … cuda:n-1`` (asking for more than exist is an error). Without a GPU they are
    ``n`` entries of ``device('cpu')``: "devices" that share the same cores, so the
    code paths are those of several GPUs but nothing runs faster.
    """
    num_gpus = torch.cuda.device_count()
    if n is None:
        n = config.num_devices(default=num_gpus or 2)
    if n < 1:
        raise ValueError(f"need at least one device, got {n}")
    if num_gpus == 0:
        return [torch.device("cpu")] * n
    if n > num_gpus:
        raise ValueError(f"asked for {n} devices but this machine has {num_gpus} GPU(s); "
                         f"set DPBOOK_NUM_DEVICES to at most {num_gpus}")
    return [torch.device(f"cuda:{i}") for i in range(n)]


def synchronize(_result=None) -> None:
    """Wait until every GPU has finished its queued work (no-op without CUDA)."""
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


class Timer(tools.Timer):
    """:class:`dpbook.Timer` that synchronizes every GPU before reading the clock."""

    def __init__(self, *, start: bool = True):
        super().__init__(sync=synchronize, start=start)


def get_scale(name: str | None = None) -> config.Scale:
    """:func:`dpbook.get_scale` with the default chosen by ``torch.cuda.is_available()``."""
    return config.get_scale(name, has_gpu=torch.cuda.is_available())


def hardware_line(devices: Sequence[torch.device] | None = None) -> str:
    """Where a number came from: CPU, GPUs, the devices used, torch version and scale."""
    if devices is None:
        devices = get_devices()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return _core.hardware_line(devices, gpus, {"torch": torch.__version__},
                               get_scale().name)


def split_batch(X: torch.Tensor, y: torch.Tensor, devices: Sequence[torch.device],
                weights: Sequence[float] | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split a minibatch along its first axis into one shard per device.

    Shards are as equal as possible (:func:`dpbook.split_sizes`: 10 examples on 4 devices
    → 3, 3, 2, 2), or in proportion to ``weights`` (say, each device's measured
    examples per second: ``weights=[3, 1]`` gives the first device three quarters); a
    batch smaller than the number of devices is refused with a ``ValueError``. Returns
    ``(X_shards, y_shards)``, shard ``i`` on ``devices[i]``.
    """
    if len(X) != len(y):
        raise ValueError(f"X has {len(X)} examples and y has {len(y)}")
    sizes = _core.split_sizes(len(X), len(devices), weights)
    X_shards = [x.to(d) for x, d in zip(torch.split(X, sizes), devices)]
    y_shards = [t.to(d) for t, d in zip(torch.split(y, sizes), devices)]
    return X_shards, y_shards

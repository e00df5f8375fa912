"""Devices for PyTorch: find them, time on them, split a batch across them."""
from __future__ import annotations

from typing import Sequence

import torch

from .. import config, devices as _core, tools

__all__ = ["try_gpu", "try_all_gpus", "get_devices", "devices_note", "synchronize", "Timer",
           "get_scale", "hardware_line", "split_batch", "full_float32"]


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

    ``n`` defaults to ``$DPBOOK_NUM_DEVICES``, else every GPU, else 2 (1 GPU: 2 as well).
    With at least ``n`` GPUs these are ``cuda:0 … cuda:n-1``. With fewer, GPU ``i % g``
    holds replica ``i``: on one GPU, ``n`` replicas share it (the code paths of ``n``
    devices, not their speed). Without a GPU they are ``n`` entries of
    ``device('cpu')``, replicas that share the same cores. :func:`devices_note` says which.
    """
    num_gpus = torch.cuda.device_count()
    if n is None:
        n = config.num_devices(default=max(num_gpus, 2))
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"need at least one device, got {n!r}")
    if num_gpus == 0:
        return [torch.device("cpu")] * n
    return [torch.device(f"cuda:{i % num_gpus}") for i in range(n)]


def devices_note(devices: Sequence[torch.device]) -> str | None:
    """One line for the reader when ``devices`` repeat a device (several replicas on one
    GPU, or on the CPU), else ``None``."""
    distinct = sorted({str(d) for d in devices})
    if len(distinct) == len(devices):
        return None
    where = "the CPU" if distinct == ["cpu"] else ", ".join(distinct)
    return (f"{len(devices)} replicas on {where}: the code of {len(devices)} devices, "
            "without their speed")


def synchronize(devices: Sequence[torch.device] | None = None) -> None:
    """Wait until the GPUs in ``devices`` (default: the current one) have finished their
    queued work; a no-op without CUDA. Only the GPUs in use are touched."""
    if not torch.cuda.is_available():
        return
    gpus = {d for d in (devices or [None]) if d is None or torch.device(d).type == "cuda"}
    for d in gpus:
        torch.cuda.synchronize(d)


class Timer(tools.Timer):
    """:class:`dpbook.tools.Timer` that synchronizes the GPUs in ``devices`` (default: the
    current one) before reading the clock."""

    def __init__(self, devices: Sequence[torch.device] | None = None, *, start: bool = True):
        super().__init__(sync=lambda _result=None: synchronize(devices), start=start)


def full_float32() -> None:
    """Compute float32 as float32 on GPUs: no TF32 in cuDNN convolutions or CUDA matmuls
    (cuDNN uses TF32 by default on Ampere and later). Equivalence checks call it, so
    that k devices equal one device up to float32 rounding, as on a CPU."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def get_scale(name: str | None = None) -> config.Scale:
    """:func:`dpbook.config.get_scale` with the default chosen by ``torch.cuda.device_count()``."""
    return config.get_scale(name, num_gpus=torch.cuda.device_count())


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

    Shards are as equal as possible (:func:`dpbook.devices.split_sizes`: 10 examples on 4 devices
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

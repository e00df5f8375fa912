"""Devices for JAX: pick them, time on them, split a batch across them."""
from __future__ import annotations

from typing import Any, Sequence

import jax

from .. import config, devices as _core, tools

__all__ = ["try_gpu", "try_all_gpus", "get_devices", "all_devices", "devices_note", "synchronize", "Timer",
           "get_scale", "hardware_line", "split_batch"]


def _gpus() -> list[jax.Device]:
    return [d for d in jax.devices() if d.platform == "gpu"]


def try_gpu(i: int = 0) -> jax.Device:
    """GPU ``i`` if it exists, else the first CPU device (d2l's name)."""
    gpus = _gpus()
    return gpus[i] if i < len(gpus) else jax.devices("cpu")[0]


def try_all_gpus() -> list[jax.Device]:
    """All GPUs, or ``[first CPU device]`` when there are none (never an empty list)."""
    return _gpus() or [jax.devices("cpu")[0]]


def get_devices(n: int | None = None) -> list[jax.Device]:
    """The ``n`` devices a chapter uses: the first ``n`` of ``jax.devices()``.

    ``n`` defaults to ``$DPBOOK_NUM_DEVICES``, else all devices, but at least 2 when the
    CPU has 2 emulated devices (:func:`dpbook.devices.emulate_cpu_devices`, called before
    ``import jax``). A GPU is one device in JAX: on a machine with fewer GPUs than ``n``,
    the chapters run on ``n`` emulated CPU devices instead (:func:`devices_note` says so).
    """
    available, cpus = jax.devices(), jax.devices("cpu")
    if n is None:
        n = config.num_devices(default=max(len(available), min(len(cpus), 2)))
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"need at least one device, got {n!r}")
    if n <= len(available):
        return available[:n]
    if n <= len(cpus):
        return cpus[:n]
    raise ValueError(
        f"asked for {n} devices but jax has {len(available)} ({available[0].platform}) and "
        f"{len(cpus)} CPU device(s); call dpbook.emulate_cpu_devices({n}) before "
        "`import jax` (restart the kernel first if jax is already imported)")


def all_devices() -> list[jax.Device]:
    """Every device a page can spread work over: ``jax.devices()``, or the emulated CPU
    devices when there are more of them (one GPU and 8 emulated CPU devices: the 8)."""
    return max(jax.devices(), jax.devices("cpu"), key=len)


def devices_note(devices: Sequence[jax.Device]) -> str | None:
    """One line for the reader when ``devices`` are emulated CPU devices on a machine
    with a GPU, else ``None``."""
    gpus = _gpus()
    if gpus and devices and devices[0].platform == "cpu":
        return (f"{len(devices)} emulated CPU devices: this machine has {len(gpus)} GPU(s), "
                "and JAX counts a GPU as one device")
    return None


def synchronize(result: Any = None) -> None:
    """Wait until ``result`` (any pytree of arrays) is computed; JAX dispatches asynchronously."""
    if result is not None:
        jax.block_until_ready(result)


class Timer(tools.Timer):
    """:class:`dpbook.tools.Timer` for JAX: ``timer.stop(result)`` waits for ``result`` first."""

    def __init__(self, *, start: bool = True):
        super().__init__(sync=synchronize, start=start)


def get_scale(name: str | None = None) -> config.Scale:
    """:func:`dpbook.config.get_scale` with the default chosen by the number of GPUs."""
    return config.get_scale(name, num_gpus=len(_gpus()))


def hardware_line(devices: Sequence[jax.Device] | None = None) -> str:
    """Where a number came from: CPU, GPUs, the devices used, jax version and scale."""
    if devices is None:
        devices = get_devices()
    if (jax.config.jax_platforms or "").split(",") == ["cpu"]:
        gpus = ["not used (jax_platforms=cpu)"]   # JAX does not look for them
    else:
        gpus = [d.device_kind for d in jax.devices() if d.platform == "gpu"]
    return _core.hardware_line([f"{d.platform}:{d.id}" for d in devices], gpus,
                               {"jax": jax.__version__}, get_scale().name)


def split_batch(X, y, devices: Sequence[jax.Device], weights: Sequence[float] | None = None
                ) -> tuple[list[jax.Array], list[jax.Array]]:
    """Split a minibatch along its first axis, shard ``i`` placed on ``devices[i]``.

    Shards are as equal as possible (:func:`dpbook.devices.split_sizes`: 10 examples on 4 devices
    → 3, 3, 2, 2), or in proportion to ``weights`` (``weights=[3, 1]`` gives the first
    device three quarters); a batch smaller than the number of devices is refused with a
    ``ValueError``. Unequal shard shapes make jitted code compile once per shape, so
    chapters pick batch sizes that divide evenly.
    """
    if len(X) != len(y):
        raise ValueError(f"X has {len(X)} examples and y has {len(y)}")
    sizes = _core.split_sizes(len(X), len(devices), weights)
    X_shards, y_shards, start = [], [], 0
    for size, device in zip(sizes, devices):
        X_shards.append(jax.device_put(X[start:start + size], device))
        y_shards.append(jax.device_put(y[start:start + size], device))
        start += size
    return X_shards, y_shards

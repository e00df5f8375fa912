"""Framework-free device helpers: emulate several CPU devices for JAX, describe the hardware."""
from __future__ import annotations

import os
import platform
import re
import sys
from typing import Iterable, Sequence

__all__ = ["emulate_cpu_devices", "hardware_line", "cpu_name", "split_sizes"]

_FLAG = "--xla_force_host_platform_device_count"


def emulate_cpu_devices(n: int) -> None:
    """Make JAX show ``n`` CPU devices. Call it **before** ``import jax``.

    Sets ``--xla_force_host_platform_device_count=n`` in ``XLA_FLAGS``, keeping any other
    flags already there (an existing count is replaced). XLA reads the flag once, when JAX
    first creates its CPU backend; if that already happened with fewer devices, this
    raises a ``RuntimeError`` that says to restart the kernel/process.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"number of devices must be a positive integer, got {n!r}")
    old = os.environ.get("XLA_FLAGS")
    flags = [f for f in (old or "").split() if not f.startswith(_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_FLAG}={n}"])
    if "jax" in sys.modules:
        have = len(sys.modules["jax"].devices("cpu"))
        if have < n:
            if old is None:
                del os.environ["XLA_FLAGS"]
            else:
                os.environ["XLA_FLAGS"] = old
            raise RuntimeError(
                f"jax was imported before emulate_cpu_devices({n}) and already has {have} CPU "
                f"device(s); XLA reads XLA_FLAGS only once. Restart the kernel (or process) "
                f"and call dpbook.emulate_cpu_devices({n}) before `import jax`.")


def cpu_name() -> str:
    """The CPU model, e.g. ``'AMD EPYC 7B13'`` (best effort; never raises)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            import subprocess
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                 capture_output=True, text=True, timeout=5).stdout.strip()
            if out:
                return out
        except Exception:  # noqa: BLE001
            pass
    return platform.processor() or platform.machine() or "unknown CPU"


def hardware_line(devices: Iterable[object], accelerators: Sequence[str] = (),
                  frameworks: dict[str, str] | None = None, scale: str | None = None) -> str:
    """One line that says where a number came from: CPU, cores, RAM, accelerators, devices.

    ``dpbook.torch.hardware_line`` and ``dpbook.jax.hardware_line`` fill in the
    framework's device list, GPU names and version.
    """
    import psutil
    ram = psutil.virtual_memory().total / 2**30
    cores = psutil.cpu_count(logical=True)
    parts = [f"cpu: {cpu_name()} ({cores} logical cores, {ram:.0f} GiB RAM)"]
    if accelerators:
        parts.append("gpus: " + ", ".join(accelerators))
    else:
        parts.append("gpus: none")
    devs = [str(d) for d in devices]
    parts.append(f"devices ({len(devs)}): [{', '.join(devs)}]")
    for name, version in (frameworks or {}).items():
        parts.append(f"{name} {version}")
    if scale:
        parts.append(f"scale: {scale}")
    return "hardware | " + " | ".join(parts)


def split_sizes(n: int, k: int, weights: Sequence[float] | None = None) -> list[int]:
    """Sizes of ``k`` parts of ``n`` examples: as equal as possible, or in proportion to
    ``weights`` (MXNet's ``work_load_list``).

    Every part gets at least one example, and the sizes always add up to ``n`` (largest
    remainders get the rest). Raises ``ValueError`` when ``n < k``, which would leave a
    device with nothing to do, or for weights that are not ``k`` positive numbers.

    >>> split_sizes(10, 4)                      # the first parts are the larger ones
    [3, 3, 2, 2]
    >>> split_sizes(128, 2, weights=[3, 1])
    [96, 32]
    """
    if k < 1:
        raise ValueError(f"need at least one device, got {k}")
    if n < k:
        raise ValueError(f"cannot split a batch of {n} example(s) across {k} devices: "
                         f"every device needs at least one; use a batch of at least {k}")
    if weights is None:
        q, r = divmod(n, k)
        return [q + 1] * r + [q] * (k - r)
    weights = [float(w) for w in weights]
    if len(weights) != k or not all(w > 0 and w < float("inf") for w in weights):
        raise ValueError(f"need {k} positive, finite weights (one per device), got {weights}")
    # one example each, then the remaining n - k in proportion to the weights
    shares = [(n - k) * w / sum(weights) for w in weights]
    sizes = [1 + int(s) for s in shares]
    by_remainder = sorted(range(k), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    for i in by_remainder[:n - sum(sizes)]:
        sizes[i] += 1
    return sizes

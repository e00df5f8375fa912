"""The α–β (latency–bandwidth) cost model of communication. Framework-free.

Sending one message of ``n`` bytes costs ``α + n β``: a fixed latency α (seconds: software,
handshakes, the first byte's trip) plus β seconds per byte (1 / bandwidth). An allreduce
algorithm sends messages in rounds; if a round's messages travel on different links at
the same time, the round costs what one message costs. So an algorithm's time is
``L α + B n β``, with ``L`` rounds and ``B n`` bytes in sequence on the busiest link
(:func:`coefficients`). Computing the sums is left out: on GPUs and on a CPU alike it is
much faster than moving the bytes.

That assumes *separate* links that work in parallel, like the NVLinks between GPUs. When
every message goes through one shared medium — processes on one machine, copying through
the same cores and memory — what counts is the total of bytes sent by everybody
(``links="shared"``), and that is ``2 (N - 1) n`` for all three algorithms.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np

__all__ = ["ALGORITHMS", "coefficients", "predict", "relative_error", "fit", "bus_bandwidth",
           "transfer_seconds", "break_even_batch", "communication_share", "LINKS",
           "LINK_LATENCY", "DEVICE_FLOPS"]

ALGORITHMS = ("naive", "ring", "tree")


def coefficients(algorithm: str, world_size: int, links: str = "separate"
                 ) -> tuple[float, float]:
    """``(L, B)`` of ``algorithm`` on ``world_size`` processes: time = L α + B n β.

    * naive: rank 0 receives N - 1 messages of n bytes one after the other, then sends
      N - 1: L = B = 2 (N - 1).
    * ring: 2 (N - 1) rounds, every link carries n / N bytes per round: L = 2 (N - 1),
      B = 2 (N - 1) / N, which tends to 2 — the time hardly grows with N.
    * tree (binomial): ⌈log₂ N⌉ rounds up, as many down, n bytes each: L = B = 2 ⌈log₂ N⌉.

    With ``links="shared"``, B counts the bytes *all* processes send: 2 (N - 1) for every
    algorithm (each of the N - 1 non-root contributions travels once up and the sum once
    down, or, in the ring, N processes send 2 (N - 1) / N n each).
    """
    if world_size < 1:
        raise ValueError(f"need at least one process, got {world_size}")
    if links not in ("separate", "shared"):
        raise ValueError(f"links must be 'separate' or 'shared', not {links!r}")
    n = world_size
    if algorithm == "naive":
        L, B = 2.0 * (n - 1), 2.0 * (n - 1)
    elif algorithm == "ring":
        L, B = 2.0 * (n - 1), 2.0 * (n - 1) / n
    elif algorithm == "tree":
        depth = math.ceil(math.log2(n))
        L, B = 2.0 * depth, 2.0 * depth
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}: choose one of "
                         f"{', '.join(ALGORITHMS)}")
    return (L, 2.0 * (n - 1)) if links == "shared" else (L, B)


def predict(algorithm: str, nbytes: float, world_size: int, alpha: float, beta: float,
            links: str = "separate") -> float:
    """Seconds for one allreduce of ``nbytes`` by ``algorithm``, per the α–β model."""
    L, B = coefficients(algorithm, world_size, links)
    return L * alpha + B * nbytes * beta


def break_even_batch(nbytes: float, world_size: int, alpha: float, beta: float,
                     seconds_per_example: float, algorithm: str = "ring",
                     links: str = "separate") -> float:
    """The per-device batch ``b*`` whose backward pass lasts as long as the allreduce.

    ``b* = T_allreduce / t``, with ``T_allreduce`` = :func:`predict` of ``nbytes`` (for
    the ring: ``2 (N - 1) α + 2 (N - 1) / N · nbytes · β``) and ``t`` =
    ``seconds_per_example``, the backward pass's time per example on one device. With a
    per-device batch of at least ``b*``, an allreduce that overlaps the backward pass
    (DDP's buckets) can hide behind it; below ``b*``, communication dominates the step.
    More bytes raise ``b*``; more computation per example lowers it.
    """
    if seconds_per_example <= 0:
        raise ValueError(f"seconds_per_example must be positive, got {seconds_per_example}")
    return predict(algorithm, nbytes, world_size, alpha, beta, links) / seconds_per_example


def communication_share(batch: float, comm_seconds: float, seconds_per_example: float,
                        fixed_seconds: float = 0.0, hidden_per_example: float = 0.0
                        ) -> float:
    """The predicted share of a data-parallel step's time spent waiting for communication,
    at a per-device batch of ``batch`` examples.

    The step computes for ``fixed_seconds + batch · seconds_per_example`` and
    communicates for ``comm_seconds`` (e.g. :func:`predict` of the gradients' bytes), of
    which up to ``batch · hidden_per_example`` can hide behind the computation (the
    backward pass per example, when buckets are sent while it runs; 0 when the gradients
    go out in one piece after it, as DDP's single bucket for a small model). The exposed
    part ``max(0, comm_seconds - batch · hidden_per_example)`` over the step's time.
    It falls as the batch grows; with full overlap it reaches 0 at
    :func:`break_even_batch`.
    """
    if batch <= 0 or seconds_per_example <= 0:
        raise ValueError("batch and seconds_per_example must be positive, got "
                         f"{batch} and {seconds_per_example}")
    exposed = max(0.0, comm_seconds - batch * hidden_per_example)
    return exposed / (fixed_seconds + batch * seconds_per_example + exposed)


def relative_error(measurements: Iterable[Mapping], alpha: float, beta: float,
                   links: str = "separate") -> float:
    """The root-mean-square relative error of the model on ``measurements``."""
    errors = [(predict(m["algorithm"], m["bytes"], m["processes"], alpha, beta, links)
               - m["seconds"]) / m["seconds"] for m in measurements]
    return float(np.sqrt(np.mean(np.square(errors))))


def fit(measurements: Iterable[Mapping], links: str = "separate") -> tuple[float, float]:
    """α (seconds) and β (seconds per byte) that best explain ``measurements``.

    Each measurement is a mapping with ``algorithm``, ``processes``, ``bytes`` and
    ``seconds`` (what :func:`dpbook.torch.allreduce.benchmark` returns). Least squares on
    the *relative* error, so that the 1 KB and the 64 MB messages count alike, and
    neither value may be negative.
    """
    rows, targets = [], []
    for m in measurements:
        L, B = coefficients(m["algorithm"], m["processes"], links)
        rows.append([L / m["seconds"], B * m["bytes"] / m["seconds"]])
        targets.append(1.0)
    if len(rows) < 2:
        raise ValueError("need at least two measurements to fit α and β")
    A, t = np.array(rows), np.array(targets)
    alpha, beta = np.linalg.lstsq(A, t, rcond=None)[0]
    if alpha < 0:       # the latency is lost in the noise: fit the bandwidth alone
        alpha, beta = 0.0, float(A[:, 1] @ t / (A[:, 1] @ A[:, 1]))
    elif beta < 0:
        alpha, beta = float(A[:, 0] @ t / (A[:, 0] @ A[:, 0])), 0.0
    return float(alpha), float(beta)


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> float:
    """Bytes per second each link carried (NCCL's "bus bandwidth"): ``n / t · 2 (N-1) / N``.

    It compares allreduce implementations and process counts on one scale: a ring
    that keeps every link busy reaches the link's bandwidth whatever N is.
    """
    return nbytes / seconds * 2 * (world_size - 1) / world_size


#: Bandwidths (bytes/s, one direction) of common links, from the vendors' data sheets —
#: peak numbers; real transfers reach roughly 70–90 % of them.
LINKS = {
    "PCIe 3.0 x16": 15.75e9,
    "PCIe 4.0 x16": 31.5e9,
    "PCIe 5.0 x16": 63.0e9,
    "NVLink (V100, 6 links)": 150e9,
    "NVLink (H100, 18 links)": 450e9,
    "Ethernet 10 Gbit/s": 1.25e9,
    "Ethernet 100 Gbit/s": 12.5e9,
    "InfiniBand NDR 400 Gbit/s": 50e9,
}

#: A typical latency α (seconds per message) of each link in :data:`LINKS`, for the α–β
#: model: typical orders of magnitude, not measurements — software, driver and NIC decide
#: as much as the wire. The GPU links and InfiniBand follow NCCL's own α–β model
#: (``hwLat`` in NCCL's ``src/graph/tuning.cc``: seconds per ring step, Simple protocol:
#: NVLink 3.4 µs, PCIe 5.7 µs, network 9.6 µs in the NCCL 2.x release read for this
#: table; later releases raise the network's to 14 µs; NCCL adds one fixed launch cost
#: per collective on top).
LINK_LATENCY = {
    # A step over PCIe between two GPUs (NCCL: 5.7 µs). PCIe's generations double the
    # bandwidth; the latency of a message stays about the same.
    "PCIe 3.0 x16": 6e-6,
    "PCIe 4.0 x16": 6e-6,
    "PCIe 5.0 x16": 6e-6,
    # A step over NVLink (NCCL: 3.4 µs); NVIDIA's p2pBandwidthLatencyTest (CUDA samples)
    # shows a GPU-to-GPU write of a couple of µs on either generation.
    "NVLink (V100, 6 links)": 3e-6,
    "NVLink (H100, 18 links)": 3e-6,
    # TCP through the kernel's network stack (gloo, NCCL's socket transport): a message
    # costs tens of µs, at 10 and 100 Gbit/s alike; the stack, not the wire, sets it.
    "Ethernet 10 Gbit/s": 30e-6,
    "Ethernet 100 Gbit/s": 30e-6,
    # RDMA itself takes 1–2 µs (perftest's ib_write_lat); NCCL's model puts a network
    # step, GPU, PCIe and proxy thread included, at 9.6 µs.
    "InfiniBand NDR 400 Gbit/s": 10e-6,
}

#: Peak dense matrix throughput (floating-point operations per second) of a device, from
#: the vendor's data sheet. NVIDIA's H100 data sheet (SXM) gives 1,979 teraFLOPS of
#: BF16 tensor-core throughput "with sparsity"; dense products run at half that: 528
#: tensor cores × 1,024 FLOPs per clock × 1.83 GHz = 989 teraFLOPS. A peak, like
#: :data:`LINKS`: real training computes slower.
DEVICE_FLOPS = {
    "H100 SXM, bfloat16": 989e12,
}


def transfer_seconds(nbytes: float, bandwidth: float, latency: float = 0.0) -> float:
    """``latency + nbytes / bandwidth``: one message over one link."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return latency + nbytes / bandwidth

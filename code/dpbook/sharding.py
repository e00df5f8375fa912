"""Where the memory of data-parallel training goes, and what sharding it costs. Framework-free.

A model with Ψ parameters trained with Adam keeps, on every device of plain data
parallelism (DDP), the parameters, their gradients and Adam's two moments. ZeRO
(Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") shards them over the N devices in three stages:

========  =====================================  =======================================
stage     sharded over the N devices             communication per step (ring)
========  =====================================  =======================================
0 (DDP)   nothing                                allreduce of the gradients: 2 (N-1)/N Ψ
1         optimizer state                        reduce-scatter + all-gather: 2 (N-1)/N Ψ
2         + gradients                            the same
3 (FSDP)  + parameters                           2 all-gathers + reduce-scatter: 3 (N-1)/N Ψ
========  =====================================  =======================================

(values sent by each device, times the bytes of one value). Mixed precision keeps 16-bit
parameters and gradients for compute and communication, and float32 master weights beside
Adam's float32 moments: 2 + 2 + (4 + 4 + 4) = 16 bytes per parameter, the paper's "16Ψ".

None of that counts the activations: the values the forward pass keeps for the backward
pass. They grow with the per-device batch, not with N, and ZeRO does not shard them.
:func:`activation_bytes` is the count for any network, from the values it keeps per
example; :func:`transformer_activation_bytes` is the per-layer estimate of Korthikanti et
al. (2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.1),
with and without full activation checkpointing (recomputation), with the attention scores
stored (the paper's baseline) or not (fused attention).
"""
from __future__ import annotations

__all__ = ["STAGES", "PRECISIONS", "bytes_per_parameter", "memory_per_device",
           "devices_to_fit", "values_sent", "collective_seconds", "step_seconds",
           "activation_bytes", "transformer_activation_bytes"]

STAGES = (0, 1, 2, 3)

#: bytes per parameter of (parameters, gradients, optimizer state) with Adam:
#: float32: 4 + 4 + (4 + 4) for the two moments; mixed: 2 + 2 + (4 master + 4 + 4).
PRECISIONS = {"float32": (4, 4, 8), "mixed": (2, 2, 12)}


def bytes_per_parameter(precision: str = "float32") -> tuple[int, int, int]:
    """``(parameters, gradients, optimizer state)`` bytes per parameter with Adam."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {list(PRECISIONS)}")
    return PRECISIONS[precision]


def memory_per_device(num_params: int, stage: int, world_size: int,
                      precision: str = "float32") -> dict[str, float]:
    """Bytes each device holds for parameters, gradients and optimizer state (and their
    ``total``) at ZeRO ``stage`` on ``world_size`` devices. Activations not included.

    >>> memory_per_device(1000, 0, 4)
    {'params': 4000.0, 'grads': 4000.0, 'optimizer': 8000.0, 'total': 16000.0}
    >>> memory_per_device(1000, 3, 4)['total']
    4000.0
    """
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage}")
    if world_size < 1:
        raise ValueError(f"need at least one device, got {world_size}")
    p, g, o = bytes_per_parameter(precision)
    n = world_size
    out = {"params": num_params * p / (n if stage >= 3 else 1),
           "grads": num_params * g / (n if stage >= 2 else 1),
           "optimizer": num_params * o / (n if stage >= 1 else 1)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def devices_to_fit(num_params: int, budget_bytes: float, stage: int,
                   precision: str = "float32", max_devices: int = 1 << 20,
                   activations: float = 0.0) -> int | None:
    """The fewest devices on which ``stage`` fits ``num_params`` into ``budget_bytes`` per
    device, or ``None`` if no number of devices does (stages 0–2 keep a part whole).
    ``activations`` is the bytes of activations on each device (for its per-device batch,
    e.g. from :func:`transformer_activation_bytes`); more devices do not shrink them.

    >>> devices_to_fit(1000, 10_000, 1), devices_to_fit(1000, 10_000, 0)
    (4, None)
    >>> devices_to_fit(1000, 10_000, 3, activations=6_000)
    4
    """
    if activations < 0:
        raise ValueError(f"activations must be >= 0 bytes, got {activations}")

    def fits(n: int) -> bool:
        state = memory_per_device(num_params, stage, n, precision)["total"]
        return state + activations <= budget_bytes

    if not fits(max_devices):
        return None
    lo, hi = 1, max_devices            # memory falls as devices are added: bisect
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def values_sent(num_params: int, stage: int, world_size: int) -> float:
    """Values each device sends per step with ring collectives (multiply by the bytes of
    one value): 2 (N-1)/N Ψ for stages 0–2, 3 (N-1)/N Ψ for stage 3.

    >>> values_sent(1000, 0, 4), values_sent(1000, 3, 4)
    (1500.0, 2250.0)
    """
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage}")
    n = world_size
    return (3 if stage == 3 else 2) * (n - 1) / n * num_params


def collective_seconds(kind: str, nbytes: float, world_size: int, alpha: float,
                       beta: float) -> float:
    """α–β time of one ring collective on ``nbytes`` (the full tensor): ``allreduce``
    2 (N-1) (α + nbytes/N β); ``reduce-scatter`` and ``all-gather`` half of that, the
    two halves of the ring allreduce (:mod:`dpbook.costmodel`)."""
    rounds = {"allreduce": 2, "reduce-scatter": 1, "all-gather": 1}
    if kind not in rounds:
        raise ValueError(f"unknown collective {kind!r}; choose from {list(rounds)}")
    n = world_size
    return rounds[kind] * (n - 1) * (alpha + nbytes / n * beta)


def step_seconds(num_params: int, stage: int, world_size: int, alpha: float, beta: float,
                 bytes_per_value: int = 4, layers: int = 1) -> float:
    """α–β communication time of one step at ``stage``, the model's parameters sent in
    ``layers`` equal pieces (buckets for stages 0–2, FSDP units for stage 3), nothing
    overlapped with computation."""
    piece = num_params * bytes_per_value / layers
    if stage == 0:
        one = collective_seconds("allreduce", piece, world_size, alpha, beta)
    elif stage in (1, 2):
        one = (collective_seconds("reduce-scatter", piece, world_size, alpha, beta)
               + collective_seconds("all-gather", piece, world_size, alpha, beta))
    elif stage == 3:
        one = (2 * collective_seconds("all-gather", piece, world_size, alpha, beta)
               + collective_seconds("reduce-scatter", piece, world_size, alpha, beta))
    else:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage}")
    return layers * one if world_size > 1 else 0.0



def activation_bytes(values_per_example: int, batch: int, bytes_per_value: int = 4) -> int:
    """Bytes of activations kept for the backward pass on one device: ``values_per_example``
    values kept per example (from the layers' shapes), times the per-device ``batch``, times
    ``bytes_per_value`` (4 in float32, 2 in 16 bits). Linear in the batch: the batch, not
    the model, decides how much of the memory activations take.

    >>> activation_bytes(1000, 32)
    128000
    """
    for name, value in (("values_per_example", values_per_example), ("batch", batch),
                        ("bytes_per_value", bytes_per_value)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return values_per_example * batch * bytes_per_value


def transformer_activation_bytes(seq_len: int, batch: int, hidden: int, heads: int,
                                 layers: int, checkpoint: bool = False,
                                 flash: bool = False) -> float:
    """Bytes of activations of ``layers`` transformer layers in 16-bit training, per device.

    Korthikanti et al. (2022), section 4.1: one layer of a GPT-style transformer (GeLU MLP
    4h wide, dropout) keeps s·b·h·(34 + 5·a·s/h) bytes for sequence length s, per-device
    batch b, hidden size h and a attention heads (16-bit values, 1-byte dropout masks; no
    tensor parallelism). By default the attention scores are stored, as in the paper's
    baseline: the 5·a·s/h term is the a score matrices of s×s. With ``flash`` (fused
    attention, e.g. FlashAttention) they are never stored, and a layer keeps s·b·h·34
    bytes: the paper's selective recomputation (section 5) drops exactly that term. (A
    fused kernel keeps a few statistics per row, a·s·b values: not counted.)
    With full activation ``checkpoint`` ing only each layer's input is kept, 2·s·b·h bytes
    per layer (the paper's section 4.2), and during the backward pass one layer at a time
    is recomputed, which holds that layer's activations once more: the peak counted here.
    Embeddings, the output logits and the loss are not counted.

    >>> transformer_activation_bytes(2048, 1, 4096, 32, 32) / 1e9
    30.601641984
    >>> transformer_activation_bytes(2048, 1, 4096, 32, 32, flash=True) / 1e9
    9.126805504
    """
    for name, value in (("seq_len", seq_len), ("batch", batch), ("hidden", hidden),
                        ("heads", heads), ("layers", layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads})")
    s, b, h, a = seq_len, batch, hidden, heads
    per_layer = s * b * h * 34                            # s·b·h·34
    if not flash:
        per_layer += 5 * a * s * s * b                     # + the s×s scores: 5·a·s²·b
    if checkpoint:
        return layers * 2 * s * b * h + per_layer
    return layers * per_layer

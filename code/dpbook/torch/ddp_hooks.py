"""DDP communication hooks that count what they send, and the one list of them.

DDP calls a communication hook once per bucket of gradients instead of its own
allreduce (``model.register_comm_hook(state, hook)``). :func:`counting_hook` does what
DDP does by default; :func:`counting_compress_hook` is PyTorch's ``fp16_compress_hook`` /
``bf16_compress_hook``; :func:`dpbook.torch.compression.two_bit_hook` sends 2-bit codes.
Each adds its calls and bytes to the ``state`` it is registered with (a :class:`Counter`,
or the 2-bit hook's ``TwoBitState``). :data:`HOOKS` names them all, and :func:`register`
puts one on a model — the training script's ``--comm-hook``, the precision and the
compression pages use it::

    counter = register(model, "fp16")
    ...                                    # train
    counter.calls, counter.bytes

(:func:`recording_hook` instead writes down which parameters each bucket holds, in a
:class:`BucketLog`.)

DDP checks a hook's annotations at run time (``bucket: dist.GradBucket``, returning
``torch.futures.Future[torch.Tensor]``), so this module does not postpone them
(no ``from __future__ import annotations``).
"""
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .compression import TwoBitState, two_bit_hook

__all__ = ["Counter", "counting_hook", "counting_compress_hook", "Hook", "HOOKS",
           "payload_bytes", "register", "BucketLog", "recording_hook"]


@dataclasses.dataclass
class Counter:
    """What a counting hook has sent: allreduce calls and bytes."""

    calls: int = 0
    bytes: int = 0
    dtype: torch.dtype | None = None     # the compressed type (None: the gradients' own)


def counting_hook(counter: Counter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own averaging (divide the bucket by the number of processes, then allreduce
    it), counting each call and its bytes in ``counter``."""
    tensor = bucket.buffer()
    counter.calls += 1
    counter.bytes += tensor.numel() * tensor.element_size()
    tensor.div_(dist.get_world_size())
    work = dist.all_reduce(tensor, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def counting_compress_hook(counter: Counter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's compression hook for ``counter.dtype`` (``torch.float16``: the
    ``fp16_compress_hook``, ``torch.bfloat16``: the ``bf16_compress_hook``: cast the bucket,
    divide, allreduce, cast back), counting the bytes that travel."""
    counter.calls += 1
    counter.bytes += bucket.buffer().numel() * torch.finfo(counter.dtype).bits // 8
    hook = {torch.float16: default_hooks.fp16_compress_hook,
            torch.bfloat16: default_hooks.bf16_compress_hook}[counter.dtype]
    return hook(None, bucket)                  # None: the default process group


@dataclasses.dataclass(frozen=True)
class Hook:
    """How one entry of :data:`HOOKS` sends a float32 gradient entry."""

    bits: int                            # on the wire, per gradient entry
    dtype: torch.dtype | None = None     # what fp16/bf16 cast the bucket to


#: name → how DDP sends the gradients with that hook
HOOKS = {"float32": Hook(32),                          # counting_hook: DDP's own allreduce
         "fp16": Hook(16, torch.float16),              # counting_compress_hook
         "bf16": Hook(16, torch.bfloat16),             # counting_compress_hook
         "2bit": Hook(2)}                              # compression.two_bit_hook


def _hook(name: str) -> Hook:
    if name not in HOOKS:
        raise ValueError(f"unknown hook {name!r}; choose from {list(HOOKS)}")
    return HOOKS[name]


def payload_bytes(numel: int, name: str) -> int:
    """Bytes one process hands to the collectives for ``numel`` gradient entries with the
    hook ``name``.

    >>> [payload_bytes(1001, name) for name in ("float32", "bf16", "2bit")]
    [4004, 2002, 251]
    """
    return -(-numel * _hook(name).bits // 8)             # whole bytes, rounded up


def register(model: torch.nn.parallel.DistributedDataParallel, name: str = "float32",
             threshold: float = 0.01) -> Counter | TwoBitState:
    """Put the hook ``name`` (a key of :data:`HOOKS`) on ``model`` and return its state:
    its ``calls`` and ``bytes`` grow as DDP sends gradients. ``threshold`` is the 2-bit
    hook's."""
    hook = _hook(name)
    if name == "2bit":
        state = TwoBitState(threshold)
        model.register_comm_hook(state, two_bit_hook)
        return state
    counter = Counter(dtype=hook.dtype)
    model.register_comm_hook(counter, counting_hook if hook.dtype is None
                             else counting_compress_hook)
    return counter


@dataclasses.dataclass
class BucketLog:
    """What :func:`recording_hook` saw: per backward pass, the buckets in the order DDP
    handed them over, each ``{"index", "params", "bytes"}`` (parameter names from
    ``names``: ``id(parameter)`` → name); and the storage of every bucket buffer of the
    latest pass (``data_ptr`` → bytes), to tell whether the gradients live in the buckets."""

    names: dict
    iterations: list = dataclasses.field(default_factory=list)
    storages: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, module: torch.nn.Module) -> "BucketLog":
        return cls(names={id(p): n for n, p in module.named_parameters()})

    def new_iteration(self) -> None:
        """Call before each backward pass."""
        self.iterations.append([])
        self.storages.clear()        # DDP may have rebuilt, and freed, the buckets


def recording_hook(log: BucketLog, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default allreduce (``default_hooks.allreduce_hook``), after writing down the
    bucket's index, its parameters' names and its bytes in ``log``."""
    buffer = bucket.buffer()
    log.iterations[-1].append({"index": bucket.index(),
                               "params": [log.names[id(p)] for p in bucket.parameters()],
                               "bytes": buffer.numel() * buffer.element_size()})
    storage = buffer.untyped_storage()
    log.storages[storage.data_ptr()] = storage.nbytes()
    return default_hooks.allreduce_hook(None, bucket)   # None: the default process group

"""Checked exercises for PyTorch (see :mod:`dpbook.exercises`): the reader's allreduce and
split_batch, run on the cases careless solutions get wrong, on CPU "devices" (distinct
tensors, as in the from-scratch chapter), so they run on any laptop."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..exercises import HINTS, Failure, run_check

__all__ = ["check_allreduce", "check_split_batch"]

HINTS.update({
    "allreduce-rebind": {
        "en": "data[i] now refers to another tensor than the one the device held: the caller "
              "still sees the old values. Write the result into each device's tensor in place "
              "(t[:] = … or t.copy_(…)) instead of assigning a new tensor to data[i]",
        "zh": "data[i]现在指向的已不是设备上原来那个张量，调用者看到的仍是旧值。请把结果就地写进每个设备的张量"
              "（t[:] = …或t.copy_(…)），而不是给data[i]赋一个新张量"},
    "allreduce-sum": {
        "en": "every device must end with the sum of the tensors of *all* devices; check the "
              "loop bounds, and that each device gets the total, not a partial sum",
        "zh": "每个设备最后都必须得到*所有*设备上张量之和；检查循环的范围，并确认每个设备拿到的是总和而不是部分和"},
    "allreduce-mean": {
        "en": "that is the mean: the allreduce of this chapter sums (the caller divides by the "
              "batch size afterwards)",
        "zh": "这是平均值：本章的全归约求的是和（之后由调用者除以批量大小）"},
    "allreduce-device": {
        "en": "each tensor must stay on its own device and keep its dtype",
        "zh": "每个张量都必须留在原来的设备上，并保持原来的数据类型"},
    "split-batch-count": {
        "en": "return one part of X and one of y per device",
        "zh": "每个设备都要得到X的一份和y的一份"},
    "split-batch-order": {
        "en": "the parts, put back together in device order, must give X and y unchanged: no "
              "example dropped (the remainder!), repeated or moved, and y split like X",
        "zh": "按设备顺序拼接各份，必须原样得到X和y：不能丢掉样本（注意余数！），不能重复或打乱，y的切分要与X一致"},
    "split-batch-even": {
        "en": "two parts may differ by at most one example",
        "zh": "任意两份的样本数最多相差1"},
    "split-batch-device": {
        "en": "part i of X and of y must be on devices[i]",
        "zh": "X和y的第i份都必须放在devices[i]上"},
})


def _devices(k: int) -> list[torch.device]:
    return [torch.device("cpu")] * k        # distinct tensors stand for distinct devices


def check_allreduce(fn: Callable[[list[torch.Tensor]], object], quiet: bool = False
                    ) -> Failure | None:
    """Check ``fn(data)``, which must leave in every tensor of the list ``data`` (one per
    device) the sum of all of them, in place: 1 to 8 devices, sizes that do not divide,
    float and integer tensors."""
    cases = [(f"{k} device(s), tensors of shape {shape}, {dtype}", (k, shape, dtype))
             for k in (1, 2, 3, 4, 8) for shape in ((1,), (5,), (2, 3))
             for dtype in (torch.float32, torch.int64)]

    def run_case(case):
        k, shape, dtype = case
        g = torch.Generator().manual_seed(k)
        originals = [torch.randint(-9, 10, shape, generator=g).to(dtype) for _ in range(k)]
        data = [t.clone().to(d) for t, d in zip(originals, _devices(k))]
        held = list(data)                                   # what the devices hold
        fn(data)
        total = sum(originals)
        if any(a is not b for a, b in zip(data, held)) or len(data) != k:
            return Failure("allreduce-rebind", "data[i] is a new tensor for i in "
                           f"{[i for i, (a, b) in enumerate(zip(data, held)) if a is not b]}")
        if any(t.dtype != dtype or t.shape != shape for t in held):
            return Failure("allreduce-device", f"dtypes {[str(t.dtype) for t in held]}")
        wrong = [i for i, t in enumerate(held) if not torch.equal(t, total)]
        if wrong:
            i = wrong[0]
            seen = f"device {i} holds {held[i].tolist()}, the sum is {total.tolist()}"
            if dtype.is_floating_point and torch.allclose(held[i].float(), total.float() / k):
                return Failure("allreduce-mean", seen)
            return Failure("allreduce-sum", seen)
        return None

    return run_check("allreduce", cases, run_case, quiet)


def check_split_batch(fn: Callable[..., tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
                      quiet: bool = False) -> Failure | None:
    """Check ``fn(X, y, devices) -> (X parts, y parts)``: one part per device, placed on
    it, in order, nothing dropped (sizes that do not divide), as even as possible."""
    cases = [(f"{n} examples, {k} device(s)", (n, k))
             for n in (1, 4, 5, 7, 12, 30) for k in (1, 2, 3, 4, 8) if n >= k]

    def run_case(case):
        n, k = case
        X = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
        y = torch.arange(n) * 10
        devices = _devices(k)
        Xs, ys = fn(X, y, devices)
        Xs, ys = list(Xs), list(ys)
        if len(Xs) != k or len(ys) != k:
            return Failure("split-batch-count", f"{len(Xs)} parts of X, {len(ys)} of y")
        if any(p.device != d for p, d in zip(Xs + ys, devices + devices)):
            return Failure("split-batch-device", f"on {[str(p.device) for p in Xs]}")
        sizes = [len(p) for p in Xs]
        if not (torch.equal(torch.cat(Xs), X) and torch.equal(torch.cat(ys), y)):
            return Failure("split-batch-order", f"part sizes {sizes} for {n} examples")
        if max(sizes) - min(sizes) > 1:
            return Failure("split-batch-even", f"part sizes {sizes}")
        return None

    return run_check("split_batch", cases, run_case, quiet)

"""Checked exercises for PyTorch (see :mod:`dpbook.exercises`): the reader's allreduce and
split_batch (on CPU "devices": distinct tensors, as in the from-scratch chapter), DDP's
bucket assignment, 2-bit quantization with error feedback, gradient accumulation over
micro-batches, and a ZeRO shard with its padding — each run on the cases careless
solutions get wrong, in one process, so they run on any laptop in seconds."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..exercises import HINTS, Failure, run_check

__all__ = ["check_allreduce", "check_split_batch", "check_accumulation", "check_shard",
           "check_buckets", "check_two_bit"]

HINTS.update({
    "allreduce-rebind": {
        "en": "data[i] now refers to another tensor than the one the device held: the caller "
              "still sees the old values. Write the result into each device's tensor in place "
              "(t[:] = … or t.copy_(…)) instead of assigning a new tensor to data[i]",
        "zh": "data[i]现在指向的已不是设备上原来那个张量，"
              "调用者看到的仍是旧值。请把结果就地写进每个设备的张量"
              "（t[:] = …或t.copy_(…)），而不是给data[i]赋一个新张量"},
    "allreduce-sum": {
        "en": "every device must end with the sum of the tensors of *all* devices; check the "
              "loop bounds, and that each device gets the total, not a partial sum",
        "zh": "每个设备最后都必须得到*所有*设备上张量之和；"
              "检查循环的范围，并确认每个设备拿到的是总和而不是部分和"},
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
        "zh": "按设备顺序拼接各份，必须原样得到X和y：不能丢掉样本（"
              "注意余数！），不能重复或打乱，y的切分要与X一致"},
    "split-batch-even": {
        "en": "two parts may differ by at most one example",
        "zh": "任意两份的样本数最多相差1"},
    "accumulation-scale": {
        "en": "the gradient is k times too large: each micro-batch's loss is a mean over its "
              "own examples, so divide it by the number of micro-batches before backward",
        "zh": "梯度大了k倍：每个微批量的损失是它自己样本上的平均值，"
              "反向传播之前要再除以微批量的个数"},
    "accumulation-overwrite": {
        "en": "only the last micro-batch's gradient is left: backward adds into .grad, so "
              "zero the gradients once before the loop, not inside it",
        "zh": "只剩下最后一个微批量的梯度：backward会累加到.grad中，"
              "所以只在循环之前清零一次，不要在循环里清零"},
    "accumulation-grad": {
        "en": "after the micro-batches, .grad must equal the gradient of the mean loss over "
              "the whole batch",
        "zh": "跑完所有微批量之后，.grad必须等于整个批量上平均损失的梯度"},
    "accumulation-step": {
        "en": "the parameters changed: accumulate only; the training loop calls "
              "optimizer.step() afterwards",
        "zh": "参数被改动了：这里只累加梯度，optimizer.step()由训练循环在之后调用"},
    "shard-size": {
        "en": "every rank's slice must have the same size, ⌈numel / N⌉ values: a "
              "reduce-scatter needs equal pieces",
        "zh": "每个进程的切片大小都必须相同，为⌈numel / N⌉个值：归约散播要求各块一样大"},
    "shard-padding": {
        "en": "the slices, put together in rank order, must be the flattened tensor followed "
              "by zeros up to N ⌈numel / N⌉ values",
        "zh": "按进程编号拼接各个切片，必须得到展平后的张量，"
              "后面补零，直到共有N ⌈numel / N⌉个值"},
    "buckets-order": {
        "en": "backward produces the gradients from the last parameter to the first: fill the "
              "buckets in reverse order, every parameter exactly once",
        "zh": "反向传播从最后一个参数到第一个参数依次算出梯度："
              "按相反的顺序装桶，每个参数恰好装一次"},
    "buckets-cap": {
        "en": "a bucket closes when the next parameter would take it over the cap; a "
              "parameter larger than the cap gets a bucket of its own",
        "zh": "下一个参数会让桶超过上限时，这个桶就结束；"
              "比上限还大的参数单独占一个桶"},
    "two-bit-values": {
        "en": "every quantized entry must be +t, 0 or -t: compare grad + residual (not the "
              "gradient alone) with the threshold",
        "zh": "量化后的每个元素只能是+t、0或-t："
              "拿来与阈值比较的是grad + residual，而不只是梯度"},
    "two-bit-residual": {
        "en": "the new residual keeps what was not sent: (grad + residual) minus the "
              "quantized value, so nothing is lost over the steps",
        "zh": "新的残差保存没有发送出去的部分："
              "(grad + residual)减去量化后的值，这样多步累计下来什么也不会丢"},
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


def _accumulation_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def check_accumulation(fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, int], object],
                       quiet: bool = False) -> Failure | None:
    """Check ``fn(model, X, y, micro_batches)``: starting from gradients set to ``None``,
    it runs the cross-entropy loss of ``model`` on ``micro_batches`` equal parts of
    ``(X, y)`` and leaves in ``.grad`` the gradient of the mean loss over the whole batch,
    without changing the parameters."""
    cases = [(f"{n} examples in {k} micro-batch(es)", (n, k))
             for k in (1, 2, 4) for n in (4, 8, 12) if n % k == 0]

    def run_case(case):
        n, k = case
        g = torch.Generator().manual_seed(n + k)
        X, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
        reference = _accumulation_model()
        torch.nn.functional.cross_entropy(reference(X), y).backward()
        model = _accumulation_model()
        before = [p.detach().clone() for p in model.parameters()]
        fn(model, X, y, k)
        if any(not torch.equal(p, b) for p, b in zip(model.parameters(), before)):
            return Failure("accumulation-step", "a parameter changed")
        grads = [p.grad for p in model.parameters()]
        want = [p.grad for p in reference.parameters()]
        if any(gr is None for gr in grads):
            return Failure("accumulation-grad", ".grad is None")
        if all(torch.allclose(gr, w, atol=1e-6) for gr, w in zip(grads, want)):
            return None
        seen = f"|grad| = {float(grads[-1].norm()):.4g}, expected {float(want[-1].norm()):.4g}"
        if all(torch.allclose(gr, k * w, atol=1e-5) for gr, w in zip(grads, want)):
            return Failure("accumulation-scale", seen)
        last = _accumulation_model()
        Xk, yk = X.chunk(k)[-1], y.chunk(k)[-1]
        (torch.nn.functional.cross_entropy(last(Xk), yk) / k).backward()
        lasts = [p.grad for p in last.parameters()]
        if k > 1 and (all(torch.allclose(gr, w, atol=1e-6) for gr, w in zip(grads, lasts))
                      or all(torch.allclose(gr, k * w, atol=1e-5) for gr, w in zip(grads, lasts))):
            return Failure("accumulation-overwrite", seen)
        return Failure("accumulation-grad", seen)

    return run_check("accumulation", cases, run_case, quiet)


def check_shard(fn: Callable[[torch.Tensor, int, int], torch.Tensor], quiet: bool = False
                ) -> Failure | None:
    """Check ``fn(t, rank, world_size)``, which returns rank ``rank``'s slice of ``t``:
    flattened, padded with zeros to a multiple of ``world_size``, cut into equal pieces."""
    cases = [(f"a tensor of shape {shape} on {w} rank(s)", (shape, w))
             for shape in ((1,), (4,), (7,), (2, 3), (3, 5)) for w in (1, 2, 3, 4)]
    cases.sort(key=lambda c: (int(torch.Size(c[1][0]).numel()), c[1][1]))

    def run_case(case):
        shape, w = case
        t = torch.arange(1, torch.Size(shape).numel() + 1, dtype=torch.float32).reshape(shape)
        size = -(-t.numel() // w)
        parts = [torch.as_tensor(fn(t, r, w)).reshape(-1) for r in range(w)]
        sizes = [p.numel() for p in parts]
        if any(n != size for n in sizes):
            return Failure("shard-size", f"slice sizes {sizes}, expected {size} each")
        padded = torch.cat([t.reshape(-1), torch.zeros(size * w - t.numel())])
        if not torch.equal(torch.cat(parts), padded):
            return Failure("shard-padding", f"slices {[p.tolist() for p in parts]}")
        return None

    return run_check("shard", cases, run_case, quiet)


def check_buckets(fn: Callable[[Sequence[int], int], list[list[int]]], quiet: bool = False
                  ) -> Failure | None:
    """Check ``fn(sizes, cap) -> buckets``: ``sizes[i]`` is the bytes of parameter ``i`` in
    the order of ``model.parameters()``; each bucket lists parameter indices, filled in
    reverse order (the order backward produces the gradients) up to ``cap`` bytes, like
    :func:`dpbook.torch.data_parallel.make_buckets`."""
    cases = [(f"sizes {sizes}, cap {cap}", (sizes, cap)) for sizes, cap in (
        ([4], 10), ([4, 4], 10), ([4, 4, 4], 10), ([8, 4], 10), ([20], 10), ([4, 20, 4], 10),
        ([1, 2, 3, 4, 5], 6), ([3, 3, 3, 3], 6), ([6, 1, 6], 6), ([5, 5, 5, 5, 5], 100))]

    def expected(sizes, cap):
        buckets, current, size = [], [], 0
        for i in reversed(range(len(sizes))):
            if current and size + sizes[i] > cap:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += sizes[i]
        return buckets + [current] if current else buckets

    def run_case(case):
        sizes, cap = case
        got = [list(b) for b in fn(list(sizes), cap)]
        flat = [i for b in got for i in b]
        if flat != list(reversed(range(len(sizes)))):
            return Failure("buckets-order", f"buckets {got}")
        if got != expected(sizes, cap):
            return Failure("buckets-cap", f"buckets {got}")
        return None

    return run_check("buckets", cases, run_case, quiet)


def check_two_bit(fn: Callable[[torch.Tensor, torch.Tensor, float],
                               tuple[torch.Tensor, torch.Tensor]], quiet: bool = False
                  ) -> Failure | None:
    """Check ``fn(grad, residual, t) -> (quantized, new_residual)``: ``v = grad +
    residual`` becomes ``+t`` where ``v >= t``, ``-t`` where ``v <= -t``, else 0, and the
    new residual is ``v`` minus that. Several steps in a row, so a residual that is lost or
    not added back shows."""
    cases = [(f"{n} entries, threshold {t}, {steps} step(s)", (n, t, steps))
             for n, t, steps in ((1, 0.5, 1), (4, 0.5, 1), (4, 0.5, 3), (10, 0.25, 5),
                                 (100, 1.0, 10))]

    def run_case(case):
        n, t, steps = case
        g = torch.Generator().manual_seed(n)
        residual, want_residual = torch.zeros(n), torch.zeros(n)
        for step in range(steps):
            grad = torch.randn(n, generator=g) * 0.6
            q, residual = fn(grad.clone(), residual.clone(), t)
            v = grad + want_residual
            want = t * ((v >= t).float() - (v <= -t).float())
            want_residual = v - want
            if not torch.allclose(q, want):
                return Failure("two-bit-values", f"step {step + 1}: {q[:4].tolist()}, "
                               f"expected {want[:4].tolist()}")
            if not torch.allclose(residual, want_residual, atol=1e-6):
                return Failure("two-bit-residual", f"step {step + 1}: residual "
                               f"{residual[:4].tolist()}, expected {want_residual[:4].tolist()}")
        return None

    return run_check("two_bit", cases, run_case, quiet)

"""Checked exercises for PyTorch (see :mod:`dpbook.exercises`): replicas that are real
copies, the reader's allreduce and split_batch (on CPU "devices": distinct tensors, as in
the from-scratch chapter), a data-parallel step equal to one device's, DDP's bucket
assignment, 2-bit quantization with error feedback, gradient accumulation over
micro-batches, a ZeRO shard with its padding and an atomic checkpoint — each run in one
process on the cases careless solutions get wrong — and a ring allreduce (plain, pipelined
or bidirectional) run by 2, 3 and 4 gloo processes at once (:func:`check_ring_allreduce`).
Every check takes seconds on a laptop's CPU."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..exercises import Failure, run_check
from .models import seeded

__all__ = ["check_replicate", "check_allreduce", "check_split_batch", "check_dp_step",
           "check_accumulation", "check_shard", "check_buckets", "check_two_bit",
           "check_atomic_save", "check_ring_allreduce", "check_mlp_activations",
           "check_finish_callback",
           "check_main_grad", "check_resume", "check_break_even", "check_prefetch_schedule",
           "check_accumulation_cost"]


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
    with seeded(0):
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                   torch.nn.Linear(8, 3))


def check_accumulation(fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, int], object],
                       quiet: bool = False) -> Failure | None:
    """Check ``fn(model, X, y, micro_batches)``: starting from gradients set to ``None``,
    it runs the cross-entropy loss of ``model`` on ``micro_batches`` equal parts of
    ``(X, y)`` and leaves in ``.grad`` the gradient of the mean loss over the whole batch,
    without changing the parameters. A forward pre-hook on ``model`` records the batch
    of every forward pass: none may be larger than a micro-batch (the memory
    accumulation saves)."""
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
        rows: list[int] = []                 # the batch size of every forward pass
        hook = model.register_forward_pre_hook(lambda m, args: rows.append(len(args[0])))
        try:
            fn(model, X, y, k)
        finally:
            hook.remove()
        if any(not torch.equal(p, b) for p, b in zip(model.parameters(), before)):
            return Failure("accumulation-step", "a parameter changed")
        if rows and max(rows) > n // k:
            return Failure("accumulation-micro", f"forward passes on {rows} examples; "
                           f"a micro-batch has {n // k}")
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
    the order of ``model.parameters()``; each bucket lists parameter indices. DDP's rule,
    as in :func:`dpbook.torch.ddp_by_hand.make_buckets` (one dtype): take the parameters
    in reverse order (the order backward produces the gradients), add each to the open
    bucket, and close the bucket once it holds ``cap`` bytes or more."""
    cases = [(f"sizes {sizes}, cap {cap}", (sizes, cap)) for sizes, cap in (
        ([4], 10), ([4, 4], 10), ([4, 4, 4], 10), ([8, 4], 10), ([20], 10), ([4, 20, 4], 10),
        ([1, 2, 3, 4, 5], 6), ([3, 3, 3, 3], 6), ([6, 1, 6], 6), ([5, 5, 5, 5, 5], 100))]

    def expected(sizes, cap):
        buckets, current, size = [], [], 0
        for i in reversed(range(len(sizes))):
            current.append(i)
            size += sizes[i]
            if size >= cap:                    # reached the cap: close the bucket
                buckets.append(current)
                current, size = [], 0
        return buckets + [current] if current else buckets

    def run_case(case):
        sizes, cap = case
        got = [list(b) for b in fn(list(sizes), cap)]
        flat = [i for b in got for i in b]
        if flat != list(reversed(range(len(sizes)))):
            return Failure("buckets-order", f"buckets {got}")
        if got != expected(sizes, cap):
            return Failure("buckets-cap", f"buckets {got}, expected {expected(sizes, cap)}")
        return None

    return run_check("buckets", cases, run_case, quiet)


def check_two_bit(fn: Callable[[torch.Tensor, torch.Tensor, float],
                               tuple[torch.Tensor, torch.Tensor]], quiet: bool = False
                  ) -> Failure | None:
    """Check ``fn(grad, residual, t) -> (quantized, new_residual)``: ``v = grad +
    residual`` becomes ``+t`` where ``v >= t``, ``-t`` where ``v <= -t``, else 0, and the
    new residual is ``v`` minus that. Several steps in a row, so a residual that is lost or
    not added back shows; and a case where ``v`` lands exactly on ``±t`` (``>=``, not
    ``>``)."""
    cases = [(f"{n} entries, threshold {t}, {steps} step(s)", (n, t, steps))
             for n, t, steps in ((1, 0.5, 1), (4, 0.5, 1), (4, 0.5, 3), (10, 0.25, 5),
                                 (100, 1.0, 10))]
    cases.insert(3, ("5 entries equal to 0, ±t/2 or ±t, threshold 0.5, 2 steps",
                     (5, 0.5, 2)))
    ties = torch.tensor([0.5, -0.5, 0.25, -0.25, 0.0])   # exact in binary: v hits ±t

    def run_case(case):
        n, t, steps = case
        g = torch.Generator().manual_seed(n)
        residual, want_residual = torch.zeros(n), torch.zeros(n)
        for step in range(steps):
            grad = ties.clone() if n == 5 else torch.randn(n, generator=g) * 0.6
            q, residual = fn(grad.clone(), residual.clone(), t)
            v = grad + want_residual
            want = t * ((v >= t).float() - (v <= -t).float())
            want_residual = v - want
            if not torch.allclose(q, want):
                seen = f"step {step + 1}: {q[:4].tolist()}, expected {want[:4].tolist()}"
                if torch.allclose(q, t * ((v > t).float() - (v < -t).float())):
                    return Failure("two-bit-ties", seen)         # > where >= is meant
                return Failure("two-bit-values", seen)
            if not torch.allclose(residual, want_residual, atol=1e-6):
                return Failure("two-bit-residual", f"step {step + 1}: residual "
                               f"{residual[:4].tolist()}, expected {want_residual[:4].tolist()}")
        return None

    return run_check("two_bit", cases, run_case, quiet)


def check_replicate(fn: Callable[[Sequence[torch.Tensor], Sequence[torch.device]],
                                 Sequence[Sequence[torch.Tensor]]], quiet: bool = False
                    ) -> Failure | None:
    """Check ``fn(params, devices) -> replicas``: ``replicas[j][i]`` is a copy of
    ``params[i]`` on ``devices[j]`` with its own storage (so an update on one device does
    not change another), a leaf tensor that records gradients — what
    :func:`dpbook.torch.scratch.get_params` does for one device. On a CPU-only machine
    every "device" is the CPU, which is where ``Tensor.to`` copies nothing."""
    cases = [(f"{k} device(s), {m} parameter(s)", (k, m)) for k in (1, 2, 3, 4)
             for m in (1, 3)]

    def run_case(case):
        k, m = case
        g = torch.Generator().manual_seed(k * 10 + m)
        params = [torch.randn(3, 2, generator=g).requires_grad_() for _ in range(m)]
        originals = [p.detach().clone() for p in params]
        devices = _devices(k)
        replicas = [list(r) for r in fn(params, devices)]
        if len(replicas) != k or any(len(r) != m for r in replicas):
            return Failure("replicate-count", f"{len(replicas)} replicas of lengths "
                           f"{[len(r) for r in replicas]}")
        for j, (replica, device) in enumerate(zip(replicas, devices)):
            for i, (t, o) in enumerate(zip(replica, originals)):
                if (not isinstance(t, torch.Tensor) or t.device != device or t.shape != o.shape
                        or t.dtype != o.dtype or not torch.equal(t.detach(), o)):
                    return Failure("replicate-values", f"replica {j}, parameter {i}")
        storages = [("params", i, p.untyped_storage().data_ptr()) for i, p in enumerate(params)]
        storages += [(j, i, t.untyped_storage().data_ptr())
                     for j, r in enumerate(replicas) for i, t in enumerate(r)]
        seen = {}
        for j, i, ptr in storages:
            if ptr in seen:
                (j0, i0) = seen[ptr]
                return Failure("replicate-shared", f"replica {j}, parameter {i} shares memory "
                               f"with {'params' if j0 == 'params' else f'replica {j0}'}, "
                               f"parameter {i0}")
            seen[ptr] = (j, i)
        for j, replica in enumerate(replicas):
            for i, t in enumerate(replica):
                if not t.requires_grad or t.grad_fn is not None:
                    return Failure("replicate-leaf", f"replica {j}, parameter {i}: "
                                   f"requires_grad={t.requires_grad}, grad_fn="
                                   f"{type(t.grad_fn).__name__ if t.grad_fn else None}")
        return None

    return run_check("replicate", cases, run_case, quiet)


def _step_model() -> torch.nn.Module:
    with seeded(1):
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                                   torch.nn.Linear(6, 3))


def check_dp_step(fn: Callable[[list[torch.nn.Module], list[torch.Tensor], list[torch.Tensor],
                                float], object], quiet: bool = False) -> Failure | None:
    """Check ``fn(replicas, Xs, ys, lr)``: one data-parallel SGD step. ``replicas`` are k
    copies of one model (gradients ``None``), ``(Xs[i], ys[i])`` is replica i's part of
    the batch; afterwards every replica must hold the parameters of one plain SGD step
    (``p -= lr * grad``) on the mean cross-entropy over the whole batch — what one device
    does. Equal parts first (what DDP's sampler gives), then parts of unequal sizes."""
    cases = [(f"{k} replica(s), parts of sizes {sizes}", (k, sizes)) for k, sizes in (
        (1, [4]), (2, [2, 2]), (3, [4, 4, 4]), (4, [3, 3, 3, 3]), (2, [3, 1]), (3, [5, 2, 1]))]
    lr = 0.5

    def run_case(case):
        k, sizes = case
        g = torch.Generator().manual_seed(sum(sizes) + k)
        X, y = torch.randn(sum(sizes), 4, generator=g), torch.randint(0, 3, (sum(sizes),),
                                                                      generator=g)
        one = _step_model()
        torch.nn.functional.cross_entropy(one(X), y).backward()
        with torch.no_grad():
            want = [p - lr * p.grad for p in one.parameters()]
            start = [p.detach().clone() for p in one.parameters()]
        replicas = [_step_model() for _ in range(k)]
        fn(replicas, list(X.split(sizes)), list(y.split(sizes)), lr)
        got = [[p.detach() for p in r.parameters()] for r in replicas]
        if any(not torch.allclose(a, b, atol=1e-6) for r in got[1:] for a, b in zip(r, got[0])):
            return Failure("dp-step-diverged", "replica 0 and another differ by "
                           f"{max(float((a - b).abs().max()) for r in got[1:] for a, b in zip(r, got[0])):.3g}")
        if all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got[0], want)):
            return None
        step = [a - s for a, s in zip(got[0], start)]
        right = [w - s for w, s in zip(want, start)]
        ratio = float(sum((a * b).sum() for a, b in zip(step, right))
                      / sum((b * b).sum() for b in right))
        seen = f"the step is {ratio:.3g} × the one-device step"
        if k > 1 and abs(ratio - k) < 0.05 * k:
            return Failure("dp-step-scale", seen)
        if k > 1 and abs(ratio - 1 / k) < 0.05 / k:
            return Failure("dp-step-small", seen)
        if len(set(sizes)) > 1:
            return Failure("dp-step-unequal", seen)
        return Failure("dp-step-value", seen)

    return run_check("dp_step", cases, run_case, quiet)


class _Crash:
    """Pickling this raises: the stand-in for a process killed halfway through a save."""

    def __reduce__(self):
        raise RuntimeError("simulated crash while writing the checkpoint")


class _KilledFile:
    """A file opened for writing whose writes stop after ``budget`` bytes with an error:
    the stand-in for a process killed while the bytes go to disk."""

    def __init__(self, file, budget: int):
        self._file, self._budget = file, budget

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self._budget:
            self._file.write(data[:self._budget])
            self._file.flush()
            self._budget = 0
            raise RuntimeError("simulated crash while writing the checkpoint")
        self._budget -= len(data)
        return self._file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def __getattr__(self, name):
        return getattr(self._file, name)


@contextlib.contextmanager
def _killed_while_writing(folder: str, budget: int = 4096) -> Iterator[None]:
    """While active, every file under ``folder`` that Python's ``open`` (``builtins.open``,
    ``io.open``: what ``pathlib`` uses too) opens for writing takes ``budget`` bytes and
    then fails. Writes from C++ (``torch.save`` given a file name) are not cut: such a
    save completes, which the check accepts."""
    import builtins
    import io
    import os
    real = builtins.open
    folder = os.path.realpath(folder)

    def open_(file, mode="r", *args, **kwargs):
        f = real(file, mode, *args, **kwargs)
        inside = (isinstance(file, (str, bytes, os.PathLike))
                  and os.path.realpath(os.fsdecode(file)).startswith(folder + os.sep))
        if inside and any(c in mode for c in "wax+"):
            return _KilledFile(f, budget)
        return f

    builtins.open = io.open = open_
    try:
        yield
    finally:
        builtins.open = io.open = real


def check_atomic_save(fn: Callable[[dict, str], object], quiet: bool = False
                      ) -> Failure | None:
    """Check ``fn(state, path)``, which saves the checkpoint ``state`` (a dict) to ``path``:
    ``torch.load(path)`` gives it back; when the save fails halfway, ``path`` still holds
    a complete checkpoint and no temporary file is left; and ``path`` is never rewritten
    in place. Two kinds of failure: the state holds an object that cannot be pickled (the
    save fails while serializing: ``path`` must hold the previous checkpoint), or the
    process is "killed" while the bytes go to a file (every file the save opens with
    Python's ``open`` fails after 4 KB: ``path`` must hold the previous checkpoint or the
    new one). In place: a save onto an existing ``path`` must give ``path`` a new file
    (inode), the one written beside it and renamed; a file written over, even from bytes
    serialized in memory first, keeps its inode, and a kill during that write tears it."""
    import os
    import tempfile
    cases = [("one save", ("ok",)), ("a save, then one that crashes halfway", ("ok", "crash")),
             ("two saves", ("ok", "ok")),
             ("a save, then one killed while it writes", ("ok", "kill")),
             ("three saves, the last crashes halfway", ("ok", "ok", "crash"))]

    def state(i, crash=False):
        s = {"epoch": i, "weights": torch.full((256, 256), float(i))}
        if crash:
            s["bad"] = _Crash()
        return s

    def describe(loaded):
        return loaded if isinstance(loaded, str) else f"epoch {loaded.get('epoch')}"

    def run_case(saves):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "checkpoint.pt")
            for i, kind in enumerate(saves, start=1):
                inode = os.stat(path).st_ino if os.path.exists(path) else None
                try:
                    if kind == "kill":
                        with _killed_while_writing(folder):
                            fn(state(i), path)
                    else:
                        fn(state(i, kind == "crash"), path)
                except Exception:  # noqa: BLE001 - the crash may propagate: that is fine
                    if kind == "ok":
                        raise
                allowed = {"ok": (i,), "crash": (i - 1,), "kill": (i - 1, i)}[kind]
                try:
                    loaded = torch.load(path, weights_only=True)
                    intact = (loaded.get("epoch") in allowed and torch.equal(
                        loaded.get("weights"), state(loaded.get("epoch"))["weights"]))
                except Exception as e:  # noqa: BLE001 - a torn file fails to load
                    intact, loaded = False, f"{type(e).__name__}"
                if not intact:
                    failed = kind != "ok"                    # the save crashed or was killed
                    return Failure("atomic-save-torn" if failed else "atomic-save-load",
                                   f"after save {i}: torch.load(path) gives "
                                   f"{describe(loaded)}, expected epoch "
                                   f"{' or '.join(map(str, allowed))}")
                if kind == "ok" and inode and os.stat(path).st_ino == inode:
                    return Failure("atomic-save-in-place", f"save {i} wrote over the file "
                                   "at path (same inode) instead of replacing it")
            left = sorted(set(os.listdir(folder)) - {"checkpoint.pt"})
            if left:
                return Failure("atomic-save-leftover", f"files left: {left}")
        return None

    return run_check("atomic_save", cases, run_case, quiet)


# ------------------------------------------------------------ ring allreduce, processes

def _ring_worker(rank: int, nprocs: int, payload: bytes, worlds: Sequence[int],
                 sizes: Sequence[int], timeout: float, port: int) -> None:
    """One process of :func:`check_ring_allreduce`: for each world size w, the first w
    processes form a gloo group (a fresh one, on a prefix of the store the checking
    process serves on ``port``) and call the reader's function on every size. After each
    world its results go to that store (``results/<rank>``, JSON), where they outlive a
    later crash. The groups agree through the store whether to go on, so a failure or a
    deadlock stops everyone."""
    import datetime
    import json
    import traceback
    import cloudpickle
    from .allreduce import _rank_data
    from .messages import recording
    torch.set_num_threads(1)
    fn = cloudpickle.loads(payload)
    wait = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
    results = []
    for w in worlds:
        failed = False
        if rank < w:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"world{w}", store),
                                    rank=rank, world_size=w, timeout=wait)
            try:
                for size in sizes:
                    x = _rank_data(rank, size)
                    expected = sum(_rank_data(r, size) for r in range(w))
                    log, error = [], None
                    try:
                        with recording(lambda kind, peer, t: log.append((kind, peer,
                                                                         t.numel()))):
                            returned = fn(x)
                    except Exception as e:  # noqa: BLE001 - the reader's code
                        returned, error = None, "".join(
                            traceback.format_exception_only(type(e), e)).strip()
                    wrong = [] if error else (x != expected).nonzero().flatten().tolist()
                    results.append(dict(
                        world=w, size=size, rank=rank, error=error, messages=log,
                        wrong=wrong[:1], got=x[wrong[0]].item() if wrong else None,
                        want=expected[wrong[0]].item() if wrong else None,
                        returned_right=(isinstance(returned, torch.Tensor)
                                        and returned.shape == expected.shape
                                        and bool(torch.equal(returned, expected)))))
                    if error or wrong:
                        failed = True
                        break
            finally:
                dist.destroy_process_group()     # closes our links: waiting peers fail fast
        store.set(f"done{w}/{rank}", "fail" if failed else "ok")
        verdicts = []
        for r in range(w):
            store.wait([f"done{w}/{r}"], datetime.timedelta(seconds=timeout * 3))
            verdicts.append(store.get(f"done{w}/{r}").decode())
        store.set(f"results/{rank}", json.dumps(results))   # after every world
        if "fail" in verdicts:
            break


@contextlib.contextmanager
def _forkserver() -> Iterator[str]:
    """The start method for the check's processes: ``forkserver`` where there is one (a
    server imports torch once and forks the 4 processes: about 1 s, where ``spawn``
    imports torch 4 times, about 5 s), stopped afterwards so that no process stays
    behind; else ``spawn``."""
    import multiprocessing
    import multiprocessing.forkserver
    if "forkserver" not in multiprocessing.get_all_start_methods():
        yield "spawn"
        return
    multiprocessing.set_forkserver_preload([__name__])      # this module imports torch
    try:
        yield "forkserver"
    finally:
        server = multiprocessing.forkserver._forkserver
        if hasattr(server, "_stop"):        # not public: CPython's own tests use it
            server._stop()


def check_ring_allreduce(fn: Callable[[torch.Tensor], object], bidirectional: bool = False,
                         quiet: bool = False, timeout: float = 10.0) -> Failure | None:
    """Check ``fn(x)``, called by every process of a gloo group on its own 1-D float32
    tensor ``x``, like :func:`dpbook.torch.allreduce.ring_allreduce`: afterwards every
    process's ``x`` holds the elementwise sum, in place; processes only exchange
    point-to-point messages with their neighbours ``rank ± 1``; each sends 2 (N - 1) / N of
    the tensor in all (the ring's bandwidth); and with ``bidirectional=True``, as many
    values to the left as to the right (N ≥ 3). A pipelined ring passes too.

    2, 3 and 4 processes (started once, :func:`dpbook.torch.dist.spawn`, from a fork
    server where there is one), sizes from 1
    value (fewer than processes: empty chunks) to 1,200. ``fn`` may be defined in the
    notebook: it reaches the processes by value (cloudpickle). A process that waits
    longer than ``timeout`` seconds for a message gives up, so a deadlock fails the check
    instead of hanging it; no process is left behind."""
    import datetime
    import json
    import cloudpickle
    from .dist import spawn
    worlds, sizes = (2, 3, 4), (1, 5, 64, 1200)
    cases = [(f"{w} processes, {n} value(s)", (w, n)) for w in worlds for n in sizes]
    results: dict = {}

    def launch():
        # this process serves the store: what the workers put there survives their crash
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        with _forkserver() as method:
            try:
                spawn(_ring_worker, max(worlds), cloudpickle.dumps(fn), worlds, sizes,
                      timeout, store.port, timeout=60 + 12 * timeout, start_method=method)
            finally:                                    # read what was written, whatever
                for rank in range(max(worlds)):
                    if store.check([f"results/{rank}"]):
                        for r in json.loads(store.get(f"results/{rank}")):
                            results.setdefault((r["world"], r["size"]), {})[r["rank"]] = r

    def run_case(case):
        if not results:
            launch()
        w, n = case
        ranks = results.get(case, {})
        if len(ranks) < w:
            return Failure("ring-process-timeout", f"{len(ranks)} of {w} processes finished")
        errors = {r: v["error"] for r, v in ranks.items() if v["error"]}
        if errors:           # a peer that gave up makes its neighbours fail: find the cause
            echoes = ("closed by peer", "reset by peer", "timed out", "timeout")
            causes = {r: e for r, e in errors.items() if not any(w in e.lower() for w in echoes)}
            rank, error = min((causes or errors).items())
            error = error.split("] ", 1)[-1] if "gloo" in error else error   # gloo's path
            if causes:
                return Failure("exception", f"rank {rank}: {error[:300]}")
        wrong = {r: v for r, v in ranks.items() if v["wrong"]}
        if wrong:
            rank, v = min(wrong.items())
            seen = (f"rank {rank}: x[{v['wrong'][0]}] = {v['got']:g}, the sum is {v['want']:g}")
            if all(v["returned_right"] for v in ranks.values()):
                return Failure("ring-process-inplace", seen)
            return Failure("ring-process-sum", seen)
        if errors:
            return Failure("ring-process-timeout", f"rank {rank}: {error[:300]}")
        sends = {r: [(peer, k) for kind, peer, k in v["messages"] if kind in ("send", "isend")]
                 for r, v in ranks.items()}
        if w > 1 and n >= w and not any(sends.values()):
            return Failure("ring-process-p2p", "no dist.send/isend/recv/irecv")
        for r, v in sorted(ranks.items()):
            peers = {peer for _, peer, _ in v["messages"]}
            if not peers <= {(r + 1) % w, (r - 1) % w}:
                return Failure("ring-process-neighbours", f"rank {r} exchanged messages with "
                               f"ranks {sorted(peers)}")
        if n % (2 * w) == 0 and n >= 100:           # chunks and half-chunks divide exactly
            want = 2 * (w - 1) * n // w
            for r, s in sorted(sends.items()):
                sent = sum(k for _, k in s)
                if abs(sent - want) > 2 * w:
                    return Failure("ring-process-bytes", f"rank {r} sent {sent} values of "
                                   f"{n}; a ring sends {want}")
            if bidirectional and w >= 3:
                for r, s in sorted(sends.items()):
                    right = sum(k for peer, k in s if peer == (r + 1) % w)
                    left = sum(k for peer, k in s if peer == (r - 1) % w)
                    if abs(right - left) > 2 * w:
                        return Failure("ring-process-both-ways", f"rank {r} sent {right} "
                                       f"values to the right, {left} to the left")
        return None

    return run_check("bidirectional_ring" if bidirectional else "ring_allreduce", cases,
                     run_case, quiet)


def check_mlp_activations(fn: Callable[[Sequence[int], int], int], quiet: bool = False
                          ) -> Failure | None:
    """Check ``fn(widths, batch)``, the bytes of activations that autograd saves for the
    backward pass of a float32 MLP ``Linear(widths[0], widths[1]), ReLU, …,
    Linear(widths[-2], widths[-1])`` on ``batch`` examples (the loss not included),
    against the bytes measured with ``saved_tensors_hooks``
    (:func:`dpbook.torch.memory.saved_bytes`)."""
    from .memory import saved_bytes

    cases = [(f"widths {widths}, batch {b}", (widths, b))
             for widths in ((4, 2), (4, 8, 2), (3, 5, 7, 2), (6, 16, 16, 16, 3))
             for b in (1, 3)]

    def run_case(case):
        widths, b = case
        layers: list[torch.nn.Module] = []
        for i in range(len(widths) - 1):
            layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
            if i < len(widths) - 2:
                layers.append(torch.nn.ReLU())
        with seeded(0):
            net = torch.nn.Sequential(*layers)
            X = torch.randn(b, widths[0])
        want = saved_bytes(net, X)
        got = fn(tuple(widths), b)
        if got == want:
            return None
        seen = f"{got} bytes, measured {want}"
        if got == want - 4 * b * widths[0]:
            return Failure("mlp-saved-input", seen)
        if got * b == want:
            return Failure("mlp-saved-batch", seen)
        return Failure("mlp-saved-count", seen)

    return run_check("mlp_activations", cases, run_case, quiet)


def check_finish_callback(fn: Callable[[Callable[[], None]], Callable], quiet: bool = False
                          ) -> Failure | None:
    """Check ``fn(finish)``, which returns a post-accumulate-grad hook ``hook(p)`` that
    makes autograd call ``finish()`` exactly once per backward pass, after every gradient
    of that pass is final (``torch.autograd.Variable._execution_engine.queue_callback``),
    as :class:`dpbook.torch.ddp_by_hand.DataParallel` does: 1 to 3 backward passes of
    models with 1 and 3 parameters."""
    cases = [(f"{n} backward pass(es), {k} parameter(s)", (n, k))
             for n in (1, 2, 3) for k in (1, 3)]

    def run_case(case):
        n, k = case
        params = [torch.nn.Parameter(torch.full((2,), float(i + 1))) for i in range(k)]
        arrived, calls = [0], []

        def count(p):                          # runs before the reader's hook
            arrived[0] += 1

        def finish():
            calls.append(arrived[0])           # gradients final when finish ran

        hook = fn(finish)
        for p in params:
            p.register_post_accumulate_grad_hook(count)
            p.register_post_accumulate_grad_hook(hook)
        for i in range(n):
            arrived[0], calls[:] = 0, []
            x = torch.ones(2)
            for p in params:                   # a chain: every parameter gets a gradient
                x = x * p
            x.sum().backward()
            seen = f"backward pass {i + 1}: finish() ran {len(calls)} time(s), when " \
                   f"{calls} of the {k} gradients were final"
            if any(c < k for c in calls) or (not calls and i == 0):
                return Failure("callback-early", seen)
            if len(calls) > 1:
                return Failure("callback-once", seen)
            if not calls:
                return Failure("callback-reset", seen)
        return None

    return run_check("finish_callback", cases, run_case, quiet)


def check_main_grad(fn: Callable[[torch.nn.Parameter], object], quiet: bool = False
                    ) -> Failure | None:
    """Check ``fn(p)``, a post-accumulate-grad hook on the bfloat16 parameters of a model
    that adds each micro-batch's ``p.grad`` to the float32 buffer ``p.main_grad`` and
    frees ``p.grad``, as Megatron and picotron do: after k backward passes ``main_grad``
    must hold the sum of the k bfloat16 gradients, added in float32 (within 1e-5 of the
    float64 sum, relative to its largest entry), and no ``p.grad`` is left."""
    cases = [(f"{k} micro-batch(es)", k) for k in (1, 2, 8, 64)]

    def run_case(k):
        with seeded(k):                        # the reader's random state untouched
            model = torch.nn.Linear(16, 4).to(torch.bfloat16)
            X = torch.randn(k, 8, 16).to(torch.bfloat16)
        params = list(model.parameters())
        reference = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
        for Xi in X:                           # each micro-batch's gradient, summed in f64
            loss = model(Xi).float().square().mean()
            for r, g in zip(reference, torch.autograd.grad(loss, params)):
                r += g.double()
        for p in params:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            p.register_post_accumulate_grad_hook(fn)
        for Xi in X:
            model(Xi).float().square().mean().backward()
        for name, p, r in zip(("weight", "bias"), params, reference):
            if p.grad is not None:
                return Failure("main-grad-free", f"{name}.grad is still set after the "
                                                 f"{k} backward passes")
            if p.main_grad.dtype != torch.float32:
                return Failure("main-grad-dtype", f"{name}.main_grad is {p.main_grad.dtype}")
            err = ((p.main_grad.double() - r).abs().max() / r.abs().max()).item()
            if err > 1e-5:
                seen = f"{name}.main_grad is {err:.1e} (relative) from the float64 sum"
                last = torch.autograd.grad(model(X[-1]).float().square().mean(), [p])[0]
                if k > 1 and torch.allclose(p.main_grad, last.float()):
                    return Failure("main-grad-add", seen)
                return Failure("main-grad-precision", seen)
        return None

    return run_check("main_grad", cases, run_case, quiet)


# ------------------------------------------------------------ resuming from a DCP checkpoint

def check_resume(fn: Callable[[torch.nn.Module, torch.optim.Optimizer, str], object],
                 quiet: bool = False) -> Failure | None:
    """Check ``fn(model, optimizer, path)``, which loads the checkpoint that
    :func:`dpbook.torch.checkpoint.save` wrote to the folder ``path`` (with
    ``torch.distributed.checkpoint``) into a fresh ``model`` and its Adam ``optimizer``,
    in one process: afterwards the parameters, the optimizer's state (``step``, both
    moments) and its learning rate must be the saved ones, and the next step must be the
    one the uninterrupted run takes. The cases: a checkpoint after 1 step, and one after
    3 steps whose learning rate a scheduler has lowered."""
    import tempfile
    from . import checkpoint as ck
    cases = [("a checkpoint after 1 step", (1, None)),
             ("a checkpoint after 3 steps, lr lowered to 1e-4 by a scheduler", (3, 1e-4))]

    def run_case(case):
        steps, lr = case
        with seeded(0):
            model = ck.mlp(16)
        opt = ck.adam(model)
        ck.train(model, opt, range(steps), 12)
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr
        with tempfile.TemporaryDirectory() as folder:
            ck.save(model, opt, folder)
            with seeded(1):
                fresh = ck.mlp(16)
            fresh_opt = ck.adam(fresh)
            with ck._expected_warnings():     # DCP in one process, on purpose
                fn(fresh, fresh_opt, folder)
        saved, got = opt.state_dict(), fresh_opt.state_dict()
        wrong = [n for (n, p), q in zip(model.named_parameters(), fresh.parameters())
                 if not torch.equal(p, q)]
        if wrong:
            return Failure("resume-model", f"parameters {wrong} differ from the saved ones")
        moments = [(i, k) for i, s in saved["state"].items() for k in s
                   if i not in got["state"] or k not in got["state"][i] or not torch.equal(
                       torch.as_tensor(s[k]), torch.as_tensor(got["state"][i][k]))]
        if moments:
            return Failure("resume-optimizer", f"optimizer state {moments[:3]} is not the "
                           f"saved one ({len(got['state'])} of {len(saved['state'])} "
                           "parameters have any state)")
        lrs = ([g["lr"] for g in saved["param_groups"]],
               [g["lr"] for g in got["param_groups"]])
        if lrs[0] != lrs[1]:
            return Failure("resume-param-groups", f"learning rate {lrs[1]}, saved {lrs[0]}")
        ck.train(model, opt, range(steps, steps + 1), 12)
        ck.train(fresh, fresh_opt, range(steps, steps + 1), 12)
        if any(not torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters())):
            return Failure("resume-model", "the next step differs from the saved run's")
        return None

    return run_check("resume", cases, run_case, quiet)


# ---------------------------------------------------------------- when communication hides

def check_break_even(fn: Callable[[float, int, float, float, float], float],
                     quiet: bool = False) -> Failure | None:
    """Check ``fn(nbytes, world_size, alpha, beta, seconds_per_example) -> b*``: the
    per-device batch whose backward pass lasts as long as a ring allreduce of ``nbytes``
    in the α–β model (:func:`dpbook.costmodel.break_even_batch`)."""
    import math
    from .. import costmodel
    cases = [(f"{n:,} bytes on {w} devices, alpha = {a * 1e6:g} us, 1/beta = "
              f"{1 / b / 1e9:g} GB/s, backward {t * 1e6:g} us per example", (n, w, a, b, t))
             for n, w, a, b, t in ((1e6, 2, 0.0, 1e-9, 1e-4), (1e6, 4, 0.0, 1e-9, 1e-4),
                                   (1e6, 4, 1e-5, 1e-9, 1e-4), (1e8, 8, 3e-6, 1 / 450e9,
                                                                 2.7e-4))]

    def run_case(case):
        n, w, a, b, t = case
        got, want = float(fn(*case)), costmodel.break_even_batch(*case)
        if math.isclose(got, want, rel_tol=1e-6):
            return None
        seen = f"b* = {got:g}, expected {want:g}"
        comm = 2 * (w - 1) * a + 2 * (w - 1) / w * n * b
        if math.isclose(got, t / comm, rel_tol=1e-6):
            return Failure("break-even-inverted", seen)
        if math.isclose(got, (2 * (w - 1) * a + 2 * n * b) / t, rel_tol=1e-6):
            return Failure("break-even-ring", seen)
        if math.isclose(got, 2 * (w - 1) / w * n * b / t, rel_tol=1e-6):
            return Failure("break-even-latency", seen)
        return Failure("break-even-value", seen)

    return run_check("break_even", cases, run_case, quiet)


def check_prefetch_schedule(fn: Callable[[int], Sequence[tuple[str, int]]],
                            quiet: bool = False) -> Failure | None:
    """Check ``fn(num_units)``: the order of one ZeRO-3 step with a one-unit prefetch,
    as ``ZeroModel.events`` records it — ``("gather", i)`` when
    unit i's all-gather is issued, ``("forward", i)`` / ``("backward", i)`` when it
    starts to compute (:func:`dpbook.torch.zero.prefetch_schedule`)."""
    from .profiling import gathers_ahead
    from .zero import prefetch_schedule
    cases = [(f"{n} unit(s)", n) for n in (1, 2, 3, 5)]

    def run_case(n):
        got = [(str(kind), int(i)) for kind, i in fn(n)]
        seen = f"{got}"
        computes = [e for e in got if e[0] != "gather"]
        if computes != ([("forward", i) for i in range(n)]
                        + [("backward", i) for i in reversed(range(n))]):
            return Failure("prefetch-compute-order", seen)
        gathered: set = set()
        most = 0
        for kind, i in got:
            if kind == "gather":
                gathered.add(i)
                most = max(most, len(gathered))
            elif i not in gathered:
                return Failure("prefetch-missing", f"{kind} of unit {i} before its gather: "
                               + seen)
            else:
                gathered.discard(i)            # computed: freed
        if most > 2:
            return Failure("prefetch-memory", f"{most} units gathered at once: {seen}")
        ahead, total = gathers_ahead(got)
        want = gathers_ahead(prefetch_schedule(n))
        if (ahead, total) != want:
            return Failure("prefetch-late", f"{ahead} of {total} computations had their "
                           f"gather issued a unit early, expected {want[0]}: {seen}")
        return None if got == prefetch_schedule(n) else Failure("prefetch-order", seen)

    return run_check("prefetch_schedule", cases, run_case, quiet)


def check_accumulation_cost(fn: Callable[[int, int, int, bool], tuple[float, float]],
                            quiet: bool = False) -> Failure | None:
    """Check ``fn(numel, world_size, k, keep) -> (sent, held)`` for ZeRO-2 with float32
    gradients and k micro-batches per step: the bytes one rank sends for the gradients in
    one step (reduce-scatters, ring), and the bytes of gradients it holds between two
    micro-batches; ``keep``: the first k - 1 backward passes under ``no_sync``. Slices
    are padded as :class:`dpbook.torch.zero.Shard` pads them."""
    import math
    # numel divisible by the ranks and not (10 and 1001 values on 3 and 4 ranks are
    # padded to 12, 1002 and 1004: an answer that forgets the padding fails there),
    # smallest first
    sizes = sorted([(numel, w) for numel in (12, 1000) for w in (2, 4)]
                   + [(numel, w) for numel in (10, 1001) for w in (3, 4)])
    cases = [(f"{numel:,} values on {w} ranks, k = {k}, keep={keep}", (numel, w, k, keep))
             for numel, w in sizes for k in (3, 2) for keep in (False, True)]

    def expected(numel, w, k, keep, padded=True):
        size = 4 * w * math.ceil(numel / w) if padded else 4 * numel     # bytes
        sent = (1 if keep else k) * (w - 1) / w * size
        return sent, (4 * numel if keep else size / w)

    def run_case(case):
        numel, w, k, keep = case
        got = tuple(float(v) for v in fn(*case))
        sent, held = expected(*case)
        seen = f"(sent, held) = {got}, expected ({sent:g}, {held:g})"
        unpadded = expected(*case, padded=False)
        if got != (sent, held) and numel % w and any(
                math.isclose(g, u, rel_tol=1e-9) and not math.isclose(g, e, rel_tol=1e-9)
                for g, u, e in zip(got, unpadded, (sent, held))):
            return Failure("accum-cost-padding", seen)
        if not math.isclose(got[0], sent, rel_tol=1e-9):
            if math.isclose(got[0], (k if keep else 1 / k) * sent, rel_tol=1e-9):
                return Failure("accum-cost-sent", seen)
            if math.isclose(got[0], 2 * sent, rel_tol=1e-9):
                return Failure("accum-cost-allreduce", seen)
            return Failure("accum-cost-sent", seen)
        if not math.isclose(got[1], held, rel_tol=1e-9):
            return Failure("accum-cost-held", seen)
        return None

    return run_check("accumulation_cost", cases, run_case, quiet)

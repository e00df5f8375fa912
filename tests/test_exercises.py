"""The checked exercises (dpbook.exercises and its torch and jax parts): every check passes
the package's own solution and fails known-wrong ones with the expected hint, in English
and in Chinese; the multi-process check leaves no process behind."""
from __future__ import annotations

import io
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.distributed as dist
from jax import lax
from torch.nn import functional as F

from helpers import no_children_left

from dpbook import costmodel, exercises
from dpbook.devices import split_sizes
from dpbook.jax import allreduce as jax_allreduce
from dpbook.jax import exercises as jax_exercises
from dpbook.jax import scratch as jax_scratch
from dpbook.jax import step as jax_step
from dpbook.jax.unequal import pad_batch
from dpbook.tools import atomic_write
from dpbook.torch import allreduce as torch_allreduce
from dpbook.torch import compression
from dpbook.torch import exercises as torch_exercises
from dpbook.torch.ddp_by_hand import make_buckets
from dpbook.torch import scratch as torch_scratch
from dpbook.torch import zero
from dpbook.torch.devices import split_batch


# ---------------------------------------------------------------- known-wrong solutions

def rebinding_allreduce(data):           # the bug a famous book shipped for a year
    total = sum(data)
    for i in range(len(data)):
        data[i] = total.clone()


def two_device_allreduce(data):          # right for one and two devices only
    for t in data[1:]:
        data[0] += t
    if len(data) > 1:
        data[1].copy_(data[0])


def mean_allreduce(data):
    total = sum(t.clone() for t in data) / len(data)
    for t in data:
        t.copy_(total)


def dropping_split(X, y, devices):        # drops the remainder
    s = len(X) // len(devices)
    return ([X[i * s:(i + 1) * s] for i in range(len(devices))],
            [y[i * s:(i + 1) * s] for i in range(len(devices))])


def chunk_split(X, y, devices):           # torch.chunk: ceil-sized parts, maybe fewer
    return list(X.chunk(len(devices))), list(y.chunk(len(devices)))


def floor_sizes(n, k, weights=None):
    return [n // k] * k


def lumped_sizes(n, k, weights=None):     # the whole remainder on the last device
    return [n // k] * (k - 1) + [n - (k - 1) * (n // k)]


def floor_weighted_sizes(n, k, weights=None):   # even split right; weights: floor, rest last
    if weights is None:
        return split_sizes(n, k)
    sizes = [int(n * w / sum(weights)) for w in weights]
    return sizes[:-1] + [n - sum(sizes[:-1])]


def jax_allreduce_on_first(data):         # the sum, but only on the first device
    total = sum(jax.device_put(x, list(data[0].devices())[0]) for x in data)
    return [total] * len(data)


def jax_builtin_sum_allreduce(data):      # sum() of arrays that live on different devices
    return [sum(data)] * len(data)


def jax_partial_allreduce(data):          # each device adds its left neighbour only
    return [x + jax.device_put(data[i - 1], list(x.devices())[0]) if len(data) > 1 else x
            for i, x in enumerate(data)]


def neighbour_ring(x, axis_name):         # one step around the ring: right for 1 and 2
    n = lax.axis_size(axis_name)
    if n == 1:
        return x
    return x + lax.ppermute(x, axis_name, [(j, (j + 1) % n) for j in range(n)])


def psum_ring(x, axis_name):              # the built-in allreduce: right sums, no ring
    return lax.psum(x, axis_name)


def whole_array_ring(x, axis_name):       # passes the whole array N - 1 times: N - 1 × x
    n, total = lax.axis_size(axis_name), x
    for _ in range(n - 1):
        x = lax.ppermute(x, axis_name, [(j, (j + 1) % n) for j in range(n)])
        total = total + x
    return total


def open_ring(x, axis_name):              # the ring never closes: device 0 receives nothing
    n = lax.axis_size(axis_name)
    total = x
    for _ in range(n - 1):
        x = lax.ppermute(x, axis_name, [(j, j + 1) for j in range(n - 1)])
        total = total + x
    return total


def right_accumulation(model, X, y, k):
    for Xm, ym in zip(X.chunk(k), y.chunk(k)):
        (F.cross_entropy(model(Xm), ym) / k).backward()


def unscaled_accumulation(model, X, y, k):   # forgets to divide by k
    for Xm, ym in zip(X.chunk(k), y.chunk(k)):
        F.cross_entropy(model(Xm), ym).backward()


def zeroing_accumulation(model, X, y, k):    # zeroes the gradients in the loop
    for Xm, ym in zip(X.chunk(k), y.chunk(k)):
        model.zero_grad()
        (F.cross_entropy(model(Xm), ym) / k).backward()


def whole_batch_accumulation(model, X, y, k):   # ignores the micro-batches: right grads
    F.cross_entropy(model(X), y).backward()


def right_shard(t, rank, world_size):
    return zero.Shard(t.numel(), rank, world_size).slice(t)


def chunk_shard(t, rank, world_size):        # unequal pieces, and fewer than asked for
                                             # when numel < world_size: an IndexError
    return t.reshape(-1).chunk(world_size)[rank]


def unpadded_shard(t, rank, world_size):     # equal pieces, but the last is cut short
    size = -(-t.numel() // world_size)
    return t.reshape(-1)[rank * size:(rank + 1) * size]


def front_padded_shard(t, rank, world_size):  # the zeros in front instead of at the end
    size = -(-t.numel() // world_size)
    flat = torch.cat([torch.zeros(size * world_size - t.numel()), t.reshape(-1)])
    return flat[rank * size:(rank + 1) * size]


def right_buckets(sizes, cap):               # make_buckets on parameters of these sizes
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.uint8), requires_grad=False)
              for n in sizes]                # one byte per value: n bytes
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in b] for b in make_buckets(params, cap / 2**20)]


def forward_buckets(sizes, cap):             # the parameters' own order
    out, current, size = [], [], 0
    for i, n in enumerate(sizes):
        if current and size + n > cap:
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    return out + [current] if current else out


def one_per_parameter(sizes, cap):           # right order, but no grouping
    return [[i] for i in reversed(range(len(sizes)))]


def at_most_cap_buckets(sizes, cap):         # right order, but never above the cap
    out, current, size = [], [], 0
    for i in reversed(range(len(sizes))):
        if current and size + sizes[i] > cap:
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += sizes[i]
    return out + [current] if current else out


def right_two_bit(grad, residual, t):
    packed = compression.quantize_2bit(grad, residual, t)
    return compression.dequantize_2bit(packed, grad.numel(), t), residual


def gradient_only_two_bit(grad, residual, t):    # ignores the residual when quantizing
    q = t * ((grad >= t).float() - (grad <= -t).float())
    return q, grad + residual - q


def forgetful_two_bit(grad, residual, t):        # never updates the residual
    v = grad + residual
    return t * ((v >= t).float() - (v <= -t).float()), residual


def strict_two_bit(grad, residual, t):          # > where >= is meant: ±t become 0
    v = grad + residual
    q = t * ((v > t).float() - (v < -t).float())
    return q, v - q


def right_replicate(params, devices):
    return [torch_scratch.get_params(params, d) for d in devices]


def to_replicate(params, devices):           # Tensor.to copies nothing on the CPU
    return [[p.to(d) for p in params] for d in devices]


def clone_replicate(params, devices):        # copies, but part of the graph: not leaves
    return [[p.clone().to(d) for p in params] for d in devices]


def right_dp_step(replicas, Xs, ys, lr):     # each part's loss weighted by its share
    n = sum(len(X) for X in Xs)
    for model, X, y in zip(replicas, Xs, ys):
        (F.cross_entropy(model(X), y) * len(X) / n).backward()
    with torch.no_grad():
        for ps in zip(*(m.parameters() for m in replicas)):
            grad = sum(p.grad for p in ps)
            for p in ps:
                p -= lr * grad


def _averaged_step(replicas, Xs, ys, lr, loss_scale, grad_scale):
    for model, X, y in zip(replicas, Xs, ys):
        (F.cross_entropy(model(X), y) * loss_scale).backward()
    with torch.no_grad():
        for ps in zip(*(m.parameters() for m in replicas)):
            grad = sum(p.grad for p in ps) * grad_scale
            for p in ps:
                p -= lr * grad


def summing_dp_step(replicas, Xs, ys, lr):       # adds the replicas' gradients
    _averaged_step(replicas, Xs, ys, lr, 1, 1)


def twice_averaging_dp_step(replicas, Xs, ys, lr):   # averages twice
    _averaged_step(replicas, Xs, ys, lr, 1 / len(replicas), 1 / len(replicas))


def mean_of_means_dp_step(replicas, Xs, ys, lr):     # right for equal parts only
    _averaged_step(replicas, Xs, ys, lr, 1, 1 / len(replicas))


def local_dp_step(replicas, Xs, ys, lr):         # no communication: replicas drift apart
    _averaged_step(replicas[:1], Xs[:1], ys[:1], lr, 1, 1)


def right_save(state, path):
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def file_object_save(state, path):           # right, written through Python's open: the
    tmp = path + ".tmp"                      # check's cut write reaches it
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def test_a_save_through_a_file_object_is_right(capsys):
    """The write cut after 4 KB reaches only Python's open: a right answer that writes
    through it must survive the cut, torch's zip writer failing inside it included."""
    assert torch_exercises.check_atomic_save(file_object_save) is None


def direct_save(state, path):                # a crash leaves half a file at path
    torch.save(state, path)


def leaky_save(state, path):                 # atomic, but a crash leaves the temporary
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def buffered_save(state, path):              # serialized in memory, then path written over
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())


def unprotected_temporary_save(state, path):     # open() a temporary, no cleanup
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
    os.replace(path + ".tmp", path)


def tail_padding(X, y, sizes):               # pads the end of the batch, not each block
    k, m = len(sizes), max(sizes)
    X_pad, y_pad = np.zeros((k * m, *X.shape[1:]), X.dtype), np.zeros(k * m, y.dtype)
    mask = np.zeros(k * m, np.float32)
    X_pad[:len(X)], y_pad[:len(y)], mask[:len(X)] = X, y, 1
    return X_pad, y_pad, mask


def boolean_mask(X, y, sizes):
    X_pad, y_pad, mask = pad_batch(X, y, sizes)
    return X_pad, y_pad, mask > 0


def nan_padding(X, y, sizes):                # NaN rows: 0 × NaN is NaN
    X_pad, y_pad, mask = pad_batch(X, y, sizes)
    X_pad[mask == 0] = np.nan
    return X_pad, y_pad, mask


def right_grads(loss_fn, params, X, y, axis):
    params = lax.pcast(params, axis, to="varying")
    return lax.pmean(jax.grad(loss_fn)(params, X, y), axis)


def no_pcast_grads(loss_fn, params, X, y, axis):   # already summed, then pmean: N×
    return lax.pmean(jax.grad(loss_fn)(params, X, y), axis)


def psum_grads(loss_fn, params, X, y, axis):       # sums the per-device means: N×
    params = lax.pcast(params, axis, to="varying")
    return lax.psum(jax.grad(loss_fn)(params, X, y), axis)


def local_grads(loss_fn, params, X, y, axis):      # never leaves the device
    return jax.grad(loss_fn)(lax.pcast(params, axis, to="varying"), X, y)


def _scan(params, apply_fn, X, y, k, scale, add):
    Xs, ys = X.reshape(k, -1, *X.shape[1:]), y.reshape(k, -1)
    grad_fn = jax.value_and_grad(jax_step.mixed_loss)

    def body(total, batch):
        loss, grads = grad_fn(params, apply_fn, *batch)
        return (jax.tree.map(jnp.add, total, grads) if add else grads), loss

    total, losses = lax.scan(body, jax.tree.map(jnp.zeros_like, params), (Xs, ys))
    return losses.mean(), jax.tree.map(lambda g: g * scale, total)


def unscaled_scan(params, apply_fn, X, y, k):      # forgets to divide by k
    return _scan(params, apply_fn, X, y, k, 1, True)


def replacing_scan(params, apply_fn, X, y, k):     # the carry keeps the last gradient
    return _scan(params, apply_fn, X, y, k, 1 / k, False)


def stacking_scan(params, apply_fn, X, y, k):     # right numbers, k gradients as ys
    Xs, ys = X.reshape(k, -1, *X.shape[1:]), y.reshape(k, -1)
    grad_fn = jax.value_and_grad(jax_step.mixed_loss)
    _, (losses, grads) = lax.scan(lambda c, b: (c, grad_fn(params, apply_fn, *b)), 0.0,
                                  (Xs, ys))
    return losses.mean(), jax.tree.map(lambda g: g.mean(0), grads)


def per_example_losses_scan(params, apply_fn, X, y, k):   # right: the carry sums the
    Xs, ys = X.reshape(k, -1, *X.shape[1:]), y.reshape(k, -1)   # gradients, ys are losses
    zeros = jax.tree.map(jnp.zeros_like, params)

    def micro(total, batch):
        Xi, yi = batch
        def loss_fn(p):
            logp = jax.nn.log_softmax(apply_fn({"params": p}, Xi))
            losses = -jnp.take_along_axis(logp, yi[:, None], axis=1)[:, 0]
            return losses.mean(), losses
        (_, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return jax.tree.map(jnp.add, total, grads), losses   # ys: (k, micro-batch)

    total, losses = lax.scan(micro, zeros, (Xs, ys))
    return losses.mean(), jax.tree.map(lambda g: g / k, total)


def test_a_scan_returning_per_example_losses_is_right(capsys):
    """24 examples in 8 micro-batches: the losses' ys have the shape (8, 3) of a stacked
    bias of 3 classes; only a scan that stacks every parameter's gradient is refused."""
    assert jax_exercises.check_scan_accumulation(per_example_losses_scan) is None


def test_the_scan_check_reads_jax_0_11_scans(monkeypatch):
    """jax 0.11's scan has no ``num_carry`` parameter (seen on a GPU box with jax 0.11.2:
    the reference solution failed with a KeyError). Without it the check still passes the
    reference and the per-example losses, and still finds the stacked gradients."""
    walk = jax_exercises._equations

    def without_num_carry(jaxpr):
        for eqn in walk(jaxpr):
            if eqn.primitive.name == "scan":
                eqn = eqn.replace(params={k: v for k, v in eqn.params.items()
                                          if k != "num_carry"})
            yield eqn

    monkeypatch.setattr(jax_exercises, "_equations", without_num_carry)
    check = jax_exercises.check_scan_accumulation
    assert check(jax_step.accumulated_grads, quiet=True) is None
    assert check(per_example_losses_scan, quiet=True) is None
    assert check(stacking_scan, quiet=True).hint == "scan-stacked"


def python_loop(params, apply_fn, X, y, k):        # right numbers, k copies when traced
    losses, total = [], jax.tree.map(jnp.zeros_like, params)
    for Xi, yi in zip(jnp.split(X, k), jnp.split(y, k)):
        loss, grads = jax.value_and_grad(jax_step.mixed_loss)(params, apply_fn, Xi, yi)
        losses.append(loss)
        total = jax.tree.map(jnp.add, total, grads)
    return sum(losses) / k, jax.tree.map(lambda g: g / k, total)


def inverted_break_even(nbytes, world_size, alpha, beta, seconds_per_example):
    comm = costmodel.predict("ring", nbytes, world_size, alpha, beta)
    return seconds_per_example / comm


def twice_break_even(nbytes, world_size, alpha, beta, seconds_per_example):
    return (2 * (world_size - 1) * alpha + 2 * nbytes * beta) / seconds_per_example


def no_latency_break_even(nbytes, world_size, alpha, beta, seconds_per_example):
    return 2 * (world_size - 1) / world_size * nbytes * beta / seconds_per_example


def no_prefetch(n):
    return zero.prefetch_schedule(n, prefetch=False)


def all_at_once(n):
    """Every gather of a pass first, then the computations: no waiting, whole model held."""
    return ([("gather", i) for i in range(n)] + [("forward", i) for i in range(n)]
            + [("gather", i) for i in reversed(range(n))]
            + [("backward", i) for i in reversed(range(n))])


def forward_order_backward(n):
    """Backward computes in the forward's order."""
    s = zero.prefetch_schedule(n)
    half = len(s) // 2
    return s[:half] + [(k, n - 1 - i) for k, i in s[half:]]


def forgetting_backward_gathers(n):
    """Gathers only once per step, in forward (as if the parameters stayed whole)."""
    return [e for e in zero.prefetch_schedule(n)[:2 * n]] + [
        ("backward", i) for i in reversed(range(n))]


def right_accumulation_cost(numel, world_size, k, keep):
    padded = 4 * world_size * math.ceil(numel / world_size)
    sent = (1 if keep else k) * (world_size - 1) / world_size * padded
    return sent, (4 * numel if keep else padded / world_size)


def allreduce_accumulation_cost(numel, world_size, k, keep):
    sent, held = right_accumulation_cost(numel, world_size, k, keep)
    return 2 * sent, held


def k_times_accumulation_cost(numel, world_size, k, keep):
    sent, held = right_accumulation_cost(numel, world_size, k, False)
    return sent, right_accumulation_cost(numel, world_size, k, keep)[1]


def sliced_accumulation_cost(numel, world_size, k, keep):
    sent, _ = right_accumulation_cost(numel, world_size, k, keep)
    return sent, right_accumulation_cost(numel, world_size, k, False)[1]


def unpadded_accumulation_cost(numel, world_size, k, keep):
    # 4 * numel bytes in place of ZeRO's padded 4 * N * ceil(numel / N)
    sent = (1 if keep else k) * (world_size - 1) / world_size * 4 * numel
    return sent, (4 * numel if keep else 4 * numel / world_size)


# ---------------------------------------------------------------- the checks

CHECKS = [
    (exercises.check_split_sizes, split_sizes,
     [(floor_sizes, "split-sizes-total"), (lumped_sizes, "split-sizes-even"),
      (floor_weighted_sizes, "split-sizes-weights")]),
    (torch_exercises.check_allreduce, torch_scratch.allreduce,
     [(rebinding_allreduce, "allreduce-rebind"), (two_device_allreduce, "allreduce-sum"),
      (mean_allreduce, "allreduce-mean")]),
    (torch_exercises.check_split_batch, split_batch,
     [(dropping_split, "split-batch-order"), (chunk_split, "split-batch-count")]),
    (torch_exercises.check_buckets, right_buckets,
     [(forward_buckets, "buckets-order"), (one_per_parameter, "buckets-cap"),
      (at_most_cap_buckets, "buckets-cap")]),
    (torch_exercises.check_two_bit, right_two_bit,
     [(gradient_only_two_bit, "two-bit-values"), (forgetful_two_bit, "two-bit-residual"),
      (strict_two_bit, "two-bit-ties")]),
    (torch_exercises.check_accumulation, right_accumulation,
     [(unscaled_accumulation, "accumulation-scale"),
      (zeroing_accumulation, "accumulation-overwrite"),
      (whole_batch_accumulation, "accumulation-micro")]),
    (torch_exercises.check_shard, right_shard,
     [(unpadded_shard, "shard-size"), (front_padded_shard, "shard-padding"),
      (chunk_shard, "exception")]),
    (jax_exercises.check_allreduce, jax_scratch.allreduce,
     [(jax_allreduce_on_first, "jax-allreduce-device"),
      (jax_partial_allreduce, "jax-allreduce-sum"),
      (jax_builtin_sum_allreduce, "jax-allreduce-mixed")]),
    (jax_exercises.check_ring_allreduce, jax_allreduce.ring_allreduce,
     [(neighbour_ring, "ring-sum"), (open_ring, "ring-sum"), (psum_ring, "ring-collective"),
      (whole_array_ring, "ring-bytes")]),
    (torch_exercises.check_replicate, right_replicate,
     [(to_replicate, "replicate-shared"), (clone_replicate, "replicate-leaf")]),
    (torch_exercises.check_dp_step, right_dp_step,
     [(summing_dp_step, "dp-step-scale"), (twice_averaging_dp_step, "dp-step-small"),
      (mean_of_means_dp_step, "dp-step-unequal"), (local_dp_step, "dp-step-diverged")]),
    (torch_exercises.check_atomic_save, right_save,
     [(direct_save, "atomic-save-torn"), (leaky_save, "atomic-save-leftover"),
      (buffered_save, "atomic-save-in-place"),
      (unprotected_temporary_save, "atomic-save-leftover")]),
    (exercises.check_pad_batch, pad_batch,
     [(tail_padding, "pad-rows"), (boolean_mask, "pad-mask"), (nan_padding, "pad-zeros")]),
    (jax_exercises.check_shard_map_grads, right_grads,
     [(no_pcast_grads, "grads-times-n"), (psum_grads, "grads-times-n"),
      (local_grads, "grads-varying")]),
    (jax_exercises.check_scan_accumulation, jax_step.accumulated_grads,
     [(unscaled_scan, "scan-scale"), (replacing_scan, "scan-last"),
      (python_loop, "scan-unrolled"), (stacking_scan, "scan-stacked")]),
    (torch_exercises.check_break_even, costmodel.break_even_batch,
     [(inverted_break_even, "break-even-inverted"), (twice_break_even, "break-even-ring"),
      (no_latency_break_even, "break-even-latency")]),
    (torch_exercises.check_prefetch_schedule, zero.prefetch_schedule,
     [(no_prefetch, "prefetch-late"), (all_at_once, "prefetch-memory"),
      (forward_order_backward, "prefetch-compute-order"),
      (forgetting_backward_gathers, "prefetch-missing")]),
    (torch_exercises.check_accumulation_cost, right_accumulation_cost,
     [(allreduce_accumulation_cost, "accum-cost-allreduce"),
      (k_times_accumulation_cost, "accum-cost-sent"),
      (sliced_accumulation_cost, "accum-cost-held"),
      (unpadded_accumulation_cost, "accum-cost-padding")]),
]
IDS = [check.__module__.split(".")[-2] + "." + check.__name__ for check, _, _ in CHECKS]


@pytest.mark.parametrize("check, right, wrongs", CHECKS, ids=IDS)
def test_right_passes_and_wrong_fails_with_its_hint(check, right, wrongs, capsys):
    assert check(right) is None
    assert "✓" in capsys.readouterr().out
    for wrong, hint in wrongs:
        failure = check(wrong)
        assert failure is not None and failure.hint == hint, (wrong.__name__, failure)
        out = capsys.readouterr().out
        assert "✗" in out and exercises.HINTS[hint]["en"] in out


@pytest.mark.parametrize("check, right, wrongs", CHECKS, ids=IDS)
def test_hints_in_chinese(check, right, wrongs, capsys, monkeypatch):
    monkeypatch.setenv("DPBOOK_LANG", "zh")
    wrong, hint = wrongs[0]
    check(wrong)
    out = capsys.readouterr().out
    assert "没有通过的最小用例" in out and exercises.HINTS[hint]["zh"] in out
    assert exercises.HINTS[hint]["en"] not in out


def test_every_hint_has_both_languages():
    for key, texts in exercises.HINTS.items():
        assert set(texts) == set(exercises.LANGUAGES), key
        assert all(t.strip() for t in texts.values()), key


def test_smallest_failing_case_comes_first(capsys):
    assert jax_exercises.check_ring_allreduce(neighbour_ring, quiet=True).seen.startswith(
        "device ")
    failure = torch_exercises.check_allreduce(two_device_allreduce)
    out = capsys.readouterr().out
    assert "3 device(s), tensors of shape (1,)" in out          # not 4 or 8 devices
    assert failure.hint == "allreduce-sum"


def test_an_exception_is_reported_not_raised(capsys):
    def broken(data):
        raise RuntimeError("boom")
    failure = torch_exercises.check_allreduce(broken)
    assert failure.hint == "exception" and "boom" in failure.seen
    assert "RuntimeError" in capsys.readouterr().err


# ---------------------------------------------------------------- processes


def two_process_ring(x):             # one reduce step and one gather step: right for N = 2
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return x
    chunks = torch.tensor_split(x, n)
    for send, mine, add in ((chunks[rank], chunks[(rank - 1) % n], True),
                            (chunks[(rank - 1) % n], chunks[rank], False)):
        received = torch.empty_like(mine)
        requests = [dist.isend(send, (rank + 1) % n)] if send.numel() else []
        if received.numel():
            requests.append(dist.irecv(received, (rank - 1) % n))
        for request in requests:
            request.wait()
        if add:
            mine += received
        else:
            mine.copy_(received)
    return x


def blocking_ring(x):                # both neighbours send first, with blocking sends
    rank, n = dist.get_rank(), dist.get_world_size()
    buffer = torch.empty_like(x)
    for _ in range(n - 1):
        dist.send(x, (rank + 1) % n)
        dist.recv(buffer, (rank - 1) % n)
    return x


def pipelined_ring(x, segments=3):  # exercise 2: each chunk in segments, added as they come
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return x
    chunks = torch.tensor_split(x, n)
    for gather in (False, True):
        for step in range(n - 1):
            send = chunks[(rank + gather - step) % n]
            mine = chunks[(rank - step - (0 if gather else 1)) % n]
            pairs = list(zip(torch.tensor_split(send, segments),
                             torch.tensor_split(mine, segments)))
            sends = [dist.isend(s, (rank + 1) % n, tag=k) for k, (s, _) in enumerate(pairs)
                     if s.numel()]
            receives = []
            for k, (_, m) in enumerate(pairs):
                buffer = m if gather else torch.empty_like(m)
                if buffer.numel():
                    receives.append((dist.irecv(buffer, (rank - 1) % n, tag=k), m, buffer))
            for request, m, buffer in receives:      # add each segment as soon as it is in
                request.wait()
                if not gather:
                    m += buffer
            for request in sends:
                request.wait()
    return x


PROCESS_CASES = [
    (torch_allreduce.ring_allreduce, False, None),
    (torch_allreduce._bidirectional_ring_allreduce, True, None),
    (pipelined_ring, False, None),
    (torch_allreduce.ring_allreduce, True, "ring-process-both-ways"),
    (two_process_ring, False, "ring-process-sum"),
    (torch_allreduce.tree_allreduce, False, "ring-process-bytes"),
]


@pytest.mark.multiprocess
def test_ring_over_processes_tells_right_from_wrong():
    """2, 3 and 4 gloo processes: the package's ring and bidirectional ring and a pipelined
    ring pass; the plain ring fails the bidirectional check, and wrong rings fail with
    their hints."""
    for fn, bidirectional, hint in PROCESS_CASES:
        failure = torch_exercises.check_ring_allreduce(fn, bidirectional=bidirectional,
                                                       quiet=True)
        assert (failure and failure.hint) == hint, (fn.__name__, failure)
    assert no_children_left()


@pytest.mark.multiprocess
def test_ring_over_processes_reports_a_deadlock_and_cleans_up(capsys, monkeypatch):
    monkeypatch.setenv("DPBOOK_LANG", "zh")
    failure = torch_exercises.check_ring_allreduce(blocking_ring, timeout=1)
    assert failure.hint == "ring-process-timeout" and "2 processes" in capsys.readouterr().out
    assert no_children_left()


@pytest.mark.multiprocess
def test_ring_over_processes_takes_a_function_defined_in_the_notebook():
    """The reader's function lives in ``__main__`` (a notebook): it reaches the spawned
    processes by value. This one leaves the sum in a new tensor, not in x."""
    namespace = {"__name__": "__main__"}
    exec("from dpbook.torch import allreduce\n"
         "def copying_ring(x):\n"
         "    return allreduce.ring_allreduce(x.clone())\n", namespace)
    failure = torch_exercises.check_ring_allreduce(namespace["copying_ring"], quiet=True)
    assert failure.hint == "ring-process-inplace"


def test_every_hint_a_check_names_is_in_hints_yml():
    """Hints are data (dpbook/hints.yml): every key a check can return is there, and
    every key there is used by some check."""
    import re
    from pathlib import Path
    sources = "".join(Path(m.__file__).read_text() for m in
                      (exercises, torch_exercises, jax_exercises))
    used = {key for call in re.findall(r"Failure\(([^,]*),", sources)   # the first argument
            for key in re.findall(r'"([\w-]+)"', call)}
    assert used and used <= set(exercises.HINTS), used - set(exercises.HINTS)
    assert set(exercises.HINTS) - {"exception"} <= used, set(exercises.HINTS) - used


def looped_whole_array_ring(x, axis_name):
    """The whole array passed on N - 1 times, in a lax.fori_loop: one collective-permute
    in the program's text, run N - 1 times."""
    n = jax.lax.axis_size(axis_name)
    perm = [(j, (j + 1) % n) for j in range(n)]

    def step(_, carry):
        total, message = carry
        message = jax.lax.ppermute(message, axis_name, perm)
        return total + message, message

    return jax.lax.fori_loop(0, n - 1, step, (x, x))[0]


def test_ring_bytes_count_every_trip_of_a_loop():
    failure = jax_exercises.check_ring_allreduce(looped_whole_array_ring, quiet=True)
    assert failure is not None and failure.hint == "ring-bytes", failure
    assert "sends 48 values of 24" in failure.seen    # 24 values, 2 trips, 3 devices

"""The checked exercises (dpbook.exercises and its torch and jax parts): every check passes
the package's own solution and fails known-wrong ones with the expected hint, in English
and in Chinese."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from jax import lax
from torch.nn import functional as F

from dpbook import exercises
from dpbook.devices import split_sizes
from dpbook.jax import allreduce as jax_allreduce
from dpbook.jax import exercises as jax_exercises
from dpbook.jax import scratch as jax_scratch
from dpbook.torch import compression
from dpbook.torch import exercises as torch_exercises
from dpbook.torch.data_parallel import make_buckets
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


def jax_allreduce_on_first(data):         # the sum, but only on the first device
    total = sum(jax.device_put(x, list(data[0].devices())[0]) for x in data)
    return [total] * len(data)


def jax_partial_allreduce(data):          # each device adds its left neighbour only
    return [x + jax.device_put(data[i - 1], list(x.devices())[0]) if len(data) > 1 else x
            for i, x in enumerate(data)]


def neighbour_ring(x, axis_name):         # one step around the ring: right for 1 and 2
    n = lax.axis_size(axis_name)
    if n == 1:
        return x
    return x + lax.ppermute(x, axis_name, [(j, (j + 1) % n) for j in range(n)])


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


def right_two_bit(grad, residual, t):
    packed = compression.quantize_2bit(grad, residual, t)
    return compression.dequantize_2bit(packed, grad.numel(), t), residual


def gradient_only_two_bit(grad, residual, t):    # ignores the residual when quantizing
    q = t * ((grad >= t).float() - (grad <= -t).float())
    return q, grad + residual - q


def forgetful_two_bit(grad, residual, t):        # never updates the residual
    v = grad + residual
    return t * ((v >= t).float() - (v <= -t).float()), residual


# ---------------------------------------------------------------- the checks

CHECKS = [
    (exercises.check_split_sizes, split_sizes,
     [(floor_sizes, "split-sizes-total"), (lumped_sizes, "split-sizes-even")]),
    (torch_exercises.check_allreduce, torch_scratch.allreduce,
     [(rebinding_allreduce, "allreduce-rebind"), (two_device_allreduce, "allreduce-sum"),
      (mean_allreduce, "allreduce-mean")]),
    (torch_exercises.check_split_batch, split_batch,
     [(dropping_split, "split-batch-order"), (chunk_split, "split-batch-count")]),
    (torch_exercises.check_buckets, right_buckets,
     [(forward_buckets, "buckets-order"), (one_per_parameter, "buckets-cap")]),
    (torch_exercises.check_two_bit, right_two_bit,
     [(gradient_only_two_bit, "two-bit-values"), (forgetful_two_bit, "two-bit-residual")]),
    (torch_exercises.check_accumulation, right_accumulation,
     [(unscaled_accumulation, "accumulation-scale"),
      (zeroing_accumulation, "accumulation-overwrite")]),
    (torch_exercises.check_shard, right_shard,
     [(unpadded_shard, "shard-size"), (front_padded_shard, "shard-padding"),
      (chunk_shard, "exception")]),
    (jax_exercises.check_allreduce, jax_scratch.allreduce,
     [(jax_allreduce_on_first, "jax-allreduce-device"),
      (jax_partial_allreduce, "jax-allreduce-sum")]),
    (jax_exercises.check_ring_allreduce, jax_allreduce.ring_allreduce,
     [(neighbour_ring, "ring-sum"), (open_ring, "ring-sum")]),
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

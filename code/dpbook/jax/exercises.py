"""Checked exercises for JAX (see :mod:`dpbook.exercises`): the reader's allreduce over a
list of arrays on devices, and a ring allreduce written with ``lax.ppermute``, run on 1 to
8 (emulated) devices with sizes that do not divide."""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..exercises import HINTS, Failure, run_check
from .state import AXIS, make_mesh

__all__ = ["check_allreduce", "check_ring_allreduce"]

HINTS.update({
    "jax-allreduce-count": {
        "en": "return one array per device, in the order of the inputs",
        "zh": "每个设备返回一个数组，顺序与输入相同"},
    "jax-allreduce-device": {
        "en": "result i must live on the device of data[i] (jax.device_put)",
        "zh": "第i个结果必须放在data[i]所在的设备上（jax.device_put）"},
    "jax-allreduce-sum": {
        "en": "every result must be the sum of the arrays of *all* devices, not a partial sum",
        "zh": "每个结果都必须是*所有*设备上数组之和，而不是部分和"},
    "ring-sum": {
        "en": "after the ring, every device must hold the sum over all devices. With N "
              "devices a ring needs N - 1 steps to reduce and N - 1 more to gather; a version "
              "that works for 2 devices often does only one of each",
        "zh": "环形传递结束后，每个设备都必须持有所有设备上的总和。N个设备的环需要N - 1步归约，"
              "再需要N - 1步收集；只对2个设备正确的写法，往往各只做了一步"},
    "ring-shape": {
        "en": "return an array of the input's shape and dtype: pad to a multiple of N to cut "
              "it into chunks, and drop the padding at the end",
        "zh": "返回的数组必须与输入的形状和数据类型相同："
              "切块前先填充到N的倍数，最后再去掉填充"},
    "ring-permute": {
        "en": "lax.ppermute's perm must send every device's chunk to exactly one neighbour: "
              "pairs (j, (j + 1) % N) for all j",
        "zh": "lax.ppermute的perm必须把每个设备的块恰好发给一个邻居："
              "对所有j取(j, (j + 1) % N)"},
})


def check_allreduce(fn: Callable[[list[jax.Array]], Sequence[jax.Array]], quiet: bool = False
                    ) -> Failure | None:
    """Check ``fn(data) -> results``: ``data`` holds one array per device; ``results[i]``
    must be the sum of all of them, on ``data[i]``'s device. 1 to 8 devices (as many as
    there are), float and integer arrays, shapes that do not divide."""
    devices = jax.devices()
    cases = [(f"{k} device(s), arrays of shape {shape}, {dtype.__name__}", (k, shape, dtype))
             for k in (1, 2, 3, 4, 8) if k <= len(devices)
             for shape in ((1,), (5,), (2, 3)) for dtype in (np.float32, np.int32)]

    def run_case(case):
        k, shape, dtype = case
        rng = np.random.default_rng(k)
        host = [rng.integers(-9, 10, shape).astype(dtype) for _ in range(k)]
        data = [jax.device_put(a, d) for a, d in zip(host, devices[:k])]
        results = list(fn(data))
        total = sum(host)
        if len(results) != k:
            return Failure("jax-allreduce-count", f"{len(results)} results for {k} devices")
        for i, (r, d) in enumerate(zip(results, devices[:k])):
            if r.devices() != {d}:
                return Failure("jax-allreduce-device", f"result {i} on {r.devices()}")
            if not np.array_equal(np.asarray(r), total):
                return Failure("jax-allreduce-sum", f"result {i} is {np.asarray(r).tolist()}, "
                               f"the sum is {total.tolist()}")
        return None

    return run_check("allreduce", cases, run_case, quiet)


def check_ring_allreduce(fn: Callable[[jax.Array, str], jax.Array], quiet: bool = False
                         ) -> Failure | None:
    """Check ``fn(x, axis_name)``, called inside ``jax.shard_map`` on each device's array,
    against ``lax.psum``: 1 to 8 devices (as many as there are), sizes that divide by the
    device count and sizes that do not."""
    devices = jax.devices()
    cases = [(f"{k} device(s), {size} value(s) per device", (k, size))
             for k in (1, 2, 3, 4, 8) if k <= len(devices) for size in (1, 5, 8)]

    def run_case(case):
        k, size = case
        mesh = make_mesh(devices[:k])
        x = jnp.asarray(np.random.default_rng(size).integers(-9, 10, (k, size)),
                        jnp.float32)                 # small integers: exact float sums
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(AXIS)))

        def body(rows):                            # rows: (1, size), this device's
            out = fn(rows[0], AXIS)
            return out[None], jax.lax.psum(rows[0], AXIS)[None]

        try:
            out, expected = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS),
                                                  out_specs=(P(AXIS), P(AXIS))))(x)
        except ValueError as e:
            if "perm" in str(e) or "permut" in str(e):
                return Failure("ring-permute", f"{type(e).__name__}: {str(e)[:120]}")
            raise
        if out.shape != expected.shape or out.dtype != expected.dtype:
            return Failure("ring-shape", f"{out.shape} {out.dtype} instead of "
                           f"{expected.shape} {expected.dtype}")
        if not np.array_equal(np.asarray(out), np.asarray(expected)):
            row = int(np.argmax(np.any(np.asarray(out) != np.asarray(expected), axis=1)))
            return Failure("ring-sum", f"device {row} holds {np.asarray(out)[row].tolist()}, "
                           f"the sum is {np.asarray(expected)[row].tolist()}")
        return None

    return run_check("ring_allreduce", cases, run_case, quiet)

"""Checked exercises for JAX (see :mod:`dpbook.exercises`): the reader's allreduce over a
list of arrays on devices, a ring allreduce written with ``lax.ppermute`` (1 to 8
emulated devices, sizes that do not divide), the gradient of replicated parameters inside
``shard_map`` (the ``lax.pcast`` trap) and gradient accumulation with ``lax.scan``; and,
for the JAX notebooks' convenience, the framework-free :func:`dpbook.exercises.check_pad_batch`
(padding and mask of unequal shards)."""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..exercises import Failure, check_pad_batch, run_check
from .devices import all_devices
from .state import AXIS, make_mesh

__all__ = ["check_allreduce", "check_ring_allreduce", "check_shard_map_grads",
           "check_scan_accumulation", "check_pad_batch", "check_restore"]


def _check_devices() -> list[jax.Device]:
    """The devices a check runs its cases on: the emulated CPU devices when there are more
    of them than accelerators (one GPU still gives the cases of 2, 3, 4 and 8 devices)."""
    return all_devices()


def check_allreduce(fn: Callable[[list[jax.Array]], Sequence[jax.Array]], quiet: bool = False
                    ) -> Failure | None:
    """Check ``fn(data) -> results``: ``data`` holds one array per device; ``results[i]``
    must be the sum of all of them, on ``data[i]``'s device. 1 to 8 devices (as many as
    there are), float and integer arrays, shapes that do not divide."""
    devices = _check_devices()
    cases = [(f"{k} device(s), arrays of shape {shape}, {dtype.__name__}", (k, shape, dtype))
             for k in (1, 2, 3, 4, 8) if k <= len(devices)
             for shape in ((1,), (5,), (2, 3)) for dtype in (np.float32, np.int32)]

    def run_case(case):
        k, shape, dtype = case
        rng = np.random.default_rng(k)
        host = [rng.integers(-9, 10, shape).astype(dtype) for _ in range(k)]
        data = [jax.device_put(a, d) for a, d in zip(host, devices[:k])]
        try:
            results = list(fn(data))
        except ValueError as e:                  # sum(data): arrays on several devices
            if "incompatible devices" not in str(e):
                raise
            return Failure("jax-allreduce-mixed", f"{type(e).__name__}: {str(e)[:160]}")
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
    """Check ``fn(x, axis_name)``, called inside ``jax.shard_map`` on each device's array:
    every device must end with the sum over the devices (compared with a sum on the
    host), computed by a ring. 1 to 8 devices (as many as there are), sizes that divide
    by the device count and sizes that do not. The compiled program is read too
    (:func:`dpbook.jax.hlo.collectives`): it may hold no collective but
    ``collective-permute`` (no ``lax.psum``, ``all_gather``…), and, on 3 or more devices
    with a size that divides, each device may send at most 2 (N - 1) / N of its array
    (a ring's bandwidth; passing the whole array around N - 1 times sends N - 1 times
    it)."""
    from .hlo import executed_collectives, type_bytes
    devices = _check_devices()
    cases = [(f"{k} device(s), {size} value(s) per device", (k, size))
             for k in (1, 2, 3, 4, 8) if k <= len(devices) for size in (1, 5, 24)]

    def run_case(case):
        k, size = case
        mesh = make_mesh(devices[:k])
        host = np.random.default_rng(size).integers(-9, 10, (k, size)).astype(np.float32)
        expected = np.broadcast_to(host.sum(axis=0), host.shape)   # small integers: exact
        x = jax.device_put(jnp.asarray(host), jax.sharding.NamedSharding(mesh, P(AXIS)))
        ring = jax.jit(jax.shard_map(lambda rows: fn(rows[0], AXIS)[None], mesh=mesh,
                                     in_specs=P(AXIS), out_specs=P(AXIS)))
        try:
            compiled = ring.lower(x).compile()
        except ValueError as e:
            if "perm" in str(e) or "permut" in str(e):
                return Failure("ring-permute", f"{type(e).__name__}: {str(e)[:120]}")
            raise
        out = compiled(x)
        if out.shape != expected.shape or out.dtype != expected.dtype:
            return Failure("ring-shape", f"{out.shape} {out.dtype} instead of "
                           f"{expected.shape} {expected.dtype}")
        if not np.array_equal(np.asarray(out), expected):
            row = int(np.argmax(np.any(np.asarray(out) != expected, axis=1)))
            return Failure("ring-sum", f"device {row} holds {np.asarray(out)[row].tolist()}, "
                           f"the sum is {expected[row].tolist()}")
        ops = executed_collectives(compiled.as_text())    # a loop's body: × its trips
        others = sorted({kind for kind, _, _ in ops if kind != "collective-permute"})
        if others:
            return Failure("ring-collective", f"the compiled program holds {others}")
        if k >= 3 and size % k == 0:
            sent = sum(type_bytes(t) * times for kind, t, times in ops) // 4
            want = 2 * (k - 1) * size // k
            if sent > want:
                return Failure("ring-bytes", f"each device sends {sent} values of {size}; "
                               f"a ring sends {want}")
        return None

    return run_check("ring_allreduce", cases, run_case, quiet)


def _linear_loss(params, X, y):
    """Mean softmax cross-entropy of a linear model: the loss both checks hand the reader."""
    logits = X @ params["w"] + params["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def _linear_problem(n: int, seed: int):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=3), jnp.float32)}
    X = jnp.asarray(rng.normal(size=(n, 5)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, n), jnp.int32)
    return params, X, y


def _close(got, want) -> bool:
    return all(np.allclose(a, b, atol=1e-5)
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _ratio(got, want) -> float:
    """How many times ``want`` the tree ``got`` is (least squares)."""
    g = jnp.concatenate([a.ravel() for a in jax.tree.leaves(got)])
    w = jnp.concatenate([a.ravel() for a in jax.tree.leaves(want)])
    return float(g @ w / (w @ w))


def check_shard_map_grads(fn: Callable, quiet: bool = False) -> Failure | None:
    """Check ``fn(loss_fn, params, X, y, axis_name) -> grads``, called inside
    ``jax.shard_map`` with the parameters replicated (``P()``) and ``X``, ``y`` split along
    ``axis_name``; the grads come back replicated (``out_specs=P()``) and must equal the
    gradient of the mean loss over the whole batch on one device. ``loss_fn(params, X, y)``
    is the mean cross-entropy of a linear model. 1 to 8 devices (as many as there are)."""
    devices = _check_devices()
    cases = [(f"{k} device(s), {2 * k} examples", k) for k in (1, 2, 3, 4, 8)
             if k <= len(devices)]

    def run_case(k):
        mesh = make_mesh(devices[:k])
        params, X, y = _linear_problem(2 * k, seed=k)
        want = jax.grad(_linear_loss)(params, X, y)
        body = jax.shard_map(lambda p, X, y: fn(_linear_loss, p, X, y, AXIS), mesh=mesh,
                             in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P())
        split = jax.sharding.NamedSharding(mesh, P(AXIS))
        try:
            got = jax.jit(body)(params, jax.device_put(X, split), jax.device_put(y, split))
        except Exception as e:  # noqa: BLE001 - shard_map's check of out_specs
            if "vma" in str(e) or "varying" in str(e).lower():
                return Failure("grads-varying", f"{type(e).__name__}: {str(e)[:160]}")
            raise
        if jax.tree.structure(got) != jax.tree.structure(want):
            return Failure("grads-value", f"a tree {jax.tree.structure(got)}")
        if _close(got, want):
            return None
        ratio = _ratio(got, want)
        seen = f"the gradient is {ratio:.3g} × the one-device gradient"
        if k > 1 and abs(ratio - k) < 0.02 * k:
            return Failure("grads-times-n", seen)
        return Failure("grads-value", seen)

    return run_check("shard_map_grads", cases, run_case, quiet)


def _linear_apply(variables, X):
    """A Flax-style ``apply_fn`` for the linear model of :func:`_linear_loss`."""
    return X @ variables["params"]["w"] + variables["params"]["b"]


def _equations(jaxpr) -> Iterator:
    """Every equation of a traced program, those of nested programs (a scan's body, a
    pjit's callee) included. Read from the objects, not the printed text, whose form
    changes between JAX releases (jax 0.11 prints no ``scan[``)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)       # a ClosedJaxpr or a Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def _stacked_gradients(closed, shapes: set[tuple[int, ...]]) -> list[str]:
    """The stacked outputs (``ys``) of every ``scan`` in a traced program, nested ones
    included, that hold one gradient per iteration: outputs of shape ``(length, *s)``
    for *every* parameter shape ``s`` — k gradient copies in memory. (One such output
    alone may be something else: per-example losses of a micro-batch of 3 look like a
    stacked bias of 3 classes.)"""
    found = []
    for eqn in _equations(closed.jaxpr):
        if eqn.primitive.name == "scan":
            # jax <= 0.10 says how many outputs are the carry; 0.11 replaced num_carry
            # with tree structures (ft_in, ft_out). Without it, every output is looked
            # at: a carry that adds gradients up has a parameter's shape, not (k, *s).
            length, carry = eqn.params["length"], eqn.params.get("num_carry", 0)
            stacked = [var.aval for var in eqn.outvars[carry:]
                       if tuple(var.aval.shape[:1]) == (length,)
                       and tuple(var.aval.shape[1:]) in shapes]
            if {tuple(a.shape[1:]) for a in stacked} == shapes:
                found.extend(f"{a.dtype}{list(a.shape)}" for a in stacked)
    return found


def check_scan_accumulation(fn: Callable, quiet: bool = False) -> Failure | None:
    """Check ``fn(params, apply_fn, X, y, micro_batches) -> (loss, grads)``, the contract
    of :func:`dpbook.jax.step.accumulated_grads`: the mean cross-entropy of
    ``apply_fn({'params': params}, X)`` over the whole batch and its gradient, computed
    ``micro_batches`` equal parts at a time with ``lax.scan`` (the traced program must
    hold one copy of the micro-step, not k, and the scan must add the gradients up in its
    carry, not return one per micro-batch: that keeps k gradients in memory)."""
    cases = [(f"{n} examples in {k} micro-batch(es)", (n, k))
             for k in (1, 2, 4, 8) for n in (8, 24) if n % k == 0]

    def run_case(case):
        n, k = case
        params, X, y = _linear_problem(n, seed=n + k)
        want_loss, want = jax.value_and_grad(_linear_loss)(params, X, y)
        loss, got = fn(params, _linear_apply, X, y, k)
        if jax.tree.structure(got) != jax.tree.structure(want):
            return Failure("grads-value", f"a tree {jax.tree.structure(got)}")
        if not _close(got, want):
            ratio = _ratio(got, want)
            seen = f"the gradient is {ratio:.3g} × the whole-batch gradient"
            if k > 1 and abs(ratio - k) < 0.02 * k:
                return Failure("scan-scale", seen)
            parts = [jax.grad(_linear_loss)(params, Xi, yi)
                     for Xi, yi in zip(jnp.split(X, k), jnp.split(y, k))]
            if k > 1 and any(_close(got, jax.tree.map(lambda g: g * scale, part))
                             for part in parts for scale in (1, 1 / k)):
                return Failure("scan-last", seen)
            return Failure("grads-value", seen)
        if not np.allclose(loss, want_loss, atol=1e-5):
            return Failure("scan-loss", f"loss {float(loss):.4g}, expected {float(want_loss):.4g}")
        if k > 1:
            traced = jax.make_jaxpr(lambda p, X, y: fn(p, _linear_apply, X, y, k))(
                params, X, y)
            if not {"scan", "while"} & {e.primitive.name for e in _equations(traced.jaxpr)}:
                return Failure("scan-unrolled", "no lax.scan (nor any other loop) in the "
                               "traced program")
            stacked = _stacked_gradients(
                traced, {tuple(leaf.shape) for leaf in jax.tree.leaves(params)})
            if stacked:
                return Failure("scan-stacked", f"the scan's outputs {stacked}: one gradient "
                               f"per micro-batch, {k} in all")
        return None

    return run_check("scan_accumulation", cases, run_case, quiet)


def check_restore(fn: Callable, quiet: bool = False) -> Failure | None:
    """Check ``fn(path, state)``, which restores the Orbax checkpoint in the folder
    ``path`` (a LeNet + Adam ``TrainState`` saved by :func:`dpbook.jax.checkpoint.save`
    from another mesh) and returns it shaped and placed like ``state``, a fresh state on
    the new mesh: a ``TrainState`` of the same structure, every array equal to the saved
    one and with the sharding of the matching array of ``state``. The cases: saved on 4
    devices, restored on 2 others; saved on 2, restored on 3 (most LeNet arrays stay whole
    there: none of their dimensions divides by 3)."""
    import os
    import tempfile
    from . import checkpoint as ck
    from .fsdp import make_auto_mesh
    devices = _check_devices()
    cases = [(f"saved on {a} devices, restored on {b}", (a, b))
             for a, b in ((4, 2), (2, 3)) if len(devices) >= min(a + b, 4)]

    def run_case(case):
        a, b = case
        old = make_auto_mesh(devices[:a])
        new = make_auto_mesh(devices[-b:] if len(devices) >= a + b else devices[:b])
        trained = ck.initial_state(0)      # as if trained: a step count, nonzero moments
        trained = trained.replace(step=trained.step + 3, opt_state=jax.tree.map(
            lambda x: x + (0.5 if jnp.issubdtype(x.dtype, jnp.floating) else 3),
            trained.opt_state))
        saved, _ = ck.place(trained, old)
        fresh, shardings = ck.new_state(new, seed=1)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "checkpoint")
            ck.save(path, saved)
            got = fn(path, fresh)
        if jax.tree.structure(got) != jax.tree.structure(fresh):
            return Failure("restore-target", f"got a {type(got).__name__}, expected "
                           f"{type(fresh).__name__} of the same structure")
        if ck.max_abs_difference(got.params, saved.params) != 0:
            return Failure("restore-values", "the parameters differ from the saved ones")
        if ck.max_abs_difference(got, saved) != 0:
            return Failure("restore-optimizer", "the optimizer state differs from the "
                           "saved one")
        if not ck.shardings_equal(got, shardings):
            wrong = [x.sharding for x, s in zip(jax.tree.leaves(got),
                                                 jax.tree.leaves(shardings))
                     if x.sharding != s]
            return Failure("restore-sharding", f"{len(wrong)} arrays placed otherwise, "
                           f"e.g. {wrong[0]}")
        return None

    return run_check("restore", cases, run_case, quiet)

"""Communication in JAX: a ring allreduce with ppermute (dpbook.jax.allreduce), what XLA
compiles (dpbook.jax.hlo), unequal shards (dpbook.jax.unequal)."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

import dpbook.jax.devices
from dpbook.jax import allreduce, hlo, unequal
from dpbook.jax.concise import jit_train_step
from dpbook.jax.state import AXIS, create_train_state, make_mesh, max_abs_difference

TOL = 1e-5


@pytest.mark.parametrize("num_devices", [2, 3, 4])
@pytest.mark.parametrize("size", [1, 7, 1001])
def test_ring_equals_psum(num_devices, size):
    # sizes smaller than, and not divisible by, the number of devices
    assert allreduce.ring_vs_psum(jax.devices()[:num_devices], size, seed=size) < TOL


def test_ring_sums_on_every_device_and_keeps_the_shape():
    mesh = make_mesh(jax.devices()[:3])
    x = np.arange(3 * 2 * 5, dtype=np.float32).reshape(3, 2, 5)   # (devices, 2, 5)
    out = np.asarray(allreduce.make_allreduce(allreduce.ring_allreduce, mesh)(allreduce.place_rows(x, mesh)))
    assert out.shape == x.shape
    for row in out:                      # integers: the sum is exact in float32
        np.testing.assert_array_equal(row, x.sum(axis=0))


def test_ring_on_one_device_is_the_identity():
    mesh = make_mesh(jax.devices()[:1])
    x = np.arange(5, dtype=np.float32)[None]
    out = allreduce.make_allreduce(allreduce.ring_allreduce, mesh)(allreduce.place_rows(x, mesh))
    np.testing.assert_array_equal(np.asarray(out), x)


def test_compiled_collectives():
    mesh = make_mesh(jax.devices()[:4])
    x = allreduce.place_rows(np.ones((4, 10), np.float32), mesh)
    ring = allreduce.make_allreduce(allreduce.ring_allreduce, mesh)
    psum = allreduce.make_allreduce(allreduce.psum_allreduce, mesh)
    assert hlo.collective_ops(ring, x) == {"collective-permute": 2 * (4 - 1)}
    assert hlo.collective_ops(psum, x) == {"all-reduce": 1}


def test_time_allreduce_waits_for_every_result(monkeypatch):
    calls = []                 # what the timer waited for: every call's result, even the warm-up
    monkeypatch.setattr(dpbook.jax.devices, "synchronize",
                        lambda r=None: r is None or calls.append(r))
    mesh = make_mesh(jax.devices()[:2])
    x = allreduce.place_rows(np.arange(6, dtype=np.float32).reshape(2, 3), mesh)
    seconds = allreduce.time_allreduce(allreduce.make_allreduce(allreduce.psum_allreduce, mesh),
                                       x, 3)
    assert len(calls) == 1 + 3 and seconds > 0
    for out in calls:
        np.testing.assert_array_equal(np.asarray(out), [[3, 5, 7], [3, 5, 7]])


def test_pad_batch_layout():
    X = np.arange(5 * 2, dtype=np.float32).reshape(5, 2) + 1
    y = np.arange(5, dtype=np.int32) + 1
    X_pad, y_pad, mask = unequal.pad_batch(X, y, [3, 2])
    assert X_pad.shape == (6, 2) and y_pad.shape == (6,) and mask.dtype == np.float32
    np.testing.assert_array_equal(y_pad, [1, 2, 3, 4, 5, 0])
    np.testing.assert_array_equal(mask, [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(X_pad[mask == 1], X)
    np.testing.assert_array_equal(X_pad[5], [0, 0])
    X_pad, y_pad, mask = unequal.pad_batch(X, y, [1, 4])      # device 0: one example, 3 pads
    np.testing.assert_array_equal(y_pad, [1, 0, 0, 0, 2, 3, 4, 5])
    assert unequal.padding_waste([1, 4]) == pytest.approx(3 / 8)
    assert unequal.padding_waste([4, 4]) == 0


@pytest.mark.parametrize("sizes, match", [([3, 3], "add up to 6"), ([5, 0], "at least one"),
                                          ([], "at least one")])
def test_pad_batch_refuses_wrong_sizes(sizes, match):
    X, y = np.zeros((5, 2), np.float32), np.zeros(5, np.int32)
    with pytest.raises(ValueError, match=match):
        unequal.pad_batch(X, y, sizes)


def test_pad_batch_refuses_mismatched_X_and_y():
    with pytest.raises(ValueError, match="X has 5"):
        unequal.pad_batch(np.zeros((5, 2)), np.zeros(4), [5])


class MLP(nn.Module):
    """A tiny model: the masked step compiles in a moment."""

    @nn.compact
    def __call__(self, x):                       # (B, 8)
        return nn.Dense(10)(nn.relu(nn.Dense(16)(x)))


@pytest.mark.parametrize("sizes", [[96, 32], [4, 3, 3], [2, 1, 1, 5]])
def test_masked_step_equals_one_device(sizes):
    rng = np.random.default_rng(0)
    batch = sum(sizes)
    X = rng.standard_normal((batch, 8), dtype=np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)
    state = create_train_state(MLP(), jax.random.key(0), lr=0.5, input_shape=(1, 8))
    reference, reference_loss = jax.jit(jit_train_step)(state, X, y)

    mesh = make_mesh(jax.devices()[:len(sizes)])
    X_pad, y_pad, mask = unequal.pad_batch(X, y, sizes)
    placed = jax.device_put((X_pad, y_pad, mask), NamedSharding(mesh, P(AXIS)))
    new_state, loss = unequal.make_masked_train_step(mesh)(
        jax.device_put(state, NamedSharding(mesh, P())), *placed)
    assert max_abs_difference(new_state.params, reference.params) < TOL
    assert abs(float(loss) - float(reference_loss)) < TOL
    # the check has teeth: the step itself moves the parameters far more than TOL
    assert max_abs_difference(reference.params, state.params) > 100 * TOL
    assert int(new_state.step) == 1

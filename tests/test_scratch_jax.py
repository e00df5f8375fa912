"""From-scratch data parallelism in JAX (dpbook.jax.scratch)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dpbook import jax as dp
from dpbook.jax import scratch
from dpbook.jax.data import random_batch

TOL = 1e-5   # float32 rounding of a different summation order


def random_params(seed):
    """Random weights (not the zero output layer of the init): every layer gets a gradient."""
    params = scratch.init_lenet_params(jax.random.key(seed))
    return [p + 0.1 * jax.random.normal(jax.random.key(100 + i), p.shape)
            for i, p in enumerate(params)]


def test_conv2d_equals_lax_conv():
    key1, key2 = jax.random.split(jax.random.key(0))
    X = jax.random.normal(key1, (4, 13, 13, 20))
    W = jax.random.normal(key2, (5, 5, 20, 50))
    expected = lax.conv_general_dilated(X, W, (1, 1), "VALID",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(scratch.conv2d(X, W, 0.0), expected, atol=1e-4, rtol=1e-4)


def test_lenet_by_hand_equals_flax_lenet():
    params = scratch.init_lenet_params(jax.random.key(0))
    assert sum(p.size for p in params) == 129_068
    params = [p + 0.1 * jax.random.normal(jax.random.key(i), p.shape)   # every layer matters
              for i, p in enumerate(params)]
    X, _ = random_batch(4)
    names = ["Conv_0", "Conv_1", "Dense_0", "Dense_1"]
    flax_params = {n: {"kernel": W, "bias": b}
                   for n, W, b in zip(names, params[::2], params[1::2])}
    expected = dp.LeNet().apply({"params": flax_params}, X)
    np.testing.assert_allclose(scratch.lenet_forward(params, X), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_allreduce_returns_the_sum_on_every_device(k):
    devices = jax.devices()[:k]
    data = [jax.device_put(jnp.full((2, 3), float(i + 1)), d) for i, d in enumerate(devices)]
    out = scratch.allreduce(data)
    assert [x.devices() for x in out] == [{d} for d in devices]
    for x in out:
        np.testing.assert_array_equal(x, np.full((2, 3), k * (k + 1) / 2))
    np.testing.assert_array_equal(data[-1], np.full((2, 3), float(k)))  # inputs unchanged


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_k_device_step_equals_one_device_step(k):
    X, y = random_batch(24 * k, seed=k)
    init = random_params(1)
    devices = jax.devices()[:k]
    [reference], ref_loss = scratch.train_batch(
        X, y, [scratch.get_params(init, devices[0])], devices[:1], 0.3)
    replicas, loss = scratch.train_batch(X, y, [scratch.get_params(init, d) for d in devices],
                                         devices, 0.3)
    for ref, p in zip(reference, replicas[0]):
        np.testing.assert_allclose(p, ref, atol=TOL, rtol=0)
    assert all(not np.array_equal(a, b) for a, b in zip(replicas[0], init))  # all moved
    for replica, device in zip(replicas, devices):
        assert all(p.devices() == {device} for p in replica)
        assert all(np.array_equal(a, b) for a, b in zip(replica, replicas[0]))
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)   # the summed batch loss


def test_uneven_split_still_equals_one_device():
    X, y = random_batch(30)
    init = random_params(2)
    devices = jax.devices()[:4]                 # shards of 8, 8, 7, 7
    [reference], ref_loss = scratch.train_batch(X, y, [init], devices[:1], 0.3)
    replicas, loss = scratch.train_batch(X, y, [scratch.get_params(init, d) for d in devices],
                                         devices, 0.3)
    for ref, p in zip(reference, replicas[-1]):
        np.testing.assert_allclose(p, ref, atol=TOL, rtol=0)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)   # the summed batch loss


def test_train_runs_and_matches_across_device_counts(fashion_mnist_dir):
    scale = dp.get_scale("quick")
    results = [scratch.train(k, 128, 0.3, num_epochs=2, scale=scale, root=fashion_mnist_dir,
                             animator=dp.Animator(legend=["train loss", "test acc"],
                                                     path=False, live=False)) for k in (1, 2)]
    for r in results:
        losses = r.animator.series()["train loss"][1]
        assert len(losses) == 2 and losses[1] < losses[0]
        assert 0.2 < r.test_acc <= 1             # chance is 0.1
        assert len(r.model) == r.num_devices     # every device's parameters
    # Same data, same initial parameters, equivalent steps: the first epoch's losses agree
    # to rounding. (Later epochs may drift apart: training amplifies 1e-7 differences.)
    first = [r.animator.series()["train loss"][1][0] for r in results]
    assert first[0] == pytest.approx(first[1], rel=1e-5)

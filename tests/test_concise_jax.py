"""Concise data parallelism in JAX (dpbook.jax.concise): pmap, shard_map, jit + sharding."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from dpbook import jax as dp
from dpbook.jax import concise, hlo
from dpbook.jax.data import random_batch
from dpbook.jax.state import AXIS, create_train_state, make_mesh, max_abs_difference

# float32 rounding of a different summation order: parameters of size ~0.1 are stored
# with a spacing of ~1e-8, and reordered sums change the new parameters by about that
# (1.5e-8 measured for LeNet). A real bug, such as a gradient off by a factor of 2,
# changes them by about as much as the step itself (~1e-2).
TOL = 1e-5
LR = 0.3


class TinyCNN(nn.Module):
    """A convolution (optionally with BatchNorm) and a dense layer: the sweeps below
    compile this in a fraction of LeNet's time (the steps do not depend on the model)."""
    batch_norm: bool = False
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):                    # (B, 28, 28, 1)
        x = nn.Conv(4, (3, 3), strides=(3, 3))(x)                 # (B, 10, 10, 4)
        if self.batch_norm:
            x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
        x = nn.relu(x)
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))          # (B, 10)


# 'rbg' keys: XLA's CPU backend compiles an init with the default threefry keys in ~6 s,
# with rbg keys in ~2 s. The values do not matter here, only that every layer is random.
def key(seed=0):
    return jax.random.key(seed, impl="rbg")


@pytest.fixture(scope="module")
def lenet_state():
    return create_train_state(dp.LeNet(), key(), LR)


@pytest.fixture(scope="module")
def tiny_state():
    return create_train_state(TinyCNN(), key(), LR)


@pytest.fixture(scope="module")
def bn_state():
    return create_train_state(dp.LeNetBN(), key(), LR)


def one_device_step(state, X, y):
    return jax.jit(concise.jit_train_step)(state, X, y)


# --- data and placement ------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_shard_batch_shapes(k):
    X, y = random_batch(32)
    X_split, y_split = concise.shard_batch(X, y, k)
    assert X_split.shape == (k, 32 // k, 28, 28, 1) and y_split.shape == (k, 32 // k)
    np.testing.assert_array_equal(X_split.reshape(X.shape), X)   # order kept: device i gets block i
    np.testing.assert_array_equal(y_split[-1], y[-(32 // k):])


def test_shard_batch_errors():
    X, y = random_batch(30)
    with pytest.raises(ValueError, match="does not split evenly across 4 devices"):
        concise.shard_batch(X, y, 4)
    with pytest.raises(ValueError, match="X has 30 examples and y has 29"):
        concise.shard_batch(X, y[:29], 2)
    with pytest.raises(ValueError, match="at least one device"):
        concise.shard_batch(X, y, 0)
    dpar = concise.make_data_parallel("jit", jax.devices()[:4])   # same check on a mesh
    with pytest.raises(ValueError, match="does not split evenly"):
        dpar.place_batch(X, y)
    with pytest.raises(ValueError, match="unknown method"):
        concise.make_data_parallel("dp", jax.devices()[:2])


@pytest.mark.parametrize("k", [1, 4])
def test_replicate_and_unreplicate(k, lenet_state):
    devices = jax.devices()[:k]
    replicated = concise.replicate(lenet_state.params, devices)
    kernel = replicated["Conv_0"]["kernel"]
    assert kernel.shape == (k, 3, 3, 1, 20)
    assert [s.device for s in kernel.addressable_shards] == devices
    back = concise.unreplicate(replicated)
    assert back["Conv_0"]["kernel"].shape == (3, 3, 1, 20)        # also for k == 1
    assert back["Conv_0"]["kernel"].devices() == {devices[0]}
    assert max_abs_difference(back, lenet_state.params) == 0


def test_pmap_step_compiles_once(lenet_state, caplog):
    """Our replicate uses pmap's own mesh, so feeding the step its output does not recompile."""
    dpar = concise.make_data_parallel("pmap", jax.devices()[:2])
    X, y = dpar.place_batch(*random_batch(64, seed=2))
    state, _ = dpar.step(dpar.place_state(lenet_state), X, y)
    def compiles(f):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="jax"), jax.log_compiles(True):
            jax.block_until_ready(f())
        return [r for r in caplog.records if "Compiling" in r.getMessage()]

    assert compiles(lambda: jax.jit(lambda x: x + 1)(jnp.ones(3)))   # the check can see one
    assert not compiles(lambda: dpar.step(state, X, y))


# --- every method equals one device on the whole minibatch -----------------------------


def check_step_equals_one_device_step(method, k, state0, n):
    X, y = random_batch(n, seed=k)
    reference, reference_loss = one_device_step(state0, X, y)
    dpar = concise.make_data_parallel(method, jax.devices()[:k])
    state, loss = dpar.step(dpar.place_state(state0), *dpar.place_batch(X, y))
    state = dpar.get_state(state)
    assert max_abs_difference(state.params, reference.params) < TOL
    assert max_abs_difference(reference.params, state0.params) > 1e-3   # it moved
    assert float(loss) == pytest.approx(float(reference_loss), abs=TOL)
    assert int(state.step) == 1
    assert all(x.devices() == {jax.devices()[0]} for x in jax.tree.leaves(state.params))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("method", concise.METHODS)
def test_step_equals_one_device_step(method, k, tiny_state):
    check_step_equals_one_device_step(method, k, tiny_state, 64)


@pytest.mark.parametrize("method", concise.METHODS)
def test_lenet_step_equals_one_device_step(method, lenet_state):
    check_step_equals_one_device_step(method, 2, lenet_state, 64)


def test_jit_step_has_one_fused_allreduce(lenet_state, tiny_state):
    X, y = random_batch(64, seed=2)                # the shapes of the tests above: no compiling
    for k, state, expected in ((1, tiny_state, 0), (2, lenet_state, 1)):
        mesh = make_mesh(jax.devices()[:k])
        state = jax.device_put(state, NamedSharding(mesh, P()))
        X_mesh, y_mesh = jax.device_put((X, y), NamedSharding(mesh, P(AXIS)))
        ops = hlo.allreduce_ops(concise.make_jit_train_step(mesh), state, X_mesh, y_mesh)
        assert len(ops) == expected
    assert ops[0].count("f32[") == 9          # LeNet's 8 gradients and the loss


def test_mesh_axis_is_explicit_and_refuses_unsharded_input(lenet_state):
    mesh = make_mesh(jax.devices()[:2])
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    X, y = random_batch(16)
    state = jax.device_put(lenet_state, NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match="does not match the specs of the input"):
        concise.make_shard_map_train_step(mesh)(state, X, y)


# --- sentinel: the shard_map gradient trap ---------------------------------------------


def _linear_loss(w, X, y):
    return jnp.mean((X @ w - y) ** 2)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_sentinel_grad_of_unvarying_params_is_already_summed(k):
    """Fails if JAX changes what shard_map's autodiff does with replicated parameters.

    With check_vma=True (the default), the gradient w.r.t. unvarying (replicated)
    parameters comes out summed over the devices; pmean then leaves it unchanged, so
    grad-then-pmean is k times the gradient of the whole batch (and grad-then-psum k²
    times). lax.pcast(..., to='varying') before the gradient restores the per-device
    gradient. pmap runs shard_map with check_vma=False and never had the problem.
    """
    rng = np.random.default_rng(k)
    X = rng.normal(size=(8 * k, 3)).astype(np.float32)
    y = rng.normal(size=8 * k).astype(np.float32)
    w = np.array([0.5, -1.0, 2.0], np.float32)
    expected = jax.grad(_linear_loss)(w, X, y)
    mesh = make_mesh(jax.devices()[:k])
    w_mesh = jax.device_put(w, NamedSharding(mesh, P()))
    X_mesh, y_mesh = jax.device_put((X, y), NamedSharding(mesh, P(AXIS)))

    def run(body):
        f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                          out_specs=P())
        return np.asarray(jax.jit(f)(w_mesh, X_mesh, y_mesh))

    def no_pcast(w, X, y):
        return lax.pmean(jax.grad(_linear_loss)(w, X, y), AXIS)

    def no_pcast_psum(w, X, y):
        return lax.psum(jax.grad(_linear_loss)(w, X, y), AXIS)

    def with_pcast(w, X, y):
        w = lax.pcast(w, AXIS, to="varying")
        return lax.pmean(jax.grad(_linear_loss)(w, X, y), AXIS)

    np.testing.assert_allclose(run(no_pcast), k * expected, rtol=1e-5)
    np.testing.assert_allclose(run(no_pcast_psum), k * k * expected, rtol=1e-5)
    np.testing.assert_allclose(run(with_pcast), expected, rtol=1e-5)
    pmapped = jax.pmap(no_pcast, axis_name=AXIS, in_axes=(None, 0, 0),
                       devices=jax.devices()[:k])
    X_split, y_split = concise.shard_batch(X, y, k)
    np.testing.assert_allclose(pmapped(w, X_split, y_split)[0], expected, rtol=1e-5)


# --- BatchNorm ---------------------------------------------------------------------------


def test_lenet_bn_sizes(bn_state):
    # LeNet's 129,068 plus a scale and a bias per channel of the three BatchNorm layers.
    assert dp.num_params(bn_state.params) == 129_464 == 129_068 + 2 * (20 + 50 + 128)
    assert dp.num_params(bn_state.batch_stats) == 2 * (20 + 50 + 128)


def test_pmean_of_batch_stats(bn_state):
    k = 4
    X, _ = random_batch(64, seed=5)
    X = X * np.repeat(np.arange(1, k + 1, dtype=np.float32), 16)[:, None, None, None]
    X_split = X.reshape(k, 16, 28, 28, 1)          # shard i scaled by i + 1: different means

    local, averaged = jax.pmap(concise.local_and_averaged, axis_name=AXIS, in_axes=(None, 0),
                               devices=jax.devices()[:k])(bn_state, X_split)
    whole = jax.jit(concise.local_batch_stats)(bn_state, X)
    for layer in ("BatchNorm_0", "BatchNorm_1", "BatchNorm_2"):
        for name in ("mean", "var"):
            a = np.asarray(local[layer][name])
            assert float(np.ptp(a, axis=0).max()) > 1e-4                # devices differ before
            a = np.asarray(averaged[layer][name])
            assert all(np.array_equal(a[0], a[i]) for i in range(k))   # identical after pmean
    # Only the first layer sees the same inputs in both runs: deeper layers' inputs were
    # normalized with local statistics in one run and whole-batch ones in the other.
    first = local["BatchNorm_0"]
    m = first["mean"] / 0.1                               # running = 0.9 * 0 + 0.1 * batch
    np.testing.assert_allclose(averaged["BatchNorm_0"]["mean"][0], whole["BatchNorm_0"]["mean"],
                               atol=1e-6)
    # Law of total variance: whole = mean of the local variances + spread of local means.
    spread = np.mean((m - m.mean(axis=0)) ** 2, axis=0)
    gap = (whole["BatchNorm_0"]["var"] - averaged["BatchNorm_0"]["var"][0]) / 0.1
    np.testing.assert_allclose(gap, spread, rtol=1e-3, atol=1e-5)
    assert float(spread.max()) > 1e-2                   # so the variances really differ


def test_batchnorm_steps():
    """Local BatchNorm (pmap, shard_map) is not the one-device step; jit and synced BN are."""
    k = 2
    state0 = create_train_state(TinyCNN(batch_norm=True), key(), LR)
    X, y = random_batch(64, seed=6)
    reference, _ = one_device_step(state0, X, y)
    diffs = {}
    for method in concise.METHODS:
        dpar = concise.make_data_parallel(method, jax.devices()[:k])
        state, _ = dpar.step(dpar.place_state(state0), *dpar.place_batch(X, y))
        diffs[method] = max_abs_difference(dpar.get_state(state).params, reference.params)
    assert diffs["pmap"] > 1e-4 and diffs["shard_map"] > 1e-4
    assert diffs["jit"] < TOL
    synced = state0.replace(apply_fn=TinyCNN(batch_norm=True, axis_name=AXIS).apply)
    dpar = concise.make_data_parallel("pmap", jax.devices()[:k])
    state, _ = dpar.step(dpar.place_state(synced), *dpar.place_batch(X, y))
    state = dpar.get_state(state)
    assert max_abs_difference(state.params, reference.params) < TOL
    assert max_abs_difference(state.batch_stats, reference.batch_stats) < TOL


# --- timing and training -----------------------------------------------------------------


def test_time_steps_smoke(lenet_state):
    """It runs and its numbers agree with each other. The timing is dpbook.tools.benchmark
    with the JAX Timer; that it waits for every result is tested with time_allreduce
    (tests/test_comm_jax.py)."""
    X, y = random_batch(64, seed=2)
    r = concise.time_steps("jit", jax.devices()[:2], lenet_state, X, y, num_steps=2)
    assert r["num_devices"] == 2 and r["batch_size"] == 64
    assert r["ms_per_step"] > 0
    assert r["examples_per_sec"] == pytest.approx(64 / (r["ms_per_step"] / 1e3))


@pytest.mark.parametrize("method", ["shard_map"])
def test_train_lowers_the_loss(method, fashion_mnist_dir):
    scale = dp.get_scale("quick")
    animator = dp.Animator(legend=["train loss", "test acc"], path=False, live=False)
    r = concise.train(2, 128, LR, method=method, num_epochs=2, scale=scale,
                      root=fashion_mnist_dir, animator=animator)
    losses = animator.series()["train loss"][1]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert 0.2 < r.test_acc <= 1                     # chance is 0.1
    assert len(r.epoch_times) == 2 and r.sec_per_epoch > 0
    assert r.method == method and r.num_devices == 2 and r.batch_size == 128
    assert "devices (2)" in r.hardware
    assert r.model.params["Conv_0"]["kernel"].shape == (3, 3, 1, 20)

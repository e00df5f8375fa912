"""Inside the JAX step (dpbook.jax.step, dpbook.jax.hlo, dpbook.jax.nnx_lenet): gradient
accumulation equals the whole batch, donation, mixed precision, the schedule, and NNX
equals Linen — on 1, 2, 3 and 8 emulated devices."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dpbook import jax as dp
from dpbook.jax import concise, hlo, nnx_lenet, step
from dpbook.jax.data import random_batch
from dpbook.jax.state import AXIS, create_train_state, make_mesh, max_abs_difference

# float32 rounding of another summation order changes parameters of size ~0.1 by ~1e-8;
# a real bug (a gradient off by a factor k or n) changes them by about the step, ~1e-2.
TOL = 1e-5


class Linear(nn.Module):
    """Logistic regression on the pixels: it compiles in a fraction of LeNet's time, and
    accumulation does not depend on the model."""
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def place(n, model=None, per_device=8, seed=0):
    mesh = make_mesh(jax.devices()[:n])
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    state = create_train_state(model or Linear(), jax.random.key(seed), 0.5)
    X, y = random_batch(per_device * n, seed=seed)
    return (mesh, jax.device_put(state, replicated), jax.device_put(X, split),
            jax.device_put(y, split))


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_accumulation_equals_the_whole_batch(n):
    mesh, state, X, y = place(n)
    whole, whole_loss = step.make_step(mesh)(state, X, y)
    # the reference: one device, the whole batch, plain SGD written out
    grads = jax.grad(lambda p: step.mixed_loss(p, state.apply_fn, np.asarray(X),
                                               np.asarray(y)))(jax.device_get(state.params))
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, jax.device_get(state.params), grads)
    assert max_abs_difference(whole.params, expected) < TOL
    for k in (2, 4, 8):
        new, loss = step.make_step(mesh, micro_batches=k)(state, X, y)
        assert max_abs_difference(new.params, whole.params) < TOL, k
        assert abs(float(loss) - float(whole_loss)) < TOL
        assert hlo.collective_ops(step.make_step(mesh, micro_batches=k), state, X, y) \
            == {"all-reduce": 1}, "one cross-device mean whatever k is (even on one device)"


def test_accumulation_that_averages_twice_is_caught():
    """The check above fails on a wrong step: a sum of micro-batch gradients not divided by k."""
    mesh, state, X, y = place(2)
    whole, _ = step.make_step(mesh)(state, X, y)
    params = jax.device_get(state.params)
    grads = step.accumulated_grads(params, state.apply_fn, np.asarray(X), np.asarray(y), 4)[1]
    right = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    wrong = jax.tree.map(lambda p, g: p - 0.5 * 4 * g, params, grads)
    assert max_abs_difference(right, whole.params) < TOL
    assert max_abs_difference(wrong, whole.params) > 100 * TOL


def test_accumulation_needs_equal_micro_batches_and_no_batchnorm():
    mesh, state, X, y = place(2, per_device=6)
    with pytest.raises(ValueError, match="equal micro-batches"):
        step.make_step(mesh, micro_batches=4)(state, X, y)
    bn_state = create_train_state(dp.LeNetBN(), jax.random.key(0), 0.1)
    with pytest.raises(ValueError, match="BatchNorm"):
        step.train_step(bn_state, X, y)


def test_memory_shrinks_with_micro_batches_and_donation_aliases_the_state():
    mesh, state, X, y = place(2, model=dp.LeNet(), per_device=32)
    temporaries = [hlo.memory(step.make_step(mesh, micro_batches=k), state, X, y)["temporaries"]
                   for k in (1, 4)]
    assert temporaries[1] < temporaries[0] / 2          # a quarter of the activations
    plain = hlo.memory(step.make_step(mesh), state, X, y)
    donating = hlo.memory(step.make_step(mesh, donate=True), state, X, y)
    state_bytes = sum(a.nbytes for a in jax.tree.leaves(state))
    assert plain["aliased"] == 0 and donating["aliased"] == state_bytes
    assert donating["total"] == plain["total"] + donating["temporaries"] \
        - plain["temporaries"] - state_bytes

    old = jax.tree.map(jnp.copy, state)
    new, _ = step.make_step(mesh, donate=True)(old, X, y)
    assert all(a.is_deleted() for a in jax.tree.leaves(old.params))
    assert not any(a.is_deleted() for a in jax.tree.leaves(new.params))
    assert max_abs_difference(new.params, step.make_step(mesh)(state, X, y)[0].params) == 0


@pytest.mark.pins         # pins a framework's behaviour (see pytest.ini)
@pytest.mark.parametrize("n", [2, 3])
def test_mixed_precision_keeps_float32_master_weights(n):
    mesh, state, X, y = place(n)
    full, full_loss = step.make_step(mesh)(state, X, y)
    for comm in (jnp.float32, jnp.bfloat16):
        f = step.make_step(mesh, compute_dtype=jnp.bfloat16, comm_dtype=comm)
        new, loss = f(state, X, y)
        assert {p.dtype for p in jax.tree.leaves(new.params)} == {jnp.dtype("float32")}
        assert abs(float(loss) - float(full_loss)) < 0.05          # bfloat16: ~3 digits
        assert 0 < max_abs_difference(new.params, full.params) < 0.01
    # what JAX asks for: a bfloat16 all-reduce of the gradients
    lowered = step.make_step(mesh, compute_dtype=jnp.bfloat16, comm_dtype=jnp.bfloat16
                             ).lower(state, X, y).as_text()
    assert "all_reduce" in lowered and "bf16" in lowered


def test_type_bytes():
    assert hlo.type_bytes("(f32[20], bf16[3,3])") == 4 * 20 + 2 * 9
    assert hlo.type_bytes("f32[]") == 4
    assert hlo.type_bytes("(f32[128,800]{1,0}, s32[10]{0})") == 4 * 128 * 800 + 40


@pytest.mark.pins         # pins a framework's behaviour (see pytest.ini)
def test_schedule_puts_the_allreduce_after_backward_work():
    mesh, state, X, y = place(2)
    rows = hlo.schedule(step.make_step(mesh), state, X, y)
    phases = [phase for _, _, phase in rows]
    assert {"forward", "backward", "collective"} <= set(phases)
    assert "backward" in phases[:phases.index("collective")]
    assert [op for _, op, phase in rows if phase == "collective"] == ["all-reduce"]


@pytest.mark.parametrize("n", [2, 3])
def test_nnx_equals_linen(n):
    mesh, linen, X, y = place(n, model=dp.LeNet(), per_device=4)
    replicated = NamedSharding(mesh, P())
    model = nnx_lenet.from_linen(jax.device_get(linen.params))
    assert max_abs_difference(nnx_lenet.to_linen(model), linen.params) == 0
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    state = jax.device_put(state, replicated)
    nnx_step, linen_step = nnx_lenet.make_step(graphdef), concise.make_jit_train_step(mesh)
    for _ in range(2):
        state, nnx_loss = nnx_step(state, X, y)
        linen, linen_loss = linen_step(linen, X, y)
        assert abs(float(nnx_loss) - float(linen_loss)) < TOL
    model, _ = nnx.merge(graphdef, state)
    assert max_abs_difference(nnx_lenet.to_linen(model), linen.params) < TOL
    kinds = [kind for kind, _ in hlo.collectives(nnx_step, state, X, y)]
    assert kinds == ["all-reduce"]


def test_from_linen_refuses_other_shapes():
    params = create_train_state(dp.LeNet(num_classes=5), jax.random.key(0), 0.1).params
    with pytest.raises(ValueError, match="Dense_1.kernel"):
        nnx_lenet.from_linen(params)

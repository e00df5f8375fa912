"""FSDP in JAX by sharding (dpbook.jax.fsdp): equal to replicated data parallelism on 2, 3,
4 and 8 emulated devices (3 divides none of the model's large dimensions: all replicated);
each device holds about 1/N of the state; XLA gathers the parameters. Inside the step the
sharded program is not ZeRO-3: more temporaries than the replicated one, whole gradients
and gathered parameters kept into the backward pass; with each layer rematerialized
(fsdp.RematLeNet) the backward pass gathers again, but on the CPU backend XLA schedules
both gathers at the start, so the whole parameters alive at once do not shrink."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from dpbook.jax import fsdp, hlo
from dpbook.jax.data import random_batch
from dpbook.jax.models import LeNet
from dpbook.jax.state import AXIS, TrainState, max_abs_difference


class MLP(nn.Module):
    """784 → 64 → 10: compiles in a fraction of LeNet's time."""
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10)(x)


def test_fsdp_spec():
    assert fsdp.fsdp_spec((800, 128), 4) == P(AXIS, None)
    assert fsdp.fsdp_spec((5, 5, 20, 50), 4) == P(None, None, AXIS, None)
    assert fsdp.fsdp_spec((10,), 4) == P()
    assert fsdp.fsdp_spec((), 4) == P()
    assert fsdp.fsdp_spec((784, 64), 3) == P()


@pytest.mark.parametrize("n", [2, 3, 8])     # 4: test_in_step_memory_and_remat
def test_sharded_equals_replicated(n):
    mesh = fsdp.make_auto_mesh(jax.devices()[:n])
    state = fsdp.create_adam_state(MLP(), jax.random.key(0))
    X, y = (jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in random_batch(8 * n))
    runs = {}
    for sharded in (True, False):
        s = jax.device_put(state, fsdp.state_shardings(state, mesh, sharded))
        step = fsdp.make_step(mesh, state, sharded)
        kinds = [kind for kind, _ in hlo.collectives(step, s, X, y)]
        for _ in range(2):
            s, _ = step(s, X, y)
        runs[sharded] = (s, kinds)
    (s_sharded, kinds), (s_replicated, kinds_replicated) = runs[True], runs[False]
    assert max_abs_difference(s_sharded.params, s_replicated.params) < 1e-5
    assert "all-gather" not in kinds_replicated
    held = fsdp.bytes_per_device(s_sharded)
    full = fsdp.bytes_per_device(s_replicated)
    assert len(set(held.values())) == 1 and len(held) == n
    if n == 3:                                      # nothing divides: all replicated
        assert held == full and "all-gather" not in kinds
    else:
        assert held[0] < full[0] / n * 1.05         # the 10 biases of the output stay whole
        assert "all-gather" in kinds
        assert s_sharded.params["Dense_0"]["kernel"].sharding.spec == P(AXIS, None)


def test_in_step_memory_and_remat():
    """LeNet + Adam on 4 devices, with and without rematerialization: the state is 1/4
    between steps, the temporaries are above the replicated step's; remat gathers the
    rematerialized layers' parameters again; every program makes the same update."""
    mesh = fsdp.make_auto_mesh(jax.devices()[:4])
    # random parameters of LeNet's shapes: fsdp.create_adam_state's jitted init costs
    # seconds to compile on a busy CPU
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.normal(0, 0.1, s.shape).astype(np.float32),
                          jax.eval_shape(LeNet().init, jax.random.key(0),
                                         jnp.ones((1, 28, 28, 1)))["params"])
    state = TrainState.create(apply_fn=LeNet().apply, params=params, tx=optax.adam(1e-3))
    state = state.replace(step=jnp.asarray(state.step))
    remat = state.replace(apply_fn=fsdp.RematLeNet().apply)
    shapes = [a.shape for a in jax.tree.leaves(state.params)]
    X, y = (jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in random_batch(32))
    memory, whole, new = {}, {}, {}
    for name, s, sharded in (("replicated", state, False), ("sharded", state, True),
                             ("remat", remat, True)):
        placed = jax.device_put(s, fsdp.state_shardings(s, mesh, sharded))
        compiled = fsdp.make_step(mesh, s, sharded).lower(placed, X, y).compile()
        memory[name] = compiled.memory_analysis().temp_size_in_bytes, sum(
            a.nbytes // len(a.sharding.device_set) if a.sharding.spec != P() else a.nbytes
            for a in jax.tree.leaves(placed))          # temporaries, state per device
        whole[name] = fsdp.parse_gathered_params(compiled.as_text(), shapes)
        new[name] = compiled(placed, X, y)[0]
    assert memory["sharded"][1] < memory["replicated"][1] / 3
    # inside the step: more temporaries than replicated (whole gradients and parameters)
    assert memory["sharded"][0] > memory["replicated"][0]
    assert whole["replicated"] == []
    assert any(w.phase == "backward" for w in whole["sharded"])   # kept into backward
    gathers = {name: [w.shape for w in rows if w.opcode == "all-gather"]
               for name, rows in whole.items()}
    assert len(gathers["remat"]) > len(gathers["sharded"])
    for shape in ((3, 3, 1, 20), (800, 128), (128,)):   # rematerialized: gathered again
        assert gathers["remat"].count(shape) == gathers["sharded"].count(shape) + 1, shape
    assert gathers["remat"].count((128, 10)) == gathers["sharded"].count((128, 10)) == 1
    # XLA's CPU scheduler gathers both copies at the start: remat does not lower the peak
    # of whole parameters alive at once (its temporaries: lower with jax 0.10.2, not 0.8.2)
    peak = {name: max((sum(v.nbytes for v in rows if v.first <= w.first <= v.last)
                       for w in rows), default=0) for name, rows in whole.items()}
    assert peak["remat"] >= peak["sharded"] > 0
    for name in ("sharded", "remat"):                    # float32 rounding only
        # after one step Adam's first moment is (1 - 0.9) * the gradient
        grads = [jax.tree.map(lambda m: m / 0.1, new[k].opt_state[0].mu)
                 for k in (name, "replicated")]
        assert max_abs_difference(*grads) < 1e-5
        assert max_abs_difference(new[name].params, new["replicated"].params) < 1e-5


GPU_FIXTURES = Path(__file__).parent / "fixtures" / "hlo"


@pytest.mark.parametrize("name", ["gpu_step.hlo", "gpu_step_async.hlo"])
def test_gathered_params_read_gpu_hlo(name):
    """On a GPU the gather is an async pair inside a command buffer (a called
    computation): the whole kernel leaves the call as a tuple element."""
    text = (GPU_FIXTURES / name).read_text()
    [whole] = fsdp.parse_gathered_params(text, [(64, 32), (64,)])
    assert whole.shape == (64, 32) and whole.opcode == "all-gather"
    assert whole.nbytes == 64 * 32 * 4 and whole.phase == "backward"   # its last reader
    assert whole.first < whole.last


ENTRY_GATHERS = """\
HloModule m, is_scheduled=true

ENTRY %main (p0: f32[2,8], p1: f32[4]) -> f32[] {
  %p0 = f32[2,8]{1,0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %ag-start = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%p0), dimensions={0}
  %other = f32[4]{0} negate(%p1)
  %ag-done = f32[8,8]{1,0} all-gather-done(%ag-start)
  %both = (f32[8,8]{1,0}, f32[16]{0}) all-gather(%p0, %p1), dimensions={0}
  %w = f32[8,8]{1,0} get-tuple-element(%both), index=0
  %b = f32[16]{0} get-tuple-element(%both), index=1
  %use = f32[8,8]{1,0} add(%ag-done, %w), metadata={op_name="jit(step)/jvp(f)/add"}
  ROOT %r = f32[] reduce(%b, %use), dimensions={0}
}
"""


def test_gathered_params_read_async_pairs_and_tuple_gathers():
    found = {(w.shape, w.first) for w in fsdp.parse_gathered_params(ENTRY_GATHERS,
                                                                    [(8, 8), (16,)])}
    # the async pair is whole from its start (position 2), the tuple's two elements
    # from their get-tuple-element; the operands' shards are not whole
    assert found == {((8, 8), 2), ((8, 8), 6), ((16,), 7)}

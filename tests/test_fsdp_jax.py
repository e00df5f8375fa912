"""FSDP in JAX by sharding (dpbook.jax.fsdp): equal to replicated data parallelism on 2, 3,
4 and 8 emulated devices (3 divides none of the model's large dimensions: all replicated);
each device holds about 1/N of the state; XLA gathers the parameters."""
from __future__ import annotations

import jax
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from dpbook.jax import fsdp, hlo
from dpbook.jax.data import random_batch
from dpbook.jax.state import AXIS, max_abs_difference


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


@pytest.mark.parametrize("n", [2, 3, 4, 8])
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

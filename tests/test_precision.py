"""Mixed precision with DDP (dpbook.torch.precision): bfloat16 compute keeps float32 master
weights and gradients, the compression hooks halve the bytes, and training still learns."""
from __future__ import annotations

import pytest
import torch

from dpbook.torch import ddp_hooks, precision

pytestmark = pytest.mark.multiprocess     # every test leaves no process behind


@pytest.mark.timeout(240)
def test_mixed_precision_keeps_float32_master_weights_and_halves_the_bytes(fashion_mnist_dir):
    r = precision.compare(2, steps=30, batch_size=64, lr=0.3, num_train=2048, num_test=256,
                          root=fashion_mnist_dir, timeout=200)
    by = {x["name"]: x for x in r["results"]}
    assert list(by) == [p.name for p in precision.PRECISIONS]
    f32, bf16 = by["float32"], by["bf16 compute"]
    for x in r["results"]:
        assert x["param_dtype"] == x["grad_dtype"] == "torch.float32", x["name"]
        first, last = sum(x["losses"][:5]) / 5, sum(x["losses"][-5:]) / 5
        assert last < first - 0.3, (x["name"], first, last)            # it learns
        assert x["calls_per_step"] == 1                                # LeNet: one bucket
    assert bf16["bytes_per_step"] == f32["bytes_per_step"] == 4 * 129_068
    assert (by["bf16 compute + bf16 hook"]["bytes_per_step"]
            == by["float32 + fp16 hook"]["bytes_per_step"] == 2 * 129_068)
    assert bf16["losses"] != f32["losses"]                  # autocast really computed in bf16
    assert abs(sum(bf16["losses"][-5:]) - sum(f32["losses"][-5:])) / 5 < 0.2   # ... alike


def test_unknown_hook_is_refused():
    with pytest.raises(ValueError, match="unknown hook"):
        ddp_hooks.register(None, "int8")
    assert ddp_hooks.HOOKS["bf16"].dtype is torch.bfloat16


# ---------------------------------------------------------------- the reduction's dtype

from dpbook.torch import reduce_precision  # noqa: E402


@pytest.mark.timeout(120)
def test_fp32_reduce_is_closer_to_float64_than_bf16_reduce():
    r = reduce_precision.reduce_drift((2, 4), n=20_000, timeout=100)
    for ranks, e in r.items():
        assert e["dtype"] == "torch.bfloat16"             # gloo really summed bf16
        assert e["fp32"] < 1e-6 < 1e-4 < e["bf16"], (ranks, e)


def test_float32_main_grad_is_closer_to_float64_than_bf16_grad():
    r = reduce_precision.accumulation_drift((1, 16))
    assert r[1]["bf16"] == r[1]["fp32"] == 0.0            # one micro-batch: nothing added
    assert r[16]["fp32"] < 1e-6 < 1e-4 < r[16]["bf16"]
    assert (r[16]["grad_dtype"], r[16]["main_grad_dtype"]) == ("torch.bfloat16",
                                                               "torch.float32")


def test_the_drift_and_the_check_leave_the_readers_random_state_alone():
    from dpbook.torch import exercises as torch_exercises
    state = torch.random.get_rng_state()
    reduce_precision.accumulation_drift((1, 2))
    assert torch_exercises.check_main_grad(_right_main_grad, quiet=True) is None
    assert torch.equal(torch.random.get_rng_state(), state)


def test_xla_cpu_promotes_a_bf16_all_reduce_to_f32():
    """The claim of the precision page's note for JAX readers: the compiled HLO of a
    psum of a bfloat16 array under shard_map (4 emulated CPU devices) converts to f32,
    all-reduces in f32 and converts back; 256 + 1 + 1 comes out 258, not bf16's 256."""
    import subprocess
    import sys
    code = r'''
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((4,), ("d",))
f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh,
                          in_specs=P("d"), out_specs=P()))
x = jax.device_put(jnp.array([[256.], [1.], [1.], [0.]], jnp.bfloat16),
                   NamedSharding(mesh, P("d")))
hlo = f.lower(x).compile().as_text()
reduce = [l for l in hlo.splitlines() if " all-reduce(" in l]
assert len(reduce) == 1 and "f32[" in reduce[0].split("=")[1], reduce
assert float(f(x)[0, 0]) == 258.0
print("ok")
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


# ---------------------------------------------------------------- the checked exercise

def _right_main_grad(p):
    p.main_grad += p.grad                  # float32 += bfloat16 computes in float32
    p.grad = None


def _kept_grad(p):                         # the page's first attempt: .grad never freed
    p.main_grad += p.grad


def _replaced(p):                          # keeps only the last micro-batch
    p.main_grad = p.grad.float()
    p.grad = None


def _bf16_sum(p):                          # adds in bfloat16, stores in float32
    p.main_grad.copy_(p.main_grad.to(p.grad.dtype) + p.grad)
    p.grad = None


def _bf16_buffer(p):                       # the buffer becomes bfloat16
    p.main_grad = p.main_grad.to(p.grad.dtype) + p.grad
    p.grad = None


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_main_grad_exercise(lang, monkeypatch, capsys):
    from dpbook import exercises
    from dpbook.torch import exercises as torch_exercises
    monkeypatch.setenv("DPBOOK_LANG", lang)
    assert torch_exercises.check_main_grad(_right_main_grad) is None
    for wrong, hint in [(_kept_grad, "main-grad-free"), (_replaced, "main-grad-add"),
                        (_bf16_sum, "main-grad-precision"),
                        (_bf16_buffer, "main-grad-dtype")]:
        capsys.readouterr()
        failure = torch_exercises.check_main_grad(wrong)
        assert failure is not None and failure.hint == hint, (wrong.__name__, failure)
        assert exercises.HINTS[hint][lang] in capsys.readouterr().out

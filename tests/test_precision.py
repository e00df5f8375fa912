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

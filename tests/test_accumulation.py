"""Gradient accumulation with DDP (dpbook.torch.accumulation): no_sync over k micro-batches
equals one step on the k-times batch, with one allreduce per optimizer step instead of k;
BatchNorm breaks the equality."""
from __future__ import annotations

import pytest

from dpbook.torch import accumulation

pytestmark = pytest.mark.multiprocess     # every test leaves no process behind

LENET_BYTES = 4 * 129_068                 # one float32 per parameter


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_no_sync_accumulation_equals_the_whole_batch(nprocs):
    r = accumulation.compare(nprocs, "lenet", ks=(1, 3), micro_batch=8, steps=3, timeout=150)
    for rec in r["results"]:
        k = rec["k"]
        assert rec["moved"] > 1e-3                                     # the steps did move
        assert rec["accumulated"]["max_difference"] < 1e-5, rec        # float32 rounding
        assert rec["every"]["max_difference"] < 1e-5, rec
        # LeNet fits in one bucket: one call per optimizer step with no_sync, k without
        assert rec["accumulated"]["calls_per_step"] == rec["whole"]["calls_per_step"] == 1
        assert rec["every"]["calls_per_step"] == k
        assert rec["accumulated"]["bytes_per_step"] == LENET_BYTES
        assert rec["every"]["bytes_per_step"] == k * LENET_BYTES


@pytest.mark.timeout(180)
def test_batchnorm_normalizes_each_micro_batch():
    r = accumulation.compare(2, "resnet18", ks=(1, 2), micro_batch=8, steps=2, timeout=150)
    one, two = r["results"]
    assert one["accumulated"]["max_difference"] < 1e-5          # k = 1: the same batches
    assert two["accumulated"]["max_difference"] > 1e-4          # k = 2: other statistics


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        accumulation.compare(2, ks=(0,))

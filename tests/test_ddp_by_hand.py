"""DDP by hand (dpbook.torch.ddp_by_hand): every wrapper equals DDP after several steps on
2 and 3 gloo processes, on any model (tied weights, frozen layers, ranks seeded
differently), with the allreduce calls and bytes each one should make."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dpbook.torch import ddp_by_hand

pytestmark = pytest.mark.multiprocess     # every test leaves no process behind

NAMES = ("per-parameter", "flat", "overlap", "bucketed")


def _grad_params(kind: str) -> list[nn.Parameter]:
    return [p for p in ddp_by_hand._model(kind, 0).parameters() if p.requires_grad]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("kind", ["mlp", "tied"])
def test_every_wrapper_equals_ddp(nprocs, kind):
    r = ddp_by_hand.compare(nprocs, NAMES, kind=kind, steps=4, bucket_cap_mb=0.01,
                              timeout=150)
    assert r["moved"] > 1e-3                              # the steps did move
    for name in NAMES:                                    # float32 rounding only
        assert r[name]["max_difference"] < 1e-5 * max(1.0, r["moved"]), (name, r[name])
    params = _grad_params(kind)                           # tied: once; frozen: never
    numel = sum(p.numel() for p in params)
    assert {r[n]["bytes_per_step"] for n in NAMES} == {4 * numel}
    assert r["per-parameter"]["calls_per_step"] == r["overlap"]["calls_per_step"] == len(params)
    assert r["flat"]["calls_per_step"] == 1
    buckets = ddp_by_hand.make_buckets(params, 0.01)
    assert r["bucketed"]["calls_per_step"] == r["bucketed"]["buckets"] == len(buckets)
    assert len(buckets) > 1 or kind == "tied"             # the MLP fills several buckets


def test_buckets_follow_backward_order_and_the_cap():
    params = [nn.Parameter(torch.zeros(n)) for n in (1000, 10, 10, 300_000, 20)]
    buckets = ddp_by_hand.make_buckets(params, bucket_cap_mb=0.01)   # 10,485 bytes
    assert [[p.numel() for p in b] for b in buckets] == [[20], [300_000], [10, 10, 1000]]
    assert [p for b in buckets for p in b] == params[::-1]   # reverse order, each once
    one = ddp_by_hand.make_buckets(params, bucket_cap_mb=25)
    assert len(one) == 1 and len(one[0]) == len(params)


def test_unknown_wrapper_is_refused():
    with pytest.raises(ValueError, match="unknown wrapper"):
        ddp_by_hand.wrap("hogwild", nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown wrapper"):
        ddp_by_hand.compare(2, ["ddp"])


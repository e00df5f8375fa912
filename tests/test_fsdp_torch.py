"""PyTorch's FSDP2 on a CPU mesh (dpbook.torch.fsdp): equal to one process with AdamW on 3
gloo processes (LeNet's tensors do not divide by 3), the collectives counted, and
reshard_after_forward's trade. The chapter's notebook checks Adam on 2 and 3 processes."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from dpbook import sharding
from dpbook.torch import fsdp
from dpbook.torch.zero import Traffic

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

PARAMS = 129_068


def test_fsdp2_equals_one_process():
    r = fsdp.compare(3, optimizer="adamw", steps=3, batch_size=36)
    on, off = r[True], r[False]
    assert on["difference"] < 5e-5 and off["difference"] < 5e-5
    # four units (two convolutions, two linear layers): one all-gather each before the
    # forward and, resharded, again before the backward; one reduce-scatter each
    assert on["calls"] == {"all-gather": 8, "reduce-scatter": 4}
    assert off["calls"] == {"all-gather": 4, "reduce-scatter": 4}
    ddp = sharding.values_sent(PARAMS, 0, 3) * 4
    assert 1.5 * ddp <= on["sent"] <= 1.5 * ddp * 1.02      # padding: at most 2 %
    assert ddp <= off["sent"] <= ddp * 1.02
    assert on["held_between"] == 0 and off["held_between"] == 4 * PARAMS
    assert on["shards"]["9.bias"] == ((10,), (4,), "(Shard(dim=0),)")


def test_counting_restores_torch_distributed():
    before = dist.all_gather_single
    with fsdp.counting(Traffic(2)):
        assert dist.all_gather_single is not before
    assert dist.all_gather_single is before

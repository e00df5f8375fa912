"""DDP's knobs (dpbook.torch.ddp_knobs): what the recording hook sees agrees with DDP's own
log, the rebuild after the first iteration, gradient_as_bucket_view, the unused-parameter
error and its fixes, and no knob changing the parameters — on 2 and 3 gloo processes."""
from __future__ import annotations

import pytest

from dpbook.torch import ddp_knobs

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.pins         # pins a framework's behaviour (see pytest.ini)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_knobs(nprocs):
    settings = ddp_knobs.DEFAULT_SETTINGS if nprocs == 2 else \
        ({"bucket_cap_mb": 0.1}, {"gradient_as_bucket_view": True})
    r = ddp_knobs.compare(nprocs, settings, batch_size=6 * nprocs, rounds=1, steps=1)
    param_bytes = r["param_bytes"]
    assert param_bytes == 129_068 * 4 and "hardware | " in r["hardware"]
    by = {x["name"]: x for x in r["results"]}
    assert len(by) == len(settings)
    for x in r["results"]:
        # A knob never changes the math. Two processes sum a + b, exactly; with three, buckets
        # of other sizes may be summed in another order (7e-9 measured).
        assert x["difference"] < (1e-6 if nprocs > 2 else 1e-12), x["name"]
        sizes = [b["bytes"] for b in x["buckets"]]
        if x["setting"] != {"static_graph": True}:       # its log records no rebuild
            assert x["rebuilt"]
            assert sizes == x["logged_bucket_bytes"], "the hook saw DDP's own buckets"
        assert sum(sizes) == sum(b["bytes"] for b in x["first_buckets"]) == param_bytes
        names = [n for b in x["buckets"] for n in b["params"]]
        assert sorted(names) == sorted(n for b in x["first_buckets"] for n in b["params"])
        assert len(names) == len(set(names)) == 8
        assert x["seconds_per_step"] > 0
    small = by["bucket_cap_mb=0.1"]
    # this torch: one bucket in the first iteration, then buckets in the order of backward
    assert len(small["first_buckets"]) == 1 < len(small["buckets"])
    assert small["buckets"][0]["params"][0] == "9.bias"    # the output layer is ready first
    view = by["gradient_as_bucket_view=True"]
    assert view["gradient_bytes"] == param_bytes
    assert view["grad_storages"] == len(view["buckets"])
    if nprocs == 2:
        default = by["defaults"]
        assert default["gradient_bytes"] == 2 * param_bytes and default["grad_storages"] == 8
        assert len(by["bucket_cap_mb=0.01"]["buckets"]) >= len(small["buckets"]) \
            >= len(default["buckets"]) == 1


def test_unused_parameters():
    outcomes = ddp_knobs.unused_parameters(2)
    assert [o["name"] for o in outcomes] == ["defaults", "find_unused_parameters=True",
                                             "static_graph=True"]
    assert [o["ok"] for o in outcomes] == [False, True, True]
    assert "find_unused_parameters=True" in outcomes[0]["error"]
    assert all(o["unused_grad"] is None for o in outcomes[1:])


def test_compare_refuses_bad_settings():
    with pytest.raises(ValueError, match="not a DDP knob"):
        ddp_knobs.compare(2, [{"bucket_size": 1}])
    with pytest.raises(ValueError, match="does not divide"):
        ddp_knobs.compare(3, batch_size=128)

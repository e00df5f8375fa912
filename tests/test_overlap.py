"""When communication hides (dpbook.torch.overlap): the sweep and the profiled prefetch
return what the page reads; FSDP2 prefetches as ZeroModel does. The overlap page's
exercises are checked with the others in test_exercises.py."""
from __future__ import annotations

import pytest

from dpbook import costmodel
from dpbook.torch import overlap, profiling, zero
from dpbook.torch.evaluate import max_abs_difference


# ---------------------------------------------------------------- the measurements

def test_compute_rate_is_a_line_through_the_step_times():
    rate = overlap.compute_rate([1, 8, 32], repeats=2)
    assert rate["per_example"] > 0 and rate["fixed"] >= 0
    assert len(rate["step"]) == len(rate["backward"]) == 3
    assert rate["backward_per_example"] == rate["backward"][-1] / 32


@pytest.mark.multiprocess
def test_sweep_returns_a_fit_and_a_share_per_batch():
    out = overlap.sweep(2, [2, 32], sizes=(2**12, 2**22), repeats=2)    # 4 KB, 4 MB
    alpha, beta = costmodel.fit(out["allreduce"])
    assert alpha >= 0 and beta >= 0 and alpha + beta > 0     # timings: noisy here
    assert [s["batch"] for s in out["steps"]] == [2, 32]
    for s in out["steps"]:
        assert s["share"] == pytest.approx((s["step"] - s["local"]) / s["step"])


@pytest.mark.multiprocess
def test_fsdp2_and_zeromodel_prefetch_the_same_way():
    """From the traces: ZeroModel with prefetch issues 6 of its 8 all-gathers a unit early
    (all but the first of each pass), as FSDP2 does with forward prefetch; FSDP2 by
    default prefetches in backward only (3), ZeroModel without prefetch never (0). All
    four train to the same parameters (LeNet on 2 processes: no padding, the same sums)."""
    from dpbook.versions import VersionError
    try:
        import dpbook.torch.fsdp  # noqa: F401  (FSDP2 needs a newer torch: versions.yml)
    except VersionError as e:
        pytest.skip(str(e))
    r = overlap.prefetch(2, batch_size=16, repeats=1)
    ahead = {name: profiling.gathers_ahead(profiling.gather_order(x["trace"]))
             for name, x in r.items()}
    assert ahead == {"ZeroModel": (0, 8), "ZeroModel, prefetch": (6, 8),
                     "FSDP2": (3, 8), "FSDP2, forward prefetch": (6, 8)}
    assert r["ZeroModel, prefetch"]["events"] == zero.prefetch_schedule(4)
    for name, x in r.items():
        assert max_abs_difference(x["params"], r["ZeroModel"]["params"]) < 1e-6, name
        lanes = profiling.gather_timeline(x["trace"])
        assert lanes["compute"] and lanes["all-gather"] and lanes["reduce-scatter"], name


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_fsdp2_reduce_dtype():
    """The overlap page's reduce dtype: FSDP2 keeps float32 storage and gradients and
    computes in bfloat16; a float32 reduce-scatter sends twice the bytes and lands far
    closer to the float64 mean than a bfloat16 one."""
    from dpbook.versions import VersionError
    try:
        import dpbook.torch.fsdp  # noqa: F401  (FSDP2 needs a newer torch: versions.yml)
    except VersionError as e:
        pytest.skip(str(e))
    r = overlap.fsdp_reduce_dtype(2, timeout=100)
    f32, b16 = r["torch.float32"], r["torch.bfloat16"]
    for x in (f32, b16):           # fp32 storage and gradients, bf16 compute
        assert (x["param_dtype"], x["compute_dtype"], x["grad_dtype"]) == (
            "torch.float32", "torch.bfloat16", "torch.float32")
    assert f32["reduce_scatter_bytes"] == 2 * b16["reduce_scatter_bytes"] == 4 * 129_068
    assert f32["error"] < 1e-6 < 1e-4 < b16["error"]

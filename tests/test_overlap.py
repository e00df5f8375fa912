"""When communication hides (dpbook.torch.overlap and the overlap page's exercises): the
exercises tell right from wrong with the right hint, in both languages; the sweep and the
profiled prefetch return what the page reads; FSDP2 prefetches as ZeroModel does."""
from __future__ import annotations

import math

import pytest

from dpbook import costmodel, exercises
from dpbook.torch import exercises as torch_exercises
from dpbook.torch import overlap, profiling, zero
from dpbook.torch.evaluate import max_abs_difference


# ---------------------------------------------------------------- the exercises

def inverted_break_even(nbytes, world_size, alpha, beta, seconds_per_example):
    comm = costmodel.predict("ring", nbytes, world_size, alpha, beta)
    return seconds_per_example / comm


def twice_break_even(nbytes, world_size, alpha, beta, seconds_per_example):
    return (2 * (world_size - 1) * alpha + 2 * nbytes * beta) / seconds_per_example


def no_latency_break_even(nbytes, world_size, alpha, beta, seconds_per_example):
    return 2 * (world_size - 1) / world_size * nbytes * beta / seconds_per_example


def no_prefetch(n):
    return zero.prefetch_schedule(n, prefetch=False)


def all_at_once(n):
    """Every gather of a pass first, then the computations: no waiting, whole model held."""
    return ([("gather", i) for i in range(n)] + [("forward", i) for i in range(n)]
            + [("gather", i) for i in reversed(range(n))]
            + [("backward", i) for i in reversed(range(n))])


def forward_order_backward(n):
    """Backward computes in the forward's order."""
    s = zero.prefetch_schedule(n)
    half = len(s) // 2
    return s[:half] + [(k, n - 1 - i) for k, i in s[half:]]


def forgetting_backward_gathers(n):
    """Gathers only once per step, in forward (as if the parameters stayed whole)."""
    return [e for e in zero.prefetch_schedule(n)[:2 * n]] + [
        ("backward", i) for i in reversed(range(n))]


def right_accumulation_cost(numel, world_size, k, keep):
    padded = 4 * world_size * math.ceil(numel / world_size)
    sent = (1 if keep else k) * (world_size - 1) / world_size * padded
    return sent, (4 * numel if keep else padded / world_size)


def allreduce_accumulation_cost(numel, world_size, k, keep):
    sent, held = right_accumulation_cost(numel, world_size, k, keep)
    return 2 * sent, held


def k_times_accumulation_cost(numel, world_size, k, keep):
    sent, held = right_accumulation_cost(numel, world_size, k, False)
    return sent, right_accumulation_cost(numel, world_size, k, keep)[1]


def sliced_accumulation_cost(numel, world_size, k, keep):
    sent, _ = right_accumulation_cost(numel, world_size, k, keep)
    return sent, right_accumulation_cost(numel, world_size, k, False)[1]


def unpadded_accumulation_cost(numel, world_size, k, keep):
    # 4 * numel bytes in place of ZeRO's padded 4 * N * ceil(numel / N)
    sent = (1 if keep else k) * (world_size - 1) / world_size * 4 * numel
    return sent, (4 * numel if keep else 4 * numel / world_size)


CHECKS = [
    (torch_exercises.check_break_even, costmodel.break_even_batch,
     [(inverted_break_even, "break-even-inverted"), (twice_break_even, "break-even-ring"),
      (no_latency_break_even, "break-even-latency")]),
    (torch_exercises.check_prefetch_schedule, zero.prefetch_schedule,
     [(no_prefetch, "prefetch-late"), (all_at_once, "prefetch-memory"),
      (forward_order_backward, "prefetch-compute-order"),
      (forgetting_backward_gathers, "prefetch-missing")]),
    (torch_exercises.check_accumulation_cost, right_accumulation_cost,
     [(allreduce_accumulation_cost, "accum-cost-allreduce"),
      (k_times_accumulation_cost, "accum-cost-sent"),
      (sliced_accumulation_cost, "accum-cost-held"),
      (unpadded_accumulation_cost, "accum-cost-padding")]),
]
IDS = [check.__name__ for check, _, _ in CHECKS]


@pytest.mark.parametrize("check, right, wrongs", CHECKS, ids=IDS)
def test_right_passes_and_wrong_fails_with_its_hint(check, right, wrongs, capsys):
    assert check(right) is None
    assert "✓" in capsys.readouterr().out
    for wrong, hint in wrongs:
        failure = check(wrong)
        assert failure is not None and failure.hint == hint, (wrong.__name__, failure)
        out = capsys.readouterr().out
        assert "✗" in out and exercises.HINTS[hint]["en"] in out


@pytest.mark.parametrize("check, right, wrongs", CHECKS, ids=IDS)
def test_hints_in_chinese(check, right, wrongs, capsys, monkeypatch):
    monkeypatch.setenv("DPBOOK_LANG", "zh")
    wrong, hint = wrongs[0]
    check(wrong)
    out = capsys.readouterr().out
    assert exercises.HINTS[hint]["zh"] in out and exercises.HINTS[hint]["en"] not in out


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

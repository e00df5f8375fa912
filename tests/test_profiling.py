"""Seeing the overlap (dpbook.torch.profiling): the trace is read into the right lanes, the
flat wrapper sends after backward and the bucketed one during it."""
from __future__ import annotations

import pytest

from dpbook.torch import ddp_by_hand, profiling

pytestmark = pytest.mark.multiprocess     # every test leaves no process behind


def test_timeline_and_overlap_from_a_trace():
    trace = {"traceEvents": [
        {"ph": "X", "name": "aten::mm", "ts": 0, "dur": 10},                 # neither lane
        {"ph": "X", "name": "autograd::engine::evaluate_function: AddmmBackward0",
         "ts": 1000, "dur": 4000},
        {"ph": "X", "name": "gloo:all_reduce", "ts": 3000, "dur": 4000},
        {"ph": "i", "name": "gloo:all_reduce", "ts": 0}]}                    # an instant
    lanes = profiling.timeline(trace)
    assert lanes == {"backward": [(1.0, 4.0)], "allreduce": [(3.0, 4.0)]}
    assert profiling.overlap_fraction(lanes) == pytest.approx(0.5)  # 2 of 4 ms hidden
    assert profiling.overlap_fraction({"backward": [(0, 1)], "allreduce": []}) == 0


def test_timeline_on_a_gpu_reads_the_kernels():
    """On CUDA the CPU spans only launch work: the lanes are kernels, backward's those a
    backward function launched (the correlation id ties a kernel to its launch)."""
    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": corr}}

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts,
                "dur": 5, "args": {"correlation": corr}}

    trace = {"traceEvents": [
        {"ph": "X", "name": "aten::mm", "ts": 0, "dur": 100}, launch(10, 1),   # forward
        {"ph": "X", "name": "autograd::engine::evaluate_function: AddmmBackward0",
         "ts": 1000, "dur": 100}, launch(1050, 2),
        {"ph": "X", "name": "nccl:all_reduce", "ts": 1100, "dur": 10},  # only the launch
        kernel("volta_sgemm_128x64_nn", 500, 1000, 1),
        kernel("volta_sgemm_128x64_tn", 2000, 3000, 2),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 4000, 2000, 3)]}
    lanes = profiling.timeline(trace)
    assert lanes == {"backward": [(2.0, 3.0)], "allreduce": [(4.0, 2.0)]}
    assert profiling.overlap_fraction(lanes) == pytest.approx(0.5)


def _launches(trace):
    """When the main thread handed each allreduce over (ms), and when backward ended."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    start = min(e["ts"] for e in events)
    launch = sorted((e["ts"] - start) / 1e3 for e in events if e["name"] == "c10d::allreduce_")
    lanes = profiling.timeline(trace)
    return launch, max(s + d for s, d in lanes["backward"]), lanes


@pytest.mark.timeout(180)
def test_profile_shows_when_each_wrapper_communicates():
    traces = profiling.profile(2, ("flat", "bucketed"), width=4, batch_size=16,
                                   bucket_cap_mb=0.05, timeout=150)
    launch, backward_end, lanes = _launches(traces["flat"])
    assert len(launch) == len(lanes["allreduce"]) == 1
    assert launch[0] >= backward_end                       # (b): after backward
    from dpbook.torch.models import resnet18
    buckets = ddp_by_hand.make_buckets(list(resnet18(width=4).parameters()), 0.05)
    launch, backward_end, lanes = _launches(traces["bucketed"])
    assert len(launch) == len(lanes["allreduce"]) == len(buckets) > 1
    assert launch[0] < backward_end                        # (d): the first bucket leaves early


def test_gather_lanes_and_order_from_a_sharded_trace():
    """ZeroModel's marks: a unit computes from the end of its pre-forward mark to its
    post-forward mark; an FSDP2 forward-prefetch mark after the pre-forward mark delays
    the compute's start; gathers_ahead counts the gathers issued a unit early."""
    def x(name, ts, dur, tid=1):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}
    trace = {"traceEvents": [
        x("ZeroModel::pre_forward (a)", 0, 1000), x("ZeroModel::all_gather (a)", 100, 100),
        x("ZeroModel::all_gather (b)", 500, 100), x("gloo:all_gather", 550, 2000, tid=2),
        x("ZeroModel::post_forward (a)", 4000, 10),
        x("ZeroModel::pre_forward (b)", 5000, 100),
        x("ZeroModel::post_forward (b)", 6000, 10),
        x("autograd::engine::evaluate_function: AddmmBackward0", 7000, 500),
        x("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 7500, 9),
        x("gloo:all_reduce", 7600, 300, tid=2),
        x("autograd::engine::evaluate_function: MmBackward0", 8000, 1000),
        x("ZeroModel::pre_backward (b)", 8100, 300)]}          # the wait: not compute
    lanes = profiling.gather_timeline(trace)
    assert lanes == {"compute": [(1.0, 3.0), (5.1, 0.9), (7.0, 0.5), (8.0, 0.1),
                                 (8.4, 0.6)],
                     "all-gather": [(0.55, 2.0)], "reduce-scatter": [(7.6, 0.3)]}
    assert profiling.overlap_fraction(lanes, "all-gather", "compute") == pytest.approx(
        0.775)                                     # 1.55 of 2 ms during a's forward
    order = profiling.gather_order(trace)
    assert order == [("gather", "a"), ("gather", "b"), ("forward", "a"), ("forward", "b"),
                     ("backward", "b")]
    assert profiling.gathers_ahead(order) == (1, 2)
    fsdp = {"traceEvents": [
        x("FSDP::pre_forward (0)", 0, 100), x("FSDP::forward_prefetch for 3", 150, 300),
        x("FSDP::all_gather (3)", 160, 200), x("FSDP::post_forward (0)", 1000, 10)]}
    assert profiling.gather_timeline(fsdp)["compute"] == [(0.45, 0.55)]
    assert profiling.gather_order(fsdp) == [("gather", "3"), ("forward", "0")]

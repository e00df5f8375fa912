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

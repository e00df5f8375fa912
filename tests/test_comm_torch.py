"""The communication chapter's PyTorch code: allreduce algorithms, the cost model, where to
aggregate, 2-bit compression with error feedback, weighted splits."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from dpbook import costmodel
from dpbook.torch import aggregate, allreduce, compression, ddp, ddp_hooks
from dpbook.torch.dist import process_group, run

pytestmark = pytest.mark.multiprocess     # every test leaves no process behind


# ---------------------------------------------------------------- allreduce, processes

@pytest.mark.timeout(180)
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_every_allreduce_equals_the_true_sum(nprocs):
    # integer-valued data: every order of summation is exact, so 0.0 means "equal";
    # from 1 element (most chunks empty) to 16 MB, mostly sizes that do not divide evenly
    errors = allreduce.check(nprocs, sizes=(1, 3, 7, 1001, 4099, 4_000_003), timeout=150)
    assert errors == {name: 0.0 for name in allreduce.ALGORITHMS}


@pytest.mark.slow        # a timing target: run with --run-slow (make bench)
@pytest.mark.timeout(240)
def test_hand_written_ring_keeps_up_with_gloo_at_16_mb():
    """The issue's speed bar: at 16 MB on 2 processes, the ring reaches >= 0.8x the bus
    bandwidth of dist.all_reduce in the same run (same N: the ratio of bus bandwidths is
    the inverse ratio of the times). The two take turns for 61 rounds: on two shared
    cores single calls vary by +-20 %, and the medians of a few calls were not enough."""
    bench = allreduce.benchmark(2, [2**24], names=["ring", "all_reduce"], repeats=61,
                                timeout=200)
    t = {r["algorithm"]: r["seconds"] for r in bench["results"]}
    ratio = (costmodel.bus_bandwidth(2**24, t["ring"], 2)
             / costmodel.bus_bandwidth(2**24, t["all_reduce"], 2))
    print(f"ring / all_reduce bus bandwidth at 16 MB, 2 processes: {ratio:.2f}")
    assert ratio >= 0.8, t


@pytest.mark.timeout(120)
def test_benchmark_times_functions_of_our_own():
    maximum = functools.partial(dist.all_reduce, op=dist.ReduceOp.MAX)
    bench = allreduce.benchmark(2, [2**20], repeats=1, timeout=100,
                                algorithms={"ring": allreduce.ring_allreduce, "max": maximum})
    assert [r["algorithm"] for r in bench["results"]] == ["ring", "max"]
    assert all(r["seconds"] > 0 and r["bytes"] == 2**20 for r in bench["results"])
    assert [r["correct"] for r in bench["results"]] == [True, False]   # a max is no sum


@pytest.mark.timeout(120)
def test_benchmark_sums_the_same_finite_input_every_call():
    """Each timed call starts from ones again (in-place results used to grow N-fold per
    call and overflow), so every algorithm ends every call with the sum, N."""
    bench = allreduce.benchmark(3, [2**12], repeats=40, timeout=100)
    assert {r["algorithm"]: r["correct"] for r in bench["results"]} == \
        dict.fromkeys(allreduce.ALGORITHMS, True)
    with pytest.raises(ValueError, match="unknown algorithm"):
        allreduce.benchmark(2, [2**20], names=["ring", "butterfly"])


# ---------------------------------------------------------------- where to aggregate

@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(aggregate.AGGREGATORS))
def test_aggregators_leave_the_sum_on_every_device(name, k):
    grads = [torch.randint(-9, 9, (1001,)).float() for _ in range(k)]
    expected = sum(g.clone() for g in grads)
    aggregate.AGGREGATORS[name](grads)
    for g in grads:
        assert torch.equal(g, expected)
    assert len({g.data_ptr() for g in grads}) == k          # still k separate tensors


# ---------------------------------------------------------------- compression

def test_pack_and_unpack_2bit_round_trip():
    codes = torch.randint(0, 3, (4099,))
    packed = compression.pack_2bit(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(4099 / 4)
    assert torch.equal(compression.unpack_2bit(packed, 4099), codes.to(torch.uint8))


def test_quantize_sends_only_plus_minus_threshold_or_zero():
    t = 0.5
    g = torch.tensor([0.7, -0.7, 0.2, -0.2, 0.5, -0.5])
    residual = torch.zeros_like(g)
    sent = compression.dequantize_2bit(compression.quantize_2bit(g, residual, t), 6, t)
    assert sent.tolist() == [0.5, -0.5, 0.0, 0.0, 0.5, -0.5]
    assert torch.allclose(residual, g - sent)
    with pytest.raises(ValueError, match="threshold must be positive"):
        compression.quantize_2bit(g, residual, 0.0)


def test_error_feedback_keeps_the_accumulated_error_bounded():
    """Sum of what was sent == sum of the gradients - the residual, and the residual
    stays within the threshold; without feedback the error grows with every step."""
    torch.manual_seed(0)
    t, steps = 0.1, 500
    residual = torch.zeros(256)
    true_sum, sent_sum, sent_sum_no_feedback = (torch.zeros(256) for _ in range(3))
    for _ in range(steps):
        g = (torch.rand(256) - 0.3) * 0.1          # small, biased: below the threshold
        true_sum += g
        sent_sum += compression.dequantize_2bit(
            compression.quantize_2bit(g, residual, t), 256, t)
        sent_sum_no_feedback += compression.dequantize_2bit(
            compression.quantize_2bit(g, torch.zeros(256), t), 256, t)
    error = (true_sum - sent_sum).abs().max().item()
    assert error < t + 1e-5
    assert torch.allclose(true_sum - sent_sum, residual, atol=1e-4)
    assert (true_sum - sent_sum_no_feedback).abs().max().item() > 10 * t   # lost for good


def test_payload_bytes():
    assert ddp_hooks.payload_bytes(1000, "float32") == 4000
    assert ddp_hooks.payload_bytes(1000, "fp16") == 2000
    assert ddp_hooks.payload_bytes(1001, "2bit") == 251
    with pytest.raises(ValueError, match="unknown hook '1bit'"):
        ddp_hooks.payload_bytes(10, "1bit")


@pytest.mark.timeout(240)
def test_two_bit_hook_trains_a_tiny_problem(fashion_mnist_dir):
    """DDP with the 2-bit hook on 2 processes still learns, sends 16x fewer bytes than
    float32, and ends within a few points of the uncompressed run."""
    cfg = ddp.Config(model="lenet", batch_size=64, lr=0.3, epochs=2, num_train=2048,
                     num_test=512, data=str(fashion_mnist_dir))
    plain = ddp.spawn_train(2, cfg, timeout=200)["history"][-1]
    packed = ddp.spawn_train(2, ddp.Config(**{**cfg.__dict__, "comm_hook": "2bit",
                                                "threshold": 0.01}), timeout=200)["history"][-1]
    assert packed["test_acc"] > 0.5, packed                  # chance is 0.1
    assert packed["test_acc"] > plain["test_acc"] - 0.1, (plain, packed)
    assert 15 < plain["bytes_sent"] / packed["bytes_sent"] < 17


# A model whose gradients fill several DDP buckets (bucket_cap_mb below), in an order DDP
# changes after the first iteration: the hook's residuals must follow the parameters.
TWO_BIT = dict(threshold=0.002, lr=0.5, steps=5, batch=24, bucket_cap_mb=0.002)


def _several_buckets_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 10))    # 2,026 parameters, 8 KB


def _two_bit_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(TWO_BIT["batch"], 20, generator=g),
             torch.randint(0, 10, (TWO_BIT["batch"],), generator=g))
            for _ in range(TWO_BIT["steps"])]


def _two_bit_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP
    with process_group(rank, world_size):
        net = _several_buckets_net()
        model = DDP(net, bucket_cap_mb=TWO_BIT["bucket_cap_mb"])
        state = compression.TwoBitState(TWO_BIT["threshold"])
        model.register_comm_hook(state, compression.two_bit_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=TWO_BIT["lr"])
        for X, y in _two_bit_batches():
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(X.chunk(world_size)[rank]),
                                              y.chunk(world_size)[rank]).backward()
            optimizer.step()
        logged = model._get_ddp_logging_data()
        buckets = [logged["bucket_sizes"], logged["rebuilt_bucket_sizes"]]  # bytes, ", "
        return {"buckets": buckets, "params": [p.tolist() for p in net.parameters()],
                "residuals": [state.residuals[p].tolist() for p in net.parameters()]}


def _two_bit_reference(world_size):
    """The same training in one process: each rank's shard quantized with that rank's
    residuals (per parameter), the decoded codes averaged, one SGD step."""
    net = _several_buckets_net()
    t = TWO_BIT["threshold"]
    residuals = [[torch.zeros(p.numel()) for p in net.parameters()] for _ in range(world_size)]
    optimizer = torch.optim.SGD(net.parameters(), lr=TWO_BIT["lr"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for X, y in _two_bit_batches():
            total = [torch.zeros(p.numel()) for p in net.parameters()]
            for rank in range(world_size):
                net.zero_grad()
                torch.nn.functional.cross_entropy(net(X.chunk(world_size)[rank]),
                                                  y.chunk(world_size)[rank]).backward()
                for i, p in enumerate(net.parameters()):
                    packed = compression.quantize_2bit(p.grad.reshape(-1), residuals[rank][i], t)
                    total[i] += compression.dequantize_2bit(packed, p.numel(), t)
            for p, s in zip(net.parameters(), total):
                p.grad = (s / world_size).view_as(p)
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return [p.detach() for p in net.parameters()], residuals[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_two_bit_hook_residuals_follow_parameters_across_buckets(nprocs):
    got = run(_two_bit_worker, nprocs, timeout=100)
    first, rebuilt = got["buckets"]     # here: one bucket in step 1, then two other ones
    assert first != rebuilt and len(rebuilt.split(",")) >= 2, got["buckets"]
    params, residuals = _two_bit_reference(nprocs)
    for mine, ref in zip(got["residuals"], residuals):
        assert ref.abs().max() > 0                      # error feedback is at work
        torch.testing.assert_close(torch.tensor(mine), ref, atol=1e-6, rtol=0)
    for mine, ref in zip(got["params"], params):
        torch.testing.assert_close(torch.tensor(mine), ref, atol=1e-6, rtol=0)


def test_unknown_comm_hook_is_refused():
    with pytest.raises(SystemExit):                      # argparse: not one of HOOKS
        ddp.parser().parse_args(["--comm-hook", "1bit"])
    assert ddp.parser().parse_args(["--comm-hook", "bf16"]).comm_hook == "bf16"


# ---------------------------------------------------------------- unequal devices

def test_weighted_split_gives_each_device_its_share_and_every_example_once():
    from dpbook import split_sizes
    assert split_sizes(128, 2, weights=[3, 1]) == [96, 32]
    assert split_sizes(10, 4) == [3, 3, 2, 2]                 # unchanged without weights
    for n, weights in [(256, [441.0, 141.1]), (7, [1, 1, 5]), (3, [1000, 1, 1]),
                       (1000, [0.1, 0.2, 0.3, 0.4])]:
        sizes = split_sizes(n, len(weights), weights)
        assert sum(sizes) == n and min(sizes) >= 1
        ideal = [n * w / sum(weights) for w in weights]
        assert all(abs(s - i) <= len(weights) for s, i in zip(sizes, ideal)), (sizes, ideal)
    X, y = torch.arange(100.0).view(100, 1), torch.arange(100)
    X_shards, y_shards = dp_split(X, y, weights=[1, 2, 1])
    assert [len(s) for s in y_shards] == [25, 50, 25]
    assert torch.equal(torch.cat(y_shards), y)               # every example exactly once
    for bad in ([1, 0], [1, -1], [1], [1, float("nan")]):
        with pytest.raises(ValueError, match="positive, finite weights"):
            split_sizes(10, 2, bad)


def dp_split(X, y, weights):
    from dpbook.torch import split_batch
    return split_batch(X, y, [torch.device("cpu")] * len(weights), weights=weights)


@pytest.mark.slow        # a timing target: run with --run-slow (make bench)
@pytest.mark.timeout(180)
def test_weighted_split_takes_the_same_step_and_is_faster_with_a_slow_device():
    from dpbook.torch import unequal
    r = unequal.compare_splits([1, 3], batch_size=128, steps=6, timeout=150)
    assert r["even"]["sizes"] == [64, 64]
    small = r["weighted"]["sizes"][1]
    assert 16 <= small <= 48, r["weighted"]["sizes"]          # about a quarter
    assert r["max_param_difference"] < 1e-5                   # the same SGD steps
    assert r["weighted"]["step_seconds"] < 0.9 * r["even"]["step_seconds"], r
    with pytest.raises(ValueError, match="slowdowns must be >= 1"):
        unequal.compare_splits([1, 0.5])

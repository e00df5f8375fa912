"""DDP by hand (dpbook.torch.ddp_by_hand): every wrapper equals DDP after several steps on
2 and 3 gloo processes, on any model (tied weights, frozen layers, ranks seeded
differently, a layer only rank 0 uses), with and without accumulation under ``no_sync``,
with the allreduce calls and bytes each one should make, whether a callback at the end of
backward finishes the synchronization (a loop with no extra call, as DDP's) or the loop
calls ``finish_gradient_synchronization``; a backward that raises midway leaves the next
step synchronizing as usual; the buckets follow DDP's rule."""
from __future__ import annotations

import contextlib
import itertools
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpbook.torch import ddp_by_hand
from dpbook.torch.data import random_batch
from dpbook.torch.dist import process_group, run

pytestmark = pytest.mark.multiprocess     # every test leaves no process behind

NAMES = ("per-parameter", "flat", "overlap", "bucketed")


def _grad_params(kind: str) -> list[nn.Parameter]:
    return [p for p in ddp_by_hand._model(kind, 0).parameters() if p.requires_grad]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nprocs, kind, micro_batches, explicit", [
    (2, "mlp", 1, False), (2, "mlp", 1, True), (3, "mlp", 2, False), (2, "tied", 2, True),
    (3, "branch", 2, False), (3, "branch", 2, True)])   # branch: a layer used on rank 0 only
def test_every_wrapper_equals_ddp(nprocs, kind, micro_batches, explicit):
    # micro_batches=2: two backward passes per step, the first inside no_sync().
    # explicit=False: the loop calls nothing after backward (the callback finishes).
    # branch: a wrapper that launched its allreduces in a rank-dependent order would
    # hang (the timeout fails the test) or abort ("collective mismatch", with gloo)
    r = ddp_by_hand.compare(nprocs, NAMES, kind=kind, steps=4, bucket_cap_mb=0.01,
                              micro_batches=micro_batches, explicit=explicit, timeout=150)
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


def test_buckets_follow_backward_order_and_ddps_cap_rule():
    params = [nn.Parameter(torch.zeros(n)) for n in (1000, 10, 10, 300_000, 20, 2600)]
    buckets = ddp_by_hand.make_buckets(params, bucket_cap_mb=0.01)   # 10,485 bytes
    # closed once it reaches the cap, so it can end larger: 10,400 + 80 < cap <= + 1.2 MB
    assert [[p.numel() for p in b] for b in buckets] == [[2600, 20, 300_000],
                                                          [10, 10, 1000]]
    assert [p for b in buckets for p in b] == params[::-1]   # reverse order, each once
    one = ddp_by_hand.make_buckets(params, bucket_cap_mb=25)
    assert len(one) == 1 and len(one[0]) == len(params)


def _indices(order, params, cap):
    """make_buckets(params, cap bytes) as lists of indices into ``order``."""
    index = {id(p): i for i, p in enumerate(order)}
    return [[index[id(p)] for p in b] for b in ddp_by_hand.make_buckets(params, cap / 2**20)]


@pytest.mark.skipif(not hasattr(dist, "_compute_bucket_assignment_by_size"),
                    reason="torch's private bucket function is not in this release")
def test_buckets_equal_torchs_own_assignment():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([1, 2, 3, 50, 400, 3000]) for _ in range(rng.randint(1, 12))]
        cap = rng.choice([4, 100, 1000, 4000, 20_000])            # bytes
        params = [nn.Parameter(torch.zeros(n)) for n in sizes]
        # torch's rule on the parameters in reverse order (indices into that order)
        theirs, _ = dist._compute_bucket_assignment_by_size(params[::-1], [cap])
        assert _indices(params[::-1], params, cap) == theirs, (sizes, cap)
    for dtypes in ([torch.float32, torch.float64, torch.float32, torch.float64],
                   [torch.float64, torch.float32, torch.float32, torch.float32,
                    torch.float32]):      # buckets ordered by their first parameter
        mixed = [nn.Parameter(torch.zeros(n, dtype=d)) for n, d in zip([3, 1, 2, 4, 4],
                                                                       dtypes)]
        theirs, _ = dist._compute_bucket_assignment_by_size(mixed[::-1], [16])
        assert _indices(mixed[::-1], mixed, 16) == theirs, dtypes


def test_unknown_wrapper_is_refused():
    with pytest.raises(ValueError, match="unknown wrapper"):
        ddp_by_hand.wrap("hogwild", nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown wrapper"):
        ddp_by_hand.compare(2, ["ddp"])


@pytest.fixture
def one_process_group():
    """A gloo group of this process alone (cheaper than starting processes)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Mixed(nn.Module):                  # a float64 layer, then a float32 one
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8, dtype=torch.float64), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).float())


def _two_micro_batches(model, X, sync=None, backward_inside=True):
    with model.no_sync() if sync else contextlib.nullcontext():
        loss = model(X[:3]).square().sum()
        if backward_inside:
            loss.backward()
    if not backward_inside:     # DDP's rule: the forward inside no_sync() decides
        loss.backward()
    model(X[3:]).square().sum().backward()
    if sync:
        sync()


def test_mixed_dtypes_no_sync_and_a_second_backward(one_process_group):
    X = torch.randn(6, 8, dtype=torch.float64)
    plain = _Mixed()
    _two_micro_batches(plain, X)
    for name, backward_inside in itertools.product(NAMES, (True, False)):
        model = ddp_by_hand.wrap(name, _Mixed(), bucket_cap_mb=25,    # one cap, two dtypes
                                 finish_in_backward=False)            # the loop finishes
        _two_micro_batches(model, X, model.finish_gradient_synchronization, backward_inside)
        for p, q in zip(model.module.parameters(), plain.parameters()):
            assert p.grad.dtype == p.dtype and torch.equal(p.grad, q.grad), name  # no cast
        if name in ("overlap", "bucketed"):              # backward twice: refused
            model(X).sum().backward()
            with pytest.raises(RuntimeError, match="no_sync"):
                model(X).sum().backward()


def test_the_callback_finishes_each_backward_and_no_sync_queues_none(one_process_group):
    X = torch.randn(6, 8, dtype=torch.float64)
    plain = _Mixed()
    _two_micro_batches(plain, X)
    for name, backward_inside in itertools.product(NAMES, (True, False)):
        model = ddp_by_hand.wrap(name, _Mixed(), bucket_cap_mb=25)   # the callback
        with model.no_sync():
            loss = model(X[:3]).square().sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        assert model.calls == 0 and not model._queued, name     # nothing queued or sent
        model(X[3:]).square().sum().backward()                  # no call after it
        calls = model.calls
        assert calls > 0 and not model._pending, name           # finished in backward
        model.finish_gradient_synchronization()                 # the explicit call: no-op
        assert model.calls == calls, name
        for p, q in zip(model.module.parameters(), plain.parameters()):
            assert p.grad.dtype == p.dtype and torch.equal(p.grad, q.grad), name


@pytest.mark.timeout(120)
def test_two_synchronized_backwards_add_up_as_with_ddp():
    # with the callback each backward is finished before the next one adds to .grad,
    # so a second backward outside no_sync() is no longer refused: like DDP, it adds
    # the second mean to the first (here on 2 processes, against DDP)
    r = ddp_by_hand.compare(2, NAMES, kind="mlp", steps=2, bucket_cap_mb=0.01,
                            micro_batches=2, timeout=100, no_sync=False)
    for name in NAMES:
        assert r[name]["max_difference"] < 1e-5, (name, r[name])


class _FailOnce(torch.autograd.Function):
    """The identity; its backward raises once when the module ``fault`` is armed."""

    @staticmethod
    def forward(ctx, x, fault):
        ctx.fault = fault
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fault.armed:
            ctx.fault.armed = False
            raise RuntimeError("injected failure in backward")
        return grad, None


class _Fault(nn.Module):
    armed = False

    def forward(self, x):
        return _FailOnce.apply(x, self)


def _failed_backward_worker(rank, world_size, names):
    """Per wrapper: a backward that raises after the last two layers' gradients, then a
    normal step on the same batch; each rank's gradients against the unwrapped model's
    on the whole batch (the mean of the ranks' means: equal shards)."""
    from torch.nn import functional as F
    with process_group(rank, world_size):
        X, y = random_batch(6 * world_size, 0, (32,))
        Xr, yr = X.chunk(world_size)[rank], y.chunk(world_size)[rank]
        results = {}
        for name in names:
            torch.manual_seed(100 + rank)          # ranks differ: the wrapper broadcasts
            fault = _Fault()
            net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), fault, nn.Linear(64, 64),
                                nn.ReLU(), nn.Linear(64, 10))
            model = ddp_by_hand.wrap(name, net, bucket_cap_mb=0.01)
            fault.armed = True
            try:
                F.cross_entropy(model(Xr), yr).backward()
                raise AssertionError("the armed fault did not raise")
            except RuntimeError as e:
                assert "injected failure" in str(e), e
            calls = getattr(model, "calls", None)  # launched before the failure
            net.zero_grad()
            F.cross_entropy(model(Xr), yr).backward()   # no call after it
            torch.manual_seed(100)                 # rank 0's start, unwrapped
            plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64),
                                  nn.ReLU(), nn.Linear(64, 10))
            F.cross_entropy(plain(X), y).backward()
            results[name] = {
                "max_difference": max((p.grad - q.grad).abs().max().item()
                                      for p, q in zip(net.parameters(), plain.parameters())),
                "calls_before": calls,
                "pending": getattr(model, "_pending", False)}
        return results


@pytest.mark.timeout(120)
def test_a_backward_that_raises_leaves_the_next_step_synchronized():
    # autograd never runs the callback of a backward that raised: without the reset in
    # forward, per-parameter and flat skipped every later synchronization, and overlap
    # and bucketed refused the next backward as "a second backward() ... no_sync()".
    # (DDP itself, in torch 2.8 to 2.13, refuses the next forward: "Expected to have
    # finished reduction in the prior iteration", so the reference is the unwrapped model)
    r = run(_failed_backward_worker, 2, NAMES, timeout=100, verbose=False)
    for name in NAMES:
        assert r[name]["max_difference"] < 1e-6, (name, r[name])   # float32 rounding
        assert not r[name]["pending"], name
    assert r["per-parameter"]["calls_before"] == r["flat"]["calls_before"] == 0
    assert r["overlap"]["calls_before"] == 4        # the last two layers: weights, biases
    assert r["bucketed"]["calls_before"] >= 1       # ... and the full buckets sent


# ---------------------------------------------------------------- the checked exercise

def _right_callback(finish):
    queued = False

    def end_of_backward():
        nonlocal queued
        queued = False
        finish()

    def hook(p):
        nonlocal queued
        if not queued:
            queued = True
            torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)
    return hook


def _never_reset(finish):                  # the page's first attempt
    queued = [False]

    def hook(p):
        if not queued[0]:
            queued[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(finish)
    return hook


def _every_gradient(finish):               # queued once per parameter
    return lambda p: torch.autograd.Variable._execution_engine.queue_callback(finish)


def _from_the_hook(finish):                # finishes before the last gradient is final
    return lambda p: finish()


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_finish_callback_exercise(lang, monkeypatch, capsys):
    from dpbook import exercises
    from dpbook.torch import exercises as torch_exercises
    monkeypatch.setenv("DPBOOK_LANG", lang)
    assert torch_exercises.check_finish_callback(_right_callback) is None
    for wrong, hint in [(_never_reset, "callback-reset"), (_every_gradient, "callback-once"),
                        (_from_the_hook, "callback-early")]:
        capsys.readouterr()
        failure = torch_exercises.check_finish_callback(wrong)
        assert failure is not None and failure.hint == hint, (wrong.__name__, failure)
        assert exercises.HINTS[hint][lang] in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_callback_runs_once_after_every_hook():
    """The order the DDP-by-hand page prints: every parameter's hook, then the
    end-of-backward callback once, then backward() returns; the callback launches no
    allreduce the bucketed wrapper had not launched from its hooks, and the per-parameter
    wrapper launches them all from the callback."""
    events = ddp_by_hand.backward_events(2, "bucketed", bucket_cap_mb=0.01)
    kinds = [e for e, _, _ in events]
    assert kinds[-2:] == ["callback", "returned"] and kinds.count("callback") == 1
    assert set(kinds[:-2]) == {"hook"}
    assert events[-2][2] == events[-1][2] > 0
    events = ddp_by_hand.backward_events(2, "per-parameter")
    assert [e for e, _, _ in events][-2:] == ["callback", "returned"]
    assert events[-3][2] == 0 < events[-1][2]          # all sent after the last hook
    with pytest.raises(ValueError, match="unknown wrapper"):
        ddp_by_hand.backward_events(2, "ddp")

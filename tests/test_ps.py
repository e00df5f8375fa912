"""The parameter server (dpbook.torch.ps): synchronous updates equal single-process SGD,
asynchronous ones apply every worker's gradients with the staleness they must have, and
stale SGD with tau = 0 is plain SGD. The multi-process runs share one process group, run
within a time bound and leave no process behind."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.nn.utils import parameters_to_vector

from helpers import live_children, no_children_left
from dpbook.torch import ps

pytestmark = pytest.mark.multiprocess     # every test leaves no process behind

NUM_TRAIN, NUM_TEST = 1024, 256
SYNC = ps.PSConfig("sync", num_grads=12, batch_size=32, lr=0.1, num_hiddens=32)
ASYNC = ps.PSConfig("async", num_grads=30, batch_size=32, lr=0.1, num_hiddens=32)
SYNC_TOLERANCE = 1e-6    # float32: the server averages two means, SGD takes one mean of 64


@pytest.fixture(scope="module")
def arrays(fashion_mnist_dir):
    return ps.load_arrays(NUM_TRAIN, NUM_TEST, fashion_mnist_dir)


@pytest.fixture(scope="module")
def runs(fashion_mnist_dir):
    """One server + 2 workers run SYNC, then ASYNC; then no process of theirs is left."""
    before = {p.pid for p in live_children()}
    results = ps.run_ps([SYNC, ASYNC], num_workers=2, num_train=NUM_TRAIN,
                        num_test=NUM_TEST, root=fashion_mnist_dir, timeout=90)
    assert no_children_left(exclude=before), [p.cmdline() for p in live_children(before)]
    return results


def test_mlp_size():
    assert sum(p.numel() for p in ps.mlp().parameters()) == 203_530
    assert sum(p.numel() for p in ps.mlp(32).parameters()) == 25_450


def test_worker_batches_are_disjoint_full_and_repeatable():
    X, y = torch.arange(100.0).reshape(100, 1), torch.arange(100)
    seen = []
    for worker in (1, 2):
        stream = ps.worker_batches(X, y, worker, 2, batch_size=16, seed=3)
        batches = [next(stream) for _ in range(3)]      # 50 examples: 3 full batches/epoch
        assert all(len(b[0]) == 16 for b in batches)
        assert all(int(i) % 2 == worker - 1 for b in batches for i in b[1])   # own shard
        seen.append(torch.cat([b[1] for b in batches]))
        again = ps.worker_batches(X, y, worker, 2, batch_size=16, seed=3)
        assert torch.equal(next(again)[1], batches[0][1])
    assert not set(seen[0].tolist()) & set(seen[1].tolist())


def test_bad_configs_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="divide"):
        ps.run_ps([ps.PSConfig("sync", num_grads=5)], num_workers=2)
    with pytest.raises(ValueError, match="mode"):
        ps.run_ps([ps.PSConfig("hogwild")], num_workers=2)


@pytest.mark.timeout(120)
def test_sync_equals_single_process_sgd(runs, arrays):
    X, y, _, _ = arrays
    sync = runs[0]
    assert sync["mode"] == "sync" and sync["updates"] == SYNC.num_grads // 2
    reference = ps.sgd_reference(SYNC, 2, X, y)
    start = parameters_to_vector(ps.mlp(SYNC.num_hiddens, SYNC.seed).parameters()).detach()
    assert (reference - start).abs().max() > 1e-3          # the steps did move
    assert (sync["params"] - reference).abs().max() <= SYNC_TOLERANCE
    assert sync["staleness_all"] == {0: SYNC.num_grads}    # sync: never stale


@pytest.mark.timeout(120)
def test_async_applies_every_gradient_with_plausible_staleness(runs):
    run, W, n = runs[1], 2, ASYNC.num_grads
    assert run["mode"] == "async" and run["updates"] == n
    assert set(run["grads_per_worker"]) == {1, 2}
    assert all(c > 0 for c in run["grads_per_worker"].values())
    assert sum(run["grads_per_worker"].values()) == n       # every pushed gradient applied
    assert sum(run["staleness_all"].values()) == n
    assert min(run["staleness_all"]) >= 0 and max(run["staleness_all"]) < n
    # Every other worker always holds a pull until the last W updates, so the staleness
    # sums to (W - 1)(n - W / 2): a mean of W - 1, whatever the workers' speeds.
    total = sum(s * c for s, c in run["staleness_all"].items())
    assert 2 * total == (W - 1) * (2 * n - W)
    assert torch.isfinite(run["params"]).all()


@pytest.mark.timeout(120)
def test_async_staleness_sum_with_three_unequal_workers(fashion_mnist_dir):
    """The staleness total does not depend on speeds: worker 3 sleeps, the sum holds."""
    before = {p.pid for p in live_children()}
    W, n = 3, 24
    cfg = ps.PSConfig("async", num_grads=n, batch_size=32, num_hiddens=32,
                      delays=(0, 0, 0.01))
    [run] = ps.run_ps([cfg], num_workers=W, num_train=NUM_TRAIN, num_test=NUM_TEST,
                      root=fashion_mnist_dir, timeout=90)
    assert no_children_left(exclude=before), [p.cmdline() for p in live_children(before)]
    assert sum(run["grads_per_worker"].values()) == n and len(run["grads_per_worker"]) == W
    assert 2 * sum(s * c for s, c in run["staleness_all"].items()) == (W - 1) * (2 * n - W)


def test_train_stale_tau0_is_plain_sgd(arrays):
    X, y, X_test, y_test = arrays
    lr, steps = 0.1, 12
    stale = ps.train_stale(0, lr, steps, X, y, X_test, y_test, num_hiddens=32, eval_every=4)
    net = ps.mlp(32)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    batches = ps.worker_batches(X, y, 1, 1, 64)
    for _ in range(steps):
        X_batch, y_batch = next(batches)
        optimizer.zero_grad()
        F.cross_entropy(net(X_batch), y_batch).backward()
        optimizer.step()
    assert torch.equal(stale["params"], parameters_to_vector(net.parameters()))   # exactly
    assert stale["steps"] == [0, 4, 8, 12] and len(stale["losses"]) == 4
    assert not stale["diverged"]


def test_train_stale_uses_the_parameters_of_step_t_minus_tau(arrays):
    """With tau >= steps - 1 every gradient is taken at the starting point w_0."""
    X, y, X_test, y_test = arrays
    lr, steps = 0.1, 5
    stale = ps.train_stale(16, lr, steps, X, y, X_test, y_test, num_hiddens=32)
    net = ps.mlp(32)
    w = parameters_to_vector(net.parameters()).detach().clone()
    batches = ps.worker_batches(X, y, 1, 1, 64)
    for _ in range(steps):
        grad, _ = ps.flat_grad(net, *next(batches))     # net stays at w_0
        w.add_(grad, alpha=-lr)
    assert torch.equal(stale["params"], w)
    fresh = ps.train_stale(1, lr, steps, X, y, X_test, y_test, num_hiddens=32)
    assert not torch.equal(fresh["params"], w)

"""dpbook.jax: devices, batch splitting, Flax models, data loaders."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpbook import jax as dp
from dpbook.data import FASHION_MNIST_MEAN, FASHION_MNIST_STD
from dpbook.jax.data import random_batch
from helpers import NUM_JAX_DEVICES, PARAMS, RESNET18_PARAMS   # the PyTorch models' sizes


def test_emulated_devices():
    assert len(jax.devices()) == NUM_JAX_DEVICES


def test_get_devices(monkeypatch):
    monkeypatch.delenv("DPBOOK_NUM_DEVICES", raising=False)
    assert dp.get_devices() == jax.devices()
    monkeypatch.setenv("DPBOOK_NUM_DEVICES", "3")
    assert dp.get_devices() == jax.devices()[:3]
    with pytest.raises(ValueError, match="emulate_cpu_devices"):
        dp.get_devices(NUM_JAX_DEVICES + 1)


def test_try_gpu_falls_back_to_cpu():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    assert dp.try_all_gpus() == (gpus or [jax.devices("cpu")[0]])   # never empty
    assert dp.try_gpu(len(gpus)) == jax.devices("cpu")[0]
    if gpus:
        assert dp.try_gpu(0) == gpus[0]


def test_split_batch_places_shards():
    X, y = np.arange(20.0).reshape(10, 2), np.arange(10)
    devices = jax.devices()[:4]
    Xs, ys = dp.split_batch(X, y, devices)
    assert [len(x) for x in Xs] == [3, 3, 2, 2]
    assert [x.devices() for x in Xs] == [{d} for d in devices]
    assert [t.devices() for t in ys] == [{d} for d in devices]
    np.testing.assert_array_equal(np.concatenate([np.asarray(x) for x in Xs]), X)
    with pytest.raises(ValueError, match="batch of 3"):
        dp.split_batch(X[:3], y[:3], devices)


def test_split_batch_by_weights():
    X, y = np.arange(256.0).reshape(128, 2), np.arange(128)
    devices = jax.devices()[:2]
    Xs, ys = dp.split_batch(X, y, devices, weights=[3, 1])
    assert [len(x) for x in Xs] == [96, 32] == dp.split_sizes(128, 2, weights=[3, 1])
    assert [x.devices() for x in Xs] == [{d} for d in devices]
    assert [t.devices() for t in ys] == [{d} for d in devices]
    np.testing.assert_array_equal(np.concatenate([np.asarray(t) for t in ys]), y)  # in order
    with pytest.raises(ValueError, match="positive, finite weights"):
        dp.split_batch(X, y, devices, weights=[1, 0])
    with pytest.raises(ValueError, match="positive, finite weights"):
        dp.split_batch(X, y, devices, weights=[1, 1, 1])


@pytest.mark.parametrize("name, cls", [("lenet", dp.LeNet), ("lenet5", dp.LeNet5)])
def test_lenets_match_torch_sizes(name, cls):
    x = jnp.zeros((5, 28, 28, 1))
    variables = jax.jit(cls().init)(jax.random.key(0), x)
    assert dp.num_params(variables["params"]) == PARAMS[name]
    assert jax.jit(cls().apply)(variables, x).shape == (5, 10)


@pytest.mark.parametrize("width", sorted(RESNET18_PARAMS))
def test_resnet18_matches_torch_size(width):
    model = dp.ResNet18(num_classes=10, width=width)
    x = jnp.zeros((2, 28, 28, 1))
    shapes = jax.eval_shape(lambda k: model.init(k, x, train=False), jax.random.key(0))
    assert dp.num_params(shapes["params"]) == RESNET18_PARAMS[width]
    assert set(shapes) == {"params", "batch_stats"}


def test_resnet18_forward():
    model = dp.ResNet18(num_classes=10, width=4)
    x = jnp.ones((2, 28, 28, 1))
    # The 'rbg' generator: XLA on a CPU takes ~18 s to compile ResNet-18's initialization
    # with the default threefry generator, ~3 s with rbg. This test is about the model.
    key = jax.random.key(0, impl="rbg")
    variables = jax.jit(lambda k: model.init(k, x, train=False))(key)
    apply = jax.jit(lambda v: model.apply(v, x, train=True, mutable=["batch_stats"]))
    logits, updates = apply(variables)
    assert logits.shape == (2, 10) and "batch_stats" in updates
    assert not jax.tree_util.tree_all(jax.tree_util.tree_map(
        jnp.array_equal, updates["batch_stats"], variables["batch_stats"]))


def test_timer_waits_for_the_result(monkeypatch):
    import dpbook.jax.devices as devices
    calls = []
    monkeypatch.setattr(devices, "synchronize", lambda r=None: calls.append(r))
    timer = dp.Timer()
    result = jnp.ones((256, 256)) @ jnp.ones((256, 256))
    timer.stop(result)
    assert calls[-1] is result      # the clock stops after the result is ready


def test_hardware_line_names_devices_and_jax():
    line = dp.hardware_line(jax.devices()[:2])
    assert "devices (2): [cpu:0, cpu:1]" in line and f"jax {jax.__version__}" in line


def test_all_devices_takes_the_emulated_cpus_over_one_gpu(monkeypatch):
    """One GPU and 8 emulated CPU devices: the pages spread work over the 8 (as on Colab's
    GPU runtime), and their exercise guards count the same devices as the checks."""
    cpus = jax.devices("cpu")
    assert dp.all_devices() == jax.devices()          # a CPU machine: every device
    gpu = type("Gpu", (), {"platform": "gpu", "id": 0, "device_kind": "H200"})()
    monkeypatch.setattr(jax, "devices", lambda backend=None: cpus if backend else [gpu])
    assert dp.all_devices() == cpus
    from dpbook.jax import exercises
    assert exercises._check_devices() == cpus


def test_hardware_line_when_jax_is_kept_on_the_cpu():
    """A process restricted to the CPU (jax_platforms=cpu, as the multi-machine processes)
    cannot see the GPUs: its line says they are not used, not that there are none."""
    old = jax.config.jax_platforms
    jax.config.update("jax_platforms", "cpu")
    try:
        line = dp.hardware_line(jax.devices()[:2])
    finally:
        jax.config.update("jax_platforms", old)
    assert "gpus: not used (jax_platforms=cpu)" in line and "gpus: none" not in line


def test_cross_entropy_is_optax_integer_label_loss_without_a_scatter():
    import optax
    from dpbook.jax.state import cross_entropy
    logits = jax.random.normal(jax.random.key(0), (16, 10))
    y = jax.random.randint(jax.random.key(1), (16,), 0, 10)
    want = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    np.testing.assert_allclose(cross_entropy(logits, y), want, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(cross_entropy)(logits, y), jax.grad(
        lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y).mean())(logits),
        rtol=1e-5, atol=1e-7)
    jaxpr = str(jax.make_jaxpr(jax.grad(cross_entropy))(logits, y))
    assert "scatter" not in jaxpr and "gather" not in jaxpr


def test_load_data_fashion_mnist(fashion_mnist_dir):
    train_iter, test_iter = dp.load_data_fashion_mnist(100, 250, 130, root=fashion_mnist_dir)
    batches = list(train_iter)
    assert len(batches) == 2                                 # the partial batch is dropped
    X, y = batches[0]
    assert X.shape == (100, 28, 28, 1) and X.dtype == np.float32 and y.dtype == np.int32
    assert sum(len(b[1]) for b in test_iter) == 130           # the test set is complete
    standard, _ = dp.load_data_fashion_mnist(100, 250, 130, root=fashion_mnist_dir,
                                             normalize=True)
    np.testing.assert_allclose(next(iter(standard))[0],
                               (X - FASHION_MNIST_MEAN) / FASHION_MNIST_STD, rtol=1e-6, atol=1e-6)


def test_random_batch():
    X, y = random_batch(16, seed=3)
    assert X.shape == (16, 28, 28, 1) and X.dtype == np.float32 and y.dtype == np.int32
    assert 0 <= X.min() and X.max() < 1 and 0 <= y.min() and y.max() <= 9
    again, _ = random_batch(16, seed=3)
    other, _ = random_batch(16, seed=4)
    np.testing.assert_array_equal(X, again)                  # fixed by the seed
    assert not np.array_equal(X, other)


def test_evaluate_accuracy_counts_every_example():
    batches = [(np.zeros((4, 1)), np.array([0, 1, 2, 3])), (np.zeros((2, 1)), np.array([5, 5]))]
    always_five = lambda X: jnp.full(len(X), 5)        # right on 2 of the 6 examples
    assert dp.evaluate_accuracy(always_five, batches) == pytest.approx(2 / 6)

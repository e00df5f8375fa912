"""Data parallelism from scratch, in JAX: the code of the from-scratch chapter.

The same four moves as ``dpbook.torch.scratch``, written functionally: parameters are
immutable arrays placed on each device with ``jax.device_put``; a jitted function computes
one device's gradient where its inputs live; ``allreduce`` returns new arrays.
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from .. import config
from ..plot import Animator, training_animator
from ..tools import Accumulator, TrainResult, cosine_lr
from .data import load_data_fashion_mnist
from .devices import Timer, get_devices, get_scale, hardware_line, split_batch
from .state import evaluate_accuracy

__all__ = ["init_lenet_params", "conv2d", "avg_pool2d", "lenet_forward", "loss_fn", "grad_fn",
           "get_params", "allreduce", "sgd", "train_batch", "train"]


def init_lenet_params(key: jax.Array) -> list[jax.Array]:
    """LeNet's parameters drawn from ``key`` (NHWC/HWIO layout).

    Hidden layers: He initialization (normal, variance 2 / fan_in). Output layer and
    biases: zero, so the first logits are all zero and the first steps stay small even
    with a large learning rate. Shapes: conv1 (3, 3, 1, 20), conv2 (5, 5, 20, 50),
    dense (800, 128), dense (128, 10), each followed by its bias: 129,068 numbers, like
    ``dpbook.jax.LeNet``.
    """
    k1, k2, k3 = jax.random.split(key, 3)

    def he(k, shape, fan_in):
        return jax.random.normal(k, shape) * (2 / fan_in) ** 0.5

    return [he(k1, (3, 3, 1, 20), 9), jnp.zeros(20),
            he(k2, (5, 5, 20, 50), 500), jnp.zeros(50),
            he(k3, (800, 128), 800), jnp.zeros(128),
            jnp.zeros((128, 10)), jnp.zeros(10)]


def conv2d(X: jax.Array, W: jax.Array, b: jax.Array) -> jax.Array:
    """A 'VALID' convolution written as im2col: (B, H, W, C_in) → (B, H', W', C_out).

    Each of the kh·kw kernel offsets contributes one shifted slice of ``X``; stacking them
    turns the convolution into a single matrix product. It equals
    ``lax.conv_general_dilated`` (checked in the tests); which of the two computes the
    gradient faster depends on the machine and XLA's CPU backend (the chapter times both).
    """
    kh, kw, c_in, c_out = W.shape
    h, w = X.shape[1] - kh + 1, X.shape[2] - kw + 1
    patches = jnp.stack([X[:, i:i + h, j:j + w, :] for i in range(kh) for j in range(kw)],
                        axis=3)                                # (B, h, w, kh*kw, C_in)
    patches = patches.reshape(*patches.shape[:3], kh * kw * c_in)
    return patches @ W.reshape(kh * kw * c_in, c_out) + b      # (B, h, w, C_out)


def avg_pool2d(X: jax.Array) -> jax.Array:
    """2×2 average pooling with stride 2 (an odd last row/column is dropped)."""
    return lax.reduce_window(X, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4


def lenet_forward(params: Sequence[jax.Array], X: jax.Array) -> jax.Array:
    """LeNet with raw parameters: (B, 28, 28, 1) images → (B, 10) logits."""
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    H = avg_pool2d(jax.nn.relu(conv2d(X, W1, b1)))   # (B, 13, 13, 20)
    H = avg_pool2d(jax.nn.relu(conv2d(H, W2, b2)))   # (B, 4, 4, 50)
    H = jax.nn.relu(H.reshape(H.shape[0], -1) @ W3 + b3)  # (B, 128)
    return H @ W4 + b4                               # (B, 10)


def loss_fn(params, X, y) -> jax.Array:
    """Softmax cross-entropy, *summed* over the examples of ``X``."""
    log_probs = jax.nn.log_softmax(lenet_forward(params, X))
    return -jnp.take_along_axis(log_probs, y[:, None], axis=1).sum()


#: ``(loss, grads)`` of one shard; runs on the device its inputs are on.
grad_fn = jax.jit(jax.value_and_grad(loss_fn))


def get_params(params: Sequence[jax.Array], device: jax.Device) -> list[jax.Array]:
    """The parameters placed on ``device``. JAX arrays are immutable, so replicas can
    never change each other even when they share memory; no gradient flag is needed."""
    return [jax.device_put(p, device) for p in params]


def _device(x: jax.Array) -> jax.Device:
    (device,) = x.devices()
    return device


def allreduce(data: Sequence[jax.Array]) -> list[jax.Array]:
    """Sum arrays that live on different devices; return the sum once per device.

    Naive algorithm: move every array to the first one's device, add them up there, then
    place the result back on each array's own device. Inputs are not changed.
    """
    device0 = _device(data[0])
    total = data[0]
    for x in data[1:]:
        total = total + jax.device_put(x, device0)          # collect on device 0
    return [jax.device_put(total, _device(x)) for x in data]  # broadcast back


@jax.jit
def sgd(params, grads, lr, batch_size):
    """Minibatch SGD on one device: a new list ``p - lr * grad / batch_size``."""
    return [p - lr * g / batch_size for p, g in zip(params, grads)]


def train_batch(X, y, device_params: Sequence[Sequence[jax.Array]],
                devices: Sequence[jax.Device], lr: float) -> tuple[list, jax.Array]:
    """One data-parallel SGD step; returns the new replicas and the summed loss."""
    X_shards, y_shards = split_batch(X, y, devices)
    # Each call is dispatched to its shard's device and returns at once (asynchronous).
    results = [grad_fn(params, X_shard, y_shard)
               for params, X_shard, y_shard in zip(device_params, X_shards, y_shards)]
    losses = [loss for loss, _ in results]
    grads = [g for _, g in results]                          # grads[device][param]
    reduced = [allreduce([g[i] for g in grads]) for i in range(len(grads[0]))]
    new_params = [sgd(params, [r[k] for r in reduced], lr, X.shape[0])
                  for k, params in enumerate(device_params)]
    return new_params, sum(jax.device_put(loss, devices[0]) for loss in losses)


@jax.jit
def _predict(params, X) -> jax.Array:
    """LeNet's predicted classes (B,); a numpy ``X`` goes to the device of ``params``."""
    return jnp.argmax(lenet_forward(params, X), axis=1)


def train(num_devices: int, batch_size: int, lr: float, num_epochs: int | None = None,
          scale: config.Scale | None = None, root=None, seed: int = 0,
          animator: Animator | None = None) -> TrainResult:
    """Train LeNet on Fashion-MNIST with :func:`train_batch` on ``num_devices`` devices.

    Like ``dpbook.torch.scratch.train``: same standardized data, epochs, learning rate
    schedule (warm-up, then cosine decay), curves and results. One untimed step first
    compiles the jitted functions. Returns a :class:`dpbook.tools.TrainResult` whose
    ``model`` is the list of every device's parameters.
    """
    scale = scale or get_scale()
    num_epochs = num_epochs or scale.num_epochs
    devices = get_devices(num_devices)
    train_iter, test_iter = load_data_fashion_mnist(batch_size, scale.num_train,
                                                    scale.num_test, root=root, seed=seed,
                                                    normalize=True)
    init = init_lenet_params(jax.random.key(seed))
    device_params = [get_params(init, d) for d in devices]
    if animator is None:
        animator = training_animator(
            num_epochs, f"{num_devices} device(s), batch {batch_size}, lr {lr}")
    # Warm-up: compile for this batch shape outside the timed epochs. The step is
    # functional, so throwing its result away leaves the parameters untouched.
    X, y = next(iter(train_iter))
    jax.block_until_ready(train_batch(X, y, device_params, devices, lr))
    timer, step, num_steps = Timer(start=False), 0, num_epochs * len(train_iter)
    warmup_steps = num_steps // 5     # a tenth let (2 devices, 512, 0.6) diverge here
    for epoch in range(num_epochs):
        metric = Accumulator(2)      # summed loss, examples
        timer.start()
        for X, y in train_iter:
            step_lr = cosine_lr(lr, step, num_steps, warmup_steps)
            device_params, loss = train_batch(X, y, device_params, devices, step_lr)
            metric.add(loss, len(y))
            step += 1
        timer.stop(device_params)
        test_acc = evaluate_accuracy(partial(_predict, device_params[0]), test_iter)
        animator.add(epoch + 1, (metric[0] / metric[1], test_acc))
    return TrainResult(num_devices=num_devices, batch_size=batch_size, lr=lr,
                       test_acc=test_acc, train_loss=metric[0] / metric[1],
                       epoch_times=list(timer.times), hardware=hardware_line(devices),
                       model=device_params, animator=animator)

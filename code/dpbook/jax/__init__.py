"""dpbook for JAX: ``from dpbook import jax as dp``.

Call :func:`dpbook.devices.emulate_cpu_devices` *before* importing this (it imports jax).
Re-exports the framework-free core (``dp.Timer`` here waits for JAX arrays) and adds the
JAX/Flax helpers. Never imports torch. Importing it checks that jax, flax and optax are
recent enough (:mod:`dpbook.versions`).
"""
from ..versions import require as _require

_require("jax", "flax", "optax")   # one clear line if one is too old, before anything fails later

from ..config import SCALES, Scale, num_devices
from ..data import ArrayLoader, get_fashion_mnist_labels, read_fashion_mnist
from ..devices import emulate_cpu_devices, split_sizes
from ..plot import Animator
from ..tools import Accumulator, TrainResult, benchmark, cosine_lr
from .data import load_data_fashion_mnist
from .devices import (Timer, all_devices, devices_note, get_devices, get_scale, hardware_line,
                      split_batch, synchronize, try_all_gpus, try_gpu)
from .models import LeNet, LeNet5, LeNetBN, Residual, ResNet18, num_params
from .state import evaluate_accuracy

__all__ = ["SCALES", "Scale", "num_devices", "ArrayLoader", "get_fashion_mnist_labels",
           "read_fashion_mnist", "emulate_cpu_devices", "split_sizes", "Animator",
           "Accumulator", "TrainResult", "benchmark", "cosine_lr", "load_data_fashion_mnist",
           "Timer", "all_devices", "devices_note", "get_devices", "get_scale", "hardware_line",
           "split_batch", "synchronize",
           "try_gpu", "try_all_gpus", "LeNet", "LeNet5", "LeNetBN", "Residual", "ResNet18",
           "num_params", "evaluate_accuracy"]

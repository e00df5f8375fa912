"""dpbook for PyTorch: ``from dpbook import torch as dp``.

Re-exports the framework-free core (``dp.Timer`` here synchronizes CUDA) and adds the
PyTorch helpers. Never imports jax. Importing it checks that torch is recent enough
(:mod:`dpbook.versions`).
"""
from ..versions import require as _require

_require("torch")      # one clear line if torch is too old, before anything fails later

from ..config import SCALES, Scale, num_devices
from ..data import get_fashion_mnist_labels, read_fashion_mnist
from ..devices import emulate_cpu_devices, split_sizes
from ..plot import Animator
from ..tools import Accumulator, TrainResult, benchmark, cosine_lr
from .data import load_data_fashion_mnist
from .devices import (Timer, devices_note, full_float32, get_devices, get_scale,
                      hardware_line, split_batch, synchronize, try_all_gpus, try_gpu)
from .models import Residual, lenet, lenet5, num_params, resnet18, seeded
from .evaluate import accuracy, evaluate_accuracy, evaluate_accuracy_gpus

__all__ = ["SCALES", "Scale", "num_devices", "get_fashion_mnist_labels", "read_fashion_mnist",
           "emulate_cpu_devices", "split_sizes", "Animator", "Accumulator", "TrainResult", "benchmark", "cosine_lr",
           "load_data_fashion_mnist", "Timer", "devices_note", "full_float32", "get_devices",
           "get_scale", "hardware_line",
           "split_batch", "synchronize", "try_all_gpus", "try_gpu", "Residual", "lenet",
           "lenet5", "num_params", "resnet18", "seeded", "accuracy", "evaluate_accuracy",
           "evaluate_accuracy_gpus"]

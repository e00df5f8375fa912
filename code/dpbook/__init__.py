"""dpbook: helpers for a book on data-parallel training.

This top-level package is framework-free: it never imports torch or jax. Chapters use
``from dpbook import torch as dp`` or ``from dpbook import jax as dp``, which re-export
everything here plus the framework's own helpers.
"""
from . import data
from .config import SCALES, Scale, get_scale, num_devices
from .devices import cpu_name, emulate_cpu_devices, hardware_line, split_sizes
from .plot import Animator, in_notebook
from .tools import Accumulator, Timer, TrainResult, atomic_write, benchmark, cosine_lr

__version__ = "0.1.0"

__all__ = ["data", "Scale", "SCALES", "get_scale", "num_devices", "emulate_cpu_devices",
           "hardware_line", "cpu_name", "split_sizes", "Animator", "in_notebook",
           "Accumulator", "Timer", "TrainResult", "atomic_write", "benchmark", "cosine_lr"]

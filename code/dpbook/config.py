"""Scale settings: the one place that turns ``DPBOOK_SCALE`` into sizes.

Every chapter runs at one of three scales:

``quick``
    For the tests: a few seconds per notebook, tiny data subsets, one epoch.
``cpu``
    The default without a GPU, used to build the site on a laptop: minutes per notebook.
``full``
    The default with a GPU: the sizes of d2l's runs.

Environment variables (read when a function below is *called*, never at import):

``DPBOOK_SCALE``        ``quick`` | ``cpu`` | ``full``.
``DPBOOK_NUM_DEVICES``  how many devices a chapter uses (a positive integer).
``DPBOOK_DATA``         the dataset folder (see :mod:`dpbook.data`).
"""
from __future__ import annotations

import dataclasses
import os

__all__ = ["Scale", "SCALES", "get_scale", "num_devices"]


@dataclasses.dataclass(frozen=True)
class Scale:
    """How big the runs of one scale are. ``None`` for a size means "all of it"."""

    name: str
    num_train: int | None      # Fashion-MNIST training examples used
    num_test: int | None       # Fashion-MNIST test examples used
    num_epochs: int            # epochs for LeNet-sized models
    resnet_epochs: int         # epochs for the ResNet-18 variant
    resnet_width: int          # channels of ResNet-18's first stage (64 in the paper)
    resnet_num_train: int | None   # training examples for the ResNet-18 runs
    resnet_num_test: int | None    # test examples for the ResNet-18 runs
    matmul_size: int           # n of the n x n matrix products in the devices chapter
    num_repeats: int           # repetitions of each timed measurement


SCALES = {
    "quick": Scale("quick", num_train=1024, num_test=512, num_epochs=1,
                   resnet_epochs=1, resnet_width=4, resnet_num_train=512,
                   resnet_num_test=256, matmul_size=128, num_repeats=3),
    "cpu": Scale("cpu", num_train=None, num_test=None, num_epochs=5,
                 resnet_epochs=4, resnet_width=8, resnet_num_train=12_000,
                 resnet_num_test=2_000, matmul_size=1024, num_repeats=10),
    "full": Scale("full", num_train=None, num_test=None, num_epochs=10,
                  resnet_epochs=10, resnet_width=64, resnet_num_train=None,
                  resnet_num_test=None, matmul_size=4096, num_repeats=20),
}


def get_scale(name: str | None = None, *, num_gpus: int = 0) -> Scale:
    """Return the :class:`Scale` named ``name``, else ``$DPBOOK_SCALE``, else the default.

    The default is ``full`` with two GPUs or more and ``cpu`` otherwise. One GPU (a Colab
    T4) keeps ``cpu``: the demos with several processes then run on the CPU, as in the
    book's stored runs, and no page takes more than minutes. This core never probes
    hardware itself: ``dpbook.torch.get_scale`` and ``dpbook.jax.get_scale`` pass
    ``num_gpus``.
    """
    if name is None:
        name = os.environ.get("DPBOOK_SCALE", "").strip().lower() or None
    if name is None:
        name = "full" if num_gpus >= 2 else "cpu"
    try:
        return SCALES[name]
    except KeyError:
        raise ValueError(f"unknown scale {name!r} (from DPBOOK_SCALE or the argument): "
                         f"choose one of {', '.join(SCALES)}") from None


def num_devices(default: int) -> int:
    """The number of devices a chapter uses: ``$DPBOOK_NUM_DEVICES``, else ``default``."""
    value = os.environ.get("DPBOOK_NUM_DEVICES", "").strip()
    if not value:
        return default
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"DPBOOK_NUM_DEVICES must be a positive integer, got {value!r}")
    return n

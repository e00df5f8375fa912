"""The book on the GPUs of this machine (``make test-gpu``). Without a GPU every test here
skips, saying why (markers ``gpu`` and ``multigpu``, tests/conftest.py).

* Every English notebook at the quick scale, on whatever GPUs there are: the device
  policy (dpbook.torch.dist.placement) decides where its processes run.
* One DDP step under NCCL, one GPU per process, equals one process's step (TF32 off,
  float32 tolerance), and a group built for GPUs still takes CPU tensors (gloo).
"""
from __future__ import annotations

import pytest

from book import ROOT, notebooks  # first: it puts tools/ on sys.path
import runs  # noqa: E402  (tools/runs.py)
from helpers import require_data

NOTEBOOKS = notebooks("en")


@pytest.mark.gpu
@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_runs_on_the_gpus_here(path, tmp_path):
    env = {"DPBOOK_DATA": str(require_data().resolve())}
    nb = runs.execute(path, "quick", env, timeout=600, progress=False)
    runs.save(nb, tmp_path / "run.ipynb")
    text = "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                     for c in nb.cells for o in c.get("outputs", []))
    assert "hardware | " in text and "gpus: none" not in text


@pytest.mark.multigpu
@pytest.mark.multiprocess
def test_one_ddp_step_under_nccl_equals_one_process():
    import torch
    from dpbook.torch import ddp_check, dist
    n = torch.cuda.device_count()
    where = dist.placement(n)
    assert where.backend == "cpu:gloo,cuda:nccl" and where.devices[-1] == f"cuda:{n - 1}"
    diff = ddp_check.ddp_step_difference(n, model="lenet", batch_size=16 * n)
    assert diff["whole"] < 1e-5, diff      # float32, TF32 off: summation order only


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_one_gpu_still_shows_data_parallelism():
    """More replicas than GPUs: the from-scratch replicas share a GPU, and processes go to
    the CPU with gloo (NCCL refuses two ranks on one GPU)."""
    import torch
    from dpbook.torch import devices, dist
    n = torch.cuda.device_count() + 1
    assert len(devices.get_devices(n)) == n
    assert devices.devices_note(devices.get_devices(n)) is not None
    assert dist.placement(n).devices == ("cpu",) * n

"""The framework-free core: scale, devices flag, split sizes, Timer, Accumulator, Animator."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import dpbook
from dpbook import config
from helpers import ROOT


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


# --- scale and settings -----------------------------------------------------------------

def test_scale_default_depends_on_gpu(monkeypatch):
    monkeypatch.delenv("DPBOOK_SCALE", raising=False)
    assert dpbook.get_scale(num_gpus=0).name == "cpu"
    assert dpbook.get_scale(num_gpus=1).name == "cpu"       # one T4: minutes, not hours
    assert dpbook.get_scale(num_gpus=2).name == "full"


def test_scale_from_env_and_argument(monkeypatch):
    monkeypatch.setenv("DPBOOK_SCALE", "Quick ")
    assert dpbook.get_scale().name == "quick"
    assert dpbook.get_scale("full").name == "full"     # an argument wins over the env


def test_scale_unknown_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("DPBOOK_SCALE", "huge")
    with pytest.raises(ValueError, match="unknown scale 'huge'.*quick, cpu, full"):
        dpbook.get_scale()


def test_scales_grow():
    q, c, f = (config.SCALES[n] for n in ("quick", "cpu", "full"))
    assert q.num_train < 60000 and c.num_train is None and f.num_train is None
    assert q.num_epochs <= c.num_epochs <= f.num_epochs
    assert q.resnet_width < c.resnet_width < f.resnet_width == 64
    assert q.resnet_num_train < c.resnet_num_train < 60000 and f.resnet_num_train is None
    assert q.matmul_size < c.matmul_size < f.matmul_size


def test_num_devices(monkeypatch):
    monkeypatch.delenv("DPBOOK_NUM_DEVICES", raising=False)
    assert dpbook.num_devices(default=3) == 3
    monkeypatch.setenv("DPBOOK_NUM_DEVICES", "5")
    assert dpbook.num_devices(default=3) == 5
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("DPBOOK_NUM_DEVICES", bad)
        with pytest.raises(ValueError, match="positive integer"):
            dpbook.num_devices(default=3)


# --- split sizes ------------------------------------------------------------------------

@pytest.mark.parametrize("n, k, sizes", [(8, 2, [4, 4]), (10, 4, [3, 3, 2, 2]),
                                         (5, 5, [1] * 5), (7, 1, [7])])
def test_split_sizes(n, k, sizes):
    assert dpbook.split_sizes(n, k) == sizes


def test_split_sizes_refuses_empty_shards():
    with pytest.raises(ValueError, match="batch of 3 example.*4 devices"):
        dpbook.split_sizes(3, 4)
    with pytest.raises(ValueError, match="at least one device"):
        dpbook.split_sizes(3, 0)


# --- emulated JAX devices ---------------------------------------------------------------

def test_emulate_cpu_devices_keeps_other_flags():
    code = ("import os, dpbook; dpbook.emulate_cpu_devices(3); dpbook.emulate_cpu_devices(5);"
            "print(os.environ['XLA_FLAGS'])")
    out = run_python(code, XLA_FLAGS="--xla_dump_to=/tmp/x")
    assert out.returncode == 0, out.stderr
    flags = out.stdout.split()
    assert flags == ["--xla_dump_to=/tmp/x", "--xla_force_host_platform_device_count=5"]


def test_emulate_cpu_devices_gives_devices():
    code = "import dpbook; dpbook.emulate_cpu_devices(3); import jax; print(len(jax.devices()))"
    out = run_python(code, XLA_FLAGS="")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


def test_emulate_cpu_devices_after_import_jax_fails_loudly():
    code = ("import jax; jax.devices(); import dpbook\n"
            "dpbook.emulate_cpu_devices(1)  # enough devices already: fine\n"
            "dpbook.emulate_cpu_devices(4)")
    out = run_python(code, XLA_FLAGS="")
    assert out.returncode != 0
    assert "RuntimeError" in out.stderr and "before `import jax`" in out.stderr


def test_emulate_cpu_devices_rejects_bad_counts():
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError):
            dpbook.emulate_cpu_devices(bad)


# --- imports: the core is framework-free, the parts never import each other -------------

def _parts() -> dict[str, list[str]]:
    """Every module of the package (found on disk), by part: core, torch, jax."""
    import pkgutil
    names = ["dpbook"] + [m.name for m in pkgutil.walk_packages(dpbook.__path__, "dpbook.")]
    parts = {"core": [], "torch": [], "jax": []}
    for name in names:
        part = (name.split(".") + [""])[1]          # dpbook.torch.ddp -> torch
        parts[part if part in parts else "core"].append(name)
    return parts


FORBIDDEN = {"core": ("torch", "jax", "flax", "optax"), "torch": ("jax", "flax", "optax"),
             "jax": ("torch",)}


@pytest.mark.parametrize("part", FORBIDDEN)
def test_import_isolation(part):
    """Importing every module of a part (in a fresh interpreter) imports no framework it
    must not: the core none, the torch part no jax, the jax part no torch."""
    modules = _parts()[part]
    assert len(modules) >= 5, modules
    forbidden = FORBIDDEN[part]
    module = ", ".join(modules)
    code = f"import sys, {module}; print([m for m in {forbidden!r} if m in sys.modules])"
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_code_folder_does_not_shadow_stdlib_code():
    out = subprocess.run([sys.executable, "-c", "import code, pdb, dpbook; print(code.__file__)"],
                         capture_output=True, text=True, cwd=dpbook.__file__.rsplit("/code/", 1)[0])
    assert out.returncode == 0, out.stderr
    assert "/code/" not in out.stdout and out.stdout.strip().endswith("code.py")


# --- Timer and Accumulator --------------------------------------------------------------

def test_timer_measures_and_syncs():
    waited = []
    timer = dpbook.Timer(sync=waited.append)
    time.sleep(0.02)
    t = timer.stop("result")
    assert 0.015 < t < 1.0
    assert waited == [None, "result"]          # synced at start and before reading
    timer.start(); timer.stop()
    assert len(timer.times) == 2
    assert timer.sum() == pytest.approx(sum(timer.times))
    assert timer.avg() == pytest.approx(timer.sum() / 2)
    assert timer.median() == pytest.approx(timer.avg())   # the median of two is their mean
    timer.times = [1.0, 100.0, 2.0]
    assert timer.median() == 2.0                            # an outlier does not move it
    assert timer.cumsum()[-1] == pytest.approx(timer.sum())


def test_timer_stop_without_start():
    timer = dpbook.Timer(start=False)
    with pytest.raises(RuntimeError, match="before Timer.start"):
        timer.stop()


def test_accumulator():
    acc = dpbook.Accumulator(2)
    acc.add(1, 2)
    acc.add(3.5, 4)
    assert (acc[0], acc[1]) == (4.5, 6.0)
    with pytest.raises(ValueError):
        acc.add(1)
    acc.reset()
    assert acc.data == [0.0, 0.0]


# --- Animator -----------------------------------------------------------------------------

def test_animator_in_a_script_writes_the_figure(tmp_path):
    path = tmp_path / "curve.png"
    animator = dpbook.Animator(xlabel="epoch", legend=["train loss", "test acc"], path=path)
    animator.add(1, (0.9, None))
    animator.add(2, (0.5, 0.8))
    assert not animator.live
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert animator.series() == {"train loss": ([1.0, 2.0], [0.9, 0.5]),
                                 "test acc": ([2.0], [0.8])}
    with pytest.raises(ValueError, match="2 lines"):
        animator.add(3, (1, 2, 3))


def test_animator_default_path_and_svg(tmp_path, monkeypatch):
    monkeypatch.setenv("DPBOOK_FIGURES", str(tmp_path))
    animator = dpbook.Animator()
    animator.add(0, 1.0)
    files = list(tmp_path.glob("animator-*.png"))
    assert len(files) == 1
    assert animator.savefig(tmp_path / "c.svg").endswith("c.svg")
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")
    quiet = dpbook.Animator(path=False, live=False)
    quiet.add(0, 1.0)
    assert quiet.path is None and len(list(tmp_path.iterdir())) == 2   # nothing written


def test_animator_redraws_in_place_in_jupyter():
    """Run in a real kernel: one output whose display is updated, not one per point."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import dpbook\nanim = dpbook.Animator(legend=['a'])\n"
        "for i in range(3):\n    anim.add(i, i * i)\nprint(anim.live, anim.path)")])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    displays = [o for o in outputs if o.output_type == "display_data"]
    assert len(displays) == 1 and "image/svg+xml" in displays[0].data
    assert outputs[-1].text.strip() == "True None"


# --- hardware line ------------------------------------------------------------------------

def test_hardware_line():
    line = dpbook.hardware_line(["cpu", "cpu"], frameworks={"torch": "9.9"}, scale="quick")
    assert line.startswith("hardware | cpu: ")
    assert "gpus: none" in line and "devices (2): [cpu, cpu]" in line
    assert "torch 9.9" in line and "scale: quick" in line
    assert "gpus: A100, A100" in dpbook.hardware_line(["cuda:0"], ["A100", "A100"])


def test_training_animator_draws_loss_and_accuracy(tmp_path):
    animator = dpbook.plot.training_animator(3, title="2 device(s)")
    animator.path = str(tmp_path / "curve.png")
    animator.add(1, (0.5, 0.8))
    assert list(animator.series()) == ["train loss", "test acc"]
    assert animator.config["xlim"] == [1, 3] and animator.config["title"] == "2 device(s)"
    assert (tmp_path / "curve.png").is_file()


def test_training_curves_of_different_runs_share_one_y_range():
    """Runs that a page compares are drawn on the same scale, whatever their values."""
    low, high = (dpbook.plot.training_animator(4) for _ in range(2))
    low.path = high.path = None                 # nothing to write
    for epoch in (1, 2, 3, 4):
        low.add(epoch, (0.3 / epoch, 0.9))
        high.add(epoch, (2.2 / epoch, 0.2))
    assert low.axes.get_ylim() == high.axes.get_ylim() == dpbook.plot.TRAINING_YLIM
    assert dpbook.plot.TRAINING_YLIM == (0.0, 2.5)   # holds ln 10 = 2.30, chance's loss
    assert list(low.axes.get_xticks()) == [1, 2, 3, 4]          # whole epochs
    other = dpbook.plot.training_animator(2, ylim=(0, 1))
    other.path = None
    other.add(1, (0.5, 0.6))
    assert other.axes.get_ylim() == (0, 1)


def test_a_point_above_the_fixed_y_range_is_marked_on_its_top_edge():
    animator = dpbook.plot.training_animator(2)
    animator.path = None
    animator.add(1, (3.1, 0.1))                 # a loss above the range: not invisible
    marks = [line for line in animator.axes.get_lines() if line.get_marker() == "^"]
    assert len(marks) == 1 and list(marks[0].get_ydata()) == [2.5]
    assert marks[0].get_color() == animator.axes.get_lines()[0].get_color()
    legend = animator.axes.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["train loss", "test acc"]
    assert animator.series()["train loss"] == ([1.0], [3.1])    # the data stay as they are


def test_animator_xticks_at_the_values_measured_labelled_plainly():
    """A log axis with a few sizes: one plain label per size, no minor-tick labels."""
    sizes = [128, 256, 512, 1024]
    animator = dpbook.Animator(xscale="log", xticks=sizes, path=False, live=False)
    animator.add(sizes[0], 1.0)                 # the axis spans every size from the start
    ax = animator.axes
    animator.fig.canvas.draw()
    assert list(ax.get_xticks()) == sizes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["128", "256", "512", "1024"]
    assert len(ax.get_xticks(minor=True)) == 0
    assert ax.get_xlim()[0] < 128 and ax.get_xlim()[1] > 1024


def test_cosine_lr_decays_from_lr_to_nearly_zero():
    lrs = [dpbook.cosine_lr(0.3, step, 100) for step in range(100)]
    assert lrs[0] == 0.3
    assert all(a > b for a, b in zip(lrs, lrs[1:]))              # strictly decreasing
    assert 0 < lrs[-1] < 1e-3 and abs(lrs[50] - 0.15) < 1e-12    # halfway: half of lr
    for bad in (-1, 100):
        with pytest.raises(ValueError, match="outside"):
            dpbook.cosine_lr(0.3, bad, 100)


def test_cosine_lr_warms_up_linearly_then_decays():
    lrs = [dpbook.cosine_lr(0.6, step, 100, warmup_steps=10) for step in range(100)]
    assert [round(v, 12) for v in lrs[:10]] == [round(0.06 * (i + 1), 12) for i in range(10)]
    assert lrs[10] == 0.6                                         # the cosine starts at lr
    assert all(a > b for a, b in zip(lrs[10:], lrs[11:]))
    assert abs(lrs[55] - 0.3) < 1e-12 and 0 < lrs[-1] < 1e-3     # halfway through the decay
    for bad in (-1, 100):
        with pytest.raises(ValueError, match="warmup_steps"):
            dpbook.cosine_lr(0.6, 0, 100, warmup_steps=bad)


# --- versions: a chapter's first import says which package is too old -------------------

def test_version_parsing_and_messages():
    from dpbook import versions
    assert versions.parse("2.13.0+cpu") == (2, 13, 0)
    assert versions.parse("0.8.0rc1") == (0, 8, 0)
    assert versions.too_old("jax", "0.10.2") is None
    message = versions.too_old("jax", "0.7.2")
    assert message.startswith("dpbook needs jax >= 0.8.2 (this is 0.7.2")
    assert "pip install -U 'jax>=0.8.2'" in message and "\n" not in message


def test_the_compat_environment_is_the_minimum():
    """tools/compat.sh's oldest environment installs exactly versions.MINIMUM (both read
    dpbook/versions.yml; this checks that the shell reads it right)."""
    from dpbook import versions
    script = (ROOT / "tools/compat.sh").read_text()
    block = script[script.index("OLDEST="):script.index("newest_torch() {")]
    out = subprocess.run(["bash", "-c", block + 'echo "$OLDEST"'], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    pins = dict(p.split("==") for p in out)
    assert {p: pins[p].rstrip(".*") for p in versions.MINIMUM} == \
        {p: v for p, (v, _) in versions.MINIMUM.items()}
    assert pins["jaxlib"] == pins["jax"]


def test_a_module_with_a_higher_floor_says_so(monkeypatch):
    """dpbook.torch.fsdp needs more than the book's torch: importing it with an older one
    stops with the module's own one-line message."""
    from dpbook import versions
    [(package, (oldest, _))] = versions.MODULE_MINIMUM["dpbook.torch.fsdp"].items()
    book = versions.MINIMUM[package][0]
    assert versions.parse(oldest) > versions.parse(book)
    monkeypatch.setattr(versions, "installed", lambda p: book if p == package else None)
    monkeypatch.delenv("DPBOOK_IGNORE_VERSIONS", raising=False)
    with pytest.raises(versions.VersionError, match=f"dpbook.torch.fsdp needs {package} >= "):
        versions.require_for("dpbook.torch.fsdp")
    versions.require_for("dpbook.torch.zero")             # no floor of its own: passes
    monkeypatch.setenv("DPBOOK_IGNORE_VERSIONS", "1")
    versions.require_for("dpbook.torch.fsdp")


def test_jax_upgrade_names_the_cuda_plugin(monkeypatch):
    """With JAX's CUDA plugin installed, the advice upgrades the plugin too: a plain
    `jax>=…` would leave it behind and JAX would run on the CPU."""
    from dpbook import versions
    plugins = {"jax-cuda12-plugin": "0.7.2"}
    monkeypatch.setattr(versions, "installed", lambda package: plugins.get(package))
    assert "pip install -U 'jax[cuda12]>=" in versions.too_old("jax", "0.7.2")
    assert "pip install -U 'flax>=" in versions.too_old("flax", "0.0.1")
    plugins.clear()
    assert "pip install -U 'jax>=" in versions.too_old("jax", "0.7.2")


@pytest.mark.parametrize("package, module", [("torch", "dpbook.torch"), ("jax", "dpbook.jax"),
                                             ("flax", "dpbook.jax"), ("optax", "dpbook.jax")])
def test_importing_with_an_old_release_says_how_to_upgrade(tmp_path, package, module):
    """A fake, old distribution of ``package`` comes first on the path: importing the
    chapters' module fails with the one-line upgrade message, not later with an
    AttributeError; DPBOOK_IGNORE_VERSIONS=1 lets a reader try anyway."""
    info = tmp_path / f"{package}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.0.1\n")
    out = run_python(f"import {module}", PYTHONPATH=str(tmp_path))
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dpbook.versions.VersionError: dpbook needs {package} >= "), last
    assert "(this is 0.0.1; " in last and f"pip install -U '{package}>=" in last
    versions_ok = run_python(f"import {module}", PYTHONPATH=str(tmp_path),
                             DPBOOK_IGNORE_VERSIONS="1")
    assert versions_ok.returncode == 0, versions_ok.stderr[-2000:]


@pytest.mark.parametrize("name", [n for part in _parts().values() for n in part])
def test_docstring_examples(name):
    """The ``>>>`` examples in every module's docstrings hold: the core's, and those of
    the PyTorch and JAX parts (jax sees the emulated devices conftest set up)."""
    import doctest
    import importlib
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


def test_pages_state_the_floors_of_versions_yml():
    """The preface (both editions) and the FSDP page name the releases versions.yml holds."""
    from dpbook import versions
    fsdp = versions.MODULE_MINIMUM["dpbook.torch.fsdp"]["torch"][0]
    for lang in ("en", "zh"):
        page = (ROOT / f"chapters/{lang}/sharded/fsdp.md").read_text(encoding="utf8")
        assert f"PyTorch {fsdp}" in page, lang
        preface = " ".join((ROOT / f"chapters/{lang}/index.md").read_text("utf8").split())
        for package, name in (("torch", "PyTorch"), ("jax", "JAX"), ("flax", "Flax"),
                              ("optax", "Optax")):
            assert f"{name} {versions.MINIMUM[package][0]}" in preface, (lang, package)
        assert f"PyTorch {fsdp}" in preface, lang

"""Executed outputs that travel with the sources, and the key that says they are current.

    python tools/runs.py                # refresh: execute the stale notebooks, write outputs/
    python tools/runs.py --check        # exit 1 naming every stale or failed output (CI)
    python tools/runs.py --list         # every notebook: current, stale (why) or missing

The English notebook ``chapters/en/<slug>/<name>.md`` executed at scale ``s`` is stored
as ``outputs/<s>/<slug>/<name>.ipynb``, with its *run record* in the notebook's metadata
(``metadata.dpbook_run``). The record is the key: stored outputs are **current** when

* the notebook's code cells are the same, comments aside;
* the scale, and ``DPBOOK_NUM_DEVICES`` (unset, or the same value), are the same;
* every ``dpbook`` module the kernel had imported at the end of the run has the same code.
  A module's code is what Python parses: its source through :func:`ast.parse`, with
  docstrings removed, written back by :func:`ast.unparse` — so comments, docstrings and
  layout may change, anything that runs may not;
* torch, jax, flax and optax, those the kernel imported, have the same release.

A Chinese notebook has the same code cells as its English twin (tests/test_parity.py) and
takes its outputs (``notebooks.with_outputs_of``); it is never stored or executed.

``make book`` (tools/build_book.py) shows current stored outputs and executes only the
notebooks without them, into ``_build/outputs/<s>/``; ``DPBOOK_EXECUTE=all`` executes
every notebook. ``make outputs`` (this script) executes the stale notebooks at the default
scale (or takes a current execution from ``_build/outputs/``), writes them into
``outputs/`` and regenerates ``notebooks/`` (tools/notebooks.py), whose ``.ipynb`` files
carry the ``cpu`` outputs.
"""
from __future__ import annotations

import argparse
import ast
import base64
import copy
import datetime
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

import jupytext
import nbformat

from sources import (ROOT, STORE, load, notebook_entries, stored_path,  # noqa: F401
                     strip_comments)
CODE = ROOT / "code"                      # where the dpbook package's sources are
FRAMEWORKS = ("torch", "jax", "flax", "optax")
MODES = ("auto", "all")                   # DPBOOK_EXECUTE
REFRESH = "make outputs"                  # the command that refreshes stale outputs

# Run in the kernel after the notebook's last cell; prints what the run depended on.
PROBE = """\
import sys as _sys, json as _json, importlib.metadata as _md
_found = {"modules": sorted(m for m in _sys.modules if m.split(".")[0] == "dpbook"),
          "versions": {p: _md.version(p) for p in %r if p in _sys.modules}}
def _gpus():
    try:
        if "torch" in _sys.modules:
            import torch
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if "jax" in _sys.modules:
            import jax
            return [d.device_kind for d in jax.devices() if d.platform == "gpu"]
    except Exception:  # the record says less, the run stands
        pass
    return []
import psutil as _ps, dpbook.devices as _dev
_found["hardware"] = {"cpu": _dev.cpu_name(), "cores": _ps.cpu_count(logical=True),
                      "ram_gib": round(_ps.virtual_memory().total / 2**30), "gpus": _gpus()}
print("dpbook-run-probe " + _json.dumps(_found))
""" % (FRAMEWORKS,)


# ---------------------------------------------------------------- the key

def english_source(entry: str) -> Path:
    """``chapters/en/concise/jax`` → the path of its MyST source."""
    return ROOT / f"{entry}.md"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def code_digest(nb: nbformat.NotebookNode) -> str:
    """The digest of a notebook's code cells, comments aside."""
    return _sha("\n\x00\n".join(strip_comments(c.source) for c in nb.cells
                                if c.cell_type == "code"))


def module_file(name: str, code_root: Path = CODE) -> Path | None:
    """``dpbook.torch.ddp`` → ``code/dpbook/torch/ddp.py`` (or a package's ``__init__``)."""
    base = code_root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def python_code(source: str) -> str:
    """Source as Python parses it: no comments, no docstrings, one layout."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and \
                    isinstance(body[0].value, ast.Constant) and \
                    isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def module_digest(name: str, code_root: Path = CODE) -> str | None:
    """The digest of a dpbook module's code (:func:`python_code`); None if it is gone."""
    path = module_file(name, code_root)
    return None if path is None else _sha(python_code(path.read_text(encoding="utf8")))


def framework_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str | None) -> str | None:
    """``2.13.0+cpu`` → ``2.13.0``: the same release built for another platform (a local
    version label: CPU, CUDA, macOS wheels) computes the same outputs at the cpu scale."""
    return None if version is None else version.split("+", 1)[0]


def settings(scale: str) -> dict:
    """The settings a run's outputs depend on, besides its code."""
    return {"scale": scale, "num_devices": os.environ.get("DPBOOK_NUM_DEVICES") or None}


def stale_reasons(executed: nbformat.NotebookNode, entry: str, scale: str,
                  code_root: Path = CODE) -> list[str]:
    """Why ``executed`` (a stored run of ``entry``) is not current; ``[]`` if it is."""
    record = executed.metadata.get("dpbook_run")
    if not record:
        return ["no run record"]
    reasons = []
    for key, value in settings(scale).items():
        if record.get(key) != value:
            reasons.append(f"{key} was {record.get(key)!r}, now {value!r}")
    if record.get("code") != code_digest(jupytext.read(english_source(entry))):
        reasons.append("its code cells changed")
    for name, digest in record.get("modules", {}).items():
        now = module_digest(name, code_root)
        if now != digest:
            reasons.append(f"{name} {'is gone' if now is None else 'changed'}")
    for name, version in record.get("versions", {}).items():
        now = framework_version(name)
        if release(now) != release(version):
            reasons.append(f"{name} was {version}, now {now}")
    if edited_hints(executed):
        reasons.append("a hint it shows was edited in hints.yml")
    return reasons


def edited_hints(executed: nbformat.NotebookNode) -> list[str]:
    """The hints a run printed (checked exercises, in English) that hints.yml no longer
    has: hints are data, and editing one re-runs only the pages that show it, so that
    their Chinese twins can say it in Chinese (tools/notebooks.translate_checks)."""
    from dpbook.exercises import HINTS, MESSAGES
    prefix = MESSAGES["hint"]["en"].split("{hint}")[0]
    current = {h["en"] for h in HINTS.values()}
    return [line[len(prefix):] for cell in executed.cells for out in cell.get("outputs", [])
            if out.get("output_type") == "stream"
            for line in out.get("text", "").splitlines()
            if line.startswith(prefix) and line[len(prefix):] not in current]


def errors(executed: nbformat.NotebookNode) -> list[str]:
    """The errors a run left in its outputs (there should be none)."""
    found = []
    for i, cell in enumerate(executed.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                found.append(f"cell {i}: {out.get('ename')}: {out.get('evalue')}")
    return found


# ---------------------------------------------------------------- running

def _progress(nb, label: str):
    """A progress bar over the code cells (tqdm), and the hook that advances it."""
    from tqdm.auto import tqdm
    bar = tqdm(total=sum(c.cell_type == "code" for c in nb.cells), desc=label, unit="cell",
               file=sys.stderr, leave=False, dynamic_ncols=True,
               disable=None)              # no bar where stderr is not a terminal (CI logs)

    def advance(cell, **_):
        if cell.cell_type == "code":
            bar.update()
    return bar, advance


def execute(path: Path, scale: str, env: dict | None = None, timeout: int = 1800,
            progress: bool = True) -> nbformat.NotebookNode:
    """Execute a MyST notebook top to bottom in a fresh kernel, at ``scale``.

    Returns the executed notebook with its run record (``metadata.dpbook_run``): the key
    of :func:`stale_reasons`, the time it took, and when and where it ran. Raises
    nbclient's ``CellExecutionError`` (naming the cell) if a cell fails.
    """
    from nbclient import NotebookClient
    nb = jupytext.read(path)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    saved = dict(os.environ)
    os.environ.update({"DPBOOK_SCALE": scale, **(env or {})})
    os.environ.pop("XLA_FLAGS", None)     # a kernel sets its own device count
    os.environ.pop("MPLBACKEND", None)    # Agg (the tests') would hide plt.show()'s figures
    bar = None
    try:
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        if progress:
            bar, client.on_cell_complete = _progress(nb, path.relative_to(ROOT).as_posix())
        run_settings = settings(scale)
        start = time.perf_counter()
        client.execute()
        seconds = time.perf_counter() - start
    finally:
        if bar is not None:
            bar.close()
        os.environ.clear()
        os.environ.update(saved)
    probe = nb.cells.pop()
    text = "".join(o.get("text", "") for o in probe.outputs)
    found = json.loads(text.split("dpbook-run-probe ", 1)[1])
    nb.metadata["dpbook_run"] = {
        **run_settings,
        "code": code_digest(nb),
        "modules": {m: module_digest(m) for m in found["modules"]},
        "versions": found["versions"],
        "seconds": round(seconds, 1),
        "executed": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "hardware": found["hardware"],
    }
    return nb


def lean(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of an executed notebook worth storing: no execution timestamps, and each
    PNG re-encoded as an optimized palette image when that is smaller."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "image/png" in data:
                data["image/png"] = _smaller_png(data["image/png"])
    return nb


def _smaller_png(b64: str) -> str:
    from PIL import Image
    raw = base64.b64decode(b64)
    image = Image.open(io.BytesIO(raw))
    buf = io.BytesIO()
    image.convert("RGB").quantize(colors=256).save(buf, format="PNG", optimize=True)
    small = buf.getvalue()
    return base64.b64encode(small).decode() if len(small) < len(raw) else b64


def save(nb: nbformat.NotebookNode, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(lean(nb), indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    path.write_text(text, encoding="utf8")
    return path


def current(entry: str, scale: str,
            folders: list[Path]) -> tuple[Path, nbformat.NotebookNode] | None:
    """The first stored run of ``entry`` in ``folders`` that is current and has no error."""
    for folder in folders:
        path = stored_path(entry, scale, folder)
        nb = load(path)
        if nb is not None and not stale_reasons(nb, entry, scale) and not errors(nb):
            return path, nb
    return None


def ensure(scale: str, mode: str = "auto", build: Path = ROOT / "_build" / "outputs",
           entries: list[str] | None = None) -> dict[str, nbformat.NotebookNode]:
    """A current run of every English notebook at ``scale``.

    ``mode="auto"`` takes a current run from ``outputs/`` (committed) or ``build``
    (executed earlier) and executes the others; ``mode="all"`` executes every one. New runs
    are saved in ``build``. Prints one line per notebook, and a summary with the times.
    """
    if mode not in MODES:
        raise ValueError(f"DPBOOK_EXECUTE must be one of {', '.join(MODES)}, got {mode!r}")
    entries = notebook_entries("en") if entries is None else entries
    runs, report = {}, []
    for i, entry in enumerate(entries, 1):
        found = None if mode == "all" else current(entry, scale, [STORE, build])
        name = f"[{i}/{len(entries)}] {entry}.md"
        if found:
            path, nb = found
            runs[entry] = nb
            where = "committed" if path.is_relative_to(STORE) else "earlier run"
            report.append((entry, f"{where}, ran {nb.metadata['dpbook_run']['seconds']:.0f} s"))
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            print(f"[outputs] {name}: current ({where}: {shown})", flush=True)
            continue
        stored = load(stored_path(entry, scale))
        why = ("DPBOOK_EXECUTE=all" if mode == "all" else
               "no stored outputs" if stored is None else
               "; ".join(stale_reasons(stored, entry, scale) + errors(stored)))
        print(f"[outputs] {name}: executing at scale {scale} ({why})", flush=True)
        try:
            nb = execute(english_source(entry), scale)
        except Exception:
            print(f"[outputs] {name}: FAILED at scale {scale}. The runs before it are kept "
                  f"in {build}: run again (DPBOOK_EXECUTE=auto) to start from this notebook.",
                  file=sys.stderr, flush=True)
            raise
        save(nb, stored_path(entry, scale, build))
        runs[entry] = nb
        seconds = nb.metadata["dpbook_run"]["seconds"]
        report.append((entry, f"executed in {seconds:.0f} s"))
        print(f"[outputs] {name}: done in {seconds:.0f} s", flush=True)
    print(f"[outputs] scale {scale}, DPBOOK_EXECUTE={mode}:")
    for entry, what in report:
        print(f"    {entry:<45} {what}")
    return runs


# ---------------------------------------------------------------- commands

def default_scale() -> str:
    """``$DPBOOK_SCALE``, else ``full`` with a GPU and ``cpu`` without (as the chapters)."""
    if os.environ.get("DPBOOK_SCALE"):
        return os.environ["DPBOOK_SCALE"]
    from dpbook import torch as dp   # the default depends on whether there is a GPU
    return dp.get_scale().name


def problems(scale: str = "cpu", store: Path = STORE) -> dict[str, list[str]]:
    """Every English notebook whose stored run at ``scale`` is missing, stale or failed."""
    found = {}
    for entry in notebook_entries("en"):
        nb = load(stored_path(entry, scale, store))
        reasons = (["missing"] if nb is None else
                   stale_reasons(nb, entry, scale) + errors(nb))
        if reasons:
            found[entry] = reasons
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=["quick", "cpu", "full"], default=None,
                        help="default: $DPBOOK_SCALE, else full with a GPU, else cpu "
                             "(--check: cpu)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true",
                       help="exit 1 if a stored output is missing, stale or has an error")
    group.add_argument("--list", action="store_true", help="show what is current")
    parser.add_argument("--all", action="store_true", help="execute every notebook")
    args = parser.parse_args(argv)

    if args.check or args.list:
        scale = args.scale or ("cpu" if args.check else default_scale())
        bad = problems(scale)
        for entry in notebook_entries("en"):
            state = "; ".join(bad[entry]) if entry in bad else "current"
            if args.list or entry in bad:
                print(f"{stored_path(entry, scale).relative_to(ROOT)}: {state}")
        if bad and args.check:
            print(f"{len(bad)} stored output(s) at scale {scale} are not current: "
                  f"refresh them with `{REFRESH}`" + ("" if scale == "cpu" else
                                                      f" (DPBOOK_SCALE={scale})"))
        return 1 if bad and args.check else 0

    scale = args.scale or default_scale()
    mode = "all" if args.all else os.environ.get("DPBOOK_EXECUTE", "auto")
    runs = ensure(scale, mode)
    for entry, nb in runs.items():
        path = stored_path(entry, scale)
        if load(path) != lean(nb):
            save(nb, path)
            print(f"wrote {path.relative_to(ROOT)}")
    import notebooks
    notebooks.main([])        # the .ipynb files carry the cpu outputs
    size = sum(p.stat().st_size for p in STORE.rglob("*.ipynb"))
    print(f"outputs/: {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build both editions of the book and assemble one site.

    python tools/build_book.py                 # scale: $DPBOOK_SCALE, else full on a GPU, else cpu
    DPBOOK_EXECUTE=all python tools/build_book.py   # execute every notebook again
    python tools/build_book.py --scale quick -W --out /tmp/book   # what the tests run

Outputs come from runs the repository vouches for (tools/runs.py): each English
notebook shows its stored run in ``outputs/<scale>/`` when that run is current (same code
cells, same ``dpbook`` code, same framework versions), else a current run from an
earlier build (``<out>/outputs/<scale>/``); only the notebooks with neither are executed,
and their runs are kept there for the next build. ``DPBOOK_EXECUTE=all`` executes every
notebook.

A Chinese notebook has the same code cells as its English twin, comments aside (the
tests check it), so it is never executed: it shows the outputs of its twin's run, and
both editions show the numbers of the same run.

The runs reach ``jb build`` through its execution cache (jupyter-cache), filled afresh on
every build, so ``jb`` itself executes nothing. The site is ``<out>/site/``: English at
the root, Chinese under ``zh/``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jupytext
import yaml

import runs  # tools/runs.py
from notebooks import EDITIONS, ROOT, notebook_entries, with_outputs_of  # tools/notebooks.py


def fill_cache(out: Path, scale: str, executed: dict) -> Path:
    """Put every notebook of both editions, with the outputs of its (English) run, into a
    new jupyter-cache for ``jb build``, so that ``jb`` executes none of them; return it.

    The cache's name is a digest of the runs: Sphinx re-reads a page only when its source
    or the configuration changed, and the cache folder is part of the configuration, so
    new outputs for an unchanged page still reach the site.
    """
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    records = json.dumps([executed[e].metadata["dpbook_run"] for e in sorted(executed)],
                         sort_keys=True)
    cache = out / "cache" / f"{scale}-{hashlib.sha256(records.encode()).hexdigest()[:12]}"
    for old in (out / "cache").glob(f"{scale}-*"):
        shutil.rmtree(old, ignore_errors=True)
    jc = get_cache(str(cache))
    for lang in EDITIONS:
        for entry in notebook_entries(lang):
            path = ROOT / f"{entry}.md"
            twin = entry.replace(f"chapters/{lang}/", "chapters/en/", 1)
            nb = with_outputs_of(jupytext.read(path), executed[twin], entry, lang)
            jc.cache_notebook_bundle(CacheBundleIn(nb, str(path)), overwrite=True)
    return cache


def provenance_records(executed: dict) -> dict:
    """What each page's provenance box says, from its English run's record (the Chinese
    page shows the same run): the scale, when, how long, where, with which releases."""
    keep = ("scale", "executed", "seconds", "hardware", "machine", "versions")
    return {entry: {k: nb.metadata["dpbook_run"][k] for k in keep
                    if k in nb.metadata["dpbook_run"]}
            for entry, nb in executed.items()}


def start_edition(lang: str, scale: str, out: Path, cache: Path,
                  warnings_as_errors: bool, records: dict | None = None
                  ) -> tuple[subprocess.Popen, Path, Path]:
    """Start ``jb build`` of one edition into ``<out>/<lang>/``, its output going to
    ``<out>/<lang>.log``; return the process, the log and the HTML folder."""
    config_name, toc_name = EDITIONS[lang]
    config = yaml.safe_load((ROOT / config_name).read_text(encoding="utf8"))
    config["execute"]["cache"] = str(cache)
    config["sphinx"]["config"]["dpbook_runs"] = records or {}   # tools/dpbook_site.py
    # The config is written elsewhere, and jupyter-book resolves paths from the config file.
    config["sphinx"]["local_extensions"] = {
        name: str(ROOT / path) for name, path in config["sphinx"]["local_extensions"].items()}
    config_path = out / "config" / f"_config.{lang}.yml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf8")

    dest = out / lang
    cmd = [str(Path(sys.executable).parent / "jupyter-book"), "build", str(ROOT),
           "--config", str(config_path), "--toc", str(ROOT / toc_name),
           "--path-output", str(dest)]
    if warnings_as_errors:
        cmd += ["-W", "-n", "--keep-going"]
    env = dict(os.environ, DPBOOK_SCALE=scale)
    print(f"[build_book] {lang}: scale={scale}, building (log: {out / lang}.log)", flush=True)
    log = out / f"{lang}.log"
    with open(log, "w", encoding="utf8") as f:
        process = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    return process, log, dest / "_build" / "html"


def build_editions(langs: list[str], scale: str, out: Path, cache: Path,
                   warnings_as_errors: bool, records: dict | None = None
                   ) -> dict[str, Path]:
    """Build the editions at the same time (Sphinx uses one core each; jb executes
    nothing, the runs come from the cache), then show each one's log in turn; raise if
    one failed. Returns each edition's HTML folder."""
    started = {lang: start_edition(lang, scale, out, cache, warnings_as_errors, records)
               for lang in langs}
    failed = []
    for lang, (process, log, _) in started.items():
        code = process.wait()
        print(log.read_text(encoding="utf8"), end="", flush=True)
        if code:
            failed.append(f"{lang} (exit code {code}, log {log})")
    if failed:
        raise SystemExit(f"[build_book] jupyter-book failed: {', '.join(failed)}")
    return {lang: html for lang, (_, _, html) in started.items()}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=["quick", "cpu", "full"], default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "_build")
    parser.add_argument("-W", dest="strict", action="store_true",
                        help="treat warnings as errors (the tests do)")
    parser.add_argument("--lang", choices=list(EDITIONS), action="append",
                        help="build only this edition (repeatable); default: both")
    args = parser.parse_args(argv)
    scale = args.scale or runs.default_scale()
    out = args.out.resolve()
    langs = [lang for lang in EDITIONS if lang in (args.lang or EDITIONS)]  # en first
    executed = runs.ensure(scale, os.environ.get("DPBOOK_EXECUTE", "auto"),
                              build=out / "outputs")
    cache = fill_cache(out, scale, executed)
    html = build_editions(langs, scale, out, cache, args.strict,
                          provenance_records(executed))

    site = out / "site"
    shutil.rmtree(site, ignore_errors=True)
    if "en" in html:
        shutil.copytree(html["en"], site)
    if "zh" in html:
        shutil.copytree(html["zh"], site / "zh")
    index = site / "index.html" if "en" in html else site / "zh" / "index.html"
    print(f"[build_book] done: open {index}")
    return index


if __name__ == "__main__":
    main()

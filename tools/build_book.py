"""Build both editions of the book and assemble one site.

    python tools/build_book.py                 # scale: $DPBOOK_SCALE, else full on a GPU, else cpu
    python tools/build_book.py --scale quick -W --out /tmp/book   # what the tests run

Each edition is built with ``jb build`` from its own config and toc. Notebooks are
executed through jupyter-cache, in one cache per scale *and* per version of the
``dpbook`` package: jupyter-cache keys only on a notebook's own code cells, so without the
package hash a change in ``code/`` would leave stale outputs on the site.

A Chinese notebook has the same code cells as its English twin, comments aside (the
tests check it), so it is not executed a second time: before the Chinese edition is
built, each Chinese notebook goes into the cache with the outputs of its English twin's
cached run. Both editions then show the numbers of the same run.

The site is ``<out>/site/``: English at the root, Chinese under ``zh/``.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from notebooks import EDITIONS, ROOT, notebook_entries, with_outputs_of  # tools/notebooks.py


def code_hash() -> str:
    """A short hash of everything a notebook's outputs depend on besides its own cells."""
    h = hashlib.sha256()
    files = sorted((ROOT / "code" / "dpbook").rglob("*.py")) + [ROOT / "requirements.txt"]
    for path in files:
        h.update(path.relative_to(ROOT).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def default_scale() -> str:
    if os.environ.get("DPBOOK_SCALE"):
        return os.environ["DPBOOK_SCALE"]
    from dpbook import torch as dp  # the default depends on whether there is a GPU
    return dp.get_scale().name


def cache_folder(scale: str, out: Path) -> Path:
    """The execution cache for ``scale`` and this version of ``dpbook``; removes the
    caches of older versions, whose outputs must never be shown."""
    cache_root = out / "cache"
    cache = cache_root / f"{scale}-{code_hash()}"
    for old in cache_root.glob(f"{scale}-*"):
        if old != cache:
            shutil.rmtree(old, ignore_errors=True)
    return cache


def reuse_english_outputs(cache: Path) -> list[str]:
    """Cache every Chinese notebook with the outputs of its English twin's cached run.

    Skips a notebook already in the cache and one whose twin is not (it is then executed
    by the build as usual). Returns the Chinese notebooks it cached.
    """
    import jupytext
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    jc = get_cache(str(cache))
    done = []
    for entry in notebook_entries("zh"):
        zh_path = ROOT / f"{entry}.md"
        en_path = ROOT / "chapters" / "en" / zh_path.relative_to(ROOT / "chapters" / "zh")
        zh = jupytext.read(zh_path)
        try:
            jc.match_cache_notebook(zh)
            continue                                   # cached already
        except KeyError:
            pass
        try:
            record = jc.match_cache_notebook(jupytext.read(en_path))
        except (KeyError, FileNotFoundError):
            continue
        executed = jc.get_cache_bundle(record.pk).nb
        nb = with_outputs_of(zh, executed, entry)
        jc.cache_notebook_bundle(CacheBundleIn(nb, str(zh_path)), overwrite=True)
        done.append(entry)
    return done


def build_edition(lang: str, scale: str, out: Path, warnings_as_errors: bool) -> Path:
    config_name, toc_name = EDITIONS[lang]
    config = yaml.safe_load((ROOT / config_name).read_text(encoding="utf8"))
    cache = cache_folder(scale, out)
    if lang == "zh":
        reused = reuse_english_outputs(cache)
        print(f"[build_book] zh: {len(reused)} notebook(s) take the outputs of their "
              "English twin", flush=True)
    config["execute"]["cache"] = str(cache)
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
    print(f"[build_book] {lang}: scale={scale}, cache={cache}", flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return dest / "_build" / "html"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=["quick", "cpu", "full"], default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "_build")
    parser.add_argument("-W", dest="strict", action="store_true",
                        help="treat warnings as errors (the tests do)")
    parser.add_argument("--lang", choices=list(EDITIONS), action="append",
                        help="build only this edition (repeatable); default: both")
    args = parser.parse_args(argv)
    scale = args.scale or default_scale()
    out = args.out.resolve()
    langs = [lang for lang in EDITIONS if lang in (args.lang or EDITIONS)]  # en first
    html = {lang: build_edition(lang, scale, out, args.strict) for lang in langs}

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

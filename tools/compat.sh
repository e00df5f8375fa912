#!/usr/bin/env bash
# The notebooks under other releases than the pinned ones, each set in its own virtual
# environment (.venv-<name>, reused while this file, the requirements and the releases
# it installs are unchanged):
#
#   bash tools/compat.sh oldest   # the oldest releases the book accepts (dpbook.versions):
#                                 # every English notebook at the quick scale
#   bash tools/compat.sh newest   # the newest torch pip installs, jax/flax at their
#                                 # pins: the PyTorch notebooks at the quick scale
#
# Called by `make test-compat` and by CI. The versions below and dpbook.versions.MINIMUM
# must agree: tests/test_core.py checks it.
set -euo pipefail
cd "$(dirname "$0")/.."

# the oldest: dpbook/versions.yml's `book` releases (jaxlib with jax)
OLDEST="$(python3 - <<'PY'
import re
text = open("code/dpbook/versions.yml").read().split("\nmodules:")[0]
pins = dict(re.findall(r'^  (\w+):\n    version: "([^"]+)"', text, re.M))
print(" ".join(f"{p}=={v}.*" if p == "torch" else f"{p}=={v}" for p, v in pins.items()),
      f"jaxlib=={pins['jax']}")
PY
)"
# the newest: the newest torch release pip would install here today (the registry's
# newest, unless pip's configuration caps it: see `pip config list`)
newest_torch() {
  python3 -m pip install --dry-run --ignore-installed --quiet --report - torch 2>/dev/null |
    python3 -c 'import json, sys
print(next(p["metadata"]["version"] for p in json.load(sys.stdin)["install"]
           if p["metadata"]["name"] == "torch"))'
}

name="${1:?usage: tools/compat.sh oldest|newest}"
case "$name" in
  oldest) pins="$OLDEST"; pattern='^(import dpbook|from dpbook)' ;;       # every notebook
  newest) version="$(newest_torch)"
          [ -n "$version" ] || { echo "compat: pip cannot tell the newest torch" >&2; exit 1; }
          pins="torch==$version"; pattern='dpbook import torch|dpbook\.torch' ;;  # the PyTorch ones
  *) echo "unknown environment $name: oldest or newest" >&2; exit 2 ;;
esac
# pages that import a module with a higher floor of its own (versions.yml `modules`) need
# more than the oldest releases: they are left out there
higher="$(sed -n '/^modules:/,$p' code/dpbook/versions.yml | sed -n 's/^  \(dpbook\.[a-z]*\)\.\(\w*\):$/^from \1 import .*\\b\2\\b/p')"
tests=()
for nb in $(grep -l -E "$pattern" chapters/en/*/*.md | sort); do
  grep -q '^kernelspec:' "$nb" || continue
  if [ "$name" = oldest ] && [ -n "$higher" ] && grep -qE -f <(echo "$higher") "$nb"; then
    echo "compat: $nb needs more than the oldest releases (versions.yml): left out"
    continue
  fi
  tests+=("tests/test_notebooks.py::test_notebook_runs[$nb]")
done

venv=".venv-$name"
stamp="$venv/.dpbook-$( (cat "$0" requirements.txt code/pyproject.toml; echo "$pins") |
                        sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # the pinned requirements, less the frameworks this environment replaces and the
  # book-building tools it does not need
  skip='jupyter-book|sphinx-book-theme|pydata-sphinx-theme|playwright|jieba'
  skip="$skip|torch|jax|jaxlib|flax|optax"
  grep -v -E "^($skip)([=<> ]|\$)" requirements.txt > "$venv/requirements.txt"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet -r "$venv/requirements.txt" $pins \
    $( [ "$name" = newest ] && grep -E '^(jax|jaxlib|flax|optax)==' requirements.txt )
  "$venv/bin/python" -m pip install --quiet --no-deps -e code
  touch "$stamp"
fi
"$venv/bin/python" -c 'import importlib.metadata as m
print("compat:", ", ".join(f"{p} {m.version(p)}" for p in ("torch", "jax", "flax", "optax")))'
echo "compat: ${#tests[@]} notebooks"
# two workers, each taking the next notebook (no site is built here, so the notebooks need
# not share one worker as in `make test`)
DPBOOK_SCALE=quick "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=5 \
  -n 2 --dist load "${tests[@]}"

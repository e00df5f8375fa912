# dpbook: `make book` builds the site, `make test` runs the test suite,
# `make outputs` refreshes the stored outputs of the notebooks (tools/runs.py).
# Both create (or reuse) the virtual environment .venv first; run them again and they
# skip what is already done.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dpbook-installed
PORT   ?= 8000

.PHONY: book test test-fast test-gpu test-compat bench serve env notebooks outputs clean

env: $(STAMP)

$(STAMP): requirements.txt code/pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "dpbook needs Python >= 3.10, this is " + sys.version.split()[0]'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet -e code
	touch $@

book: $(STAMP)
	$(PY) tools/build_book.py

notebooks: $(STAMP)
	$(PY) tools/notebooks.py

outputs: $(STAMP)
	$(PY) tools/runs.py

# Two workers (pytest-xdist): the notebooks and the site build on one, the rest on the other.
test: $(STAMP)
	DPBOOK_SCALE=quick $(PY) -m pytest -n 2 --dist loadgroup

# The edit-test loop (under 3 minutes on 2 cores): no notebooks, no book build, no process
# groups, no timing targets.
test-fast: $(STAMP)
	DPBOOK_SCALE=quick $(PY) -m pytest -q -n 2 -m "not notebook and not site and not multiprocess and not slow"

# On a machine with GPUs: every notebook at the quick scale on them, DDP under NCCL.
# Without a GPU every test skips, saying why. By default in .venv (PyPI's Linux torch
# wheels are CUDA builds); GPU_PYTHON=python3 runs it in a Python that already holds your
# own CUDA builds of torch and jax, and installs nothing there. Four notebooks at a time:
# JAX then takes GPU memory as it needs it instead of 75% of it per process.
GPU_PYTHON ?= $(PY)
test-gpu: $(if $(filter $(PY),$(GPU_PYTHON)),$(STAMP))
	DPBOOK_SCALE=quick XLA_PYTHON_CLIENT_PREALLOCATE=false \
	  $(GPU_PYTHON) -m pytest -q -rs -n 4 --dist load tests/test_gpu.py

# The notebooks under the oldest releases the book accepts and the newest torch pip
# installs, each in its own environment (tools/compat.sh; CI runs both).
test-compat: $(STAMP)
	bash tools/compat.sh oldest
	bash tools/compat.sh newest

# Timing targets, printed as ratios (tests marked slow).
bench: $(STAMP)
	DPBOOK_SCALE=quick $(PY) -m pytest -q -s --run-slow -m slow

serve:
	@test -f _build/site/index.html || { echo "no site yet: run 'make book' first"; exit 1; }
	@echo "serving http://127.0.0.1:$(PORT)/ (Ctrl-C to stop)"
	$(PY) -m http.server $(PORT) --bind 127.0.0.1 --directory _build/site

clean:
	rm -rf _build

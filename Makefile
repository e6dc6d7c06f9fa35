# Agentic RL from Scratch: build, test and maintain the book.
#   make test   unit tests, package/sync checks, and every English notebook run by nbval
#   make test-portable   the notebooks again under other CPU float roundings (avx2, default)
#   make book   HTML in _build/html (Sphinx warnings are errors)
# Everything runs in .venv, created on first use from python3.

PYTHON3 ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Installed before the package so that pip keeps this (CPU) build instead of pulling the
# multi-GB default CUDA build; override e.g. `make venv TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
PYTEST := $(PY) -m pytest -p no:cacheprovider
NBVAL := $(PYTEST) --nbval-lax --nbval-current-env
EN_NOTEBOOKS = $(sort $(wildcard chapters/*/en.ipynb))
ZH_NOTEBOOKS = $(sort $(wildcard chapters/*/zh.ipynb))

# Deterministic hashing in the notebooks' kernels; the kernel's own inline backend must embed
# figures, so a backend chosen by the caller's shell (e.g. MPLBACKEND=Agg) is not passed on.
export PYTHONHASHSEED := 0
unexport MPLBACKEND

.PHONY: venv test test-all test-portable portable-notebooks execute extract sync book clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[dev]"
	touch $@

# nbval: a glob that matches nothing is skipped, and pytest's exit code 5 (no tests collected)
# is not a failure of this step alone.
define nbval
	$(if $(1),$(NBVAL) $(1) || test $$? -eq 5,@echo "nbval: no notebooks to run")
endef

test: venv
	$(PYTEST) tests
	$(PY) tools/extract.py --check
	$(PY) tools/sync.py --check
	$(call nbval,$(EN_NOTEBOOKS))

test-all: test
	$(call nbval,$(ZH_NOTEBOOKS))

# Another CPU rounds floats differently, and RL amplifies the last bits. test-portable runs the
# notebooks again under other ATen kernels (ATEN_CPU_CAPABILITY: avx2 and the plain `default`),
# each with its own empty artefact cache so that the RL base is rebuilt under that rounding too.
# `make portable-notebooks NOTEBOOKS=chapters/07_rl_loop/en.ipynb` runs only that part, for some chapters.
PORTABLE_CAPABILITIES ?= avx2 default
NOTEBOOKS ?= $(EN_NOTEBOOKS)
test-portable: test portable-notebooks

portable-notebooks: venv
	@set -e; for cap in $(PORTABLE_CAPABILITIES); do \
	  rc=0; cache=$$(mktemp -d); \
	  echo "== nbval with ATEN_CPU_CAPABILITY=$$cap (cache $$cache)"; \
	  ATEN_CPU_CAPABILITY=$$cap AGENTRL_CACHE=$$cache $(NBVAL) $(NOTEBOOKS) || rc=$$?; \
	  rm -rf $$cache; \
	  if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; \
	done

execute: venv
	$(PY) tools/execute.py

extract: venv
	$(PY) tools/extract.py

sync: venv
	$(PY) tools/sync.py

book: venv
	$(VENV)/bin/jupyter-book build . --path-output . -W -n --keep-going
	$(PY) tools/check_offline.py _build/html

clean:
	rm -rf _build .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

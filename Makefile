# Agentic RL from Scratch: build, test and maintain the book.
#   make test   unit tests, package/sync checks, and every English notebook run by nbval
#   make test-portable   the notebooks again under other CPU float roundings and another RL base
#   make artifacts   every slow artefact from an empty cache, exported as a bundle with a manifest
#   make book   the website: English in _build/html, Chinese in _build/html/zh (warnings are errors)
# Everything runs in .venv, created on first use from python3.

PYTHON3 ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Installed before the package, so that pip keeps this torch instead of resolving its own. The CI
# machines hold a CPU build of torch 2.13.0 that pip finds without any extra index (and reach no
# other index). On your own Linux machine, where PyPI's torch is the multi-GB CUDA build, get the
# CPU build from PyTorch's index: `make venv TORCH_INDEX=https://download.pytorch.org/whl/cpu`;
# any other torch: e.g. `make venv TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST := $(PY) -m pytest -p no:cacheprovider
NBVAL := $(PYTEST) --nbval-lax --nbval-current-env
EN_NOTEBOOKS = $(sort $(wildcard chapters/*/en.ipynb))
ZH_NOTEBOOKS = $(sort $(wildcard chapters/*/zh.ipynb))

# Deterministic hashing in the notebooks' kernels; the kernel's own inline backend must embed
# figures, so a backend chosen by the caller's shell (e.g. MPLBACKEND=Agg) is not passed on.
export PYTHONHASHSEED := 0
unexport MPLBACKEND

.PHONY: venv test test-all test-portable portable-notebooks artifacts execute extract sync book clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
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
# notebooks again, each pass with its own empty artefact cache (the RL base and every run rebuilt):
# PORTABLE_VARIANTS lists the passes as ATen kernels/recipe seed. avx2/0 keeps the book's RL base
# recipe under other kernels; default/1 uses the plain `default` kernels and rebuilds the RL base
# from recipe seed 1 (AGENTRL_RECIPE_SEED, chapter 5), a perturbation larger than any CPU's
# rounding: a claim that survives it is a claim about the method, not about one base.
# `make portable-notebooks NOTEBOOKS=chapters/07_rl_loop/en.ipynb PORTABLE_VARIANTS=default/1`
# runs one pass for some chapters.
PORTABLE_VARIANTS ?= avx2/0 default/1
NOTEBOOKS ?= $(EN_NOTEBOOKS)
test-portable: test portable-notebooks

portable-notebooks: venv
	@set -e; for variant in $(PORTABLE_VARIANTS); do \
	  cap=$${variant%/*}; seed=$${variant#*/}; rc=0; cache=$$(mktemp -d); \
	  echo "== nbval with ATEN_CPU_CAPABILITY=$$cap AGENTRL_RECIPE_SEED=$$seed (cache $$cache)"; \
	  ATEN_CPU_CAPABILITY=$$cap AGENTRL_RECIPE_SEED=$$seed AGENTRL_CACHE=$$cache \
	    $(NBVAL) $(NOTEBOOKS) || rc=$$?; \
	  rm -rf $$cache; \
	  if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; \
	done

# Every slow artefact of the book (RL base, runs, teachers, evaluations), built by executing every
# notebook (outputs not written) into an empty cache, then exported with its manifest (file name,
# i.e. cache key -> sha256) to $(ARTIFACTS)/bundle: what a release of the book is meant to publish
# and arl.load_artifacts(path_or_url) loads into a reader's cache.
ARTIFACTS ?= _build/artifacts
artifacts: venv
	rm -rf $(ARTIFACTS)/cache $(ARTIFACTS)/bundle
	mkdir -p $(ARTIFACTS)/cache
	AGENTRL_CACHE=$(abspath $(ARTIFACTS))/cache $(PY) tools/execute.py --no-write
	AGENTRL_CACHE=$(abspath $(ARTIFACTS))/cache $(PY) -c "import agentrl as arl; \
	  m = arl.export_artifacts('$(ARTIFACTS)/bundle'); print(len(m), 'files in $(ARTIFACTS)/bundle')"

execute: venv
	$(PY) tools/execute.py

extract: venv
	$(PY) tools/extract.py

sync: venv
	$(PY) tools/sync.py

# Two Sphinx builds of the same notebooks, one site each (tools/sphinx_lang_switch.py links each
# page to its translation): English (_config.yml, _toc.yml) into _build/html, the root of the
# published site; Chinese (_config_zh.yml, _toc_zh.yml) into _build/zh/_build/html, copied to
# _build/html/zh. .github/workflows/book.yml runs `make book` and publishes _build/html.
# The Chinese site has no MathJax of its own: it loads the English site's (mathjax_path in
# _config_zh.yml), so tools/check_offline.py checks it in place, in _build/html/zh.
JB_FLAGS := -W -n --keep-going
book: venv
	$(VENV)/bin/jupyter-book build . --path-output . $(JB_FLAGS)
	$(VENV)/bin/jupyter-book build . --config _config_zh.yml --toc _toc_zh.yml \
	  --path-output _build/zh $(JB_FLAGS)
	rm -rf _build/html/zh
	cp -R _build/zh/_build/html _build/html/zh
	$(PY) tools/check_offline.py _build/html/zh
	$(PY) tools/check_offline.py _build/html

clean:
	rm -rf _build build .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

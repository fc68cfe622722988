# The two commands of the README, and the ones that regenerate stored outputs.
# Each sets itself up on a fresh machine: a virtual environment with torch==$(TORCH), installed
# first, and then requirements.txt.
#
#   make env                                   only set up the environment, and say which torch it has
#   make site                                  build the static site into _build/html
#   make test                                  run the test suite (nbval over book/, and tests/)
#   make nbval                                 only the notebooks: pytest --nbval book
#   make outputs [NB=book/01_vmap_basics.md]   re-execute notebooks and store their outputs
#   make recipe-box                            regenerate book/08_recipe_box.md from the chapters' recipe cells
#   make shared                                copy book/_shared/*.py into the notebook cells tagged shared-<name>
#
# Another torch release, in its own environment (.venv-torch-<release>), by one variable:
#
#   make test TORCH=2.14.1                     the whole suite under torch 2.14.1
#   make nbval TORCH=newest                    the notebooks under the newest torch pip finds
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu   torch from another index (here: the CPU build)

# The one pin: the torch release the stored outputs were made with, and the one CI tests.
TORCH_DEFAULT := 2.13.0
TORCH         ?= $(TORCH_DEFAULT)
# Where torch alone comes from; empty means pip's own configuration (PyPI: a CUDA build on
# x86-64 Linux, a CPU build elsewhere).
TORCH_INDEX   ?=

PYTHON ?= python3
ifeq ($(TORCH),$(TORCH_DEFAULT))
VENV   ?= .venv
else
VENV   ?= .venv-torch-$(TORCH)
endif
PY     := $(VENV)/bin/python
READY  := $(VENV)/.installed-torch-$(TORCH)

# TORCH=newest asks pip for the newest release it can install here (re-checked on every run);
# anything else is an exact release.
ifeq ($(TORCH),newest)
TORCH_SPEC    := torch
TORCH_UPGRADE := --upgrade
READY_DEPS    := FORCE
else
TORCH_SPEC    := torch==$(TORCH)
TORCH_UPGRADE :=
READY_DEPS    :=
endif

.PHONY: env site test nbval outputs recipe-box shared clean FORCE

# torch first (so that TORCH_INDEX applies to it alone), then the rest with torch held to the
# same release, so that nothing in requirements.txt can move it; then BackPACK and curvlinops
# without their dependencies (requirements-nodeps.txt: BackPACK's torchvision would replace torch).
$(READY): requirements.txt requirements-nodeps.txt $(READY_DEPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_UPGRADE) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -r requirements.txt "torch==$$($(PY) -c 'import importlib.metadata as m; print(m.version("torch"))')"
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	rm -f $(VENV)/.installed-torch-* $(VENV)/.requirements-installed
	touch $(READY)

# Set up only, and say what is installed.
env: $(READY)
	@$(PY) -c 'import sys, torch; print(f"{sys.argv[1]}: torch {torch.__version__},", "CUDA build," if torch.version.cuda else "CPU build,", "GPU visible to torch:", "yes" if torch.cuda.is_available() else "no")' $(VENV)

site: $(READY)
	rm -rf _build/html
	$(VENV)/bin/jupyter-book build . -W --keep-going
	@echo "site: $(CURDIR)/_build/html/index.html"

test: env
	$(PY) -m pytest --nbval tests book

nbval: env
	$(PY) -m pytest --nbval book

# Stored outputs come from the pinned release only (they are what CI compares against).
outputs: $(READY)
	@test "$(TORCH)" = "$(TORCH_DEFAULT)" || { echo "make outputs: stored outputs are made with the pinned torch $(TORCH_DEFAULT), not TORCH=$(TORCH)"; exit 1; }
	$(PY) .ci/execute_notebooks.py $(NB)

recipe-box: $(READY)
	$(PY) .ci/build_recipe_box.py
	$(PY) .ci/execute_notebooks.py book/08_recipe_box.md

clean:
	rm -rf _build

FORCE:

shared: $(READY)
	$(PY) .ci/build_shared.py

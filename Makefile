# The two commands of the README, and the ones that regenerate stored outputs. Each sets itself up
# on a fresh machine, in a virtual environment: torch at the release of constraints.txt, then every
# other package at the exact release of requirements.lock (transitive dependencies included).
#
#   make site                                  build the static site into _build/html (site packages only: no torch)
#   make test                                  the test suite: the pre-commit hooks, then pytest --nbval tests book
#   make env                                   only set up the environment, and say which torch it has
#   make nbval                                 only the notebooks: pytest --nbval book
#   make cuda-tests                            the recipes on a CUDA GPU (tests/test_cuda.py; fails without one)
#   make lint                                  only the pre-commit hooks (jupytext --sync of every pair, ruff, mypy), on all files
#   make sync                                  bring every .md/.ipynb pair in sync (the hook, run until it passes)
#   make outputs [NB=book/01_vmap_basics.md]   re-execute notebooks and store their outputs
#   make shared                                copy book/_shared/*.py and package modules into the cells tagged shared-<name>,
#                                              and the package's definitions into the chapters' recipe cells
#   make lock                                  regenerate requirements.lock from requirements*.txt and constraints.txt
#   make colab-check [NB=book/03_...ipynb]     each notebook alone, as in Colab (.venv-colab: colab-packages.lock)
#   make colab-lock                            regenerate colab-packages.lock from colab-packages.txt
#
# Another torch release, in its own environment (.venv-torch-<release>), by one variable (the other
# packages stay at the lock's releases):
#
#   make test TORCH=2.14.1                     the whole suite under torch 2.14.1
#   make nbval TORCH=newest                    the notebooks under the newest torch pip finds (the
#                                              scheduled workflow newest-torch.yml; never CI on a push)
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu   torch from another index (here: the CPU build)

# The pinned torch, read from constraints.txt: the release the stored outputs were made with.
TORCH_PIN := $(shell sed -n 's/^torch==//p' constraints.txt)
TORCH     ?= $(TORCH_PIN)
# Where torch alone comes from; empty means pip's own configuration (PyPI: a CUDA build on
# x86-64 Linux, a CPU build elsewhere).
TORCH_INDEX ?=

PYTHON ?= python3
ifeq ($(TORCH),$(TORCH_PIN))
VENV   ?= .venv
else
VENV   ?= .venv-torch-$(TORCH)
endif
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip install --quiet
READY      := $(VENV)/.installed-torch-$(TORCH)
SITE_READY := $(VENV)/.installed-site
LOCK       := requirements.lock
# pip itself is held at the lock's release too.
PIP_PIN    := $(shell sed -n 's/^pip==//p' $(LOCK))

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

.PHONY: env site test nbval cuda-tests lint sync outputs shared lock clean FORCE

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "pip==$(PIP_PIN)"

# torch first, with what its build needs on this platform (so that TORCH_INDEX applies to it alone);
# then every other package at the lock's exact release, without dependency resolution (the lock
# is complete: BackPACK's torchvision, which would replace torch, is not in it); then a check that
# the environment holds exactly the lock. Last, this repository's package (src/torch_func_recipes,
# pyproject.toml), editable, without dependencies (torch is installed above) and built with the
# lock's setuptools (no build isolation, which would fetch the newest), so tests import the checkout.
$(READY): $(LOCK) constraints.txt pyproject.toml $(READY_DEPS) | $(VENV)/bin/python
	$(PIP) $(TORCH_UPGRADE) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PIP) --no-deps -r $(LOCK)
	$(PIP) --no-deps --no-build-isolation -e .
	$(PY) -m scripts.lock check
	rm -f $(VENV)/.installed-torch-* $(VENV)/.requirements-installed
	touch $(READY) $(SITE_READY)

# The site is built from the stored outputs alone: it needs requirements-site.txt, not torch, each
# package at the lock's release (the lock as constraints; the check refuses anything unlocked).
$(SITE_READY): requirements-site.txt $(LOCK) | $(VENV)/bin/python
	$(PIP) -r requirements-site.txt -c $(LOCK)
	$(PY) -m scripts.lock check --partial
	touch $(SITE_READY)

# The lock, made in a scratch environment: torch at constraints.txt's release, requirements.txt with
# constraints.txt's direct pins (pip resolves the rest), BackPACK and curvlinops without their
# dependencies (requirements-nodeps.txt), then a freeze of all of it.
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet --upgrade pip
	grep -v '^torch==' constraints.txt > $(LOCK_VENV)/constraints-but-torch.txt
	$(LOCK_VENV)/bin/python -m pip install --quiet "torch==$(TORCH_PIN)"
	$(LOCK_VENV)/bin/python -m pip install --quiet -r requirements.txt -c $(LOCK_VENV)/constraints-but-torch.txt \
		"torch==$$($(LOCK_VENV)/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))')"
	$(LOCK_VENV)/bin/python -m pip install --quiet --no-deps -r requirements-nodeps.txt -c $(LOCK_VENV)/constraints-but-torch.txt
	$(LOCK_VENV)/bin/python -m scripts.lock write
	rm -rf $(LOCK_VENV)

# Set up only, and say what is installed.
env: $(READY)
	@$(PY) -c 'import sys, torch; print(f"{sys.argv[1]}: torch {torch.__version__},", "CUDA build," if torch.version.cuda else "CPU build,", "GPU visible to torch:", "yes" if torch.cuda.is_available() else "no")' $(VENV)

site: $(SITE_READY)
	rm -rf _build/html
	$(VENV)/bin/jupyter-book build . -W --keep-going
	@echo "site: $(CURDIR)/_build/html/index.html"

# Both parts always run; the target fails if either does.
test: env
	@status=0; \
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/pre-commit run --all-files --show-diff-on-failure || status=1; \
	$(PY) -m pytest --nbval tests book || status=1; \
	exit $$status

nbval: env
	$(PY) -m pytest --nbval book

# The recipes on a CUDA device (tests/test_cuda.py), which the CUDA workflow runs. Elsewhere pytest skips that
# file; here its skip marks are off (-p no:skipping), so without a GPU it fails instead of passing by skipping.
cuda-tests: env
	$(PY) -m pytest -p no:skipping tests/test_cuda.py

# The hooks of .pre-commit-config.yaml run with this environment's tools (jupytext, ruff, mypy) on the PATH.
lint: $(READY)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/pre-commit run --all-files --show-diff-on-failure

# The hook rewrites what is out of sync and fails; a second run then passes.
sync: $(READY)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/pre-commit run jupytext-sync --all-files || \
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/pre-commit run jupytext-sync --all-files

# Stored outputs come from the pinned release only (they are what CI compares against).
outputs: $(READY)
	@test "$(TORCH)" = "$(TORCH_PIN)" || { echo "make outputs: stored outputs are made with the pinned torch $(TORCH_PIN) (constraints.txt), not TORCH=$(TORCH)"; exit 1; }
	$(PY) -m scripts.execute_notebooks $(NB)

shared: $(READY)
	$(PY) -m scripts.build_shared

clean:
	rm -rf _build

FORCE:

# --- colab-check -------------------------------------------------------------------------------
# Every notebook alone, as in Colab (scripts/colab_check.py): each copied alone into an empty
# folder and run top to bottom by a kernel of .venv-colab, which holds what Colab preinstalls and
# nothing else; the runner is $(PY). colab-packages.txt names those packages; colab-packages.lock
# (`make colab-lock`) pins them and their dependencies, torch's family aside, and is what is
# installed, with --no-deps, then checked. .venv-colab is rebuilt from scratch when either
# changes. COLAB_TORCH replaces the list's torch release (make colab-check COLAB_TORCH=2.13.0).
# Colab's torch is a CUDA build from PyPI, about 3 GB of wheels and 5 GB installed: --no-cache-dir
# keeps pip from holding a second copy of the wheels in its cache.
COLAB_VENV  := .venv-colab
COLAB_LOCK  := colab-packages.lock
COLAB_TORCH ?= $(shell sed -n 's/^torch==//p' colab-packages.txt)
COLAB_PY    := $(COLAB_VENV)/bin/python
COLAB_READY := $(COLAB_VENV)/.installed-torch-$(COLAB_TORCH)

.PHONY: colab-check colab-lock

$(COLAB_READY): colab-packages.txt $(COLAB_LOCK)
	rm -rf $(COLAB_VENV)
	$(PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_PY) -m pip install --quiet "pip==$(PIP_PIN)"
	$(COLAB_PY) -m pip install --quiet --no-cache-dir "torch==$(COLAB_TORCH)"
	$(COLAB_PY) -m pip install --quiet --no-deps -r $(COLAB_LOCK)
	$(COLAB_PY) -m scripts.lock check --lock $(COLAB_LOCK)
	touch $@

# The Colab lock, made like `make lock`: a scratch venv of colab-packages.txt, frozen.
colab-lock:
	rm -rf $(COLAB_VENV)-lock
	$(PYTHON) -m venv $(COLAB_VENV)-lock
	$(COLAB_VENV)-lock/bin/python -m pip install --quiet "pip==$(PIP_PIN)"
	$(COLAB_VENV)-lock/bin/python -m pip install --quiet -r colab-packages.txt
	$(COLAB_VENV)-lock/bin/python -m scripts.lock write --lock $(COLAB_LOCK)
	rm -rf $(COLAB_VENV)-lock

colab-check: $(READY) $(COLAB_READY)
	$(PY) -m scripts.colab_check --python $(COLAB_PY) $(NB)

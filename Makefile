# The two commands of the README, and the one that regenerates stored outputs.
# Each sets itself up on a fresh machine: a virtual environment in .venv with requirements.txt.
#
#   make site                                  build the static site into _build/html
#   make test                                  run the test suite (nbval over book/, and tests/)
#   make outputs [NB=book/01_vmap_basics.md]   re-execute notebooks and store their outputs
#   make recipe-box                            regenerate book/08_recipe_box.md from the chapters' recipe cells

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
READY  := $(VENV)/.requirements-installed

.PHONY: site test outputs recipe-box clean

$(READY): requirements.txt requirements-nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	touch $(READY)

site: $(READY)
	rm -rf _build/html
	$(VENV)/bin/jupyter-book build . -W --keep-going
	@echo "site: $(CURDIR)/_build/html/index.html"

test: $(READY)
	$(PY) -m pytest --nbval tests book

outputs: $(READY)
	$(PY) .ci/execute_notebooks.py $(NB)

recipe-box: $(READY)
	$(PY) .ci/build_recipe_box.py
	$(PY) .ci/execute_notebooks.py book/08_recipe_box.md

clean:
	rm -rf _build

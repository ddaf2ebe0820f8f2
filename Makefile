# mtcli: set up, test, and reproduce the README's numbers.
#   make             this help
#   make setup       create .venv with torch (TORCH_SPEC; from PyPI, Linux's default build is CUDA's)
#                    and mtcli[dev,ctranslate2,serve,hf]
#                    (EXTRAS=dev,ctranslate2,serve,hf,ja adds MeCab for the BLEU of Japanese; ko: Korean)
#   make setup-browser   Debian's chromium + chromium-driver for the browser test of `mtcli serve`
#                    (root; without them that one test skips)
#   make test        the default test suite (what CI runs), one worker a core up to 4 (pytest-xdist);
#                    PYTEST_ARGS='-m ""' adds the slow tests, PYTEST_ARGS='-n 0' runs in one process
#   make lint        ruff over the package, the tests and the benchmarks (CI runs it too)
#   make reproduce   prepare -> train -> average -> evaluate both Multi30k recipes for each seed,
#                    then the table (make reproduce-de-en / reproduce-en-de for one direction)
#   make reproduce-wmt-news   the same for the WMT news smoke benchmark (configs/wmt_news_en_de.yaml)
#   make reproduce-wmt-news-adapt   the Multi30k en-de model (seed 1 of make reproduce-en-de)
#                    adapted to WMT news (configs/wmt_news_en_de_adapt.yaml), beside the parent
#   make reproduce-multilingual   one model for en<->{de,fr,cs} (configs/multi30k_multi.yaml), each
#                    seed of SEEDS, each direction beside its bilingual row (results/multilingual.md)
#   make reproduce-en-fr (fr-en, en-cs, cs-en; reproduce-pairs: all four)   the bilingual rows of
#                    Multi30k's other directions: the en-de recipe with the languages changed
#   make reproduce-bt   back-translation on Multi30k: half the pairs + their other half's German
#                    back-translated by beam and by sampling (results/bt.md; BT_SEED, default 1)
#   make clean       remove caches and build leftovers (never data/ or results/)
# VENV=DIR: the virtual environment make setup creates (.venv); BIN=DIR: the bin directory of the
# Python the other targets run (VENV's; e.g. BIN=~/env/bin for one installed without make).
# SEEDS: the seeds make reproduce trains and scores for each Multi30k direction (the README's rows
# are their means). REPRODUCE_ARGS passes more options to `mtcli reproduce` (see its
# --help), e.g. REPRODUCE_ARGS='--set train.device=cuda'; reproduce-multilingual and reproduce-bt
# pass them to mtcli reproduce-multilingual and mtcli reproduce-bt, which take --set but not every
# option of mtcli reproduce (their --help says which).

PYTHON ?= python3
VENV ?= .venv
BIN ?= $(VENV)/bin
# torch==2.13.0: on the project's build machines a local CPU wheel; from PyPI elsewhere, which on Linux
# is a CUDA build (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu TORCH_SPEC=torch==2.13.0+cpu: CPU).
TORCH_SPEC ?= torch==2.13.0
# DATA=DIR: a local directory of Multi30k's <split>.<lang> files instead of the recipes' own source,
# for every Multi30k target (reproduce, the pairs, reproduce-multilingual, reproduce-bt; multi30k: a
# local copy in ../shared/data, else downloaded once into data/raw/ or $$MTCLI_DATA)
DATA ?=
PYTEST_ARGS ?=
# the package's extras make setup installs (pyproject.toml; ja and ko: MeCab for BLEU of Japanese, Korean)
EXTRAS ?= dev,ctranslate2,serve,hf
SEEDS ?= 1,2,3
# Multi30k's directions beyond de<->en, each trained as a bilingual model by reproduce-<pair>
PAIRS = en-fr fr-en en-cs cs-en
BT_SEED ?= 1
REPRODUCE_ARGS ?=

.PHONY: help setup setup-browser test lint reproduce reproduce-de-en reproduce-en-de reproduce-wmt-news \
	reproduce-wmt-news-adapt reproduce-multilingual reproduce-bt clean reproduce-pairs $(PAIRS:%=reproduce-%)

help:
	@sed -n '2,/^$$/p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'

# the Python every other target runs: said, where make setup has not made it (or BIN names none)
$(BIN)/python:
	@echo "make: $(BIN)/python not found: run make setup, or give the bin directory of the Python mtcli is installed in: make BIN=DIR ..." >&2; exit 1

setup:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"

setup-browser:  # (the package lists are fetched when a fresh machine has none to install from)
	apt-get install -y -q chromium chromium-driver || { apt-get update -q && apt-get install -y -q chromium chromium-driver; }

# the suite starts hundreds of Python processes: each module is compiled once for all of them,
# even where the environment asks Python to write no bytecode
test: $(BIN)/python
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n auto --maxprocesses 4 $(PYTEST_ARGS)

lint: $(BIN)/python
	$(BIN)/ruff check mtcli tests bench

reproduce: reproduce-de-en reproduce-en-de

reproduce-de-en reproduce-en-de: reproduce-%: $(BIN)/python
	$(BIN)/python -m mtcli reproduce $(subst -,_,$*) $(if $(DATA),--data "$(DATA)",) --seeds "$(SEEDS)" $(REPRODUCE_ARGS)

reproduce-pairs: $(PAIRS:%=reproduce-%)

$(PAIRS:%=reproduce-%): reproduce-%: $(BIN)/python
	$(BIN)/python -m mtcli reproduce $(subst -,_,$*) $(if $(DATA),--data "$(DATA)",) --seeds "$(SEEDS)" $(REPRODUCE_ARGS)

# reads the recipe's own source (wmt-news-en-de, downloaded once); DATA and SEEDS are Multi30k's
reproduce-wmt-news: $(BIN)/python
	$(if $(DATA),$(error DATA is Multi30k's directory: give the WMT news files with REPRODUCE_ARGS='--data DIR'),)
	$(BIN)/python -m mtcli reproduce wmt_news_en_de $(REPRODUCE_ARGS)

# starts from data/runs/multi30k_en_de-seed1 (make reproduce-en-de trains it)
reproduce-wmt-news-adapt: $(BIN)/python
	$(if $(DATA),$(error DATA is Multi30k's directory: give the WMT news files with REPRODUCE_ARGS='--data DIR'),)
	$(BIN)/python -m mtcli reproduce wmt_news_en_de_adapt $(REPRODUCE_ARGS)

# --set options in REPRODUCE_ARGS apply here too, e.g. REPRODUCE_ARGS='--set train.device=cuda'
reproduce-multilingual: $(BIN)/python
	$(BIN)/python -m mtcli reproduce-multilingual $(if $(DATA),--data "$(DATA)",) --seeds "$(SEEDS)" $(REPRODUCE_ARGS)

# reuses the en-de row of results/multi30k.json with seed BT_SEED as "all pairs real" when it is there
# and was trained by the same recipe
reproduce-bt: $(BIN)/python
	$(BIN)/python -m mtcli reproduce-bt --seed $(BT_SEED) $(if $(DATA),--set "data.source=$(DATA)",) $(REPRODUCE_ARGS)

clean:
	rm -rf .pytest_cache .ruff_cache .import_linter_cache .hypothesis build dist *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

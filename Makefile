# mtcli: set up, test, and reproduce the README's numbers.
#   make setup      create .venv with a CPU build of torch and mtcli[dev]
#   make test       run the default test suite (what CI runs)
#   make reproduce  prepare -> train -> average -> evaluate the Multi30k recipes (both directions)
#   make reproduce-wmt-news  the same for the WMT news smoke benchmark (configs/wmt_news_en_de.yaml)

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On these machines torch==2.13.0 is a local CPU wheel; elsewhere set TORCH_SPEC=torch (or a CUDA build).
TORCH_SPEC ?= torch==2.13.0
DATA ?= $(if $(wildcard ../shared/data/multi30k),../shared/data/multi30k,)
MTCLI := $(BIN)/mtcli

.PHONY: setup test test-all lint bench reproduce reproduce-de-en reproduce-en-de reproduce-wmt-news clean

setup:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev,ctranslate2]"

test:
	$(BIN)/python -m pytest -q

test-all:
	$(BIN)/python -m pytest -q -m ""

lint:
	$(BIN)/ruff check mtcli tests bench

bench:
	$(BIN)/python bench/run_all.py

reproduce: reproduce-de-en reproduce-en-de

reproduce-de-en reproduce-en-de: reproduce-%:
	$(BIN)/python -m mtcli.reproduce $(subst -,_,$*) $(if $(DATA),--data $(DATA),)

# reads the recipe's own source (../shared/data/wmt-news-en-de); DATA is Multi30k's
reproduce-wmt-news:
	$(BIN)/python -m mtcli.reproduce wmt_news_en_de

clean:
	rm -rf .pytest_cache .ruff_cache build dist *.egg-info

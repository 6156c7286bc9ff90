# Quickstart: `make demo` trains tuned random and RHO-LOSS on 16-token windows side by side on the default corpus
# (about 4 minutes on 2 free cores) and prints and plots the gain; `make test` runs the suite.
# Both create .venv if missing and install the package (torch pinned to the CPU wheel build).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DATA := data/default
RUN := runs/demo

.PHONY: demo test lint data data-packages data-debian clean docs

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,embed]'
	touch $(STAMP)

data: $(STAMP)
	$(BIN)/selection-callbacks corpus --out $(DATA)

data-packages: $(STAMP)
	$(BIN)/selection-callbacks packages --out data/packages

# the large pool: Debian packages installed with apt (as root; a few GB), then read from dpkg's database
data-debian: $(STAMP)
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$(grep -v '^#' configs/corpus/debian-packages.txt)
	$(BIN)/selection-callbacks debian --out data/debian

demo: data
	$(BIN)/python -m bench.harness.demo --data $(DATA) --out $(RUN)

test: $(STAMP)
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/python -m ruff check .

docs: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict -d build/site

clean:
	rm -rf $(RUN) lightning_logs .pytest_cache

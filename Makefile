# Every install step lives here so that a fresh clone works: `make demo`, `make test`, `make bench`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench lint docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: anything unpinned would pull the multi-GB CUDA build
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	# litgpt without its dependencies: its huggingface-hub pin conflicts with transformers 5 (constraints.txt)
	$(BIN)/pip install -q -c constraints.txt psutil
	$(BIN)/pip install -q -c constraints.txt --no-deps litgpt
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/train_gpt.py

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# ruff, and the import contract: DESIGN's layer order and Lightning's private names only in lightning_internals.py
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests/test_layers.py

# the documentation site into site/, warnings as errors (mkdocs.yml: strict)
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs lightning_logs .pytest_cache site

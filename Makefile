# minillm: the two commands of the README, and the setup they share.
#   make tour   sets up .venv (the package and the `hf` extra) and runs every chapter's check and benchmark
#   make test   sets up .venv, adds the test tools (the `dev` extra) and runs the whole test suite, notebooks included
#   make lab    also installs JupyterLab into .venv (the `lab` extra) and opens the notebooks
# All are idempotent: setup runs again only when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.minillm-installed
DEV_STAMP := $(VENV)/.minillm-dev-installed
# Extra pip arguments for torch, e.g. TORCH_SPEC='torch==2.5.1' or a CUDA index URL; default: what pip picks.
TORCH_SPEC ?= torch

.PHONY: setup tour test lab gpt2-ranks gpu-report clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# torch first: take a wheel this machine already holds (pip's find-links) when one fits, so a CPU-only box
	@# does not download a multi-GB CUDA build; otherwise let pip choose from the package index.
	@$(BIN)/python -c "import torch" 2>/dev/null \
	  || $(BIN)/python -m pip install -q --no-index --no-deps $(TORCH_SPEC) 2>/dev/null \
	  || $(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[hf]'
	@touch $(STAMP)

# The test tools on top, for `make test` only: the tour does not need them (about 20 s less setup in a fresh clone).
$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(DEV_STAMP)

tour: setup gpt2-ranks
	$(BIN)/minillm tour

# The real GPT-2 ranks for chapter 01's parity test: from tiktoken's cache, or the asset in openai-whisper's
# source distribution on PyPI (downloaded, not installed). Failing here only makes that one test skip.
gpt2-ranks: setup
	@$(BIN)/minillm tokenizer fetch-gpt2 || echo "note: GPT-2 ranks unavailable; the GPT-2 parity test will be skipped"

test: $(DEV_STAMP) gpt2-ranks
	@# --maxschedchunk 1: hand out tests one or two at a time, slow ones first (tests/conftest.py)
	$(BIN)/python -m pytest -n auto --maxschedchunk 1

# The notebooks in JupyterLab, from the same .venv (kernel "Python 3" is this venv's python). The `lab` extra is
# installed on first use only, so `make test` and CI never pull JupyterLab.
LAB_STAMP := $(VENV)/.minillm-lab-installed

$(LAB_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,lab]'
	@touch $(LAB_STAMP)

lab: setup $(LAB_STAMP)
	@# Served from the repository root (chapters/ and README.md beside the notebooks), opened on the first one.
	$(BIN)/jupyter lab --LabApp.default_url=/lab/tree/notebooks/01-tokenization.ipynb

gpu-report: $(DEV_STAMP)
	$(BIN)/minillm gpu-report

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info

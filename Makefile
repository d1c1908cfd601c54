# Two commands do all set-up on a fresh machine:
#   make demo   -- build the venv, make a tiny local model, run GRPO on the toy task
#   make test   -- build the venv, run the test suite (what CI runs)
#   make test-fast -- the fast tier: unit and single-process tests, about a minute
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fitrl-installed

.PHONY: demo test test-fast bench install clean

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first and exactly: its CPU wheel is found locally; nothing later may replace it.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c requirements/constraints.txt -e '.[dev]'
	$(BIN)/python -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/fitrl demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python bench/step_time.py

clean:
	rm -rf $(VENV) runs .cache

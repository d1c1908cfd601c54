# Two commands do all set-up on a fresh machine:
#   make demo   -- build the venv, make a tiny local model, run GRPO on the toy task
#   make demo-vl -- the same with a tiny vision-language model on pictures of shapes (CPU, minutes)
#   make test   -- build the venv, run the test suite (what CI runs)
#   make test-fast -- the fast tier: unit and single-process tests, one to two minutes
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fitrl-installed

.PHONY: demo demo-vl test test-fast bench install browser clean

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first and exactly: its CPU wheel is found locally; nothing later may replace it.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c requirements/constraints.txt -e '.[dev]'
	$(BIN)/python -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
	touch $(STAMP)

install: $(STAMP)

# tests/test_report.py opens the report page in a real browser: Debian's chromium (~115 MB download,
# ~15 s), installed here when it is missing and apt-get can be used (root); otherwise those checks skip.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (apt-get) for the report page's browser test"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	        chromium fonts-dejavu-core >/dev/null; } \
	      || echo "note: apt-get could not install chromium: tests/test_report.py's browser checks will skip"; \
	  else \
	    echo "note: no chromium and no root apt-get here: tests/test_report.py's browser checks will skip"; \
	  fi; }

demo: $(STAMP)
	$(BIN)/fitrl demo

demo-vl: $(STAMP)
	$(BIN)/fitrl demo --vl

test: $(STAMP) browser
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python bench/step_time.py

clean:
	rm -rf $(VENV) runs .cache .artifacts

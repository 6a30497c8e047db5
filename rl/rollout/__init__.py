"""Rollout engines: the transformers engine (`engine.py`) and vLLM (`vllm_engine.py` in the trainer,
`vllm_worker.py` in vLLM's worker process, `vllm_checks.py` at start-up)."""

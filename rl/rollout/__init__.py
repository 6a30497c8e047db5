"""Rollout engines: the transformers engine (`engine.py`) and vLLM (`vllm_engine.py`)."""

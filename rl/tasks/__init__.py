"""Tasks: prompts and answers (`task.py`), reward shaping (`reward.py`), held-out evaluation (`evaluate.py`)."""

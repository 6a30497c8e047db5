"""Tasks by kind (the `Task` base in `base.py`, built by name in `registry.py`), reward shaping (`reward.py`), held-out evaluation (`evaluate.py`)."""

"""The step and what keeps a run going: checkpoints, divergence guard, metrics, export."""

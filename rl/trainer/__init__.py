"""The step and what keeps a run going: checkpoints, divergence guard, metrics, LR schedule, export."""

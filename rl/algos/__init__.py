"""Algorithms: advantage estimators and policy losses, each a registry (`python -m rl.registry`), and the LR schedule."""

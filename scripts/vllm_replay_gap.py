"""The rollout/training log-prob gap of MoE routing replay from vLLM, on vs off.

    python scripts/vllm_replay_gap.py [overrides...]     (needs `make install-vllm`)

A tiny Qwen3-MoE (head_dim 32, the CPU attention's smallest) trains 3 steps with
`rollout.engine=vllm` and routing replay, in bf16 compute by default (`model.param_dtype=bfloat16`:
vLLM's kernels and the training forward round differently, so some near-tie routes differ).
Then vLLM samples 16 prompts x 16 tokens and the training forward scores them twice: replaying
the records' routes (on) and routing live (off). Prints one JSON line: token-layer routes that
differ between vLLM and the live training forward, and |dlogp| mean / max on and off.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from the repository root
    sys.path.insert(0, str(ROOT))

from model.moe import record_routing
from packing import make_experience_batch
from testing.inprocess import SMALL, trainer


def score(tr, rec, replay: bool):
    """Action-slot log-probs of `rec` and the routes `[L, K, T]` (top-k sorted) the forward used."""
    batch = make_experience_batch([rec], packed=False)
    if not replay:
        batch.routed_experts = None
    with torch.no_grad(), record_routing(tr.actor.model) as seen:
        lp = tr.actor(batch)[0][rec.action_mask]
    return lp, seen.routed_experts[0].sort(1).values


def main(overrides: list[str]) -> dict:
    tr = trainer("model=moe_tiny", "+model.overrides.head_dim=32", "trainer.device=cpu", "rollout.engine=vllm",
                 "task.max_new_tokens=16", "model.param_dtype=bfloat16", *SMALL, *overrides)
    try:
        steps = [tr.step(s) for s in range(3)]
        tr.actor.eval()
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 60, (12,), generator=gen) for _ in range(16)]
        recs = tr.engine.generate(prompts, prompt_indices=list(range(16)), max_new_tokens=16, temperature=1.0,
                                  seed=3)
        on, off, differ, pairs = [], [], 0, 0
        for rec in recs:
            T = rec.sequences.numel()
            rollout = rec.rollout_log_probs[rec.action_mask]
            lp_on, _ = score(tr, rec, True)
            lp_off, live = score(tr, rec, False)
            engine = rec.routed_experts.sort(1).values
            differ += int((live[..., :T - 1] != engine[..., :T - 1]).any(1).sum())
            pairs += live.shape[0] * (T - 1)
            on.append((lp_on - rollout).abs())
            off.append((lp_off - rollout).abs())
        on, off = torch.cat(on), torch.cat(off)
        return {"routes_differing": differ, "token_layers": pairs, "tokens": int(on.numel()),
                "replay_on_mean": float(on.mean()), "replay_on_max": float(on.max()),
                "replay_off_mean": float(off.mean()), "replay_off_max": float(off.max()),
                "train_rollout_logprob_abs_diff_max": [m["rollout_logprob_abs_diff_max"] for m in steps]}
    finally:
        tr.engine.close()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))

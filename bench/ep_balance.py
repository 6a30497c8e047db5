"""Where do the tokens of an EP group go? Tokens per expert and per EP rank, with and
without the EP-equalizing suffix, and under routing replay (R3).

One process stands for an EP group of `EP` data-parallel ranks: each rank's pack (a
GRPO-like lognormal mix, different totals) is run through a tiny Qwen3-MoE (16 experts,
top-2, `model.moe` blocks with `ep_group=None`); `expert_load` sums the dispatched
token-slots over the packs, which is what the group dispatches; EP rank r owns experts
[r*E/EP, (r+1)*E/EP), so its load is those experts' sum. Cases:

    live           the packs as they are (no suffix)
    suffix         each pack + its EP suffix (max tokens - own tokens, positions continuing
                   the last sequence), masked out of the experts as the actor does: the
                   counts must equal `live`'s
    suffix_unmasked  control: the same suffix dispatched like real rows; identical synthetic
                   rows pick the same experts and pile up on one rank (prime-rl #3350)
    replay         routing recorded by a rollout model whose routers drifted, replayed in
                   the trained model: the load follows the record, not the live router

`imbalance` is max/mean tokens per EP rank (1.0 = even); `expert_imbalance` per expert.

    python bench/ep_balance.py [--quick]
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, lengths, quick_flag, records, setup  # noqa: E402

import torch  # noqa: E402

EP, EXPERTS, TOP_K = 4, 16, 2


def build():
    from model.models import build_model
    from model.moe import shard_experts

    lm = build_model("qwen3_moe", seed=0, num_experts=EXPERTS, num_experts_per_tok=TOP_K, vocab_size=1024)
    return shard_experts(lm, None)


def packs(quick: bool) -> list:
    from packing.collate import make_experience_batch

    n = 8 if quick else 16
    return [make_experience_batch(records(lengths("lognormal", n, seed=10 + r, max_len=512), vocab=1024, seed=r),
                                  packed=True) for r in range(EP)]


def forward(model, pack, *, suffix: int = 0, mask_suffix: bool = True, routed=None):
    """One no-grad forward of `pack` + `suffix` synthetic tokens, as the actor feeds an EP rank."""
    from model.attention import packed_attn_kwargs
    from model.moe import moe_token_weights, routing_replay

    ids, pos = pack.sequences, pack.position_ids
    n = ids.shape[1]
    if suffix:
        ids = torch.cat([ids, ids.new_zeros(1, suffix)], 1)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, suffix + 1)], 1)
    synthetic = (torch.arange(n + suffix) >= n).unsqueeze(0)
    if routed is not None and suffix:
        routed = torch.nn.functional.pad(routed, (0, suffix), value=-1)
    with torch.no_grad(), moe_token_weights(model, (~synthetic).long() if mask_suffix else None), routing_replay(model, routed):
        model.model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False,
                    **packed_attn_kwargs(pack.packed_seq_lens, trailing_pad=suffix))


def load_of(model, run) -> dict:
    from model.moe import expert_load, reset_expert_load

    reset_expert_load(model)
    run()
    per_expert = expert_load(model)["per_expert"]
    per_rank = per_expert.view(EP, -1).sum(1)
    reset_expert_load(model)
    return {"per_expert": per_expert.tolist(), "per_rank": per_rank.tolist(),
            "imbalance": float(per_rank.max()) / float(per_rank.double().mean()),
            "expert_imbalance": float(per_expert.max()) / float(per_expert.double().mean())}


def main() -> dict:
    args = quick_flag(__doc__.splitlines()[0]).parse_args()
    setup(args)
    from model.moe import moe_blocks, record_routing

    model = build()
    rollout = copy.deepcopy(model)  # the rollout policy: its routers drifted from the trained ones
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for block in moe_blocks(rollout):
            block.gate.weight.add_(0.05 * torch.randn(block.gate.weight.shape, generator=gen))
    ranks = packs(args.quick)
    tokens = [p.sequences.shape[1] for p in ranks]
    suffixes = [max(tokens) - t for t in tokens]
    recorded = []
    for p in ranks:
        with torch.no_grad(), record_routing(rollout) as rec:
            forward(rollout, p)
        recorded.append(rec.routed_experts)

    cases = {
        "live": lambda: [forward(model, p) for p in ranks],
        "suffix": lambda: [forward(model, p, suffix=s) for p, s in zip(ranks, suffixes)],
        "suffix_unmasked": lambda: [forward(model, p, suffix=s, mask_suffix=False) for p, s in zip(ranks, suffixes)],
        "replay": lambda: [forward(model, p, suffix=s, routed=r) for p, s, r in zip(ranks, suffixes, recorded)],
    }
    loads = {name: load_of(model, run) for name, run in cases.items()}
    rollout_load = load_of(rollout, lambda: [forward(rollout, p) for p in ranks])
    replay_follows_record = loads["replay"]["per_expert"] == rollout_load["per_expert"]
    print(f"EP group of {EP} ranks, {EXPERTS} experts top-{TOP_K}; tokens per DP rank {tokens}, "
          f"suffixes {suffixes}")
    for name, ld in loads.items():
        print(f"{name:>16}: tokens per EP rank {ld['per_rank']} (max/mean {ld['imbalance']:.3f}), "
              f"per expert max/mean {ld['expert_imbalance']:.3f}")
    print(f"replayed load == the rollout's recorded load: {replay_follows_record}")
    return emit("ep_balance", {
        "imbalance": round(loads["live"]["imbalance"], 4),
        "suffix_imbalance": round(loads["suffix"]["imbalance"], 4),
        "suffix_unmasked_imbalance": round(loads["suffix_unmasked"]["imbalance"], 4),
        "replay_imbalance": round(loads["replay"]["imbalance"], 4),
        "suffix_changes_load": loads["suffix"]["per_expert"] != loads["live"]["per_expert"],
        "replay_follows_record": replay_follows_record,
        "suffix_tokens": sum(suffixes), "quick": args.quick,
    }, {"tokens_per_rank": tokens, "suffixes": suffixes, "loads": loads, "rollout_load": rollout_load})


if __name__ == "__main__":
    main()

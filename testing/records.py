"""`make_records`: seeded per-sample records (the replay contract, no batch axis) sized for
the tiny models of model/models.py; `grpo_records`: records of prompt groups sharing their prompt
tokens, as the rollout writes them. Shared by tests/, bench/, scripts/ and the parity programs."""

from __future__ import annotations

import random

import torch

from packing.experience import Experience


def make_records(lengths, *, vocab: int | None = None, seed=0, prompt_len=None, routed=None) -> list[Experience]:
    """Seeded per-sample records of the given lengths.

    `sequences [T]` random ids in [0, vocab) (default: the tiny models' vocabulary);
    `action_mask [T-1]` True on response slots (slot k scores token k+1: the response
    starts at token `prompt_len`, default a random split leaving >= 1 response token);
    random `action_log_probs` (<= 0) and `advantages`.
    `routed=(layers, topk, num_experts)` adds random `routed_experts [L, K, T]`.
    """
    if vocab is None:
        from model.models import TINY  # imports transformers: only when the default is asked for

        vocab = TINY["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    records = []
    for n in lengths:
        if n < 2:
            raise ValueError(f"make_records: length {n}, expected >= 2 (a prompt token and a response token)")
        p = prompt_len if prompt_len is not None else int(torch.randint(1, n, (1,), generator=gen))
        p = min(max(p, 1), n - 1)
        rec = Experience(
            sequences=torch.randint(0, vocab, (n,), generator=gen),
            action_mask=torch.arange(n - 1) >= p - 1,
            action_log_probs=-torch.rand(n - 1, generator=gen),
            advantages=torch.randn(n - 1, generator=gen),
        )
        if routed is not None:
            layers, topk, experts = routed
            # distinct experts per token: the first `topk` of a random permutation
            order = torch.rand(layers, n, experts, generator=gen).argsort(-1)
            rec.routed_experts = order[..., :topk].permute(0, 2, 1).contiguous()
        records.append(rec)
    return records


# (prompt length, response lengths) per GRPO group, plus a sample alone
GROUPS = [(7, [3, 5, 1, 9]), (12, [4, 4, 2, 6]), (5, [8, 2, 3, 3]), (9, [6])]


def grpo_records(groups=GROUPS, *, seed: int = 0, vocab: int = 256, hole: bool = True) -> list[Experience]:
    """Records as the rollout writes them (rl/rollout/engine.py `make_record`): a group's
    samples share the prompt tokens, `action_mask` is True from slot P-1; shuffled, so a
    pack interleaves the groups. With `hole`, group 0's 9-token response has a masked hole (a
    tool turn): it is still a response (after the first action slot), its prompt unchanged."""
    gen = torch.Generator().manual_seed(seed)
    records = []
    for index, (p, responses) in enumerate(groups):
        prompt = torch.randint(0, vocab, (p,), generator=gen)
        for r in responses:
            t = p + r
            mask = torch.arange(t - 1) >= p - 1
            records.append(Experience(sequences=torch.cat([prompt, torch.randint(0, vocab, (r,), generator=gen)]),
                                      action_mask=mask, advantages=torch.randn(t - 1, generator=gen),
                                      prompt_index=torch.tensor(index)))
    if hole:
        records[3].action_mask[-4:-1] = False
        assert records[3].action_mask.sum() == 9 - 3 and records[3].action_mask[6]
    random.Random(seed).shuffle(records)
    return records

"""One generation chunk of the transformers engine (rl/rollout/engine.py `_generate_chunk`): its
prompts left-padded, its decode state, and what its decode loop produced, laid back on its rows.
"""

from __future__ import annotations

import torch


def left_pad(prompts: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids [B, length]` and `mask [B, length]` of prompts left-padded with id 0."""
    ids = torch.zeros(len(prompts), length, dtype=torch.int64)
    mask = torch.zeros(len(prompts), length, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, length - p.numel():] = p
        mask[i, length - p.numel():] = 1
    return ids, mask


class Decoded:
    """What a chunk's decode loop produced, for a batch that shrinks as rows stop: per segment
    (a run of steps over the same rows) the rows `[b]` and their tokens and log-probs `[b]`
    per step, and (MoE) the routing its forwards recorded `[b, L, K, t]`. `result()` lays them
    on the chunk's rows: tokens `[B, S]` (`fill` where a row had left), log-probs `[B, S]`,
    routing `[B, L, K, P + S']` (-1 where a row had left) or None, all on the host."""

    def __init__(self, rows: int, fill: int, device: torch.device) -> None:
        self.rows, self.fill, self.device = rows, fill, device
        self.segments: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = []  # rows, first step, tokens, lp
        self.routing: list[tuple[torch.Tensor, torch.Tensor]] = []  # rows, routed experts of the segment's forwards
        self.tokens: list[torch.Tensor] = []  # the open segment's [b] per step
        self.log_probs: list[torch.Tensor] = []
        self.steps = 0  # steps of the closed segments

    def add(self, tokens: torch.Tensor, log_probs: torch.Tensor) -> None:
        self.tokens.append(tokens)
        self.log_probs.append(log_probs)

    def close_segment(self, rows: torch.Tensor, rec) -> None:
        """The open segment ran over `rows` (the chunk's row of each batch row); `rec`: the
        loop's RoutingRecord (None: dense), emptied into the segment."""
        if self.tokens:
            self.segments.append((rows, self.steps, torch.stack(self.tokens, 1), torch.stack(self.log_probs, 1)))
            self.steps += len(self.tokens)
            self.tokens, self.log_probs = [], []
        if rec is not None and rec.per_layer[0]:
            self.routing.append((rows, rec.routed_experts))
            for steps in rec.per_layer:
                steps.clear()  # in place: the MoE blocks append to these very lists

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        tokens = torch.full((self.rows, self.steps), self.fill, dtype=torch.int64, device=self.device)
        log_probs = torch.zeros(self.rows, self.steps, dtype=torch.float32, device=self.device)
        for rows, start, tok, lp in self.segments:
            tokens[rows, start:start + tok.shape[1]] = tok
            log_probs[rows, start:start + lp.shape[1]] = lp
        routing = None
        if self.routing:
            first = self.routing[0][1]
            routing = first.new_full((self.rows, *first.shape[1:3], sum(r.shape[-1] for _, r in self.routing)), -1)
            t = 0
            for rows, r in self.routing:
                routing[rows.to(r.device), :, :, t:t + r.shape[-1]] = r
                t += r.shape[-1]
            routing = routing.cpu()
        return tokens.cpu(), log_probs.cpu(), routing


class Chunk:
    """One chunk's decode state (`HFRolloutEngine._generate_chunk`): `B` rows, of which `live` /
    `rows` are still in the batch. Per chunk row: `n_new` the response length, `done`, `bad_at`
    the first step with non-finite logits; per batch row: `logits`, `mask`, `position`, `seeds`."""

    def responses(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per chunk row: (response [R], log_probs [R], routed_experts [L, K, P + R] or None)."""
        tokens_bt, log_probs_bt, routing_all = self.decoded.result()  # [B, S], [B, S], [B, L, K, P + S'] or None
        out = []
        for i, n in enumerate(self.n_new.tolist()):
            p = self.lens[i]
            r = routing_all[i, :, :, self.P - p : self.P + n].clone() if routing_all is not None else None
            out.append((tokens_bt[i, :n].clone(), log_probs_bt[i, :n].clone(), r))
        return out

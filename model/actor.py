"""Actor and critic forward over a padded `[B, T]` batch or a THD pack `[1, N]`.

Outputs (`action_log_probs`, `entropy`, `values`) are aligned element-wise with
`experience.action_mask`: `[B, T-1]` for a padded batch, `[1, N]` for a pack. Slot k scores
token k+1 of the same sequence; a slot with no such token (the trailing slot of each packed
sequence, a slot whose next token is right padding) is exactly 0 with no gradient.

The forward of one batch, in order:

    _check_batch(model, experience)         # clear errors for bad input
    _model_inputs(experience, pad=...)      # the kwargs the decoder sees          <- CP / EP seam
    model.model(**inputs).last_hidden_state
    _trim(hidden, pad)                      # drop the EP suffix                   <- EP seam
    _slots(hidden, experience)              # hidden, target and validity per action slot

Expert parallelism passes `pad` = `ep_suffix_length(N, ep_group)` (model/moe.py): `_model_inputs`
appends `pad` synthetic tokens whose positions continue the last sequence and folds them
into its `cu_seqlens` (`packed_attn_kwargs(..., trailing_pad=pad)`); `_suffix_mask` marks
them for `model.moe.moe_padding_mask`; `_trim` cuts them off. Context parallelism replaces
`_model_inputs` for a pack with its shard (input_ids, global position_ids, CP-attention
kwargs) and gathers the per-token outputs back onto the `[1, N]` axis after `_slots`.
"""

from __future__ import annotations

import torch
from torch import nn

from model.attention import packed_attn_kwargs
from model.context_parallel import _restore_full_sequence, cp_model_inputs
from model.logprobs import token_log_probs
from model.moe import ep_suffix_length, moe_blocks, moe_padding_mask, routing_replay
from packing.cp import local_slots, shard
from packing.experience import Experience

SUFFIX_TOKEN_ID = 0  # any valid id: suffix rows are causal-last, excluded from experts and losses


# ------------------------------------------------------------------- backbone
def _forward_backbone(
    model: nn.Module, experience: Experience, *, ep_group=None, replay: bool = True, pad: int | None = None, **extra
) -> torch.Tensor:
    """The decoder's last hidden states: `[B, T, H]` (padded) or `[1, N, H]` (pack).

    With expert parallelism every EP rank must present the same token count: the
    difference to the group's maximum is a synthetic suffix appended to the pack (its
    length is a collective, so it is decided here, not at collate time), kept out of
    expert compute and trimmed from the output. Padded rows of a `[B, T]` batch are kept
    out of expert compute the same way. With `replay`, the record's `routed_experts`
    (R3) route the MoE layers; `-1` keeps live routing. `pad` overrides the suffix length.
    """
    _check_batch(model, experience)
    if pad is None:
        pad = ep_suffix_length(experience.sequences.shape[1], ep_group) if experience.is_packed else 0
    if pad < 0:
        raise ValueError(f"pad={pad}: the EP suffix length must be >= 0")
    inputs = _model_inputs(experience, pad=pad)
    synthetic = _suffix_mask(experience, pad) if experience.is_packed else ~experience.attention_mask
    routed = experience.routed_experts if replay else None
    if routed is not None and pad:
        routed = torch.nn.functional.pad(routed, (0, pad), value=-1)
    return _trim(_run_decoder(model, inputs, synthetic, routed, **extra), pad)


def _run_decoder(model: nn.Module, inputs: dict, synthetic: torch.Tensor, routed, **extra) -> torch.Tensor:
    """`model.model(**inputs)`; MoE layers skip the `synthetic` rows and replay `routed`."""
    if not moe_blocks(model, strict=False):
        return model.model(**inputs, **extra).last_hidden_state
    with moe_padding_mask(model, synthetic), routing_replay(model, routed):
        return model.model(**inputs, **extra).last_hidden_state


def _forward_slots(model: nn.Module, experience: Experience, dims, replay: bool):
    """Per-slot `(hidden, targets, valid, restore)`: `restore` puts per-slot outputs back on
    the layout of `action_mask` (identity without CP; `_restore_full_sequence` with it).

    With context parallelism this rank runs the decoder on its zigzag shard of the token
    axis; slot targets come from the full batch (every CP rank has it), so log-probs are
    computed locally and only per-token outputs are gathered. EP ranks need no suffix
    here: the all-to-all takes uneven token counts, and CP padding rows skip the experts.
    """
    cp = getattr(dims, "cp", 1)
    if cp == 1:
        hidden = _forward_backbone(model, experience, ep_group=_ep_group(dims), replay=replay)
        hidden, targets, valid = _slots(hidden, experience)
        return hidden, targets, valid, lambda out: out
    _check_batch(model, experience)
    local, layout = shard(experience, cp, dims.cp_rank)
    routed = local.routed_experts if replay else None
    hidden = _run_decoder(model, cp_model_inputs(local, layout, dims.cp_group), ~local.attention_mask, routed)
    targets, valid = local_slots(experience, layout)

    def restore(out: torch.Tensor) -> torch.Tensor:
        full = _restore_full_sequence(out, layout, dims.cp_group)
        return full if experience.is_packed else full[:, :-1]  # padded: [B, T] -> action axis [B, T-1]

    return hidden, targets, valid, restore


def _model_inputs(experience: Experience, *, pad: int = 0) -> dict:
    """Keyword arguments of `model.model(...)` for one batch.

    Padded: `input_ids [B, T]`, `attention_mask [B, T]`, `position_ids` counted over real
    tokens. Pack: `input_ids [1, N + pad]`, `position_ids [1, N + pad]` restarting per
    sequence, `attention_mask=None` and explicit boundaries (`cu_seq_lens_q/k`,
    `max_length_q/k`), which the "varlen" attention enforces.
    """
    ids = experience.sequences
    if not experience.is_packed:
        if pad:
            raise NotImplementedError(f"an EP suffix (pad={pad}) is only defined for a pack; collate with packed=True")
        mask = experience.attention_mask
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": False}

    positions = experience.position_ids
    if pad:
        last = positions[:, -1:]
        ids = torch.cat([ids, ids.new_full((1, pad), SUFFIX_TOKEN_ID)], dim=1)
        positions = torch.cat([positions, last + torch.arange(1, pad + 1, device=last.device)], dim=1)
    return {
        "input_ids": ids,
        "position_ids": positions,
        "attention_mask": None,
        "use_cache": False,
        **packed_attn_kwargs(experience.packed_seq_lens, device=ids.device, trailing_pad=pad),
    }


def _suffix_mask(experience: Experience, pad: int) -> torch.Tensor:
    """`[1, N + pad]` bool, True on the synthetic suffix (for `model.moe.moe_padding_mask`)."""
    n = experience.sequences.shape[1]
    return torch.arange(n + pad, device=experience.sequences.device).unsqueeze(0) >= n


def _trim(hidden: torch.Tensor, pad: int) -> torch.Tensor:
    """Drop the `pad` synthetic suffix tokens: `[1, N + pad, H]` -> `[1, N, H]`."""
    return hidden[:, : hidden.shape[1] - pad] if pad else hidden


def _slots(hidden: torch.Tensor, experience: Experience) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per action slot: the hidden state that predicts, the target id, and whether it is real.

    Padded: hidden `[B, T-1, H]`, targets `[B, T-1]` (token k+1), valid = token k+1 is real.
    Pack: hidden `[1, N, H]`, targets `[1, N]` (the flat row shifted by one), valid is False
    on the trailing slot of each sequence, whose "target" is the next sequence's first token.
    """
    ids = experience.sequences
    if not experience.is_packed:
        return hidden[:, :-1], ids[:, 1:], experience.attention_mask[:, 1:]
    targets = torch.roll(ids, shifts=-1, dims=1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    ends = experience.cu_seqlens[1:].to(device=ids.device, dtype=torch.long) - 1
    valid[0, ends] = False
    return hidden, targets, valid


# ---------------------------------------------------------------- the modules
class Actor(nn.Module):
    """Policy forward: `action_log_probs` (and `entropy`) in the layout of `action_mask`."""

    def __init__(
        self, model: nn.Module, *, temperature: float = 1.0, chunk_size: int = 1024, dims=None, replay: bool = True
    ) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"Actor: temperature={temperature}, expected > 0")
        if chunk_size < 1:
            raise ValueError(f"Actor: chunk_size={chunk_size}, expected >= 1")
        self.model = model
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.dims = dims
        self.replay = replay

    def forward(
        self, experience: Experience, return_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`action_log_probs` fp32 `[B, T-1]` / `[1, N]` (plus `entropy`, same shape, if asked)."""
        hidden, targets, valid, restore = _forward_slots(self.model, experience, self.dims, self.replay)
        head = self.model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError(
                f"Actor: the output embedding {type(head).__name__} has a bias; only bias-free lm heads are supported"
            )
        out = token_log_probs(
            hidden, head.weight, targets,
            temperature=self.temperature, chunk_size=self.chunk_size, return_entropy=return_entropy,
        )
        if not return_entropy:
            return restore(out.masked_fill(~valid, 0.0))
        log_probs, entropy = out
        return restore(log_probs.masked_fill(~valid, 0.0)), restore(entropy.masked_fill(~valid, 0.0))


class Critic(nn.Module):
    """Value forward: `values` fp32 in the layout of `action_mask`.

    The value at slot k is that of the state after token k, read from hidden state k by an
    fp32 `Linear(hidden, 1)` head on the critic's own backbone (its lm_head goes unused).
    """

    def __init__(self, model: nn.Module, *, seed: int = 0, dims=None) -> None:
        super().__init__()
        self.model = model
        self.dims = dims
        size = model.config.hidden_size
        device = next(model.parameters()).device
        self.value_head = nn.Linear(size, 1, dtype=torch.float32, device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():  # small: initial values ~0, so early advantages are ~returns
            self.value_head.weight.normal_(0.0, 1.0 / size, generator=gen)
            self.value_head.bias.zero_()

    def forward(self, experience: Experience) -> torch.Tensor:
        # the critic routes live: replayed routing serves the policy's rollout/train agreement
        hidden, _, valid, restore = _forward_slots(self.model, experience, self.dims, replay=False)
        # the head's dot product as a per-row reduction: a [M, H] x [H, 1] gemv rounds
        # differently for different M, which would make padded and packed values differ
        values = (hidden.float() * self.value_head.weight[0]).sum(-1) + self.value_head.bias
        return restore(values.masked_fill(~valid, 0.0))


def _ep_group(dims):
    return getattr(dims, "ep_group", None)


# ----------------------------------------------------------------- validation
def _check_batch(model: nn.Module, exp: Experience) -> None:
    """A padded batch or a pack the forward can score, else a ValueError naming what is wrong."""
    seqs = exp.sequences
    if seqs is None or seqs.dim() != 2:
        shape = None if seqs is None else tuple(seqs.shape)
        raise ValueError(
            f"sequences has shape {shape}, expected a batch: [B, T] padded or [1, N] packed "
            "(collate records with make_experience_batch)"
        )
    config = model.config
    if exp.is_packed:
        n = seqs.shape[1]
        if seqs.shape[0] != 1:
            raise ValueError(f"a pack has sequences of shape {tuple(seqs.shape)}, expected [1, N]")
        if exp.position_ids is None:
            raise ValueError(
                f"a pack (packed_seq_lens given) has position_ids None, expected [1, {n}] restarting per sequence"
            )
        if tuple(exp.position_ids.shape) != (1, n):
            raise ValueError(
                f"position_ids has shape {tuple(exp.position_ids.shape)}, expected [1, {n}] like sequences"
            )
        lens = exp.packed_seq_lens
        if sum(lens) != n or min(lens) < 1:
            raise ValueError(
                f"packed_seq_lens {lens} (sum {sum(lens)}) does not describe sequences of shape {tuple(seqs.shape)}: "
                f"expected lengths >= 1 summing to N={n}"
            )
        longest, layout = max(lens), f"[1, {n}]"
    else:
        if exp.attention_mask is None:
            what = "has no attention_mask"
            if exp.position_ids is not None:
                what = "has position_ids but packed_seq_lens None"
            raise ValueError(
                f"sequences {tuple(seqs.shape)} {what}: expected a pack (position_ids [1, N] and packed_seq_lens) "
                "or a padded batch (attention_mask [B, T])"
            )
        if exp.attention_mask.shape != seqs.shape:
            shape = tuple(exp.attention_mask.shape)
            raise ValueError(f"attention_mask has shape {shape}, expected {tuple(seqs.shape)} like sequences")
        longest, layout = seqs.shape[1], f"[{seqs.shape[0]}, {seqs.shape[1] - 1}]"

    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and longest > limit:
        raise ValueError(f"sequence length {longest} exceeds the model's max_position_embeddings={limit}")
    vocab = model.get_input_embeddings().num_embeddings
    lo, hi = int(seqs.min()), int(seqs.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"sequences hold token ids in [{lo}, {hi}], expected ids in [0, {vocab}) (vocab_size={vocab})")
    if exp.action_mask is not None and layout != _shape(exp.action_mask):
        raise ValueError(
            f"action_mask has shape {_shape(exp.action_mask)}, expected {layout} for sequences {tuple(seqs.shape)}"
        )


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"

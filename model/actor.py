"""Actor and critic forward over a padded `[B, T]` batch or a THD pack `[1, N]`.

Outputs (`action_log_probs`, `entropy`, `values`) are aligned element-wise with
`experience.action_mask`: `[B, T-1]` for a padded batch, `[1, N]` for a pack. Slot k scores
token k+1 of the same sequence; a slot with no such token (the trailing slot of each packed
sequence, a slot whose next token is right padding) is exactly 0 with no gradient.

The forward of one batch, in order (each step names the one file it enters):

    _check_batch(model, experience)                 # clear errors for bad input
    targets, valid = _slot_targets(experience)      # [B, W] on the batch's token axis
    view = shard_forward(...) if dims.cp > 1        # model/context_parallel.py: this rank's shard
           else _shared_prompt_view(...)            # here: each repeated prompt once (share_prompts) ...
           or _local_view(...)                      # ... else the whole pack, with the EP suffix
    hidden = model.model(**view.inputs)             # under model/moe.py's token weights and routing replay
    hidden = hidden[:, view.expand]                 # shared prompts: back on the pack's slots
    out = token_log_probs(hidden, W, view.targets)  # model/logprobs.py
    view.restore(out) -> action axis                # [1, N] / [B, T-1]
"""

from __future__ import annotations

import torch
from torch import nn

from model.attention import VARLEN, packed_attn_kwargs
from model.checks import check_on_device
from model.context_parallel import CP_VARLEN, Segments, ShardedView, shard_forward
from model.logprobs import LOGPROB_CHUNK_BYTES, token_log_probs, topk_reverse_kl
from model.moe import ep_suffix_length, moe_blocks, moe_token_weights, routing_replay
from runtime.parallel_dims import ParallelDims
from packing.experience import Experience
from packing.layout import padded_positions

SUFFIX_TOKEN_ID = 0  # any valid id: suffix rows are causal-last, excluded from experts and losses


# ------------------------------------------------------------------- the forward
def _forward_slots(model: nn.Module, experience: Experience, dims: ParallelDims, replay: bool, *,
                   pad: int | None = None, share_prompts: bool = False) -> tuple[torch.Tensor, ShardedView]:
    """Hidden states of every token slot this rank computes, and the view that puts
    per-slot outputs back on the layout of `action_mask`."""
    _check_batch(model, experience)
    targets, valid = _slot_targets(experience)
    view = share_prompts and _shared_prompt_view(model, experience, targets, valid, dims, pad)
    if not view:
        view = (shard_forward(experience, targets, valid, dims) if dims.cp > 1
                else _local_view(experience, targets, valid, dims.ep_group, pad=pad))
    routed = view.routed if replay else None
    if not moe_blocks(model, strict=False):
        hidden = model.model(**view.inputs).last_hidden_state
    else:
        with moe_token_weights(model, view.weight, view.expand), routing_replay(model, routed):
            hidden = model.model(**view.inputs).last_hidden_state
    # a member's prompt slots read their group's one copy; the gather's backward sums them
    return (hidden if view.expand is None else hidden.index_select(1, view.expand)), view


def _slot_targets(experience: Experience) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of the batch's token axis `[B, W]`: the id its slot scores (token k+1 of
    the same sequence) and whether that slot is real. In a pack the last token of each
    sequence scores nothing; in a padded batch a slot is real where the next token is."""
    ids = experience.sequences
    if experience.is_packed:
        targets = torch.roll(ids, shifts=-1, dims=1)
        valid = torch.ones_like(ids, dtype=torch.bool)
        ends = experience.cu_seqlens[1:].to(device=ids.device, dtype=torch.long) - 1
        valid[0, ends] = False
        return targets, valid
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    valid = torch.nn.functional.pad(experience.attention_mask[:, 1:].bool(), (0, 1), value=False)
    return targets, valid


def _local_view(experience: Experience, targets: torch.Tensor, valid: torch.Tensor, ep_group, *,
                pad: int | None = None) -> ShardedView:
    """The whole batch on this rank (cp = 1).

    Padded: `input_ids [B, T]`, `attention_mask [B, T]`, `position_ids` counted over real
    tokens; right padding is kept out of the experts. Pack: `input_ids [1, N + pad]`,
    `position_ids` restarting per sequence, `attention_mask=None` and explicit boundaries
    (`cu_seq_lens_q/k`, `max_length_q/k`) that the "varlen" attention enforces.

    The EP-equalized suffix (`pad`, default `ep_suffix_length`, an all-reduce MAX over the
    EP group at forward time): every EP rank presents the same token count. The uneven
    all-to-all of model/moe.py does not need it for correctness; it is what kernels with
    static per-rank shapes need (fixed-size all-to-all buffers, CUDA graphs), and it costs
    only dense compute: its positions continue the last sequence so real tokens never
    attend to it (it is folded into the last `cu_seqlens` entry), it is kept out of the
    experts, scores nothing and is cut off by `restore`.
    """
    ids = experience.sequences
    if not experience.is_packed:
        if pad:
            raise NotImplementedError(f"an EP suffix (pad={pad}) is only defined for a pack; collate with packed=True")
        mask = experience.attention_mask
        positions = padded_positions(mask)
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": False}
        return ShardedView(inputs, mask.long(), experience.routed_experts, targets, valid, lambda out: out)

    n = ids.shape[1]
    if pad is None:
        pad = ep_suffix_length(n, ep_group)
    if pad < 0:
        raise ValueError(f"pad={pad}: the EP suffix length must be >= 0")
    positions, routed = experience.position_ids, experience.routed_experts
    if pad:
        ids = torch.cat([ids, ids.new_full((1, pad), SUFFIX_TOKEN_ID)], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=ids.device)], dim=1)
        targets = torch.nn.functional.pad(targets, (0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad), value=False)
        if routed is not None:
            routed = torch.nn.functional.pad(routed, (0, pad), value=-1)
    inputs = {
        "input_ids": ids,
        "position_ids": positions,
        "attention_mask": None,
        "use_cache": False,
        **packed_attn_kwargs(experience.packed_seq_lens, device=ids.device, trailing_pad=pad),
    }
    weight = (torch.arange(n + pad, device=ids.device) < n).long().unsqueeze(0)  # 1 a token, 0 the suffix
    return ShardedView(inputs, weight, routed, targets, valid, lambda out: out[:, :n])


def _shared_prompt_view(model: nn.Module, experience: Experience, targets: torch.Tensor, valid: torch.Tensor,
                        dims: ParallelDims, pad: int | None) -> ShardedView | None:
    """A pack whose repeated prompts run through the body once, or None (run the whole pack).

    A GRPO group's samples share their prompt tokens; the body runs each distinct prompt once,
    then each member's response (the pack's `shared_prompts`, packing/prompts.py, built once
    by the collate): ~700 instead of ~2100 tokens for 4 prompts x 8 samples of 45 + 16 tokens.
    A member's segment (its prompt's last token, then its response) keeps its positions (P-1,
    P, ...) and attends to the shared prefix and causally to its own tokens
    (model/attention.py `_shared_prompt_attention`), so each slot's hidden
    state is the unshared pack's; the view's `expand [N + pad]` puts them back on the pack's
    slots (targets, valid and restore are on that axis, as `_local_view`'s).

    MoE (model/moe.py): a shared prompt row weighs its group's size (`multiplicity`), so the
    aux loss and expert load count it once per sample; `routed_experts` is replayed on the
    compressed rows (`keep`: a group's prompt replays its first member's record) and recorded
    routing comes back on the pack's slots (`expand`). EP: the equalized suffix is computed on
    the compressed rows (`ep_suffix_length(N_c)`, the one collective, on every path alike) and
    is a causal segment of its own: no real row attends to it, it weighs 0, `restore` cuts it.

    cp > 1: `_shared_prompt_shard` (the compressed rows sharded with the 2*cp zigzag).
    Only a pack with a layout (a repeated prompt) and the attention that reads it ("varlen",
    or "cp_varlen" under cp > 1); every check comes before the EP collective.
    """
    layout = experience.shared_prompts
    if layout is None or not experience.is_packed:
        return None
    if getattr(model.config, "_attn_implementation", None) != (VARLEN if dims.cp == 1 else CP_VARLEN):
        return None
    n = experience.sequences.shape[1]
    if layout.expand.shape != (n,):
        raise ValueError(f"shared_prompts.expand has shape {tuple(layout.expand.shape)}, expected [{n}] like "
                         "sequences [1, N]: a layout of another pack (rebuild it with make_experience_batch)")
    if dims.cp > 1:
        return _shared_prompt_shard(experience, layout, targets, valid, dims)
    rows = layout.keep.numel()
    if pad is None:
        pad = ep_suffix_length(rows, dims.ep_group)
    if pad < 0:
        raise ValueError(f"pad={pad}: the EP suffix length must be >= 0")
    layout = layout.with_suffix(pad)
    keep, expand, routed = layout.keep, layout.expand, experience.routed_experts
    ids = experience.sequences.index_select(1, keep)
    positions = experience.position_ids.index_select(1, keep)
    if routed is not None:
        routed = routed.index_select(-1, keep)
    if pad:  # its own segment: any positions; it scores nothing and is cut off by restore
        suffix = torch.arange(pad, device=ids.device)
        ids = torch.cat([ids, ids.new_full((1, pad), SUFFIX_TOKEN_ID)], dim=1)
        positions = torch.cat([positions, suffix.unsqueeze(0)], dim=1)
        expand = torch.cat([expand, suffix + rows])
        targets = torch.nn.functional.pad(targets, (0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad), value=False)
        if routed is not None:
            routed = torch.nn.functional.pad(routed, (0, pad), value=-1)
    inputs = {"input_ids": ids, "position_ids": positions, "attention_mask": None, "use_cache": False,
              "shared_prompts": layout}
    return ShardedView(inputs, layout.multiplicity.unsqueeze(0), routed, targets, valid, lambda out: out[:, :n],
                       expand)


def _shared_prompt_shard(experience: Experience, layout, targets: torch.Tensor, valid: torch.Tensor,
                         dims: ParallelDims) -> ShardedView:
    """cp > 1: the compressed rows `[1, N_c]` as a pack of units, sharded with the 2*cp zigzag
    (model/context_parallel.py, with the units' `Segments` in its mask and flash segments).
    Every compressed row scores one target (packing/prompts.py), so per-row outputs are computed
    on this rank's rows, put back on the compressed axis by `_restore_full_sequence` (unchanged),
    then on the pack's slots by `expand` (its backward sums a shared row's members)."""
    keep = layout.keep
    compressed = Experience(
        sequences=experience.sequences.index_select(1, keep),
        position_ids=experience.position_ids.index_select(1, keep),
        packed_seq_lens=[prefix + sum(responses) for prefix, responses in layout.units],
        routed_experts=None if experience.routed_experts is None else experience.routed_experts.index_select(-1, keep),
    )
    view = shard_forward(compressed, targets.index_select(1, keep), valid.index_select(1, keep), dims,
                         weight=layout.multiplicity.unsqueeze(0), segments=Segments.of_units(layout.units))
    restore = view.restore
    return view._replace(restore=lambda out: restore(out).index_select(1, layout.expand))


def _action_axis(out: torch.Tensor, experience: Experience) -> torch.Tensor:
    """Token axis -> action axis: `[1, N]` stays; `[B, T]` drops its last column -> `[B, T-1]`.
    Never a view: FSDP's pre-backward hook on the wrapper's output would not survive an
    in-place op on a view."""
    out = out if experience.is_packed else out[:, :-1]
    return out.clone() if out._is_view() else out


# ---------------------------------------------------------------- the modules
class Actor(nn.Module):
    """Policy forward: `action_log_probs` (and `entropy`) in the layout of `action_mask`.

    The Actor is the module FSDP2 wraps last (model/parallelize.py): its forward reads the
    lm head's weight directly (chunked log-softmax), which the root's unshard covers.
    `chunk_bytes` is the log-prob head's budget of one `[rows, V]` fp32 chunk
    (model/logprobs.py; `model.logprob_chunk_bytes`).
    `actions_only` runs the lm head on the slots `action_mask` selects only; every other slot
    is then exactly 0 (with no gradient) like a slot with no next token (the trainer's
    setting: its losses, KL and metrics are masked by `action_mask`).
    `share_prompts` runs each prompt a pack repeats once through the body (`_shared_prompt_view`;
    `model.share_prompts`): the same numbers up to fp32 rounding, a no-op where it does not apply.
    """

    def __init__(self, model: nn.Module, *, temperature: float = 1.0, chunk_bytes: int = LOGPROB_CHUNK_BYTES,
                 dims: ParallelDims | None = None, replay: bool = True,
                 actions_only: bool = False, share_prompts: bool = False) -> None:
        super().__init__()
        if chunk_bytes < 1:
            raise ValueError(f"Actor: chunk_bytes={chunk_bytes}, expected >= 1")
        head = model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError(
                f"Actor: the output embedding {type(head).__name__} has a bias; only bias-free lm heads are supported"
            )
        self.model = model
        self.temperature = temperature
        self.chunk_bytes = chunk_bytes  # log-prob chunk: rows = chunk_bytes // (4 x vocab)
        self.dims = dims if dims is not None else ParallelDims()
        self.replay = replay
        self.actions_only = actions_only
        self.share_prompts = share_prompts

    def forward(
        self, experience: Experience, return_entropy: bool = False, return_argmax: bool = False,
        return_topk: int = 0, teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """`action_log_probs` fp32 `[B, T-1]` / `[1, N]` (plus `entropy`, same shape, if asked; plus,
        without grad, each slot's most likely id as fp32, `return_argmax`: model/logprobs.py).
        Distillation's top-k reverse KL: `return_topk=k` (a teacher, without grad) adds each scored
        row's k largest log-probs and their ids `[rows, k]` as this rank's forward holds them (not
        on the action axis: the student's forward of the same batch on the same rank has the same
        rows); `teacher_topk=(log-probs, ids)` from it (the student) adds, last and on the action
        axis, each slot's exact reverse KL over those k ids renormalized (`topk_reverse_kl`),
        differentiable."""
        hidden, view = _forward_slots(self.model, experience, self.dims, self.replay,
                                      share_prompts=self.share_prompts)
        rows = self._scored_rows(experience, view)
        if rows is not None:  # the lm head on the action slots only, scattered back onto the token axis
            hidden, targets = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), view.targets.reshape(-1)[rows]
        else:
            targets = view.targets
        out = token_log_probs(
            hidden, self.model.get_output_embeddings().weight, targets,
            temperature=self.temperature, chunk_bytes=self.chunk_bytes,
            return_entropy=return_entropy, return_argmax=return_argmax, return_topk=return_topk,
            extra_targets=teacher_topk[1] if teacher_topk is not None else None,
        )
        outs = out if isinstance(out, tuple) else (out,)
        local = ()
        if teacher_topk is not None:  # the student's log-probs of the teacher's ids -> the KL per row
            outs = (*outs[:-1], topk_reverse_kl(outs[-1], teacher_topk[0]))
        if return_topk:  # this rank's rows, as they are
            outs, local = outs[:-2], outs[-2:]
        if rows is not None:
            outs = tuple(o.new_zeros(view.targets.numel()).index_copy(0, rows, o).view(view.targets.shape)
                         for o in outs)
        outs = tuple(_action_axis(view.restore(o.masked_fill(~view.valid, 0.0)), experience) for o in outs) + local
        return outs if len(outs) > 1 else outs[0]

    def _scored_rows(self, experience: Experience, view: ShardedView) -> torch.Tensor | None:
        """With `actions_only`: the flat indices of the slots `action_mask` selects on this
        rank's token axis (None: score every slot). The lm head is ~20% of a training step's
        FLOPs at a 49k vocabulary and prompt slots are most of a short-answer pack; losses,
        KL and metrics read only the action slots. Not under CP (the view is a shard)."""
        mask = experience.action_mask
        if not self.actions_only or mask is None or self.dims.cp > 1:
            return None
        width = view.targets.shape[1]  # padded: T (mask T-1); pack: N (+ EP suffix)
        act = torch.nn.functional.pad(mask.bool(), (0, width - mask.shape[1]), value=False)
        rows = (act & view.valid).reshape(-1).nonzero().squeeze(1)
        return rows if rows.numel() else None  # no action slot: score every slot (keeps the graph)


class Critic(nn.Module):
    """Value forward: `values` fp32 in the layout of `action_mask`.

    The value at slot k is that of the state after token k, read from hidden state k by an
    fp32 `Linear(hidden, 1)` head on the critic's own backbone (its lm_head goes unused).
    `share_prompts` as the Actor's.
    """

    def __init__(self, model: nn.Module, *, seed: int = 0, dims: ParallelDims | None = None,
                 share_prompts: bool = False) -> None:
        super().__init__()
        self.model = model
        self.dims = dims if dims is not None else ParallelDims()
        self.share_prompts = share_prompts
        size = model.config.hidden_size
        device = next(model.parameters()).device
        if device.type == "meta":  # a checkpoint loaded shard by shard later (model/loading.py): seed it here
            device = torch.device("cpu")
        self.value_head = nn.Linear(size, 1, dtype=torch.float32, device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():  # small: initial values ~0, so early advantages are ~returns
            self.value_head.weight.normal_(0.0, 1.0 / size, generator=gen)
            self.value_head.bias.zero_()

    def forward(self, experience: Experience) -> torch.Tensor:
        # the critic routes live: replayed routing serves the policy's rollout/train agreement
        hidden, view = _forward_slots(self.model, experience, self.dims, replay=False,
                                      share_prompts=self.share_prompts)
        # the head's dot product as a per-row reduction: a [M, H] x [H, 1] gemv rounds
        # differently for different M, which would make padded and packed values differ
        values = (hidden.float() * self.value_head.weight[0]).sum(-1) + self.value_head.bias
        return _action_axis(view.restore(values.masked_fill(~view.valid, 0.0)), experience)


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
    _check_token_ids(seqs, model.get_input_embeddings().num_embeddings)
    if exp.action_mask is not None and layout != _shape(exp.action_mask):
        raise ValueError(
            f"action_mask has shape {_shape(exp.action_mask)}, expected {layout} for sequences {tuple(seqs.shape)}"
        )


def _check_token_ids(seqs: torch.Tensor, vocab: int) -> None:
    """Every id in [0, vocab), without a host sync (model/checks.py)."""
    def detail() -> str:
        lo, hi = int(seqs.min()), int(seqs.max())
        return f"sequences hold token ids in [{lo}, {hi}], expected ids in [0, {vocab}) (vocab_size={vocab})"

    check_on_device(((seqs >= 0) & (seqs < vocab)).all(),
                    f"sequences hold a token id outside [0, {vocab}) (vocab_size={vocab})", detail)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"

"""Mixture-of-experts: expert parallelism, synthetic-row masking, routing replay (R3), expert load.

`shard_experts(model, ep_group)` swaps every sparse MoE block of a Hugging Face MoE
model (Qwen3-MoE: `mlp.gate` router + fused `mlp.experts`) for a `MoEBlock`. EP rank r of
an `ep`-sized group keeps experts [r*E/ep, (r+1)*E/ep) of `gate_up_proj [E, 2I, H]` and
`down_proj [E, H, I]` as its own Parameters; every token-slot pair goes to the owning rank
and its output comes back with `all_to_all_single` (uneven splits, sizes exchanged first).
The exchange is differentiable (its backward is the reverse exchange), so after backward
an expert shard's grad holds the contributions of every EP rank's tokens: FSDP reduces it
over the ranks holding the same shard only (model/parallelize.py; `is_expert_param` tells
expert weights apart). `ep_group=None` keeps all experts local (no collectives): that is
how an unsharded copy (the rollout engine's) gets the contexts below.

Deterministic whatever the expert order: a token's top-k expert outputs are summed in slot
order (`combine`: each output copied to its own (token, slot) place, then a sum over k), in
forward and, for the token rows' gradients, in backward (`_Dispatch`); never added onto the
token in arrival order (`index_add`: order-dependent bf16 sums with k >= 3, atomics on CUDA).
The expert GEMMs are two `torch._grouped_mm` calls where torch has them (`grouped_mm_fits`).

Per forward, three contexts steer the blocks (all take the model and restore on exit):

    with moe_token_weights(model, weights, expand):  # [1, N] / [B, T] int: tokens each row stands for
    with routing_replay(model, routed_experts):      # [1, L, K, N] / [B, L, K, T] int, -1 = live
    with record_routing(model) as rec:               # rec.routed_experts -> [B, L, K, T]

The contexts are read when a block runs. Activation checkpointing recomputes a layer
inside backward, after the contexts have exited: `moe_state` captures a block's state at
forward time and puts it back for the recompute (model/parallelize.py), which then counts
no load and records no routing.

Token weights say how many of the batch's tokens each row the blocks see stands for. A
synthetic row (the EP-equalizing suffix, CP padding, right padding) weighs 0: it is never
dispatched, gets a zero MoE output and is not counted in `expert_load` or the aux loss, so
it cannot pile up on one expert (prime-rl #3350). A shared-prompt row (model/actor.py: a
GRPO group's prompt run once for its k samples) weighs k: it is dispatched once and counted
k times, so the load, the aux loss and the recorded routing (put back on the batch's slots
by `expand`) are the unshared pack's. State-dict keys are the stock ones; the expert entries hold
the local shard; `model.parallelize.full_parameters` rebuilds the full tensors.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from model.checks import check_on_device

EXPERT_PARAM_NAMES = ("gate_up_proj", "down_proj")


# ------------------------------------------------------------------ collectives
def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Plain all_to_all_single on dim 0: sends `in_splits[r]` rows to rank r, receives `out_splits[r]`."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable all_to_all_single: the gradient of a row goes back to the rank it came from."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a small host-side value must live for a collective on `group` (NCCL needs CUDA)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ep_suffix_length(local_tokens: int, ep_group: dist.ProcessGroup | None) -> int:
    """Synthetic tokens this rank appends so every EP rank presents the same token count:
    MAX of `local_tokens` over `ep_group` minus `local_tokens` (a collective: call it on
    every rank of the group, at forward time)."""
    if isinstance(local_tokens, bool) or not isinstance(local_tokens, int) or local_tokens < 0:
        raise ValueError(f"local_tokens must be an int >= 0, got {local_tokens!r}")
    if _group_size(ep_group) == 1:
        return 0
    count = torch.tensor([local_tokens], dtype=torch.int64, device=_collective_device(ep_group))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ep_group)
    return int(count.item()) - local_tokens


# ---------------------------------------------------------------------- experts
class ExpertParallelExperts(nn.Module):
    """This EP rank's contiguous slice of the fused experts, plus the token exchange.

    `gate_up_proj [E_local, 2I, H]`, `down_proj [E_local, H, I]` (E_local = E / ep) hold
    global experts [first_expert, first_expert + E_local).
    """

    def __init__(self, experts: nn.Module, num_experts: int, ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        ep, rank = _group_size(ep_group), _group_rank(ep_group)
        if num_experts % ep != 0:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel size ep={ep}: "
                f"every EP rank must own the same number of contiguous experts"
            )
        for name in EXPERT_PARAM_NAMES:
            full = getattr(experts, name)
            if full.dim() != 3 or full.shape[0] != num_experts:
                raise ValueError(f"experts.{name} has shape {tuple(full.shape)}, expected [{num_experts}, *, *]")
        self.num_experts, self.ep_size, self.ep_rank, self.ep_group = num_experts, ep, rank, ep_group
        self.num_local_experts = num_experts // ep
        self.first_expert = rank * self.num_local_experts
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        for name in EXPERT_PARAM_NAMES:
            full = getattr(experts, name)
            # clone: the shard must not keep the full tensor's storage alive
            shard = nn.Parameter(full.detach()[local].clone(), requires_grad=full.requires_grad)
            setattr(self, name, shard)
        self.act_fn = experts.act_fn

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """`x [S, H]`, `ids`/`weights [S, K]`, `keep [S]` bool (None = all rows) -> `[S, H]`.

        Rows outside `keep` are never sent anywhere and get a zero output. One host sync: the
        per-expert counts (the split sizes of the grouped matmuls and of the exchange)."""
        S, K = ids.shape
        E = self.num_experts
        pair_ids, pair_w = ids.reshape(-1), weights.reshape(-1)  # pair p = (token p // K, slot p % K)
        if keep is not None:  # a sentinel expert E past the last one: sorted last, never sent (no boolean index)
            pair_ids = torch.where(keep.repeat_interleave(K), pair_ids, E)
        # group pairs by expert; experts are contiguous per rank, so this also groups by destination
        order = torch.argsort(pair_ids, stable=True)
        counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device).scatter_add_(
            0, pair_ids, torch.ones_like(pair_ids))  # [E + 1], the sentinel's last
        per_expert = counts.tolist()  # the host sync
        kept = sum(per_expert[:E])
        pairs = order[:kept]  # the (token, slot) pair of each row, rows grouped by expert
        pair_w = pair_w[pairs]
        send_counts = counts[:E]
        rows = _Dispatch.apply(x, pairs, K)  # [P, H]: x[pairs // K]

        if self.ep_size == 1:
            out = self._compute(rows, per_expert[:E])
        else:
            ep, n_local = self.ep_size, self.num_local_experts
            recv_counts = torch.empty_like(send_counts)  # [ep * E_local]: source-major
            dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
            in_splits = send_counts.view(ep, n_local).sum(1).tolist()
            out_splits = recv_counts.view(ep, n_local).sum(1).tolist()
            recv = _all_to_all(rows, out_splits, in_splits, self.ep_group)  # [R, H], by source, then expert
            local_expert = torch.repeat_interleave(
                torch.arange(n_local, device=x.device).repeat(ep), recv_counts, output_size=sum(out_splits)
            )
            by_expert = torch.argsort(local_expert, stable=True)
            computed = self._compute(recv[by_expert], recv_counts.view(ep, n_local).sum(0).tolist())
            out = _all_to_all(computed[torch.argsort(by_expert)], in_splits, out_splits, self.ep_group)

        out = out * pair_w[:, None]
        return combine(out.to(x.dtype), pairs, S, K)

    def _compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Local experts on `rows` grouped by local expert (`counts[e]` rows each). Every local
        expert runs, even on zero rows, so every shard always gets a (possibly zero) grad and the
        expert-grad all-reduce never sees a missing tensor on one rank. Two grouped GEMMs
        (`torch._grouped_mm`) where this torch has them for these shapes, else one pair of GEMMs
        per expert: the same products (bitwise on this machine's CPU kernels, fp32 and bf16)."""
        if grouped_mm_fits(rows, self.gate_up_proj, self.down_proj):
            offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(rows.device, torch.int32)
            gate, up = torch._grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
            return torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs=offsets)
        outs = []
        for e, chunk in enumerate(torch.split(rows, counts)):
            gate, up = F.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} "
                f"of {self.num_experts}, ep_rank={self.ep_rank}/{self.ep_size}")


def combine(rows: torch.Tensor, pairs: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """Expert outputs `rows [P, H]` of the (token, slot) pairs `pairs [P]` (pair = token * k + slot,
    each at most once, in any order) -> `[tokens, H]`: each token's k slots summed in slot order.

    Each row is copied to its own slot of a `[tokens, k, H]` buffer (no two rows share one, so no
    atomics), then the k slots are summed: the result depends on the rows' values only, not on
    the order they arrive in (expert order, split sizes, EP ranks), unlike an `index_add` of the
    rows onto their tokens, which adds in arrival order (and with atomics on CUDA). A missing
    pair (a synthetic row, never dispatched) is a zero slot. Costs one `[tokens * k, H]` buffer."""
    slots = rows.new_zeros(tokens * k, rows.shape[-1]).index_copy(0, pairs, rows)
    return slots.view(tokens, k, -1).sum(1)


class _Dispatch(torch.autograd.Function):
    """`x [S, H]` -> `x[pairs // k]` `[P, H]` (each kept pair's token row). Backward: `combine`,
    so a token's k row gradients are summed in slot order too (the autograd of the indexing
    would add them in arrival order, with atomics on CUDA)."""

    @staticmethod
    def forward(ctx, x, pairs, k):
        ctx.pairs, ctx.k, ctx.tokens = pairs, k, x.shape[0]
        return x[pairs // k]

    @staticmethod
    def backward(ctx, grad):
        return combine(grad, ctx.pairs, ctx.tokens, ctx.k), None, None


def grouped_mm_fits(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these expert GEMMs: present in this torch, a dtype its
    kernels take (fp32/bf16 on CPU, bf16 on CUDA sm80+: a fused kernel on sm90/sm100, a loop of
    GEMMs below), every row and weight stride a multiple of 16 bytes (its requirement), plain
    tensors (FSDP2 hands the module unsharded ones)."""
    if not hasattr(torch, "_grouped_mm") or rows.device.type not in ("cpu", "cuda"):
        return False
    if rows.is_cuda and torch.cuda.get_device_capability(rows.device) < (8, 0):  # its CUDA kernels: sm80+
        return False
    dtypes = (torch.float32, torch.bfloat16) if rows.device.type == "cpu" else (torch.bfloat16,)
    if rows.dtype not in dtypes or any(w.dtype != rows.dtype or isinstance(w, DTensor) for w in weights):
        return False
    align = 16 // rows.element_size()
    return all(n % align == 0 for w in weights for n in w.shape[1:])


# ------------------------------------------------------------------------ block
class MoEBlock(nn.Module):
    """A sparse MoE block: the stock router (`gate`, untouched) + `ExpertParallelExperts`.

    Per-forward state, set by the context managers of this module: `token_weight [B, T]` int
    (tokens each row stands for, 0 = synthetic) and `expand [W]` (the row each of the batch's W
    token slots reads, shared prompts; None = the rows are the slots), `replay` ((shape of
    `routed_experts`, this layer's slice `[B, K, T]`)), `recorder` (a list the used top-k ids
    `[B, K, W]` are appended to). `load [E]` counts token-slot pairs per expert, each row
    counted `token_weight` times, since the last `reset_expert_load`.
    """

    def __init__(self, gate: nn.Module, experts: ExpertParallelExperts, layer: int) -> None:
        super().__init__()
        self.gate, self.experts, self.layer = gate, experts, layer
        self.top_k, self.num_experts = int(gate.top_k), int(gate.num_experts)
        self.norm_topk_prob = bool(gate.norm_topk_prob)
        self.register_buffer("load", torch.zeros(self.num_experts, dtype=torch.int64), persistent=False)
        self.token_weight: torch.Tensor | None = None
        self.expand: torch.Tensor | None = None
        self.replay: tuple[tuple[int, ...], torch.Tensor] | None = None
        self.recorder: list[torch.Tensor] | None = None
        self.recompute = False  # activation checkpointing's second run: count and record nothing
        self.aux: list | None = None  # router_aux_loss: (loss, tokens) per forward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        B, T, H = hidden_states.shape
        x = hidden_states.reshape(-1, H)
        logits, weights, ids = self.gate(x)  # [B*T, E], [B*T, K], [B*T, K]
        if self.replay is not None:
            ids, weights = self._replayed(logits, weights, ids, B, T)
        weight = keep = None
        if self.token_weight is not None:
            if tuple(self.token_weight.shape) != (B, T):
                raise ValueError(f"moe token weights have shape {tuple(self.token_weight.shape)}, "
                                 f"expected [{B}, {T}] like the hidden states (layer {self.layer})")
            weight = self.token_weight.reshape(-1).to(x.device)
            keep = weight > 0
        if not self.recompute:
            self._count(ids, weight, B, T)
        if self.aux is not None:
            aux = self._balance_loss(logits, ids, weight)
            if not self.recompute:
                self.aux.append(aux)
        out = self.experts(x, ids, weights, keep)
        return out.reshape(B, T, H)

    def _per_pair(self, ids: torch.Tensor, weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`ids [S, K]` flat, and each (row, slot) pair's token weight `[S*K]` (1 without weights)."""
        flat = ids.reshape(-1)
        if weight is None:
            return flat, torch.ones_like(flat)
        return flat, weight.to(flat.dtype).repeat_interleave(ids.shape[1])

    def _balance_loss(self, logits: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor | None):
        """Switch-style load-balancing loss over the batch's tokens: E * sum_e f_e * P_e, with f_e
        the share of top-k slots routed to expert e and P_e its mean router probability, each row
        counted `weight` times (0: synthetic rows never count; k: a shared prompt row for its k
        samples). Returns (loss, tokens), tokens a 0-d tensor (no host sync)."""
        flat, pair_w = self._per_pair(ids, weight)
        w = torch.ones(ids.shape[0], device=ids.device) if weight is None else weight.to(torch.float32)
        n = w.sum()
        denom = n.clamp(min=1.0)  # no token: share = prob = 0, the loss 0 with a graph
        share = torch.zeros(self.num_experts, device=ids.device).scatter_add_(0, flat, pair_w.float())
        share = share / (denom * ids.shape[1])
        prob = (F.softmax(logits, dim=-1, dtype=torch.float32) * w[:, None]).sum(0) / denom
        return self.num_experts * (share * prob).sum(), n

    @torch.no_grad()
    def _count(self, ids: torch.Tensor, weight: torch.Tensor | None, B: int, T: int) -> None:
        self.load.scatter_add_(0, *self._per_pair(ids, weight))
        if self.recorder is not None:
            kept = ids if weight is None else torch.where(weight[:, None] > 0, ids, torch.full_like(ids, -1))
            rec = kept.reshape(B, T, -1).transpose(1, 2)  # [B, K, T] on the rows
            rec = rec if self.expand is None else rec.index_select(2, self.expand.to(rec.device))
            self.recorder.append(rec.clone())

    def _replayed(self, logits, weights, ids, B: int, T: int):
        """Recorded ids where the record has them; gate weights from the live logits at those ids,
        normalized like the stock router (fp32 softmax over all experts, gather, renormalize if
        norm_topk_prob, cast to the logits dtype). Rows whose record is -1 keep live routing."""
        full_shape, rec = self.replay
        if tuple(rec.shape) != (B, self.top_k, T):
            _, L_, K_, _ = full_shape
            raise ValueError(
                f"routed_experts has shape {tuple(full_shape)}, expected [{B}, {L_}, {K_}, {T}]: its batch and "
                f"token axes must match the hidden states [{B}, {T}] (layer {self.layer})"
            )
        rec = rec.to(ids.device, ids.dtype).transpose(1, 2).reshape(B * T, self.top_k)
        recorded = rec >= 0
        row = recorded.all(-1)
        partial = (f"routed_experts (layer {self.layer}) has tokens with -1 in some but not all "
                   f"{self.top_k} top-k slots: a token's record is either complete or -1")
        check_on_device(~(recorded.any(-1) & ~row).any(), partial, lambda: partial)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        w = probs.gather(1, rec.clamp(min=0))
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(logits.dtype)
        return torch.where(row[:, None], rec, ids), torch.where(row[:, None], w, weights)


# ------------------------------------------------------------------- apply / find
# Blocks whose router is "fp32 softmax over all experts -> top-k -> renormalize if
# gate.norm_topk_prob" and whose experts are fused, bias-free `gate_up_proj`/`down_proj`
# (what MoEBlock and the replay normalization reproduce). Add a class only after checking
# its router and experts against those two lines (e.g. Qwen3-VL-MoE always renormalizes).
SUPPORTED_BLOCKS = ("Qwen3MoeSparseMoeBlock",)


def _looks_like_sparse_block(module: nn.Module) -> bool:
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (
        not isinstance(module, MoEBlock)
        and isinstance(gate, nn.Module) and hasattr(gate, "top_k") and hasattr(gate, "num_experts")
        and isinstance(experts, nn.Module) and all(hasattr(experts, n) for n in EXPERT_PARAM_NAMES)
    )


def shard_experts(model: nn.Module, ep_group: dist.ProcessGroup | None) -> nn.Module:
    """Shard the experts of every sparse MoE block over `ep_group` (None: keep all experts local).

    Load the full weights first; apply before FSDP. Every EP rank must call it on the same model.
    """
    found = [(name, m) for name, m in model.named_modules() if _looks_like_sparse_block(m)]
    if not found:
        already = "; it has MoEBlocks already (applied twice?)" if moe_blocks(model, strict=False) else ""
        raise ValueError(f"shard_experts: {type(model).__name__} has no sparse MoE block "
                         f"(a module with a top-k router `gate` and fused `experts`){already}")
    for layer, (name, block) in enumerate(found):
        if type(block).__name__ not in SUPPORTED_BLOCKS:
            raise ValueError(f"shard_experts: {name} is a {type(block).__name__}; supported MoE blocks: "
                             f"{SUPPORTED_BLOCKS} (their router normalization and expert layout are the ones checked)")
        extra = sorted(set(dict(block.named_children())) - {"gate", "experts"})
        if extra:
            raise ValueError(f"shard_experts: {name} ({type(block).__name__}) has submodules {extra} "
                             f"besides gate/experts (e.g. a shared expert), which MoEBlock does not run")
        if any(isinstance(p, DTensor) for p in block.parameters()):
            raise ValueError(f"shard_experts: {name} holds DTensor parameters: apply EP before FSDP")
        experts = ExpertParallelExperts(block.experts, int(block.gate.num_experts), ep_group)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MoEBlock(block.gate, experts, layer))
    return model


def is_moe(model: nn.Module) -> bool:
    """A Hugging Face MoE model (its config names experts), with or without MoEBlocks yet."""
    return getattr(model.config, "num_experts", 0) > 0 or bool(moe_blocks(model, strict=False))


def moe_blocks(model: nn.Module, *, strict: bool = True) -> list[MoEBlock]:
    """The model's `MoEBlock`s in layer order (the L axis of `routed_experts`)."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if strict and not blocks:
        raise ValueError(f"{type(model).__name__} has no MoEBlock: call shard_experts(model, ep_group) "
                         f"first (ep_group=None for an unsharded model)")
    return blocks


def expert_owners(model: nn.Module) -> dict[str, nn.Module]:
    """State-dict name of every expert weight of `model` -> the expert module holding it (its
    `ep_size` / `ep_group` say how the weight is split over EP ranks)."""
    return {f"{prefix}.experts.{w}": block.experts for prefix, block in model.named_modules()
            if isinstance(block, MoEBlock) for w in EXPERT_PARAM_NAMES}


def is_expert_param(name: str) -> bool:
    """True for a (local-shard) expert weight name, with or without wrapper prefixes
    (`..._fsdp_wrapped_module.`, `_orig_mod.`): reduce its grad over the expert-data-parallel group."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in EXPERT_PARAM_NAMES


# ----------------------------------------------------------------- per-forward contexts
@contextlib.contextmanager
def _setting(blocks: list[MoEBlock], attr: str, values: list):
    previous = [getattr(b, attr) for b in blocks]
    try:
        for b, v in zip(blocks, values):
            setattr(b, attr, v)
        yield
    finally:
        for b, v in zip(blocks, previous):
            setattr(b, attr, v)


_STATE = ("token_weight", "expand", "replay", "recorder", "aux")


def moe_state(blocks: list[MoEBlock], state: list | None = None, *, recompute: bool = False):
    """Without `state`: a snapshot of the blocks' per-forward state. With it: a context that
    puts that snapshot back (and sets `recompute`) for the forwards inside it."""
    if state is None:
        return [tuple(getattr(b, a) for a in _STATE) for b in blocks]
    return _restored(blocks, state, recompute)


@contextlib.contextmanager
def _restored(blocks: list[MoEBlock], state: list, recompute: bool):
    with contextlib.ExitStack() as stack:
        for i, attr in enumerate(_STATE):
            stack.enter_context(_setting(blocks, attr, [s[i] for s in state]))
        stack.enter_context(_setting(blocks, "recompute", [recompute] * len(blocks)))
        yield


@contextlib.contextmanager
def moe_token_weights(model: nn.Module, weights: torch.Tensor | None, expand: torch.Tensor | None = None):
    """How many of the batch's tokens each row stands for, in the forwards inside the context.

    `weights [1, N]` (pack) or `[B, T]` (padded) int: 0 = a synthetic row (EP suffix, CP
    padding, right padding: never dispatched, a zero MoE output, not counted), 1 = a token,
    k = a shared prompt row standing for its group's k copies (dispatched once; counted k
    times in `expert_load` and the aux loss). `expand [W]` int64 (shared prompts, B = 1): the
    row each of the batch's W token slots reads; recorded routing comes back on those slots.
    None weights: every row is one token."""
    blocks = moe_blocks(model)
    if weights is not None and (weights.dim() != 2 or weights.is_floating_point() or weights.dtype == torch.bool):
        raise ValueError(f"moe token weights have shape {tuple(weights.shape)} dtype {weights.dtype}, expected an "
                         f"integer [1, N] or [B, T] tensor (tokens each row stands for, 0 = synthetic)")
    if expand is not None and (expand.dim() != 1 or weights is None or weights.shape[0] != 1):
        raise ValueError(f"moe expand has shape {tuple(expand.shape)}, expected [W] with weights of one row [1, N_c]")
    with _setting(blocks, "token_weight", [weights] * len(blocks)), _setting(blocks, "expand", [expand] * len(blocks)):
        yield


@contextlib.contextmanager
def routing_replay(model: nn.Module, routed_experts: torch.Tensor | None):
    """Replay recorded top-k expert ids (R3) in the forwards inside the context.

    `routed_experts [1, L, K, N]` (pack) or `[B, L, K, T]` (padded) int; L = MoE layers in
    order, K = top-k; -1 (all K slots) keeps live routing for that token and layer. Gate
    weights come from the live router logits at the replayed ids, so the router gets grads.
    None is a no-op."""
    blocks = moe_blocks(model)
    if routed_experts is None:
        yield
        return
    L, K, E = len(blocks), blocks[0].top_k, blocks[0].num_experts
    shape = tuple(routed_experts.shape)
    if routed_experts.dim() != 4:
        raise ValueError(f"routed_experts has shape {shape}, expected [B, L={L}, K={K}, T] ([1, {L}, {K}, N] for a pack)")
    if routed_experts.is_floating_point() or routed_experts.is_complex() or routed_experts.dtype == torch.bool:
        raise ValueError(f"routed_experts has dtype {routed_experts.dtype}, expected an integer dtype")
    if shape[1] != L:
        raise ValueError(f"routed_experts has {shape[1]} MoE layers on axis 1 (shape {shape}), "
                         f"expected L={L}: [B, {L}, {K}, T]")
    if shape[2] != K:
        raise ValueError(f"routed_experts has top-k {shape[2]} on axis 2 (shape {shape}), "
                         f"expected K={K}: [B, {L}, {K}, T]")
    def detail() -> str:
        lo, hi = int(routed_experts.min()), int(routed_experts.max())
        return f"routed_experts holds ids in [{lo}, {hi}], expected -1 (live) or [0, {E})"

    check_on_device(((routed_experts >= -1) & (routed_experts < E)).all(),
                    f"routed_experts holds an id outside -1 (live) or [0, {E})", detail)
    with _setting(blocks, "replay", [(shape, routed_experts[:, i]) for i in range(L)]):
        yield


class RoutingRecord:
    """Top-k ids the MoE blocks used, per layer, over the forwards of a `record_routing` context."""

    def __init__(self, num_layers: int) -> None:
        self.per_layer: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    @property
    def routed_experts(self) -> torch.Tensor:
        """`[B, L, K, T]` int64 (`[1, L, K, N]` for a pack); successive forwards (prefill then
        decode steps) concatenate on the token axis; synthetic rows are -1."""
        if not self.per_layer or not self.per_layer[0]:
            raise ValueError("record_routing: no forward ran inside the context")
        return torch.stack([torch.cat(steps, dim=-1) for steps in self.per_layer], dim=1)


@contextlib.contextmanager
def record_routing(model: nn.Module):
    """`with record_routing(model) as rec: model(...)` then `rec.routed_experts [B, L, K, T]`."""
    blocks = moe_blocks(model)
    rec = RoutingRecord(len(blocks))
    with _setting(blocks, "recorder", rec.per_layer):
        yield rec


@contextlib.contextmanager
def router_aux_loss(model: nn.Module, enabled: bool = True):
    """`with router_aux_loss(model) as aux: model(...)`; then `aux` holds one (loss, tokens)
    per MoE layer and forward: the load-balancing loss of `MoEBlock._balance_loss`, with
    gradients to the routers, and the batch tokens it covers (a 0-d tensor: synthetic rows
    excluded, shared prompt rows counted per sample). Weight each by its tokens to average."""
    blocks = moe_blocks(model, strict=False) if enabled else []
    found: list = []
    with _setting(blocks, "aux", [found] * len(blocks)):
        yield found


# -------------------------------------------------------------------------- load
@torch.no_grad()
def reset_expert_load(model: nn.Module) -> None:
    for block in moe_blocks(model):
        block.load.zero_()


@torch.no_grad()
def expert_load(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict:
    """Token-slot pairs per expert since the last `reset_expert_load` (synthetic rows excluded,
    shared prompt rows counted once per sample they stand for: the unshared batch's figures).

    Counts are this rank's tokens; with `group` (e.g. the EP group) they are summed over it,
    which makes `per_rank` what each EP rank received. Returns
    `per_layer [L, E]`, `per_expert [E]` (summed over layers), `per_rank [ep]` (per_expert
    summed over each EP rank's experts), and floats `max_rank_load`, `mean_rank_load`,
    `imbalance` (max / mean; 1.0 is perfect balance, 0.0 if nothing was dispatched)."""
    blocks = moe_blocks(model)
    per_layer = torch.stack([b.load for b in blocks])
    if group is not None and _group_size(group) > 1:
        per_layer = per_layer.to(_collective_device(group))
        dist.all_reduce(per_layer, group=group)
    per_layer = per_layer.cpu()
    per_expert = per_layer.sum(0)
    per_rank = per_expert.view(blocks[0].experts.ep_size, -1).sum(1)
    mx, mean = float(per_rank.max()), float(per_rank.double().mean())
    return {
        "per_layer": per_layer,
        "per_expert": per_expert,
        "per_rank": per_rank,
        "max_rank_load": mx,
        "mean_rank_load": mean,
        "imbalance": mx / mean if mean > 0 else 0.0,
    }

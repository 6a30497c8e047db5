"""Context-parallel helpers for tests/test_context_parallel.py and the gloo worker it launches.

`cp_checks(rank, world_size)` runs on every rank of a cp-sized gloo group
(testing/distributed.py), runs every CP case once and returns the outputs; the test compares
them with a one-process reference built from stock "sdpa" on the padded batch (code that
never touches model/context_parallel.py or runtime/cp_shard.py). Every rank builds the same
seeded model and batches itself, so only results cross processes.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import transformers

from model.actor import _slot_targets
from model.context_parallel import CP_VARLEN, CPContext, attention_mask, cp_model_inputs
from runtime.cp_shard import _restore_full_sequence, cp_layout, shard, shard_tokens, unshard
from model.models import TINY
from runtime.parallel_dims import ParallelDims, build_mesh
from packing.collate import make_experience_batch
from packing.experience import Experience

LENGTHS = [1, 2, 3, 11, 30, 17]  # 1, 2, 3: shorter than 2*cp; the rest uneven
SINGLE = [23]  # a pack of one sequence
CHANGED = 4  # the sequence the leakage case redraws


def tiny_qwen3(attn_implementation: str) -> transformers.Qwen3ForCausalLM:
    """The tiny Qwen3 (model/models.py TINY) built by transformers directly, not by build_model:
    with "sdpa" it is a reference that runs no code of model/."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY)).float()
    model.config._attn_implementation = attn_implementation
    return model


def records(lengths, seed: int = 0, *, redraw: int | None = None) -> list[Experience]:
    """Seeded records; `redraw` gives that one sequence new token ids (same length)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, TINY["vocab_size"], (n,), generator=gen)
        prompt = int(torch.randint(1, max(n, 2), (1,), generator=gen))
        if i == redraw:
            ids = torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(999))
        out.append(Experience(sequences=ids, action_mask=torch.arange(n - 1) >= prompt - 1))
    return out


def batches() -> dict[str, Experience]:
    recs = records(LENGTHS)
    return {
        "packed": make_experience_batch(recs, packed=True),
        "padded": make_experience_batch(recs, packed=False),
        "single": make_experience_batch(records(SINGLE, seed=1), packed=True),
        "changed": make_experience_batch(records(LENGTHS, redraw=CHANGED), packed=True),
    }


def token_logp(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_mean_loss(logp: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    return -(logp * action_mask).sum() / action_mask.sum()


# ------------------------------------------------------------ the CP forward
def local_slots(batch: Experience, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slot targets and validity, as the actor's CP forward shards them."""
    targets, valid = _slot_targets(batch)
    return shard_tokens(targets, layout), shard_tokens(valid, layout, fill=False)


def cp_log_probs(model, batch: Experience, cp_group, cp: int, rank: int, *, zigzag: bool = True,
                 control: str | None = None) -> torch.Tensor:
    """Log-probs in the layout of `batch.action_mask`, as the actor's CP forward computes them.

    control: "wrong_order" feeds contiguous chunks under the zigzag metadata; "no_gather"
    lets each rank attend to its own keys only; "naive_restore" gathers the outputs with
    torch.distributed.nn.functional.all_gather, whose backward sums over ranks.
    """
    local, layout = shard(batch, cp, rank, zigzag=zigzag)
    inputs = cp_model_inputs(local, layout, cp_group)
    if control == "wrong_order":
        contiguous, _ = shard(batch, cp, rank, zigzag=False)
        inputs.update(input_ids=contiguous.sequences, position_ids=contiguous.position_ids)
    elif control == "no_gather":
        s = layout.num_local
        own_keys = attention_mask(layout)[..., rank * s:(rank + 1) * s]
        inputs["cp_context"] = CPContext(layout=layout, group=None, mask=own_keys)
    hidden = model.model(**inputs).last_hidden_state
    targets, valid = local_slots(batch, layout)
    logp = token_logp(model.lm_head(hidden), targets).masked_fill(~valid, 0.0)
    if control == "naive_restore":
        with warnings.catch_warnings():  # deprecated in torch 2.13, still the stock differentiable gather
            warnings.simplefilter("ignore", FutureWarning)
            full = unshard(torch.cat(dist_fn.all_gather(logp, group=cp_group), dim=1), layout)
    else:
        full = _restore_full_sequence(logp, layout, cp_group)
    return full if batch.is_packed else full[:, :-1]


def _grads(model, cp_group) -> dict[str, torch.Tensor]:
    """Parameter gradients SUMmed over the CP group, as the trainer reduces them."""
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    flat = torch.cat([model.get_parameter(n).grad.flatten() for n in names])
    dist.all_reduce(flat, group=cp_group)
    sizes = [model.get_parameter(n).numel() for n in names]
    return {n: g.view_as(model.get_parameter(n)) for n, g in zip(names, flat.split(sizes))}


def _logp_and_grads(model, batch, group, cp, rank, **kw) -> dict:
    model.zero_grad(set_to_none=True)
    logp = cp_log_probs(model, batch, group, cp, rank, **kw)
    token_mean_loss(logp, batch.action_mask).backward()
    return {"logp": logp.detach(), "grads": _grads(model, group)}


def cp_checks(rank: int, world_size: int) -> dict:
    dims = ParallelDims(cp=world_size, world_size=world_size)
    build_mesh(dims)
    group, cp = dims.cp_group, dims.cp
    model = tiny_qwen3(CP_VARLEN)
    b = batches()
    out = {
        "packed": _logp_and_grads(model, b["packed"], group, cp, rank),
        "padded": _logp_and_grads(model, b["padded"], group, cp, rank),
        "naive_restore": _logp_and_grads(model, b["packed"], group, cp, rank, control="naive_restore"),
    }
    with torch.no_grad():
        for name, batch, kw in [
            ("single", b["single"], {}),
            ("changed", b["changed"], {}),
            ("contiguous", b["packed"], {"zigzag": False}),
            ("wrong_order", b["packed"], {"control": "wrong_order"}),
            ("no_gather", b["packed"], {"control": "no_gather"}),
        ]:
            out[name] = {"logp": cp_log_probs(model, batch, group, cp, rank, **kw)}
    out["dims"] = {"dp": dims.dp, "cp": dims.cp, "cp_rank": dims.cp_rank, "dp_group": dims.dp_group,
                   "cp_group_ranks": dist.get_process_group_ranks(group)}
    out["local_tokens"] = cp_layout(b["packed"], cp, rank).num_local
    out["shared"] = shared_prompt_checks(dims)
    if world_size == 4:  # the same world as dp=2 x cp=2 with ep=2: every group's ranks
        mixed = ParallelDims(cp=2, ep=2, world_size=4)
        build_mesh(mixed)
        groups = {name: getattr(mixed, f"{name}_group") for name in ("dp", "cp", "ep")}
        out["groups_dp2_cp2_ep2"] = {name: None if g is None else dist.get_process_group_ranks(g)
                                     for name, g in groups.items()}
        out["groups_dp2_cp2_ep2"]["expert_fsdp"] = mixed.expert_fsdp_mesh.mesh.tolist()
        out["groups_dp2_cp2_ep2"]["fsdp"] = mixed.fsdp_mesh.mesh.tolist()
    return out


# --------------------------------------------------- shared prompts under CP (same launch)
def shared_prompt_checks(dims) -> dict:
    """The shared-prompt forward of the tiny Qwen3 under this CP group (the compressed rows
    sharded with the 2*cp zigzag, model/actor.py `_shared_prompt_shard`) against the unshared
    pack in one process ("varlen"): log-probs (every rank holds them all) and the parameter
    gradients summed over the CP group, as (diff, scale); the rows each rank's body ran; and a
    control (the CP mask without the units' segments: responses see their siblings)."""
    from runtime import cp_shard as cpmod  # where `shard` finds cp_layout
    from model.actor import Actor
    from test_shared_prompt import body_tokens
    from testing.records import grpo_records

    pack = make_experience_batch(grpo_records(), packed=True)

    def loss_of(lp):
        mask = pack.action_mask.float()
        return -(pack.advantages * lp * mask).sum() / mask.sum()

    reference = tiny_qwen3("varlen")
    ref_lp = Actor(reference)(pack)
    loss_of(ref_lp).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    def run(control: bool = False):
        model = tiny_qwen3(CP_VARLEN)
        layout = cpmod.cp_layout
        if control:
            cpmod.cp_layout = lambda *a, segments=None, **k: layout(*a, **k)
        try:
            with body_tokens(model) as seen:
                lp = Actor(model, dims=dims, share_prompts=True)(pack)
            loss_of(lp).backward()
        finally:
            cpmod.cp_layout = layout
        grads = _grads(model, dims.cp_group)
        return {"log_probs": (float((lp - ref_lp).abs().max()), float(ref_lp.abs().max())),
                "grads": (max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()),
                          max(float(g.abs().max()) for g in ref_grads.values())),
                "seen": seen}

    unit_lens = [prefix + sum(rs) for prefix, rs in pack.shared_prompts.units]
    unit = 2 * dims.cp
    return {**run(), "control_no_segments": run(control=True), "n": pack.sequences.shape[1],
            "rows": pack.shared_prompts.keep.numel(),
            "local_rows": sum(-(-n // unit) * unit for n in unit_lens) // dims.cp}


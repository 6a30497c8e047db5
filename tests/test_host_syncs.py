"""Host syncs in one actor forward, and in a whole training step, counted on the CPU (issues 25.3, 42.6).

A device-to-host read (`.item()`, `bool()`/`int()` of a tensor, `.tolist()`, `.cpu()`,
`.numpy()`, and ops whose output shape depends on the data: `nonzero`, boolean indexing,
`masked_select`, `unique`) stalls a GPU's queue. testing/host_syncs.py counts them in a
forward by kind and by where in the code they happen, and the tests assert the exact list. What remains, and why:

* transformers' `create_causal_mask` (masking_utils.py, once per forward): it looks for
  packed sequences in `position_ids` whenever `attention_mask` is None (transformers 5.18;
  Qwen3-MoE and Llama accept no precomputed mask mapping that would skip it).
* `actions_only` (the trainer's setting): one `nonzero` of the action slots, the lm head's
  row count (a data-dependent shape).
* MoE: one `tolist` per MoE layer, the per-expert counts: the split sizes of the grouped
  expert matmuls (and of the EP exchange).

Everything the host already knows is not read back: attention lengths (`max_length_k`,
`packed_seq_lens`, the shared-prompt layout's), the shared-prompt layout itself (built by the
collate), the token-id and routing-record checks (device-side assertions, model/checks.py),
and the EP count all-reduce, which runs only when ep > 1.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from testing.host_syncs import count_host_syncs
from testing.records import grpo_records

from model import attention
from model.actor import Actor, Critic
from model.models import build_model
from model.moe import moe_blocks, record_routing, shard_experts
from packing.collate import make_experience_batch

MASK = ("scalar", "masking_utils.py")  # transformers' packed-sequence detection
ACTIONS = ("shape", "actor.py")  # actions_only: the lm head's rows (a nonzero)
EXPERTS = ("to_host", "moe.py")  # per MoE layer: the per-expert counts (a tolist)


@pytest.fixture(scope="module")
def pack():
    return make_experience_batch(grpo_records(), packed=True)


@pytest.fixture(scope="module")
def dense():
    return build_model("qwen3", seed=0)


@pytest.fixture(scope="module")
def moe():
    return shard_experts(build_model("qwen3_moe", seed=0), None)


def syncs(module, batch, **kw) -> collections.Counter:
    """(kind, file) -> count of the host syncs of one no-grad forward (testing/host_syncs.py's kinds)."""
    with torch.no_grad(), count_host_syncs() as counted:
        module(batch, **kw)
    return collections.Counter((kind, Path(at.rsplit(" @ ", 1)[1].rsplit(":", 1)[0]).name)
                               for kind, hits in counted.where.items() for at in hits)


@pytest.mark.parametrize("share", [False, True])
def test_a_dense_forward_reads_back_only_what_transformers_asks(dense, pack, share):
    assert syncs(Actor(dense, share_prompts=share), pack, return_entropy=True) == {MASK: 1}
    assert syncs(Actor(dense, share_prompts=share, actions_only=True), pack) == {MASK: 1, ACTIONS: 1}
    assert syncs(Critic(dense, share_prompts=share), pack) == {MASK: 1}


@pytest.mark.parametrize("share", [False, True])
def test_a_moe_forward_adds_one_read_per_layer_for_the_expert_split_sizes(moe, pack, share):
    layers = len(moe_blocks(moe))
    actor = Actor(moe, share_prompts=share, actions_only=True)
    assert syncs(actor, pack) == {MASK: 1, ACTIONS: 1, EXPERTS: layers}
    with torch.no_grad(), record_routing(moe) as rec:  # routing replay's checks are device-side too
        Actor(moe)(pack)
    replayed = dataclasses.replace(pack, routed_experts=rec.routed_experts)
    assert syncs(actor, replayed) == {MASK: 1, ACTIONS: 1, EXPERTS: layers}


def test_the_ep_count_all_reduce_runs_only_when_ep_is_above_one(moe, pack, monkeypatch):
    """At ep = 1 (no group) the suffix is 0 without a collective: a forward with every
    collective patched to fail runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("a collective ran at ep=1")

    monkeypatch.setattr(dist, "all_reduce", refuse)
    monkeypatch.setattr(dist, "all_to_all_single", refuse)
    for share in (False, True):
        assert syncs(Actor(moe, share_prompts=share), pack)[MASK] == 1


def test_control_the_counter_catches_an_injected_item_and_cpu(dense, pack, monkeypatch):
    """The same forward with one `.item()` and one `.cpu()` per attention layer: counted, at
    the file that made them."""
    layers = dense.config.num_hidden_layers
    right = attention._per_sequence_sdpa

    def reading(module, query, *args):
        query.sum().item()
        query[0, 0, :1].cpu()
        return right(module, query, *args)

    monkeypatch.setattr(attention, "_per_sequence_sdpa", reading)
    hits = syncs(Actor(dense), pack)
    assert hits == {MASK: 1, ("scalar", "test_host_syncs.py"): layers,
                    ("to_host", "test_host_syncs.py"): layers}, hits


def test_control_device_lengths_alone_are_read_back_per_layer(dense, pack, monkeypatch):
    """A caller that gives the boundaries as device tensors only (no `packed_seq_lens`, no
    `max_length_k`): the kernel must read them back, and the counter sees it in every layer."""
    right = attention.packed_attn_kwargs

    def device_only(*args, **kwargs):
        out = right(*args, **kwargs)
        return {k: v for k, v in out.items() if k not in ("packed_seq_lens", "max_length_q", "max_length_k")}

    from model import actor as actor_module

    monkeypatch.setattr(actor_module, "packed_attn_kwargs", device_only)
    hits = syncs(Actor(dense), pack)
    layers = dense.config.num_hidden_layers
    assert hits[("scalar", "attention.py")] == layers  # the longest sequence, per layer
    assert hits[("to_host", "attention.py")] == 2 * layers  # cu_seq_lens_q/k, per layer


# ------------------------------------------------ a whole training step (issue 42.6)
GUARD = ("scalar", "guard.py")  # rl/trainer/guard.py: the non-finite verdict of each loss term, read per update
STEP = ("scalar", "trainer.py")  # the global norm's finite check (skip the update) and the step's metric sums


def _training_syncs(model: str) -> tuple[collections.Counter, int]:
    """Host syncs of the training stage of one step (every microbatch's forward and backward, the clipping
    and the optimizer step) of a one-process trainer, AdamW fused as on CUDA (rl/trainer/trainer.py
    `adamw_options`: torch's default CPU AdamW reads each parameter's step count, a CPU-only cost), and the
    number of policy forwards it ran. The rollout's decode loop: tests/test_decode_syncs.py; the sample
    bookkeeping (plan, collate, advantages) runs on host-resident records and is not a device read."""
    from testing.inprocess import SMALL, trainer

    tr = trainer(model, *SMALL, "trainer.device=cpu")
    for group in tr.optimizer.param_groups:
        group["fused"] = True
    forwards, counted, right, train = [], collections.Counter(), Actor.forward, tr.train

    def forward(self, *args, **kwargs):
        forwards.append(1)
        return right(self, *args, **kwargs)

    def training(*args, **kwargs):
        with count_host_syncs() as hits:
            out = train(*args, **kwargs)
        counted.update((kind, Path(at.rsplit(" @ ", 1)[1].rsplit(":", 1)[0]).name)
                       for kind, where in hits.where.items() for at in where)
        return out

    tr.train = training
    tr.step(0)  # the first step builds the optimizer state
    counted.clear()
    Actor.forward = forward
    try:
        tr.step(1)
    finally:
        Actor.forward = right
    return counted, len(forwards)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["model=dense_tiny", "model=moe_tiny"])
def test_a_training_step_reads_back_the_forwards_syncs_and_one_verdict_per_update(model):
    """Per forward: transformers' mask check, the action rows (actions_only) and, MoE, the per-expert
    counts per layer; per update: the guard's three term flags (read twice) and the trainer's finite
    check and metric sum. Nothing per parameter, per layer of the backward or per gradient."""
    counted, forwards = _training_syncs(model)
    layers = 2 if model == "model=moe_tiny" else 0  # the tiny MoE: every layer sparse
    want = {MASK: forwards, ACTIONS: forwards, GUARD: 6, STEP: 2}
    if layers:
        want[EXPERTS] = layers * forwards
    assert forwards >= 1 and counted == want, (forwards, counted)

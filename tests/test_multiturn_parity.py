"""Multi-turn episodes: a record with holes scores, trains and shards like its turns scored one by one.

A multi-turn record (rl/rollout/episodes.py) is the whole episode, `sequences [T]` = prompt,
reply 1, observation 1, reply 2, ...; its `action_mask [T-1]` is True on the slots that score
sampled tokens and False on the observation's: it has holes. The per-turn reference of turn t
is `make_record(context before reply t, reply t, ...)` scored alone: a record without holes,
the shape the rest of the suite covers. Slot k of both scores token k+1 of the same tokens, so
on reply t's slots the episode and its turn t must agree:

* forward (model/actor.py `Actor`, `actions_only=True` as the trainer builds it): log-probs and
  entropy of the packed collate (shared prompts on and off) and of the padded one, dense and MoE
  (live routing, and replaying the record's `routed_experts`), within the suite's 16 eps32
  (tests/parity_check.py);
* losses (rl/trainer/trainer.py `train_microbatch` on the holey pack): every registered policy
  loss under every `loss_agg`, truncated IS per token and per sequence, the KL and entropy terms,
  the step's metrics and the parameter gradients, against the library's losses on hole-free rows
  gathered from the per-turn forwards, each turn with its episode's advantage and its slice of the
  old / rollout / reference log-probs (an episode is one sequence: GSPO's ratio, sequence TIS and
  the seq-mean modes are per episode, over its turns' action tokens);
* advantages: GAE and REINFORCE++ on a holey row are the recursion over the action slots only,
  carried across the hole (computed here by hand);
* context parallelism (slow, one gloo launch): the holey pack at cp=2 equals one process.

Each parity has a control that misses by >= 1000 x the tolerance: a turn's context without its
observation, a shared-prompt layout that cuts a member at its hole, a mask without holes, a
recursion that steps through the hole, CP chunks in the wrong order.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from tests.parity_check import assert_control_fails, assert_parity, max_abs
from test_host_syncs import dense, moe  # noqa: F401 - fixtures (tiny Qwen3 / Qwen3-MoE)
from test_shared_moe import routing_per_sample
from test_shared_prompt import body_tokens, scored

from model import actor as actor_module
from model.actor import Actor
from model.models import build_model
from model.moe import moe_blocks, record_routing
from packing.collate import make_experience_batch
from packing.experience import Experience, Kind
from packing.prompts import layout_of_units
from rl.algos.advantages import compute_advantages
from rl.algos.losses import (POLICY_LOSSES, LossAgg, TISLevel, aggregate, loss_normalizer, policy_loss,
                             value_loss)
from rl.rollout.engine import make_record

# GRPO groups: (prompt length, episodes); an episode is its turns' (reply, observation) lengths,
# the last observation 0 (the episode ended). Three-, two- and one-turn episodes share a prompt;
# one-token replies and observations; a group of one (nothing shared).
GROUPS = [
    (7, [((3, 2), (4, 0)), ((5, 1), (2, 3), (3, 0)), ((6, 0),), ((1, 4), (5, 0))]),
    (11, [((4, 3), (3, 0)), ((2, 5), (6, 0)), ((3, 1), (1, 0))]),
    (5, [((4, 2), (3, 0))]),
]


@dataclass
class Episode:
    """A multi-turn record and where its replies lie: reply t is `record.sequences[a:b]`, `(a, b) = replies[t]`."""

    record: Experience
    replies: list[tuple[int, int]]


def episodes(groups=GROUPS, *, seed: int = 0, vocab: int = 256, holes: bool = True) -> list[Episode]:
    """Records as `run_episodes` writes them (`make_record(..., actions=...)`; `rollout_log_probs` the
    replies' sampled log-probs, 0 on the observations), shuffled so a pack interleaves the groups.
    `holes=False` (a control): the same tokens with the observations' slots True too."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for index, (p, group) in enumerate(groups):
        prompt = torch.randint(0, vocab, (p,), generator=gen)
        for turns in group:
            tokens, actions, log_probs, replies, start = [], [], [], [], p
            for reply, observation in turns:
                for n, sampled in ((reply, True), (observation, False)):
                    tokens.append(torch.randint(0, vocab, (n,), generator=gen))
                    actions.append(torch.full((n,), sampled or not holes))
                    log_probs.append(-3 * torch.rand(n, generator=gen) if sampled else torch.zeros(n))
                replies.append((start, start + reply))
                start += reply + observation
            rec = make_record(prompt, torch.cat(tokens), torch.cat(log_probs), index, actions=torch.cat(actions))
            out.append(Episode(rec, replies))
    random.Random(seed).shuffle(out)
    return out


def turn_records(ep: Episode, *, drop_observation: bool = False) -> list[Experience]:
    """The per-turn references: turn t is `make_record(context before reply t, reply t, ...)`, a
    record without holes; the episode's other action fields on its reply's slots (0 before, as on
    a prompt) and its routing (`[L, K, T]`) cut to the turn's tokens. `drop_observation` (a
    control): the context without the observation just before the reply."""
    rec, out = ep.record, []
    for t, (a, b) in enumerate(ep.replies):
        context = rec.sequences[:a]
        if drop_observation and t:
            context = context[:ep.replies[t - 1][1]]  # reply t-1 ends where its observation starts
        turn = make_record(context, rec.sequences[a:b], rec.rollout_log_probs[a - 1:b - 1], int(rec.prompt_index))
        if not drop_observation:
            assert torch.equal(turn.action_mask, rec.action_mask[:b - 1] & (torch.arange(b - 1) >= a - 1))
            for name, value in rec.present(Kind.ACTION).items():
                if name != "action_mask":
                    setattr(turn, name, torch.where(turn.action_mask, value[:b - 1], 0))
            if rec.routed_experts is not None:
                turn.routed_experts = rec.routed_experts[..., :b]
        out.append(turn)
    return out


def records_of(eps: list[Episode]) -> list[Experience]:
    return [ep.record for ep in eps]


def alone(actor: Actor, turn: Experience) -> list[torch.Tensor]:
    """A record scored alone (a pack of one): its log-probs and entropy on its action slots."""
    batch = make_experience_batch([turn], packed=True)
    return [scored(o, batch, [turn])[0] for o in actor(batch, return_entropy=True)]


def per_turn(actor: Actor, eps: list[Episode], **kw) -> list[list[torch.Tensor]]:
    """Per episode: its turns scored alone, concatenated in slot order (log-probs, entropy)."""
    out = []
    for ep in eps:
        parts = [alone(actor, turn) for turn in turn_records(ep, **kw)]
        out.append([torch.cat(p) for p in zip(*parts)])
    return out


def compare(what: str, got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    assert [g.shape for g in got] == [r.shape for r in ref], what
    return assert_parity(what, max_abs(g - r for g, r in zip(got, ref)), max_abs(ref))


# ------------------------------------------------------------------ the records
def test_an_episode_record_has_holes_where_its_observations_are():
    eps = episodes()
    assert len({int(ep.record.prompt_index) for ep in eps}) == len(GROUPS)
    for ep in eps:
        rec, mask = ep.record, ep.record.action_mask
        expected = torch.zeros_like(mask)
        for a, b in ep.replies:
            expected[a - 1:b - 1] = True  # slot k scores token k+1
        assert torch.equal(mask, expected)
        assert rec.action_tokens == sum(b - a for a, b in ep.replies)
        holes = len(ep.replies) > 1
        assert holes == bool((~mask[ep.replies[0][0] - 1:]).any())
        assert not rec.rollout_log_probs[~mask].any()
    turns = [t for ep in eps for t in turn_records(ep)]
    # the per-turn references score exactly the episodes' action tokens
    assert loss_normalizer(turns, LossAgg.TOKEN_MEAN) == loss_normalizer(records_of(eps), LossAgg.TOKEN_MEAN)
    pack = make_experience_batch(records_of(eps), packed=True)
    # shared prompts: the groups of several episodes share their prompt whatever their turns
    assert sorted(len(rs) for p, rs in pack.shared_prompts.units if rs) == [3, 4]


# ------------------------------------------------------------------ 1. the forward
def replayed_episodes(model) -> list[Episode]:
    """Episodes carrying the routing a perturbed router (the rollout policy) chose on them."""
    eps = episodes()
    rollout = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for block in moe_blocks(rollout):
            block.gate.weight.add_(0.2 * torch.randn(block.gate.weight.shape, generator=gen))
    pack = make_experience_batch(records_of(eps), packed=True)
    with torch.no_grad(), record_routing(rollout) as rec:
        Actor(rollout)(pack)
    routed = routing_per_sample(rec.routed_experts, pack, records_of(eps))
    return [Episode(dataclasses.replace(ep.record, routed_experts=r), ep.replies) for ep, r in zip(eps, routed)]


@pytest.mark.parametrize("case", ["dense", "moe-live", "moe-replayed"])
def test_a_holey_episode_scores_like_its_turns_scored_alone(case, dense, moe):
    """Log-probs and entropy on every action slot: packed (shared prompts on and off) and padded
    collates of the episodes vs each turn's reference record scored alone."""
    model = dense if case == "dense" else moe
    eps = replayed_episodes(moe) if case == "moe-replayed" else episodes()
    records = records_of(eps)
    with torch.no_grad():
        reference = per_turn(Actor(model, actions_only=True), eps)
        for layout, share in (("packed", False), ("packed", True), ("padded", True)):
            batch = make_experience_batch(records, packed=layout == "packed")
            with body_tokens(model) as seen:
                lp, ent = Actor(model, actions_only=True, share_prompts=share)(batch, return_entropy=True)
            if layout == "packed" and share:  # the shared forward ran: each prompt once
                assert seen == [batch.shared_prompts.keep.numel()] and seen[0] < batch.sequences.numel()
            for name, values, ref in (("log-probs", lp, [r[0] for r in reference]),
                                      ("entropy", ent, [r[1] for r in reference])):
                compare(f"{case} {layout} share_prompts={share} {name} vs per-turn", scored(values, batch, records),
                        ref)
    if case == "moe-replayed":  # the replay took: live routing differs from the record
        with torch.no_grad(), record_routing(model) as rec:
            Actor(model, replay=False)(make_experience_batch(records, packed=True))
        assert not torch.equal(rec.routed_experts, make_experience_batch(records, packed=True).routed_experts)


def test_control_a_turn_scored_without_its_observation_misses(dense):
    """The per-turn reference with the observation cut out of its context: later turns' log-probs
    are far from the episode's (the first turn's, whose context is the prompt, are not)."""
    eps = episodes()
    records = records_of(eps)
    with torch.no_grad():
        pack = make_experience_batch(records, packed=True)
        lp = scored(Actor(dense, actions_only=True)(pack), pack, records)
        wrong = per_turn(Actor(dense, actions_only=True), eps, drop_observation=True)
    # past the first reply: the slots whose context holds an observation
    later = [(x[b - a:], w[0][b - a:]) for ep, x, w in zip(eps, lp, wrong) for a, b in ep.replies[:1]
             if len(ep.replies) > 1]
    assert_control_fails("later turns scored without the observation", max_abs(x - w for x, w in later),
                         max_abs(x for x, _ in later))


def test_control_a_shared_layout_that_cuts_a_member_at_its_hole_misses(dense, monkeypatch):
    """Shared prompts whose member segments end at the first hole (each later turn a segment of its
    own, seeing the prompt but not the turns before it): far from the per-turn reference."""
    eps = episodes()
    records = records_of(eps)
    pack = make_experience_batch(records, packed=True)
    with torch.no_grad():
        reference = [r[0] for r in per_turn(Actor(dense, actions_only=True), eps)]
    view = actor_module._shared_prompt_view

    def cut_at_the_hole(*args):
        shared = view(*args)
        layout = shared.inputs["shared_prompts"]
        act = pack.action_mask[0, layout.keep]  # the compressed rows' slots
        units, row = [], 0
        for p, responses in layout.units:
            row += p
            segments = []
            for r in responses:  # a member's segment opens on its first action slot
                holes = (~act[row:row + r]).nonzero()
                first = int(holes[0]) if holes.numel() else r
                segments += [first, r - first] if first < r else [r]
                row += r
            units.append((p, segments))
        shared.inputs["shared_prompts"] = layout_of_units(units, layout.keep, layout.expand)
        return shared

    monkeypatch.setattr(actor_module, "_shared_prompt_view", cut_at_the_hole)
    with torch.no_grad():
        lp = scored(Actor(dense, actions_only=True, share_prompts=True)(pack), pack, records)
    assert_control_fails("shared layout cut at the hole vs per-turn", max_abs(x - r for x, r in zip(lp, reference)),
                         max_abs(reference))


# ------------------------------------------------------------------ 2. the losses
TERMS = ("loss", "policy_loss", "kl_loss", "value_loss", "entropy", "clip_ratio", "approx_kl", "kl",
         "rollout_logprob_abs_diff", "rollout_kl")


@pytest.fixture(scope="module")
def tr():
    """The trainer of `model=dense_tiny` (its Actor: actions_only, share_prompts), with a critic (GAE),
    a KL loss to a reference, an entropy bonus, truncated IS and dual-clip on: every term of
    `train_microbatch`."""
    from testing.inprocess import SMALL, trainer

    return trainer("model=dense_tiny", *SMALL, "algo.advantage=gae", "algo.kl_coef=0.05", "algo.entropy_coef=0.01",
                   "algo.tis_cap=2.0", "algo.dual_clip=3.0")


@pytest.fixture(scope="module")
def scored_episodes(tr):
    """Episodes with every field the losses read, as the step has them: old log-probs near the
    current policy's (so some ratios clip), rollout and reference log-probs near those, each
    episode's advantage, old values near the critic's (some clip) and returns, on its action
    slots, and finite garbage on the holes (no loss may read it). And the control's records: the
    same tokens and values with the observations' slots True and the same kind of values there
    (the environment's tokens trained as if the policy had sampled them)."""
    eps = episodes(vocab=tr.actor.model.config.vocab_size, seed=3)
    records = records_of(eps)
    without_holes = records_of(episodes(vocab=tr.actor.model.config.vocab_size, seed=3, holes=False))
    with torch.no_grad():
        pack = make_experience_batch(records, packed=True)
        current = dataclasses.replace(pack, action_mask=make_experience_batch(without_holes, packed=True).action_mask)
        current = dataclasses.replace(current, action_log_probs=tr.actor(current), values=tr.critic(current)).split()
    gen = torch.Generator().manual_seed(11)
    noise = lambda like, scale: scale * torch.randn(like.shape, generator=gen)  # noqa: E731
    for rec, full, now in zip(records, without_holes, current):
        assert torch.equal(rec.sequences, full.sequences)
        m = rec.action_mask
        shift = 0.3 * torch.randn((), generator=gen)  # per episode: GSPO's sequence ratios clip too
        old = now.action_log_probs + shift + noise(m, 0.3)
        fields = {"action_log_probs": old, "rollout_log_probs": old + noise(m, 0.2),
                  "base_action_log_probs": old + noise(m, 0.2),
                  "advantages": torch.randn((), generator=gen).expand(m.shape).clone(),
                  "values": now.values + noise(m, 0.3), "returns": noise(m, 1.0)}
        for name, value in fields.items():
            setattr(full, name, value)
            setattr(rec, name, torch.where(m, value, noise(m, 2.0)))
    return SimpleNamespace(episodes=eps, without_holes=without_holes)


def grads_of(*modules) -> dict[str, torch.Tensor]:
    """The parameter gradients of the modules (by module index and name), then zeroed."""
    out = {f"{i}.{n}": p.grad.clone() for i, mod in enumerate(modules) for n, p in mod.named_parameters()
           if p.grad is not None}
    for mod in modules:
        mod.zero_grad(set_to_none=True)
    return out


def trainer_terms(tr, records: list[Experience]) -> tuple[dict, dict]:
    """`train_microbatch` on the records' pack as the step's only microbatch: its terms and grads."""
    from rl.trainer.trainer import Stats

    pack = make_experience_batch(records, packed=True)
    mb = SimpleNamespace(plan=SimpleNamespace(normalizer=loss_normalizer(records, tr.cfg.algo.loss_agg),
                                              tokens=loss_normalizer(records, LossAgg.TOKEN_MEAN),
                                              all_tokens=sum(r.sequences.numel() for r in records)))
    stats = Stats()
    grads_of(tr.actor, tr.critic)
    tr.train_microbatch(pack, 1.0, mb, stats)
    return {k: v.float() for k, v in stats.sums.items()}, grads_of(tr.actor, tr.critic)


def per_turn_terms(tr, eps: list[Episode]) -> tuple[dict, dict, dict]:
    """The same terms from the per-turn references: the turn records (no holes) scored in one pack
    (the trainer's actor; a pack scores each record as alone, above), their action slots (the
    forward's log-probs and entropy, its slice of the old / rollout / reference log-probs and the
    episode's advantage) gathered into one hole-free row per episode, then the library's losses on
    those rows as the trainer composes them. Returns the terms, their magnitudes (the same sums over
    |per-token term|: the scale a rounding error is relative to) and the gradients."""
    algo = tr.cfg.algo
    fields = ("action_log_probs", "rollout_log_probs", "base_action_log_probs", "advantages", "values", "returns")
    cols = {}
    grads_of(tr.actor, tr.critic)
    turns = [turn_records(ep) for ep in eps]
    flat = [t for ts in turns for t in ts]
    batch = make_experience_batch(flat, packed=True)  # hole-free records: one pack, scored once
    lp, ent = tr.actor(batch, return_entropy=True)
    cols["lp"], cols["ent"] = scored(lp, batch, flat), scored(ent, batch, flat)
    cols["v"] = scored(tr.critic(batch), batch, flat)
    for name in fields:
        cols[name] = [getattr(t, name)[t.action_mask] for t in flat]
    lens = [sum(t.action_tokens for t in ts) for ts in turns]
    c = {k: torch.cat(v).unsqueeze(0) for k, v in cols.items()}
    m = c["lp"].shape[1]
    rows = Experience(action_mask=torch.ones(1, m, dtype=torch.bool), packed_seq_lens=lens,
                      **{name: c[name] for name in fields})
    normalizer = m if LossAgg.parse(algo.loss_agg, "loss_agg") is LossAgg.TOKEN_MEAN else len(lens)

    def agg(x):
        return aggregate(x, rows, algo.loss_agg, normalizer, token_sum_norm=tr.objective.token_sum_norm)

    lp, ent = c["lp"], c["ent"]
    pg, info = policy_loss(lp, rows, algo)
    kl = tr.objective.kl(lp, rows.base_action_log_probs)
    coef, bonus = tr.kl_ctl.value, algo.entropy_coef
    gap = lp.detach() - rows.rollout_log_probs
    per_token = {"policy_loss": pg, "kl_loss": kl, "entropy": ent, "clip_ratio": info["clip_ratio"],
                 "approx_kl": info["approx_kl"], "kl": tr.objective.kl(lp.detach(), rows.base_action_log_probs, "k3"),
                 "rollout_logprob_abs_diff": gap.abs(), "rollout_kl": gap.exp() - 1 - gap,
                 "value_loss": value_loss(c["v"], rows, algo.value_clip)}
    terms = {k: v.sum() / m for k, v in per_token.items()}
    scale = {k: v.abs().sum() / m for k, v in per_token.items()}
    for k in ("policy_loss", "kl_loss", "value_loss"):
        terms[k], scale[k] = agg(per_token[k]), agg(per_token[k].abs())
    terms["value_loss"], scale["value_loss"] = algo.vf_coef * terms["value_loss"], algo.vf_coef * scale["value_loss"]
    terms["loss"] = terms["policy_loss"] + coef * terms["kl_loss"] - bonus * agg(ent)
    scale["loss"] = scale["policy_loss"] + coef * scale["kl_loss"] + bonus * agg(ent.abs())
    (terms["loss"] + terms["value_loss"]).backward()
    return ({k: v.detach() for k, v in terms.items()}, {k: v.detach() for k, v in scale.items()},
            grads_of(tr.actor, tr.critic))


@pytest.mark.parametrize("tis_level", list(TISLevel), ids=str)
@pytest.mark.parametrize("loss_agg", list(LossAgg), ids=str)
@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_every_loss_on_the_holey_pack_equals_its_per_turn_terms(tr, scored_episodes, loss, loss_agg, tis_level,
                                                                 monkeypatch):
    """`train_microbatch` on the holey pack (shared prompts on) vs the per-turn terms: the loss, each
    of its terms and the metrics, and the gradients. Control: the same records with the
    observations' slots True (a mask without holes) change the normalizer and miss."""
    for key, value in {"policy_loss": loss, "loss_agg": loss_agg, "tis_level": tis_level}.items():
        monkeypatch.setattr(tr.cfg.algo, key, value)
    eps = scored_episodes.episodes
    got, grads = trainer_terms(tr, records_of(eps))
    ref, scale, ref_grads = per_turn_terms(tr, eps)
    assert set(TERMS) <= got.keys(), sorted(got)
    assert ref["clip_ratio"] > 0  # some ratios clip
    what = f"{loss} {loss_agg} tis={tis_level}"
    for key in TERMS:
        assert_parity(f"{what} {key}", (got[key] - ref[key]).abs(), scale[key])
    assert grads.keys() == ref_grads.keys()
    grad_scale = max_abs(ref_grads.values())
    assert_parity(f"{what} grads", max_abs(grads[n] - g for n, g in ref_grads.items()), grad_scale)
    # control: no holes, the observations trained as actions
    filled = scored_episodes.without_holes
    if loss_agg is LossAgg.TOKEN_MEAN:
        assert loss_normalizer(filled, loss_agg) > loss_normalizer(records_of(eps), loss_agg)
    wrong, wrong_grads = trainer_terms(tr, filled)
    assert_control_fails(f"{what} loss without holes", (wrong["loss"] - ref["loss"]).abs(), scale["loss"])
    assert_control_fails(f"{what} grads without holes", max_abs(wrong_grads[n] - g for n, g in ref_grads.items()),
                         grad_scale)


# ------------------------------------------------------------------ advantages
def hand_gae(values, rewards, mask, gamma: float, lam: float) -> torch.Tensor:
    """The recursion visiting action slots only (float64): delta = r + gamma V_next - V,
    A = delta + gamma lam A_next, `next` the next action slot; 0 elsewhere."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    next_value = next_adv = 0.0
    for t in reversed(mask.nonzero().squeeze(1).tolist()):
        delta = float(rewards[t]) + gamma * next_value - float(values[t])
        next_adv = delta + gamma * lam * next_adv
        out[t], next_value = next_adv, float(values[t])
    return out


def advantage_records(holes: bool = True) -> list[Experience]:
    """Episodes with critic values, a per-token KL and a reward (values and KL on the holes too)."""
    recs = records_of(episodes(seed=5, holes=holes))
    gen = torch.Generator().manual_seed(5)
    for rec in recs:
        rec.values = torch.randn(rec.action_mask.shape, generator=gen)
        rec.kl = torch.rand(rec.action_mask.shape, generator=gen)
        rec.rewards = torch.randn((), generator=gen)
    return recs


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp"])
def test_gae_on_a_holey_row_is_the_recursion_over_its_action_slots(estimator):
    """GAE (and REINFORCE++'s discounted returns, GAE with V = 0 and lam = 1) on records, packed
    and padded: on the action slots, the recursion over them alone, the reward on the episode's
    last action slot and the KL penalty on each; exactly 0 on the holes; then whitened over every
    action slot of the step. Control: the recursion stepping through the hole."""
    gamma, lam, kl_coef = 0.9, (0.8 if estimator == "gae" else 1.0), 0.1
    opts = {"gamma": gamma, "kl_coef": kl_coef, **({"lam": lam} if estimator == "gae" else {})}
    recs = advantage_records()

    def reference(rec, mask):
        rewards = -kl_coef * rec.kl.double() * mask
        rewards[mask.nonzero().max()] += float(rec.rewards)
        values = rec.values.double() if estimator == "gae" else torch.zeros(mask.shape, dtype=torch.float64)
        return hand_gae(values, rewards, mask, gamma, lam)

    expected = [reference(r, r.action_mask) for r in recs]
    flat = torch.cat([e[r.action_mask] for e, r in zip(expected, recs)])
    mean, std = flat.mean(), flat.var(correction=1).add(1e-8).sqrt()
    for whiten in (False, True):
        want = [((e - mean) / std if whiten else e) * r.action_mask for e, r in zip(expected, recs)]
        for layout in ("records", "packed", "padded"):
            items = ([copy.copy(r) for r in recs] if layout == "records" else
                     [make_experience_batch(recs, packed=layout == "packed")])
            compute_advantages(items, estimator, whiten=whiten, **opts)
            got = items if layout == "records" else items[0].split()
            assert all(not g.advantages[~r.action_mask].any() for g, r in zip(got, recs))  # torch.where's 0
            assert_parity(f"{estimator} {layout} whiten={whiten} vs the recursion over action slots",
                          max_abs(g.advantages.double() - w for g, w in zip(got, want)), max_abs(want))
    # control: a recursion that steps through the hole (the observation's slots counted as steps)
    stepping = advantage_records(holes=False)
    compute_advantages(stepping, estimator, whiten=False, **opts)
    misses = [(s.advantages.double() - e)[r.action_mask] for s, e, r in zip(stepping, expected, recs)]
    assert_control_fails(f"{estimator} stepping through the hole", max_abs(misses), max_abs(expected))


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_group_baseline_broadcasts_an_episode_scalar_over_its_action_slots_only(estimator):
    recs = [r for r in advantage_records() if int(r.prompt_index) != 2]  # rloo: no group of one
    compute_advantages(recs, estimator, whiten=False)
    for r in recs:
        a = r.advantages
        assert not a[~r.action_mask].any() and torch.unique(a[r.action_mask]).numel() == 1


# ------------------------------------------------------------------ 3. context parallelism
def cp_episodes() -> list[Experience]:
    """The episodes with an advantage per episode on its action slots (the CP runs' loss)."""
    records = records_of(episodes(seed=7))
    gen = torch.Generator().manual_seed(7)
    for rec in records:
        rec.advantages = torch.randn((), generator=gen) * rec.action_mask
    return records


def cp_loss(lp: torch.Tensor, ent: torch.Tensor, batch: Experience) -> torch.Tensor:
    mask = batch.action_mask.float()
    return ((-batch.advantages * lp - 0.01 * ent) * mask).sum() / mask.sum()


CP_CASES = (("packed", True, False), ("shared", True, True), ("padded", False, False))  # name, packed, share


def holey_cp_rank(rank: int, world_size: int) -> dict:
    """One CP rank: the trainer's Actor (dims cp, "cp_varlen") on the holey pack (shared prompts off
    and on) and the padded batch: log-probs and entropy restored on the full axis, the gradients of
    `cp_loss` summed over the CP group, the rows this rank's body ran; and the control, the pack's
    log-probs from zigzag metadata over contiguous chunks (tests/cp_worker.py)."""
    from cp_worker import _grads, cp_log_probs

    from model.context_parallel import CP_VARLEN
    from runtime.parallel_dims import ParallelDims, build_mesh

    dims = ParallelDims(cp=world_size, world_size=world_size)
    build_mesh(dims)
    model = build_model("qwen3", seed=0, attn_implementation=CP_VARLEN)
    records = cp_episodes()
    out = {}
    for name, packed, share in CP_CASES:
        batch = make_experience_batch(records, packed=packed)
        model.zero_grad(set_to_none=True)
        with body_tokens(model) as seen:
            lp, ent = Actor(model, dims=dims, actions_only=True, share_prompts=share)(batch, return_entropy=True)
        cp_loss(lp, ent, batch).backward()
        out[name] = {"log_probs": lp.detach(), "entropy": ent.detach(), "grads": _grads(model, dims.cp_group),
                     "seen": seen}
    with torch.no_grad():
        pack = make_experience_batch(records, packed=True)
        out["wrong_order"] = cp_log_probs(model, pack, dims.cp_group, dims.cp, rank, control="wrong_order")
    return out


@pytest.mark.slow
def test_the_holey_pack_at_cp2_equals_one_process(dense):
    """cp=2 on gloo (one launch): log-probs and entropy on every action slot, and the CP-summed
    gradients, of the holey pack (shared prompts off and on: the compressed rows sharded with the
    zigzag) and of the padded batch, equal one process's; the packed ones equal the per-turn
    reference too. Control: chunks in the wrong order."""
    from testing.distributed import run_distributed

    ranks = run_distributed(holey_cp_rank, 2, timeout=240)
    records = cp_episodes()
    with torch.no_grad():
        turns = per_turn(Actor(dense, actions_only=True), [Episode(r, ep.replies)
                                                            for r, ep in zip(records, episodes(seed=7))])
    for name, packed, share in CP_CASES:
        batch = make_experience_batch(records, packed=packed)
        actor = Actor(dense, actions_only=True, share_prompts=share)
        dense.zero_grad(set_to_none=True)
        lp, ent = actor(batch, return_entropy=True)
        cp_loss(lp, ent, batch).backward()
        ref_grads = {n: p.grad.clone() for n, p in dense.named_parameters() if p.grad is not None}
        dense.zero_grad(set_to_none=True)
        for r, out in enumerate(ranks):  # every rank holds the restored outputs
            assert torch.equal(out[name]["log_probs"], ranks[0][name]["log_probs"]), (name, r)
            assert out[name]["seen"] and out[name]["seen"][0] < batch.sequences.numel(), (name, out[name]["seen"])
        got = ranks[0][name]
        if share:  # each rank's body ran its zigzag shard of the compressed rows
            unit = 2 * 2
            rows = sum(-(-(p + sum(rs)) // unit) * unit for p, rs in batch.shared_prompts.units) // 2
            assert got["seen"] == [rows], (got["seen"], rows)
        for key, ref in (("log_probs", lp), ("entropy", ent)):
            compare(f"cp=2 {name} {key} vs one process", scored(got[key], batch, records),
                    scored(ref.detach(), batch, records))
        if packed:
            compare(f"cp=2 {name} log-probs vs per-turn", scored(got["log_probs"], batch, records),
                    [t[0] for t in turns])
        assert got["grads"].keys() == ref_grads.keys()
        assert_parity(f"cp=2 {name} grads vs one process", max_abs(got["grads"][n] - g for n, g in ref_grads.items()),
                      max_abs(ref_grads.values()))
    pack = make_experience_batch(records, packed=True)
    with torch.no_grad():
        ref = scored(Actor(dense, actions_only=True)(pack), pack, records)
    wrong = scored(ranks[0]["wrong_order"], pack, records)
    assert_control_fails("cp=2 chunks in the wrong order", max_abs(w - x for w, x in zip(wrong, ref)), max_abs(ref))

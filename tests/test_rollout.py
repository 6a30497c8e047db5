"""Rollout engine (rl/rollout/engine.py) and tasks (rl/tasks/): records, seeding, log-probs, routing."""

import inspect
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # FileTask imports "tests.test_rollout:my_reward" from the repo root
    sys.path.insert(0, str(ROOT))

from model.models import build_model  # noqa: E402
from rl.rollout.engine import HFRolloutEngine, RolloutEngine  # noqa: E402
from rl.rollout.sampler import (  # noqa: E402
    group_places, sample_inverse_cdf, sample_seeds, signed, uniform_noise)
from rl.seeds import derive  # noqa: E402
from rl.tasks.base import Task, load_callable  # noqa: E402
from rl.tasks.calls import assign_rewards  # noqa: E402
from rl.tasks.files import FileTask  # noqa: E402
from rl.tasks.registry import build_task  # noqa: E402

VOCAB, TEMP, NEW = 64, 0.7, 10  # VOCAB: the tiny models (model/models.py) with the run's vocabulary (conf/model/)


# ------------------------------------------------------- reward functions for FileTask
def my_reward(prompt_ids, response_ids, answer):
    return float(sum(r == answer for r in response_ids)) / len(response_ids)


NOT_CALLABLE = 3


# ------------------------------------------------------------------- helpers
def dense_model(seed=0):
    return build_model("qwen3", seed=seed, attn_implementation="sdpa", vocab_size=VOCAB)


def moe_model(seed=0):
    return build_model("qwen3_moe", seed=seed, attn_implementation="sdpa", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def dense():
    return HFRolloutEngine(dense_model())


@pytest.fixture(scope="module")
def moe():
    return HFRolloutEngine(moe_model())


def make_prompts(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(torch.randint(4, 13, (1,), generator=g)),), generator=g) for _ in range(n)]


def generate(engine, prompts, indices=None, seed=0, new=NEW):
    indices = list(range(len(prompts))) if indices is None else indices
    return engine.generate(prompts, prompt_indices=indices, max_new_tokens=new, temperature=TEMP, seed=seed)


def fresh_log_probs(model, rec):
    """log_softmax(logits / T) of one full forward on the finished sequence, at its tokens: [T-1]."""
    with torch.no_grad():
        logits = model(input_ids=rec.sequences[None]).logits[0, :-1].float()
    return F.log_softmax(logits / TEMP, -1).gather(-1, rec.sequences[1:, None])[:, 0]


# ------------------------------------------------------------------ records
def interface_gaps(engine_cls) -> list[str]:
    """Where `engine_cls` departs from the RolloutEngine interface, which the trainer calls by
    keyword: not a subclass, an abstract method left unimplemented, or other parameters."""
    gaps = [] if issubclass(engine_cls, RolloutEngine) else [f"{engine_cls.__name__} is not a RolloutEngine"]
    for name in sorted(RolloutEngine.__abstractmethods__):
        method = getattr(engine_cls, name)
        want, got = inspect.signature(getattr(RolloutEngine, name)), inspect.signature(method)
        if getattr(method, "__isabstractmethod__", False):
            gaps.append(f"{name}: not implemented")
        elif [(p.name, p.kind) for p in got.parameters.values()] != [(p.name, p.kind)
                                                                      for p in want.parameters.values()]:
            gaps.append(f"{name}{got} is not the interface's {name}{want}")
    return gaps


def record_gaps(engine, prompts, indices) -> list[str]:
    """Where `engine.generate` breaks the interface's promise: one record per prompt, in the
    prompts' order, each starting with its prompt and carrying its group id."""
    records = engine.generate(prompts, prompt_indices=indices, max_new_tokens=3, temperature=TEMP, seed=0)
    if len(records) != len(prompts):
        return [f"{len(records)} records for {len(prompts)} prompts"]
    return [f"record {i} is not prompt {i}'s" for i, (p, rec, g) in enumerate(zip(prompts, records, indices))
            if not (torch.equal(rec.sequences[: p.numel()], p) and int(rec.prompt_index) == g)]


def test_engines_implement_the_interface(dense, moe):
    from rl.rollout.vllm_engine import VLLMRolloutEngine  # the class imports without vllm

    assert interface_gaps(HFRolloutEngine) == [] and interface_gaps(VLLMRolloutEngine) == []
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen) for n in (9, 4, 12, 6)]  # not in length order
    assert record_gaps(dense, prompts, [3, 1, 3, 0]) == [] and record_gaps(moe, prompts, [3, 1, 3, 0]) == []
    assert (dense.is_moe, moe.is_moe) == (False, True) and not dense.model.training

    # controls: an engine without load_weights, one taking other keywords, and one returning its
    # records in the length order it generates them in, each fail the same checks
    class NoWeightSync(RolloutEngine):
        def generate(self, prompts, *, prompt_indices, max_new_tokens, temperature, seed):
            return []

    class Renamed(HFRolloutEngine):
        def generate(self, prompts, *, indices, max_new_tokens, temperature, seed):
            return super().generate(prompts, prompt_indices=indices, max_new_tokens=max_new_tokens,
                                    temperature=temperature, seed=seed)

    class LengthOrder(HFRolloutEngine):
        def generate(self, prompts, *, prompt_indices, max_new_tokens, temperature, seed):
            records = super().generate(prompts, prompt_indices=prompt_indices, max_new_tokens=max_new_tokens,
                                       temperature=temperature, seed=seed)
            return sorted(records, key=lambda r: r.sequences.numel())

    assert interface_gaps(NoWeightSync) == ["load_weights: not implemented"]
    assert [g.split("(")[0] for g in interface_gaps(Renamed)] == ["generate"]
    assert interface_gaps(LengthOrder) == []
    assert len(record_gaps(LengthOrder(dense.model), prompts, [3, 1, 3, 0])) == 4


def test_records_are_unpadded_and_well_formed(dense):
    prompts = make_prompts()
    for p, rec in zip(prompts, generate(dense, prompts)):
        P, T = p.numel(), rec.sequences.numel()
        assert rec.is_record and rec.sequences.dtype == torch.int64
        assert torch.equal(rec.sequences[:P], p)
        assert int(rec.response_length) == NEW and int(rec.total_length) == T == P + NEW
        assert rec.action_mask.shape == rec.rollout_log_probs.shape == (T - 1,)
        assert rec.action_mask.dtype == torch.bool and rec.rollout_log_probs.dtype == torch.float32
        assert torch.equal(rec.action_mask, torch.arange(T - 1) >= P - 1)  # slots whose target is a response token
        assert torch.all(rec.rollout_log_probs[: P - 1] == 0)
        assert torch.all(rec.rollout_log_probs[P - 1 :] <= 0)
        assert rec.routed_experts is None and rec.rewards is None


def test_prompt_index_is_the_group_id(dense):
    p = make_prompts(2)
    recs = generate(dense, [p[0], p[0], p[1]], indices=[5, 5, 9])
    assert [int(r.prompt_index) for r in recs] == [5, 5, 9]
    assert not torch.equal(recs[0].sequences, recs[1].sequences)  # sample k of a group draws its own stream


def test_stop_token_ends_a_sample_and_is_kept():
    engine = HFRolloutEngine(dense_model())
    prompts = make_prompts(8)
    free = generate(engine, prompts)
    response = free[0].sequences[prompts[0].numel():]
    stop = int(response[3])
    first = int((response == stop).nonzero()[0])
    engine.stop_token_id = stop
    stopped = generate(engine, prompts)
    rec = stopped[0]
    assert int(rec.response_length) == first + 1 and int(rec.sequences[-1]) == stop
    assert torch.equal(rec.sequences, free[0].sequences[: rec.sequences.numel()])  # same draws up to the stop
    for f, s, p in zip(free, stopped, prompts):
        r = f.sequences[p.numel():]
        n = int((r == stop).nonzero()[0]) + 1 if (r == stop).any() else NEW
        assert int(s.response_length) == n and s.sequences.numel() == p.numel() + n
        assert s.action_mask.shape == (p.numel() + n - 1,)


# ------------------------------------------------------------------ seeding
def test_same_seed_same_samples_another_seed_differs(dense):
    prompts = make_prompts()
    a, b, c = generate(dense, prompts, seed=3), generate(dense, prompts, seed=3), generate(dense, prompts, seed=4)
    assert all(torch.equal(x.sequences, y.sequences) and torch.equal(x.rollout_log_probs, y.rollout_log_probs)
               for x, y in zip(a, b))
    assert any(not torch.equal(x.sequences, z.sequences) for x, z in zip(a, c))
    assert derive(3, 0, 0) != derive(3, 0, 1) != derive(3, 1, 0)


def splitmix64(seed: int, n: int) -> int:
    """Output n (1-based) of the splitmix64 stream seeded with `seed`, in Python integers."""
    mask = (1 << 64) - 1
    z = (seed + n * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_uniform_noise_is_splitmix64_per_sample():
    seeds = sample_seeds(5, [0, 0, 1, 2, 3]) + [0, 1, (1 << 63) - 1]
    bits = torch.tensor([s - (1 << 64) if s >> 63 else s for s in seeds], dtype=torch.int64)
    for step in (0, 1, 15, 1000):
        u = uniform_noise(bits, step)
        assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
        want = torch.tensor([(splitmix64(s, step + 1) >> 11) * 2.0**-53 for s in seeds], dtype=torch.float64)
        assert torch.equal(u, want)  # bit for bit: int64 products wrap like the unsigned ones
        assert torch.equal(uniform_noise(bits[3:4], step), u[3:4])  # a row's draw ignores the others


def run_draws(seeds_of, steps: int, tokens: int) -> torch.Tensor:
    """The uniforms `[steps, samples, tokens]` a run draws, the seeds of step s from `seeds_of(s)`."""
    return torch.stack([torch.stack([uniform_noise(seeds_of(s), j) for j in range(tokens)], -1)
                        for s in range(steps)])


def max_correlation(u: torch.Tensor, *, group: int) -> dict:
    """Largest |Pearson correlation| of the draws (`[steps, samples, tokens]`, samples in groups
    of `group`) between two samples of a group at the same token, between a sample's token j and
    any sample of its group's token j + 1 or j + 2 (a stream shifted against another), and between
    the same sample slot of consecutive steps. Each is ~N(0, 1/n) for independent draws."""
    steps, samples, tokens = u.shape
    g = (u - 0.5).reshape(steps, samples // group, group, tokens)

    def corr(a, b):  # over every observation but the pair's two axes
        a, b = a - a.mean(), b - b.mean()
        return float((a * b).mean() / (a.std() * b.std()))

    same = max(abs(corr(g[:, :, i], g[:, :, k])) for i in range(group) for k in range(i + 1, group))
    lag = max(abs(corr(g[:, :, i, :-d], g[:, :, k, d:])) for d in (1, 2) for i in range(group) for k in range(group))
    step = abs(corr(g[:-1], g[1:]))
    return {"same_token": same, "shifted": lag, "next_step": step}


def test_a_runs_draws_are_uncorrelated_within_groups_and_across_steps(monkeypatch):
    """The seeds the rollout really uses (RolloutSource.records: seed and prompt indices per step,
    `sample_seeds` per sample) give draws with no correlation between the 8 samples of a GRPO group,
    between shifted streams, or from step to step. Controls: seeds that put sample k at offset k of
    one splitmix64 stream (each sample the last one shifted by a draw), and seeds that do not move
    with the step, are caught."""
    from types import SimpleNamespace

    import rl.rollout.source as source
    from rl.config import Config

    cfg = Config()
    cfg.task.prompts_per_step, cfg.task.samples_per_prompt = 16, 8
    calls = []
    monkeypatch.setattr(source, "run_episodes", lambda engine, task, prompts, metas, **kw: calls.append(kw) or [])
    src = source.RolloutSource(cfg, SimpleNamespace(dp=1, dp_rank=0), None, build_task("target_token", vocab_size=VOCAB))
    steps, tokens, group = 24, 48, cfg.task.samples_per_prompt
    for s in range(steps):
        src.records(s, 0, version=s)
    assert len({tuple(c["prompt_indices"]) for c in calls}) == steps  # the rollout's own indices, one list a step

    def wrap(seeds):  # as the engine hands them to uniform_noise (rl/rollout/engine.py)
        return torch.tensor([signed(x) for x in seeds], dtype=torch.int64)

    real = max_correlation(run_draws(lambda s: wrap(sample_seeds(calls[s]["seed"], calls[s]["prompt_indices"])),
                                     steps, tokens), group=group)
    n = steps * tokens * cfg.task.prompts_per_step  # observations behind each same-token pair
    bound = 5 / n**0.5  # 5 standard deviations, the maximum over ~200 pairs included
    assert max(real["same_token"], real["shifted"], real["next_step"]) < bound, (real, bound)

    gamma = 0x9E3779B97F4A7C15  # splitmix64's increment: seed + k * gamma is output k of one stream

    def one_stream(s):
        indices = calls[s]["prompt_indices"]
        return wrap([derive(calls[s]["seed"], i, 0) + k * gamma for i, k in zip(indices, group_places(indices))])

    shifted = max_correlation(run_draws(one_stream, steps, tokens), group=group)
    assert shifted["shifted"] > 0.99 and shifted["same_token"] < bound  # only the shifted pairs see it
    frozen = max_correlation(run_draws(lambda s: wrap(sample_seeds(calls[0]["seed"], calls[0]["prompt_indices"])),
                                       steps, tokens), group=group)
    assert frozen["next_step"] > 0.99


def test_inverse_cdf_samples_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    n = 40000
    logp = probs.log().expand(n, -1).contiguous()
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok = sample_inverse_cdf(logp, u)
    freq = torch.bincount(tok, minlength=5).double() / n
    assert freq[1] == 0  # a zero-probability id is never drawn
    assert (freq - probs.double()).abs().max() < 0.01  # ~4 standard deviations at n = 40000
    edge = sample_inverse_cdf(logp[:3], torch.tensor([0.0, 0.6, 1 - 2.0**-53], dtype=torch.float64),
                              out=torch.empty(3, 5, dtype=torch.float64))
    assert edge.tolist() == [0, 2, 4]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_shared_prompt_prefill_equals_one_row_at_a_time(kind, request):
    """A GRPO group's samples share one prefill (copied to every row); each sample still
    equals the same sample generated in a chunk of its own."""
    engine = request.getfixturevalue(kind)
    p = make_prompts(3)
    prompts, indices = [p[0], p[1], p[0], p[0], p[2], p[1]], [0, 1, 0, 0, 2, 1]
    grouped = generate(engine, prompts, indices=indices, seed=11)
    single = HFRolloutEngine(engine.model, max_batch_size=1)
    alone = generate(single, prompts, indices=indices, seed=11)
    assert len({tuple(r.sequences.tolist()) for r in grouped}) == len(prompts)  # the group's samples differ
    for a, b in zip(grouped, alone):
        assert torch.equal(a.sequences, b.sequences)
        assert (a.rollout_log_probs - b.rollout_log_probs).abs().max() <= 1e-5
        if kind == "moe":
            assert torch.equal(a.routed_experts, b.routed_experts)
    for rec in grouped:
        m = rec.action_mask
        assert (fresh_log_probs(engine.model, rec)[m] - rec.rollout_log_probs[m]).abs().max() <= 1e-5


# ------------------------------------------------------- log-probs and padding
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_rollout_log_probs_equal_a_fresh_full_forward(kind, request):
    engine = request.getfixturevalue(kind)
    for rec in generate(engine, make_prompts()):
        m = rec.action_mask
        assert (fresh_log_probs(engine.model, rec)[m] - rec.rollout_log_probs[m]).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_batch_of_varying_lengths_equals_each_prompt_alone(kind, request):
    engine = request.getfixturevalue(kind)
    prompts = make_prompts()
    assert len({p.numel() for p in prompts}) > 2
    batch = generate(engine, prompts, seed=7)
    for i, p in enumerate(prompts):
        alone = generate(engine, [p], indices=[i], seed=7)[0]
        assert torch.equal(alone.sequences, batch[i].sequences)
        assert (alone.rollout_log_probs - batch[i].rollout_log_probs).abs().max() <= 1e-5
        if kind == "moe":
            assert torch.equal(alone.routed_experts, batch[i].routed_experts)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_stopped_rows_leave_the_batch_and_no_sample_changes(kind, request, monkeypatch):
    """At each check the rows that stopped leave the decode batch (cache, logits, seeds):
    the later forwards run fewer rows, and every sample (tokens, log-probs, routing) equals
    the one decoded in a batch that never shrinks (checked only at the last step). Control:
    with noise drawn by batch position instead of the sample's own stream, shrinking changes
    samples, so the comparison sees a sample that depends on its neighbours."""
    model = request.getfixturevalue(kind).model
    prompts = make_prompts(8, seed=3)
    new = 24
    free = generate(HFRolloutEngine(model), prompts, new=new)
    first = {}  # token -> the first step each row draws it
    for r, p in zip(free, prompts):
        for j, t in enumerate(r.sequences[p.numel():].tolist()):
            first.setdefault(t, {}).setdefault(id(r), j)
    stop = max(first, key=lambda t: (len(set(first[t].values())), len(first[t])))  # rows stop at many steps
    assert len(set(first[stop].values())) >= 3

    def run(check_every):
        engine = HFRolloutEngine(model, stop_token_id=stop)
        engine.check_every = check_every
        sizes, forward = [], engine._forward
        engine._forward = lambda ids, *a: sizes.append(ids.shape[0]) or forward(ids, *a)
        return generate(engine, prompts, new=new), sizes[1:]  # the decode forwards' rows

    def same(a, b):
        return all(torch.equal(x.sequences, y.sequences) for x, y in zip(a, b))

    shrunk, sizes = run(2)
    whole, whole_sizes = run(new)
    assert set(whole_sizes) == {len(prompts)} and sizes == sorted(sizes, reverse=True) and sizes[-1] < len(prompts)
    assert sum(sizes) < sum(whole_sizes[:len(sizes)])
    assert same(shrunk, whole)
    for a, b in zip(shrunk, whole):
        assert (a.rollout_log_probs - b.rollout_log_probs).abs().max() <= 1e-5
        if kind == "moe":
            assert torch.equal(a.routed_experts, b.routed_experts)

    from rl.rollout import engine as engine_module

    by_position = engine_module.uniform_noise
    monkeypatch.setattr(engine_module, "uniform_noise",
                        lambda seeds, step: by_position(torch.arange(len(seeds), device=seeds.device), step))
    assert not same(run(2)[0], run(new)[0])


def test_chunking_does_not_change_samples():
    prompts = make_prompts()
    whole = generate(HFRolloutEngine(dense_model()), prompts)
    chunked = generate(HFRolloutEngine(dense_model(), max_batch_size=2), prompts)
    assert all(torch.equal(a.sequences, b.sequences) for a, b in zip(whole, chunked))


@pytest.mark.parametrize("temperature", [TEMP, 0.0])
def test_head_in_slices_gives_the_samples_of_one_matmul(temperature, monkeypatch):
    """`head_rows`: the fp32 LM head multiplied a slice of vocabulary rows at a time (CPU) draws
    exactly the tokens, and gives exactly the log-probs, of one matmul over the whole head, on the
    same seeds, sampled and greedy (a 4096-word vocabulary in slices of 1000: the last is 96 rows;
    one thread, where the slices run).
    Control: a sampling step that draws each token with the next step's noise is caught by the
    same comparison, and the slices did run (a matmul by 1000 vocabulary rows)."""
    from rl.rollout import engine as engine_module

    model = build_model("llama", seed=0, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=4096,
                        tie_word_embeddings=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 4096, (int(n),), generator=g) for n in (5, 9, 9, 12, 7, 7, 7, 7)]
    indices = [0, 1, 1, 2, 3, 3, 3, 3]

    def run(head_rows):
        engine = HFRolloutEngine(model)
        engine.head_rows = head_rows
        return engine.generate(prompts, prompt_indices=indices, max_new_tokens=12, temperature=temperature, seed=7)

    def same(a, b):
        return all(torch.equal(x.sequences, y.sequences) and torch.equal(x.rollout_log_probs, y.rollout_log_probs)
                   for x, y in zip(a, b))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the slices run on one thread only (two: one matmul)
    try:
        whole = run(None)
        widths, linear = [], F.linear
        monkeypatch.setattr(F, "linear", lambda x, w, *a: widths.append(w.shape[0]) or linear(x, w, *a))
        sliced = run(1000)
        monkeypatch.setattr(F, "linear", linear)
        control = None
        if temperature:
            noise = engine_module.uniform_noise
            monkeypatch.setattr(engine_module, "uniform_noise", lambda seeds, step: noise(seeds, step + 1))
            control = run(1000)
    finally:
        torch.set_num_threads(threads)
    assert same(sliced, whole)
    assert {1000, 96} <= set(widths) and 4096 not in widths
    assert control is None or not same(control, whole)


# ------------------------------------------------------------------ routing
def test_moe_routed_experts_are_the_live_routing_of_a_fresh_forward(moe):
    cfg = moe.model.config
    for rec in generate(moe, make_prompts(4)):
        T = rec.sequences.numel()
        assert rec.routed_experts.shape == (cfg.num_hidden_layers, cfg.num_experts_per_tok, T)
        assert rec.routed_experts.min() >= 0 and rec.routed_experts.max() < cfg.num_experts
        with torch.no_grad():
            out = moe.model(input_ids=rec.sequences[None], output_router_logits=True)
        live = torch.stack([  # [L, T, K] -> [L, K, T], exactly as the router picks: top-k of the softmax
            torch.topk(F.softmax(logits.float(), -1), cfg.num_experts_per_tok, dim=-1).indices
            for logits in out.router_logits
        ]).transpose(1, 2)
        assert torch.equal(rec.routed_experts, live)


# ---------------------------------------------------------------- weights
def test_load_weights_changes_outputs_and_rejects_bad_keys():
    engine = HFRolloutEngine(dense_model(seed=0))
    prompts = make_prompts(3)
    before = generate(engine, prompts)
    own = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.load_weights(dense_model(seed=1).state_dict())
    after = generate(engine, prompts)
    assert any(not torch.equal(a.rollout_log_probs, b.rollout_log_probs) for a, b in zip(before, after))
    engine.load_weights(own)
    again = generate(engine, prompts)
    assert all(torch.equal(a.rollout_log_probs, b.rollout_log_probs) for a, b in zip(before, again))

    missing = dict(own)
    missing.pop("lm_head.weight")
    with pytest.raises(KeyError, match=r"1 state-dict entries were not given: lm_head.weight"):
        engine.load_weights(missing)
    with pytest.raises(KeyError, match=r"unexpected tensor 'extra.weight'"):
        engine.load_weights({**own, "extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(64, 3\), expected \(64, 64\)"):
        engine.load_weights({**own, "lm_head.weight": torch.zeros(64, 3)})


def test_generate_rejects_bad_arguments(dense):
    p = make_prompts(1)
    with pytest.raises(ValueError, match=r"prompts\[0\] holds ids in .*outside the vocabulary \[0, 64\)"):
        generate(dense, [torch.tensor([1, 64])])
    with pytest.raises(ValueError, match=r"prompts\[0\] must be a non-empty 1-D tensor"):
        generate(dense, [torch.zeros(2, 3, dtype=torch.long)])
    with pytest.raises(ValueError, match="prompt_indices has 2 entries, expected 1"):
        generate(dense, p, indices=[0, 1])


# ------------------------------------------------------------------ tasks
def test_builtin_rewards_on_hand_made_examples():
    target = build_task("target_token", vocab_size=VOCAB)
    assert target.reward(torch.tensor([9, 9, 9, 9]), torch.tensor([7, 7, 3, 7]), {}) == 0.75
    copy = build_task("copy_first", vocab_size=VOCAB)
    assert copy.reward([5, 6, 7, 8], [5, 6, 5, 5], {}) == 0.75
    count = build_task("count_up", vocab_size=VOCAB)  # alphabet [4, 12): successor of 11 wraps to 4
    assert count.reward([4, 9, 9, 10], [11, 4, 5, 7], {}) == 0.75
    assert count.reward([4, 9], [40, 41], {}) == 0.0  # an id outside the alphabet has no successor
    assert target.reward([9], [], {}) == 0.0


@pytest.mark.parametrize("name", ["target_token", "copy_first", "count_up"])
def test_builtin_prompts_are_seeded_and_avoid_special_ids(name):
    task = build_task(name, vocab_size=VOCAB, prompts_path=None, reward_fn=None)  # None options are dropped
    assert isinstance(task, Task) and task.stop_token_id is None and task.min_vocab_size <= VOCAB
    a, b, c = task.prompts(32, seed=1), task.prompts(32, seed=1), task.prompts(32, seed=2)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    assert any(not torch.equal(x, z) for (x, _), (z, _) in zip(a, c))
    for ids, meta in a:
        assert ids.dtype == torch.int64 and 4 <= ids.numel() <= 12 and ids.min() >= 4 and ids.max() < VOCAB
        assert meta == {}


def test_score_sets_rewards(dense):
    task = build_task("target_token", vocab_size=VOCAB)
    prompts = task.prompts(3, seed=0)
    recs = assign_rewards(task, generate(dense, [p for p, _ in prompts]), [m for _, m in prompts])
    for (p, _), rec in zip(prompts, recs):
        response = rec.sequences[p.numel():]
        assert rec.rewards.dtype == torch.float32 and rec.rewards.dim() == 0
        assert float(rec.rewards) == pytest.approx(float((response == 7).float().mean()))


def test_build_task_errors():
    with pytest.raises(ValueError, match=r"task.name='nope': expected one of target_token, .*, reasoning_gym$"):
        build_task("nope")
    with pytest.raises(TypeError, match=r"task 'target_token' got unknown options \['prompts_path'\]"):
        build_task("target_token", vocab_size=VOCAB, prompts_path="x.jsonl")
    with pytest.raises(ValueError, match="target=99 is outside the vocabulary"):
        build_task("target_token", vocab_size=VOCAB, target=99)


# --------------------------------------------------------------- FileTask
def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_file_task_round_trip(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt_ids": [4, 5, 6], "answer": 7}, "",
                                              {"prompt_ids": [8, 9], "answer": 9}])
    task = build_task("file", prompts_path=str(path), reward_fn="tests.test_rollout:my_reward", vocab_size=VOCAB)
    assert isinstance(task, FileTask) and len(task) == 2 and task.min_vocab_size == 10
    drawn = task.prompts(5, seed=0)  # cycles through a seeded order
    assert [ids.tolist() for ids, _ in drawn[:2]] in ([[4, 5, 6], [8, 9]], [[8, 9], [4, 5, 6]])
    assert [ids.tolist() for ids, _ in drawn] == [ids.tolist() for ids, _ in task.prompts(5, seed=0)]
    by_prompt = {tuple(ids.tolist()): meta for ids, meta in drawn}
    assert by_prompt == {(4, 5, 6): {"answer": 7}, (8, 9): {"answer": 9}}
    assert task.reward(torch.tensor([4, 5, 6]), torch.tensor([7, 1, 7, 7]), {"answer": 7}) == 0.75


def test_file_task_errors(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt_ids": [4, 5]}])
    fn = "tests.test_rollout:my_reward"
    with pytest.raises(FileNotFoundError, match="prompts file '.*missing.jsonl' does not exist"):
        FileTask(tmp_path / "missing.jsonl", fn)
    with pytest.raises(ValueError, match="reward_fn 'no_colon' is not of the form 'module:function'"):
        FileTask(good, "no_colon")
    with pytest.raises(ImportError, match="cannot import module 'no_such_module'"):
        load_callable("no_such_module:f")
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        FileTask(good, "tests.test_rollout:nope")
    with pytest.raises(TypeError, match="'NOT_CALLABLE' is a int, not a callable"):
        FileTask(good, "tests.test_rollout:NOT_CALLABLE")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt_ids": [4]}, {"answer": 3}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2 has neither 'prompt_ids' nor 'prompt' \(keys: \['answer'\]\)"):
        FileTask(bad, fn)
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "hello"}])
    with pytest.raises(ValueError, match="text.jsonl:1 gives 'prompt' text but no tokenizer was given"):
        FileTask(text, fn)
    broken = write_jsonl(tmp_path / "broken.jsonl", ['{"prompt_ids": [4]', ])
    with pytest.raises(ValueError, match="broken.jsonl:1 is not valid JSON"):
        FileTask(broken, fn)
    big = write_jsonl(tmp_path / "big.jsonl", [{"prompt_ids": [4, 64]}])
    with pytest.raises(ValueError, match=r"big.jsonl:1: prompt id 64 is outside the vocabulary \[0, 64\)"):
        FileTask(big, fn, vocab_size=VOCAB)


def test_file_task_tokenizes_text_prompts(tmp_path):
    class Tok:  # the one method FileTask uses of a Hugging Face tokenizer
        eos_token_id = 2

        def encode(self, text):
            return [4 + ord(c) % 50 for c in text]

    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "ab", "answer": 5}])
    task = FileTask(path, my_reward, tokenizer=Tok())
    (ids, meta), = task.prompts(1, seed=0)
    assert ids.tolist() == Tok().encode("ab") and meta == {"answer": 5} and task.stop_token_id == 2


def test_vllm_random_init_folder_is_one_per_model_and_a_restart_finds_it(tmp_path, monkeypatch):
    """rl/rollout/build.py writes vLLM's random-init folder once per model (its weights only give
    the shapes: the first sync replaces them): a second start, as after a restart, or another seed
    finds it and writes nothing; another model gets another folder. Nothing else is left behind."""
    import tempfile
    from types import SimpleNamespace

    import rl.rollout.build as build

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    dims, built = SimpleNamespace(distributed=False, joined=False), []

    def new_model(name, seed=0):
        def make(device=None):
            built.append(device)
            return build_model(name, seed=seed, device=device, vocab_size=64)
        return make

    first = build._random_init_folder(new_model("qwen3"), dims)
    assert built == ["meta", None] and (Path(first) / "config.json").is_file()
    assert build._random_init_folder(new_model("qwen3"), dims) == first
    assert build._random_init_folder(new_model("qwen3", seed=1), dims) == first
    assert built == ["meta", None, "meta", "meta"]  # found: no second copy written
    other = build._random_init_folder(new_model("llama"), dims)
    assert other != first and built[-1] is None
    assert sorted(os.listdir(tmp_path)) == sorted([Path(first).name, Path(other).name])

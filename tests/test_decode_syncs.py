"""Host syncs of the rollout engine's decode loop (issue 25, item 3), counted on CPU.

On a GPU each `.item()`, `.cpu()`, `if tensor:` or value-dependent shape makes the host wait
for the device. `testing/host_syncs.py` counts them from a CPU run; each test compares two
generations that differ only in their number of decode steps, so what is counted per step
is the difference (the prefill and the per-chunk read-back cancel). The engine's own syncs
are told apart from the model forward's by counting inside `_forward` separately.
"""

import collections

import pytest
import torch

from model.models import build_model
from rl.rollout import engine as engine_module
from rl.rollout.engine import HFRolloutEngine
from testing.host_syncs import count_host_syncs

VOCAB, TEMP = 64, 0.7
SHORT, LONG = 8, 24  # decode steps of the two generations compared


def make_engine(family="qwen3", **kwargs):
    return HFRolloutEngine(build_model(family, seed=0, vocab_size=VOCAB), **kwargs)


def prompts():
    """A GRPO-like chunk: repeated prompts (the shared prefill) of different lengths (left padding)."""
    g = torch.Generator().manual_seed(1)
    distinct = [torch.randint(4, VOCAB, (n,), generator=g) for n in (5, 9, 7)]
    return [distinct[i] for i in (0, 0, 1, 1, 2, 2)], [0, 0, 1, 1, 2, 2]


def counted_generate(engine, new, temperature=TEMP):
    """(syncs of the whole `generate`, syncs inside its forwards, the decode forwards' sync sites
    (the prefill's left out: the chunk is one), forwards run)."""
    forward, inside, sites, calls = engine._forward, collections.Counter(), [], []

    def counted_forward(*args):
        before = {k: len(v) for k, v in syncs.where.items()}
        out = forward(*args)
        for kind, where in syncs.where.items():
            inside[kind] += len(where) - before.get(kind, 0)
            if calls:
                sites.extend(where[before.get(kind, 0):])
        calls.append(1)
        return out

    ps, index = prompts()
    engine._forward = counted_forward
    try:
        with count_host_syncs() as syncs:
            engine.generate(ps, prompt_indices=index, max_new_tokens=new, temperature=temperature, seed=0)
    finally:
        del engine._forward
    return syncs, inside, sites, len(calls)


def per_step(engine, temperature=TEMP):
    """Syncs per decode step: (the engine's own, the forward's), each a {kind: count}, and the
    decode forwards' sync sites ("op @ file:line")."""
    (a, fa, _, _), (b, fb, sites, _) = (counted_generate(engine, n, temperature) for n in (SHORT, LONG))
    own = {k: ((b[k] - fb[k]) - (a[k] - fa[k])) / (LONG - SHORT) for k in set(a) | set(b)}
    fwd = {k: (fb[k] - fa[k]) / (LONG - SHORT) for k in set(fa) | set(fb)}
    return {k: v for k, v in own.items() if v}, {k: v for k, v in fwd.items() if v}, sites


@pytest.mark.parametrize("temperature", [TEMP, 0.0])
def test_dense_decode_step_makes_no_host_sync_but_one_read_per_check_interval(temperature):
    engine = make_engine()
    own, fwd, _ = per_step(engine, temperature)
    # one `.tolist()` of the stop / non-finite flags every `check_every` steps, nothing else
    assert own == {"to_host": 1 / engine.check_every}
    assert fwd == {}  # the decode mask is handed over built: transformers reads no value of it


def test_moe_decode_step_syncs_only_in_the_expert_dispatch():
    engine = make_engine("qwen3_moe")
    own, fwd, where = per_step(engine)
    assert own == {"to_host": 1 / engine.check_every}
    # the MoE blocks read their per-expert token counts (grouped expert compute): model/moe.py's,
    # not the loop's; nothing else in the forward reads the device
    assert fwd and where and all("model/moe.py" in w for w in where), where


def test_an_injected_item_or_cpu_per_step_is_counted(monkeypatch):
    """Control: the count sees a sync added to the loop (the `.cpu()` of the logits the loop
    used to make, an `.item()`), and a 2D decode mask brings back transformers' value check."""
    engine = make_engine()
    sample = engine_module.sample_inverse_cdf

    def with_item(log_probs, uniform, **kw):
        float(log_probs.sum().item())
        return sample(log_probs.cpu(), uniform, **kw)

    monkeypatch.setattr(engine_module, "sample_inverse_cdf", with_item)
    own, _, _ = per_step(engine)
    assert own == {"scalar": 1, "to_host": 1 + 1 / engine.check_every}
    monkeypatch.setattr(engine_module, "sample_inverse_cdf", sample)

    grow = lambda self, lens, P, new: lambda step, mask: torch.cat([mask, torch.ones_like(mask[:, :1])], 1)  # noqa: E731
    monkeypatch.setattr(HFRolloutEngine, "_decode_masks", grow)
    _, fwd, where = per_step(engine)
    assert fwd == {"scalar": 1} and all("masking_utils.py" in w for w in where)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_samples_do_not_depend_on_the_check_interval(family):
    """Rows stopped before a check run on, fed the stop token; their records are those of
    a loop that checks at every step, and a chunk stops at the first check after its last row."""
    base = make_engine(family)
    ps, index = prompts()
    greedy = base.generate(ps, prompt_indices=index, max_new_tokens=LONG, temperature=0.0, seed=0)
    responses = [r.sequences[p.numel():].tolist() for r, p in zip(greedy, ps)]
    # a stop token that two distinct prompts draw early, at different steps; their rows make the chunk
    first = collections.defaultdict(dict)  # token -> {prompt index: first step drawn}
    for i, r in zip(index, responses):
        for t in set(r):
            first[t][i] = r.index(t)
    stop = min((t for t in first if len(set(first[t].values())) > 1), key=lambda t: max(first[t].values()))
    rows = [k for k, i in enumerate(index) if i in first[stop]]
    ps, index = [ps[k] for k in rows], [index[k] for k in rows]
    expected = [first[stop][i] + 1 for i in index]
    assert max(expected) < LONG - 8, expected
    runs = {}
    for every in (1, 3, 8):
        engine = make_engine(family, stop_token_id=stop)
        engine.check_every = every
        calls = []
        forward = engine._forward
        engine._forward = lambda *a: calls.append(1) or forward(*a)
        recs = engine.generate(ps, prompt_indices=index, max_new_tokens=LONG, temperature=0.0, seed=0)
        runs[every] = (recs, len(calls))
    recs, _ = runs[1]
    lengths = [int(r.response_length) for r in recs]
    assert lengths == expected
    for every, (other, calls) in runs.items():
        for a, b in zip(recs, other):
            assert torch.equal(a.sequences, b.sequences) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
            assert (a.routed_experts is None) == (b.routed_experts is None)
            assert a.routed_experts is None or torch.equal(a.routed_experts, b.routed_experts)
        # forwards: the prefill, then one per decode step up to the first check at or after the
        # last stop (MoE feeds that step's tokens too, for their routing)
        last = max(lengths) - 1
        checked = min(-(-(last + 1) // every) * every - 1, LONG - 1)
        assert calls == 1 + checked + (family == "qwen3_moe"), (every, calls)


def test_non_finite_logits_raise_naming_their_first_step():
    """The non-finite check is read at the next check, yet names the step it happened at."""
    engine = make_engine()
    forward, calls = engine._forward, []

    def poisoned(*args):
        calls.append(1)
        out = forward(*args)
        return out * float("nan") if len(calls) > 5 else out  # step 5's logits: the 5th decode forward's

    engine._forward = poisoned
    ps, index = prompts()
    with pytest.raises(FloatingPointError, match="at response token 5:"):
        engine.generate(ps, prompt_indices=index, max_new_tokens=LONG, temperature=TEMP, seed=0)
    assert len(calls) == engine.check_every  # raised at the first check after it (step 7), no later


def test_host_sync_counter_counts_each_kind_and_ignores_device_work():
    x = torch.arange(6.0)
    with count_host_syncs() as s:
        y = (x * 2).exp().cumsum(0)  # device work: nothing to count
        x[torch.tensor([1, 3])]  # integer indexing: a gather, no sync
        x.to(torch.device("cpu"))  # the code's device variable (on CPU: the host)
    assert s.total() == 0
    with count_host_syncs() as s:
        y.sum().item(), bool(y[0] > 0), int(y[1]), float(y[2])  # noqa: B018
        if y.any():
            pass
        torch.equal(x, y)
        y.cpu(), y.tolist(), y.numpy(), y.to("cpu")  # noqa: B018
        x[x > 2], x.nonzero(), torch.repeat_interleave(torch.tensor([1, 2]))  # noqa: B018
        x[x > 4] = 0.0
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # size given: no sync
    assert dict(s) == {"scalar": 6, "to_host": 4, "shape": 4}
    assert all("test_decode_syncs.py" in w for sites in s.where.values() for w in sites)
    assert torch.Tensor.cpu is torch._C.TensorBase.cpu  # the patches are undone

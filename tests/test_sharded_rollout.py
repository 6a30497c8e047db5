"""Rollout without an unsharded replica, and the bucketed weight sync (issue 20, items 3-4).

* Generation from the FSDP2-sharded policy (`PolicyRolloutEngine`, `rollout.replica=sharded`)
  gives the replica's tokens, log-probs and routing, same seeds, on 2 gloo ranks whose
  prompt counts, chunk counts and stopping steps differ; before and after an update.
* The bucketed sync yields exactly `full_parameters`' tensors, in buckets no larger than
  asked; a bucket smaller than the largest tensor is refused, naming the setting and sizes.
* The start-up memory plan keeps a replica that fits, drops one that does not (auto),
  refuses `keep` where it does not fit, and refuses what `sharded` is not proven for.
* A run with `rollout.replica=sharded` gives every metric of the replica run (same seed).
"""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testing.distributed import run_distributed  # noqa: E402

# odd vocabulary and layer sizes: FSDP2's dim-0 shards are uneven on 2 ranks
SHAPE = dict(vocab_size=19, intermediate_size=66, max_position_embeddings=128)
NEW = 8
BUCKET = {"qwen3": 40_000, "qwen3_moe": 140_000}  # bytes: several buckets, each >= the largest tensor


# ----------------------------------------------------------------- rank bodies
def _policy(family: str, dims, seed: int = 0, **over):
    from model.actor import Actor
    from model.models import build_model
    from model.parallelize import parallelize

    return parallelize(Actor(build_model(family, seed=seed, **SHAPE, **over), dims=dims), dims)


def _prompts(rank: int) -> tuple[list[torch.Tensor], list[int]]:
    """Rank 0: 3 prompts (2 chunks of 2), rank 1: 6 (3 chunks); GRPO-like repeats."""
    g = torch.Generator().manual_seed(100 + rank)
    distinct = [torch.randint(1, SHAPE["vocab_size"], (int(n),), generator=g) for n in (5, 9, 3)]
    if rank == 0:
        return [distinct[0], distinct[0], distinct[1]], [0, 0, 1]
    return [distinct[k] for k in (0, 0, 1, 1, 2, 2)], [10, 10, 11, 11, 12, 12]


def _compare(a, b) -> dict:
    same_tokens = all(torch.equal(x.sequences, y.sequences) for x, y in zip(a, b)) and len(a) == len(b)
    gap = max((float((x.rollout_log_probs - y.rollout_log_probs).abs().max()) for x, y in zip(a, b)), default=0.0)
    routing = all((x.routed_experts is None and y.routed_experts is None) or torch.equal(x.routed_experts,
                                                                                          y.routed_experts)
                  for x, y in zip(a, b))
    return {"same_tokens": same_tokens, "log_prob_gap": gap, "same_routing": routing,
            "lengths": [int(x.response_length) for x in a]}


def sharded_vs_replica(rank: int, world: int, family: str, tied: bool, ep: int = 1, cp: int = 1) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from runtime.parallel_dims import init_distributed
    from model.parallelize import full_parameters
    from rl.rollout.engine import HFRolloutEngine, PolicyRolloutEngine
    from rl.rollout.sync import buckets, sync_weights
    from testing.records import make_records
    from packing import make_experience_batch

    torch.set_num_threads(1)
    dims = init_distributed(ep=ep, cp=cp, device="cpu")
    actor = _policy(family, dims, tie_word_embeddings=tied)
    from model.models import build_model

    replica = HFRolloutEngine(build_model(family, seed=1, **SHAPE, tie_word_embeddings=tied), max_batch_size=2)
    replica.sync_bucket_bytes = BUCKET[family]  # several buckets per sync
    sync_weights(replica, actor.model)  # another seed's replica: the sync must overwrite every weight
    policy = PolicyRolloutEngine(actor, max_batch_size=2, group=dist.group.WORLD)
    prompts, index = _prompts(rank)

    # each rank's stop token: the greedy first token of its first prompt, so under greedy decoding that
    # prompt's rows (one chunk) stop at step 0 while the rank's other chunks and its peer's go on:
    # the lockstep must run the peers' steps (and rank 1's third chunk) regardless
    stop = int(replica.generate(prompts[:1], prompt_indices=[0], max_new_tokens=1, temperature=0.0,
                                seed=0)[0].sequences[-1])
    replica.stop_token_id = policy.stop_token_id = stop
    out = {}
    for name, temperature in (("sampled", 0.7), ("greedy", 0.0)):
        kw = dict(prompt_indices=index, max_new_tokens=NEW, temperature=temperature, seed=5)
        out[name] = _compare(replica.generate(prompts, **kw), policy.generate(prompts, **kw))
    # a rank with nothing to generate still joins its peers' forwards (evaluate's last chunk)
    mine = prompts[:2] if rank == 0 else []
    empty = policy.generate(mine, prompt_indices=list(range(len(mine))), max_new_tokens=NEW, temperature=0.0,
                            seed=0)
    out["empty_rank_records"] = len(empty)
    out["resharded"] = all(isinstance(p, DTensor) for p in actor.parameters())
    out["training_mode_kept"] = actor.training

    # one update, then the sync: the replica follows; the policy engine needs none
    optimizer = torch.optim.AdamW(actor.parameters(), lr=3e-2)
    routed = (2, 2, 8) if family == "qwen3_moe" else None
    batch = make_experience_batch(make_records([9, 12, 7], vocab=SHAPE["vocab_size"], seed=dims.dp_rank, routed=routed),
                                  packed=True)
    (actor(batch) * batch.action_mask).sum().backward()
    optimizer.step()
    sync_weights(replica, actor.model)
    kw = dict(prompt_indices=index, max_new_tokens=NEW, temperature=0.7, seed=6)
    out["after_update"] = _compare(replica.generate(prompts, **kw), policy.generate(prompts, **kw))

    # the bucketed gather is exactly full_parameters, bucket by bucket
    reference = dict(full_parameters(actor.model))
    sizes, got = [], {}
    for bucket in buckets(actor.model, BUCKET[family]):
        sizes.append(sum(t.numel() * t.element_size() for n, t in bucket if n != "lm_head.weight" or not tied))
        got.update(bucket)
    out["bucket_bytes"] = sizes
    out["gather_equal"] = sorted(got) == sorted(reference) and all(torch.equal(got[k], v) for k, v in reference.items())
    out["replica_equal"] = all(torch.equal(replica.model.state_dict()[k], v) for k, v in reference.items())

    # held-out evaluation over 3 problems on 2 ranks, one at a time: rank 1 has one problem fewer, and
    # still joins its peers' last forward (rl/rollout/evaluate.py calls generate as often on every rank)
    from rl.rollout.evaluate import evaluate
    from rl.tasks.registry import build_task

    task = build_task("target_token", vocab_size=SHAPE["vocab_size"], target=stop)
    problems = task.prompts(2 * dims.dp - 1, seed=3)
    kw_eval = dict(max_new_tokens=4, batch_size=1)
    drop = ("eval_s",)
    scores = [{k: v for k, v in evaluate(e, task, problems, dims, **kw_eval).items() if k not in drop}
              for e in (replica, policy)]
    out["eval_equal"] = scores[0] == scores[1]

    # non-finite logits on rank 0 only: every rank raises at the same step (none waits on the others)
    if rank == 0:
        forward = policy._forward
        policy._forward = lambda *args: forward(*args) * float("nan")
    try:
        policy.generate(prompts, **kw)
        out["diverged"] = None
    except FloatingPointError as e:
        out["diverged"] = str(e)
    return out


def sharded_run_vs_replica_run(rank: int, world: int, overrides: tuple[str, ...], steps: int) -> dict:
    """The same seeded run twice, rollout.replica=keep then sharded, on these ranks."""
    from runtime.parallel_dims import init_distributed
    from rl.trainer.build import build_trainer
    from testing.inprocess import compose

    torch.set_num_threads(1)
    out = {}
    for mode in ("keep", "sharded"):
        cfg = compose(*overrides, f"rollout.replica={mode}", world_size=world)
        dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep, device="cpu")
        torch.manual_seed(cfg.seed)
        tr = build_trainer(cfg, dims)
        out[mode] = {"plan": tr.engine.replica.mode, "metrics": [tr.step(s) for s in range(steps)]}
    return out


# ----------------------------------------------------------------------- tests
CASES = {  # world, family, tied embeddings, ep, cp
    "dense": (2, "qwen3", False, 1, 1),
    "dense-tied": (2, "qwen3", True, 1, 1),
    "moe": (2, "qwen3_moe", False, 1, 1),
    "moe-ep2": (2, "qwen3_moe", False, 2, 1),
    "dense-cp2": (2, "qwen3", False, 1, 2),
    "moe-dp2-cp2-ep2": (4, "qwen3_moe", False, 2, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_policy_generates_the_replicas_tokens(case):
    world, family, tied, ep, cp = CASES[case]
    results = run_distributed(sharded_vs_replica, world, family, tied, ep, cp, timeout=600)
    for rank, r in enumerate(results):
        for step in ("sampled", "greedy", "after_update"):
            c = r[step]
            print(f"{case} rank {rank} {step}: lengths {c['lengths']}, max |log-prob gap| {c['log_prob_gap']:.1e}")
            assert c["same_tokens"] and c["same_routing"]
            assert c["log_prob_gap"] <= 1e-6  # 0 without EP; EP's expert matmuls see other rows: ~5e-7
        assert r["greedy"]["lengths"][:2] == [1, 1]
        assert r["empty_rank_records"] == (2 if rank == 0 else 0)
        assert r["resharded"] and r["training_mode_kept"]
        assert r["gather_equal"] and r["replica_equal"]
        assert "not finite" in r["diverged"]
        assert r["eval_equal"]
        assert len(r["bucket_bytes"]) > 2 and max(r["bucket_bytes"]) <= BUCKET[family]
    assert results[0]["greedy"]["lengths"] != results[1]["greedy"]["lengths"]  # the ranks stopped differently


@pytest.mark.slow
def test_sharded_run_gives_every_metric_of_the_replica_run():
    overrides = ("model=dense_tiny", "task.prompts_per_step=4", "task.samples_per_prompt=2", "task.max_new_tokens=6",
                 "trainer.progress=false", "+task.options.stop_token_id=7")
    r = run_distributed(sharded_run_vs_replica_run, 2, overrides, 2, timeout=400)[0]
    assert (r["keep"]["plan"], r["sharded"]["plan"]) == ("keep", "sharded")
    timing = ("_s", "tokens_per_s")
    for keep, sharded in zip(r["keep"]["metrics"], r["sharded"]["metrics"]):
        assert sorted(keep) == sorted(sharded)
        differ = {k: (keep[k], sharded[k]) for k in keep if not k.endswith(timing) and keep[k] != sharded[k]}
        assert differ.pop("weight_sync_bytes", (1, 0))[1] == 0  # the one difference: sharded generation syncs nothing
        assert not differ


def test_one_process_sharded_run_equals_replica_run():
    from testing.inprocess import SMALL, trainer

    runs = {}
    for mode in ("keep", "sharded"):
        tr = trainer(*SMALL, "task.max_new_tokens=6", f"rollout.replica={mode}")
        assert tr.engine.replica.mode == mode and tr.engine.needs_sync == (mode == "keep")
        runs[mode] = [tr.step(s) for s in range(2)]
    for keep, sharded in zip(runs["keep"], runs["sharded"]):
        differ = {k: (keep[k], sharded[k]) for k in keep if not k.endswith(("_s", "tokens_per_s"))
                  and keep[k] != sharded[k]}
        assert differ.pop("weight_sync_bytes", (1, 0))[1] == 0  # the one difference: sharded generation syncs nothing
        assert not differ


def test_bucket_smaller_than_the_largest_tensor_is_refused():
    from model.models import build_model
    from rl.rollout.sync import DEFAULT_BUCKET_BYTES, full_tensor_bytes, resolve_bucket_bytes

    model = build_model("qwen3", seed=0, **SHAPE)
    sizes = full_tensor_bytes(model)
    largest = max(sizes.values())
    total = sum(sizes.values())
    assert total < DEFAULT_BUCKET_BYTES  # the default: one rank's share of the model, this small model whole
    assert resolve_bucket_bytes(model, None) == total
    assert resolve_bucket_bytes(model, None, world=4) == max(largest, -(-total // 4))
    assert resolve_bucket_bytes(model, largest) == largest
    with pytest.raises(ValueError) as e:
        resolve_bucket_bytes(model, largest - 1)
    name = max(sizes, key=sizes.get)
    for part in ("rollout.sync_bucket_bytes", str(largest - 1), name, str(largest)):
        assert part in str(e.value)


def test_memory_plan_decisions():
    from rl.rollout.replica import choose

    g = 2**30
    kw = dict(engine="hf", replica_bytes=10 * g, state_bytes=20 * g, budget_source="test")
    assert choose("auto", budget_bytes=40 * g, **kw).mode == "keep"
    assert choose("auto", budget_bytes=25 * g, **kw).mode == "sharded"
    assert choose("sharded", budget_bytes=40 * g, **kw).mode == "sharded"
    with pytest.raises(ValueError, match=r"rollout.replica=keep.*10\.000 GiB.*20\.000 GiB.*25\.000 GiB \(test\)"):
        choose("keep", budget_bytes=25 * g, **kw)
    with pytest.raises(ValueError, match="rollout.replica=auto.*does not fit.*a reason"):
        choose("auto", budget_bytes=25 * g, **kw, sharded_unsupported="a reason")
    assert choose("auto", budget_bytes=1, **{**kw, "engine": "vllm"}).mode == "external"
    with pytest.raises(ValueError, match="rollout.replica=sharded.*rollout.engine=vllm"):
        choose("sharded", budget_bytes=40 * g, **{**kw, "engine": "vllm"})


def test_config_names_what_the_plan_refuses():
    from testing.inprocess import SMALL, compose, trainer

    with pytest.raises(ValueError, match="rollout.replica=sharded: rollout.engine=vllm"):
        compose("rollout.replica=sharded", "rollout.engine=vllm")
    with pytest.raises(ValueError, match="rollout.memory_budget_gb"):
        compose("rollout.memory_budget_gb=0")
    with pytest.raises(ValueError, match="rollout.replica=keep: the unsharded rollout copy does not fit.*"
                                         r"rollout.memory_budget_gb=1e-06"):
        trainer(*SMALL, "rollout.replica=keep", "rollout.memory_budget_gb=0.000001")
    with pytest.raises(ValueError, match=r"rollout.sync_bucket_bytes=1048576 .* is smaller than the largest tensor"):
        trainer(*SMALL, "rollout.sync_bucket_bytes=1048576", "model.overrides.vocab_size=8192")
    tr = trainer(*SMALL, "rollout.memory_budget_gb=0.000001")  # auto: the copy does not fit -> sharded
    assert tr.engine.replica.mode == "sharded" and not tr.engine.needs_sync

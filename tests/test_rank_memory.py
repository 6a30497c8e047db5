"""What a rank holds beyond its shards, by default (issue 29.3; bench/rank_memory.py measures it).

* FSDP2 units: an untied input embedding is its own unit, so its gradient is reduce-scattered
  alone (not concatenated with the lm head's in the root's one flat fp32 buffer); a tied
  weight stays in the root, whose unshard covers both of its uses. Control: with the split
  off, the largest reduce-scatter input holds both matrices.
* The weight sync's default bucket is one rank's share of the model, between the largest
  tensor and 256 MiB.
* The rollout copy (`rollout.replica=keep`) is released during the training step: the HF
  engine's `sleep` frees every state-dict storage, generation refuses until a full
  `load_weights`, which gives the storage back and the same tokens as before (control: other
  weights give other log-probs). The trainer calls it between the rollout and the sync; the
  sharded engine's weights are the policy's and stay.
"""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testing.distributed import run_distributed  # noqa: E402

SHAPE = dict(vocab_size=1024, hidden_size=32, head_dim=8, intermediate_size=64)  # a vocab matrix > a layer
MIB = 2**20


# --------------------------------------------------------------- FSDP2 units
def reduce_scatter_sizes(rank: int, world: int, tied: bool, split: bool) -> dict:
    """One forward/backward of the parallelized Actor on 2 gloo ranks: which modules are FSDP
    units, and the element counts of every reduce-scatter input FSDP2 issues."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from model import parallelize as par
    from model.actor import Actor
    from model.models import build_model
    from runtime.parallel_dims import init_distributed
    from packing import make_experience_batch
    from testing.records import make_records

    if not split:  # the control: the root unit holds the embedding as well as the lm head
        par.tied_embeddings = lambda model: True
    sizes = []
    single = dist.reduce_scatter_single

    def recording(output, input, *args, **kwargs):
        sizes.append(input.numel())
        return single(output, input, *args, **kwargs)

    dist.reduce_scatter_single = recording
    dims = init_distributed(device="cpu")
    lm = build_model("qwen3", seed=0, tie_word_embeddings=tied, **SHAPE)
    actor = par.parallelize(Actor(lm, dims=dims), dims, param_dtype=torch.bfloat16)
    batch = make_experience_batch(make_records([9, 12, 7], vocab=SHAPE["vocab_size"], seed=rank), packed=True)
    (actor(batch) * batch.action_mask).sum().backward()
    return {"sizes": sizes, "embed_unit": isinstance(lm.get_input_embeddings(), FSDPModule),
            "grads": all(p.grad is not None for p in actor.parameters())}


@pytest.mark.slow
def test_an_untied_embedding_is_its_own_unit_and_its_gradient_is_reduced_alone():
    matrix = SHAPE["vocab_size"] * SHAPE["hidden_size"]
    untied = run_distributed(reduce_scatter_sizes, 2, False, True)
    control = run_distributed(reduce_scatter_sizes, 2, False, False)
    tied = run_distributed(reduce_scatter_sizes, 2, True, True)
    print(f"largest reduce-scatter input (elements): split {max(untied[0]['sizes'])}, "
          f"root holding both {max(control[0]['sizes'])}, tied {max(tied[0]['sizes'])}; one matrix {matrix}")
    assert untied[0]["embed_unit"] and not tied[0]["embed_unit"] and not control[0]["embed_unit"]
    assert all(r["grads"] for r in untied + control + tied)
    # the root holds the lm head and the final norm (hidden elements); the embedding is reduced on its own
    assert matrix <= max(untied[0]["sizes"]) <= matrix + SHAPE["hidden_size"]
    assert max(control[0]["sizes"]) >= 2 * matrix  # control: both matrices in one flat buffer
    assert max(tied[0]["sizes"]) <= matrix + SHAPE["hidden_size"]  # one tied matrix, in the root
    assert len(untied[0]["sizes"]) == len(control[0]["sizes"]) + 1  # one unit more, the embedding


# ----------------------------------------------------------------- sync bucket
def test_the_default_sync_bucket_is_one_ranks_share_between_the_largest_tensor_and_256_mib():
    from rl.rollout.sync import DEFAULT_BUCKET_BYTES, default_bucket_bytes

    sizes = {"embed": 75 * MIB, "head": 75 * MIB, **{f"layer{i}": 10 * MIB for i in range(20)}}  # 350 MiB
    assert default_bucket_bytes(sizes, 1) == DEFAULT_BUCKET_BYTES == 256 * MIB  # capped
    assert default_bucket_bytes(sizes, 2) == 175 * MIB  # the rank's share
    assert default_bucket_bytes(sizes, 4) == 350 * MIB // 4
    assert default_bucket_bytes(sizes, 8) == 75 * MIB  # never below the largest tensor (buckets hold whole tensors)
    assert default_bucket_bytes({"a": 3, "b": 4}, 3) == 4  # rounded up, at least the largest
    assert [default_bucket_bytes(sizes, w) for w in (1, 2, 4, 8, 16)] == sorted(
        (default_bucket_bytes(sizes, w) for w in (1, 2, 4, 8, 16)), reverse=True)


# ------------------------------------------------------------ rollout copy sleep
def _engine(tied: bool, seed: int = 0):
    from model.models import build_model
    from rl.rollout.engine import HFRolloutEngine

    return HFRolloutEngine(build_model("qwen3", seed=seed, tie_word_embeddings=tied, **SHAPE))


def _generate(engine):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, SHAPE["vocab_size"], (n,), generator=g) for n in (5, 9, 3)]
    return engine.generate(prompts, prompt_indices=[0, 0, 1], max_new_tokens=6, temperature=0.7, seed=3)


@pytest.mark.parametrize("tied", [False, True])
def test_the_rollout_copy_is_released_by_sleep_and_refilled_whole_by_the_sync(tied):
    engine = _engine(tied)
    before = _generate(engine)
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    held = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in engine.model.state_dict().values()}

    engine.sleep()
    assert engine.asleep
    assert all(v.untyped_storage().nbytes() == 0 for v in engine.model.state_dict().values())
    assert all(tuple(v.shape) == tuple(weights[k].shape) for k, v in engine.model.state_dict().items())
    assert sum(held.values()) == sum(v.numel() * v.element_size() for k, v in weights.items()
                                     if not (tied and k == "lm_head.weight"))  # every byte of the copy was released
    with pytest.raises(RuntimeError, match="sleep.*load_weights"):
        _generate(engine)

    partial = dict(weights)
    partial.pop("model.norm.weight")
    with pytest.raises(KeyError, match="model.norm.weight"):
        engine.load_weights(partial)
    assert engine.asleep  # a partial reload is not a copy to generate from
    with pytest.raises(RuntimeError, match="sleep"):
        _generate(engine)

    engine.load_weights(weights)
    assert not engine.asleep
    assert all(torch.equal(v, weights[k]) for k, v in engine.model.state_dict().items())
    if tied:
        assert engine.model.lm_head.weight is engine.model.get_input_embeddings().weight
    after = _generate(engine)
    assert all(torch.equal(a.sequences, b.sequences) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
               for a, b in zip(before, after))
    # control: other weights give other log-probs, so the comparison above can fail
    engine.sleep()
    engine.load_weights(_engine(tied, seed=1).model.state_dict())
    other = _generate(engine)
    assert any(not torch.equal(a.rollout_log_probs, b.rollout_log_probs) for a, b in zip(before, other))


def test_the_sharded_engine_keeps_the_policys_weights_on_sleep():
    from model.actor import Actor
    from model.models import build_model
    from rl.rollout.engine import PolicyRolloutEngine

    actor = Actor(build_model("qwen3", seed=0, **SHAPE))
    engine = PolicyRolloutEngine(actor)
    engine.sleep()
    assert not engine.asleep
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in actor.parameters())
    assert len(_generate(engine)) == 3


def test_the_trainer_releases_the_copy_for_training_and_the_sync_refills_it():
    from testing.inprocess import SMALL, trainer

    tr = trainer(*SMALL, "trainer.max_steps=2")
    assert tr.engine.needs_sync and not tr.engine.asleep
    seen = []
    train = tr.train

    def recording(minibatches):
        seen.append((tr.engine.asleep, sum(v.untyped_storage().nbytes() for v in tr.engine.model.state_dict().values())))
        return train(minibatches)

    tr.train = recording
    for step in range(2):
        tr.step(step)
        assert not tr.engine.asleep  # the step's sync refilled it
        policy = tr.actor.model.state_dict()
        assert all(torch.equal(v, policy[k].to(v.dtype)) for k, v in tr.engine.model.state_dict().items())
    assert seen == [(True, 0), (True, 0)]  # during training: released, every byte

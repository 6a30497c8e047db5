"""Sharded checkpoint loading (model/loading.py): each rank reads only its shard of a checkpoint,
and the loaded model is bit for bit the one a plain `from_pretrained` gives.

2 gloo ranks load tiny `save_pretrained` checkpoints built on the meta device, sharded (FSDP2,
EP), filled from the safetensors; every parameter's full tensor equals a plain load's, every
rank read no more rows than its shard. Controls: a different checkpoint and a shifted slice
are caught. A one-step run on the sharded path gives the metrics of the current path (a
plain load on every rank, then sharded), at world 1 and 2. Bad input fails at build time
naming model.pretrained_path, the tensor and both shapes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader

from testing.distributed import run_distributed

import model.loading as loading
from model.actor import Actor
from model.models import build_model
from runtime.parallel_dims import ParallelDims, init_distributed
from model.parallelize import full_parameters, parallelize

# (family, tied output head, ep): dense FSDP rows, a tied head, EP (each rank its experts),
# experts FSDP-sharded by rows (ep=1)
CASES = [("qwen3", False, 1), ("llama", True, 1), ("qwen3_moe", False, 2), ("qwen3_moe", False, 1)]
ODD = {"qwen3": dict(vocab_size=255, intermediate_size=99)}  # rows that do not split evenly over 2 ranks


def checkpoint(folder, family: str, tied: bool = False, seed: int = 3, **overrides) -> str:
    build_model(family, seed=seed, tie_word_embeddings=tied, **overrides).save_pretrained(folder)
    return str(folder)


def sharded_actor(path: str, dims: ParallelDims, dtype: torch.dtype, **overrides) -> Actor:
    """What build_trainer does with a checkpoint: meta model -> parallelize -> load_sharded."""
    skeleton = build_model(None, pretrained_path=path, dtype=dtype, device="meta", **overrides)
    return loading.load_sharded(parallelize(Actor(skeleton, dims=dims), dims), path, dims)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def load_and_compare(rank: int, world_size: int, cases: list, control: str | None = None) -> list[dict]:
    """Per case: parameters/buffers that differ from a plain load, rows read vs rows held."""
    out = []
    for path, ep, dtype, other in cases:
        dims = init_distributed(ep=ep)
        plain = build_model(None, pretrained_path=other or path, dtype=dtype)  # the reference: a plain load
        read = []  # the elements of every slice DCP's reader reads from the checkpoint
        process = HuggingFaceStorageReader._process_read_request

        def counted(self, f, req, planner):
            if control == "shifted":  # every rank reads from row 0: rank 1 holds rank 0's slice
                req = dataclasses.replace(req, storage_offsets=torch.Size([0] * len(req.storage_offsets)))
            read.append(math.prod(req.lengths))
            return process(self, f, req, planner)

        HuggingFaceStorageReader._process_read_request = counted
        try:
            actor = sharded_actor(path, dims, dtype)
        finally:
            HuggingFaceStorageReader._process_read_request = process
        full = dict(full_parameters(actor.model))
        want = plain.state_dict()
        differ = sorted(k for k, v in want.items() if k not in full or full[k].dtype != v.dtype
                        or not torch.equal(full[k], v))
        buffers = dict(actor.model.named_buffers())
        differ += sorted(k for k, v in plain.named_buffers() if not torch.equal(buffers[k], v))
        held = sum(_local(p).numel() for p in actor.parameters())
        out.append({"differ": differ, "checked": len(want), "read": sum(read), "held": held,
                    "total": sum(v.numel() for k, v in want.items() if k != "lm_head.weight" or not
                                 plain.config.tie_word_embeddings),
                    "tied": actor.model.get_output_embeddings().weight is actor.model.get_input_embeddings().weight,
                    "meta": [n for n, t in actor.named_parameters() if _local(t).is_meta]})
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}
    for family, tied, _ in CASES:
        if (family, tied) not in made:
            made[family, tied] = checkpoint(tmp_path_factory.mktemp(family), family, tied, **ODD.get(family, {}))
    made["other"] = checkpoint(tmp_path_factory.mktemp("other"), "qwen3", seed=4)
    return made


@pytest.mark.slow
def test_each_rank_reads_only_its_shard_and_the_model_is_the_plain_load(folders):
    cases = [(folders[f, t], ep, dtype, None) for f, t, ep in CASES for dtype in (torch.float32, torch.bfloat16)]
    results = run_distributed(load_and_compare, 2, cases, timeout=400)
    for (path, ep, dtype, _), *per_rank in zip(cases, *results):
        for rank, r in enumerate(per_rank):
            where = f"{path.rsplit('/', 1)[-1]} ep={ep} {dtype} rank {rank}"
            print(f"{where}: {r['checked']} tensors bit-identical; read {r['read']} of {r['total']} elements, "
                  f"holds {r['held']}")
            assert r["differ"] == [] and r["checked"] > 0, where
            assert r["meta"] == [], where
            assert r["read"] == r["held"] < 0.6 * r["total"], where  # its shard, nothing more
        assert per_rank[0]["tied"] == ("llama" in path)


@pytest.mark.slow
def test_control_a_shifted_slice_or_another_checkpoint_is_caught(folders):
    shifted = run_distributed(load_and_compare, 2, [(folders["qwen3", False], 1, torch.float32, None)], "shifted",
                              timeout=300)
    for r in shifted:  # each rank's full tensors hold rank 1's wrong half
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight"} <= \
            set(r[0]["differ"])
    other = load_and_compare(0, 1, [(folders["qwen3", False], 1, torch.float32, folders["other"])])[0]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight"} <= \
        set(other["differ"])


def test_one_process_load_is_the_plain_load_and_reads_each_element_once(folders):
    for family, tied in (("llama", True), ("qwen3_moe", False)):
        r = load_and_compare(0, 1, [(folders[family, tied], 1, torch.bfloat16, None)])[0]
        assert r["differ"] == [] and r["read"] == r["held"] == r["total"], r


def test_a_bin_checkpoint_is_refused_with_the_conversion_to_run(tmp_path):
    model = build_model("qwen3", seed=3)  # transformers 5 writes safetensors only: a .bin folder by hand
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"model.pretrained_path=.*pytorch_model.bin weights; the sharded loader "
                                         r"reads safetensors only .*save_pretrained\(path, safe_serialization=True\)"):
        sharded_actor(str(tmp_path), ParallelDims(), torch.float32)


# ---------------------------------------------------------------------- bad input
def test_an_override_that_does_not_match_the_checkpoint_names_the_key_and_both_shapes(folders):
    with pytest.raises(ValueError, match=r"model.pretrained_path=.*model.layers.0.mlp.gate_proj.weight has shape "
                                         r"\[99, 64\], .* expects \[96, 64\]"):
        sharded_actor(folders["qwen3", False], ParallelDims(), torch.float32, intermediate_size=96)
    with pytest.raises(ValueError, match=r"model.pretrained_path=.*has no tensor lm_head.weight \(shape \[256, 64\]"):
        sharded_actor(folders["llama", True], ParallelDims(), torch.float32, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"experts.\{0..7\}.gate_proj\+up_proj.weight has shape "
                                         r"\[8, 64, 64\], .* expects \[8, 128, 64\] for .*experts.gate_up_proj"):
        sharded_actor(folders["qwen3_moe", False], ParallelDims(), torch.float32, moe_intermediate_size=64)


def test_a_family_with_other_load_time_conversions_is_refused(folders, monkeypatch):
    from transformers.conversion_mapping import WeightRenaming

    import transformers.conversion_mapping as cm

    original = cm.get_checkpoint_conversion_mapping
    monkeypatch.setattr(cm, "get_checkpoint_conversion_mapping", lambda t: [WeightRenaming("old", "new")]
                        if t == "qwen3" else original(t))
    with pytest.raises(ValueError, match="model.pretrained_path=.*'qwen3' checkpoint needs the load-time key "
                                         "conversion"):
        sharded_actor(folders["qwen3", False], ParallelDims(), torch.float32)


# ---------------------------------------------------------- one step, current path
TIMED = ("_s", "_per_s")


def one_step(rank: int, world_size: int, overrides: tuple[str, ...], current: bool) -> dict:
    """Step 0's untimed metrics and the policy after it; `current`: today's path (a plain load
    on every rank, then sharded) instead of the sharded load."""
    import rl.rollout.build as build_module
    import rl.trainer.build as trainer_module  # build_trainer and the model code it calls
    from testing.inprocess import compose

    cfg = compose(*overrides, world_size=world_size)
    dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep, device="cpu")
    build, load, materialize = trainer_module.build_model, trainer_module.load_sharded, build_module.materialize
    if current:  # every model read whole from the checkpoint, the rollout copy too
        trainer_module.build_model = lambda *a, device=None, **k: build(*a, **k)
        trainer_module.load_sharded = lambda module, path, dims: module
        build_module.materialize = lambda lm, device: lm.to(device)
    try:
        torch.manual_seed(cfg.seed)
        tr = trainer_module.build_trainer(cfg, dims)
    finally:
        trainer_module.build_model, trainer_module.load_sharded, build_module.materialize = build, load, materialize
    metrics = {k: v for k, v in tr.step(0).items() if not k.endswith(TIMED)}
    frozen = [not p.requires_grad for m in (tr.actor, tr.reference) for p in m.parameters()]
    return {"metrics": metrics, "frozen": frozen, "policy": {k: v.clone() for k, v in full_parameters(tr.actor.model)},
            "reference": None if tr.reference is None else dict(full_parameters(tr.reference.model))}


def _step_overrides(path: str) -> tuple[str, ...]:
    return ("model=pretrained", f"model.pretrained_path={path}", "task.prompts_per_step=4",
            "task.samples_per_prompt=4", "task.max_new_tokens=6", "trainer.progress=false", "algo.kl_coef=0.05",
            "algo.entropy_coef=0.01", "trainer.device=cpu")  # the entropy term: a gradient whatever the rewards


def _assert_same_step(new: dict, old: dict, where: str) -> None:
    assert new["metrics"] == old["metrics"], (where, {k: (new["metrics"].get(k), v) for k, v in
                                                      old["metrics"].items() if new["metrics"].get(k) != v})
    assert new["frozen"] == old["frozen"] and any(new["frozen"]) and not all(new["frozen"]), where
    for part in ("policy", "reference"):
        assert new[part].keys() == old[part].keys(), where
        assert all(torch.equal(new[part][k], v) for k, v in old[part].items()), (where, part)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])  # ppo: a critic, its value head seeded beside the meta model
def test_one_step_metrics_equal_the_current_path_in_one_process(folders, algo):
    overrides = _step_overrides(folders["llama", True]) + (f"algo={algo}",)
    new, old = one_step(0, 1, overrides, False), one_step(0, 1, overrides, True)
    print(f"world 1: {len(old['metrics'])} metrics equal, grad_norm {new['metrics']['grad_norm']}, "
          f"entropy {new['metrics']['entropy']}")
    _assert_same_step(new, old, "world 1")


@pytest.mark.slow
def test_one_step_metrics_equal_the_current_path_on_two_ranks(folders):
    overrides = _step_overrides(folders["qwen3_moe", False]) + ("parallel.ep=2",)
    new = run_distributed(one_step, 2, overrides, False, timeout=400)
    old = run_distributed(one_step, 2, overrides, True, timeout=400)
    for rank, (a, b) in enumerate(zip(new, old)):
        print(f"world 2 rank {rank}: {len(b['metrics'])} metrics equal, grad_norm {a['metrics']['grad_norm']}, "
              f"entropy {a['metrics']['entropy']}")
        _assert_same_step(a, b, f"world 2 rank {rank}")


# ---------------------------------------------------------- the rollout replica
def _replica_logits(path: str, monkeypatch, *, recompute_buffers: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The HF engine's copy as rl/rollout/build.py makes it (meta -> `materialize` -> the first
    sync fills every weight) and a plain load, on the same tokens. Every allocated element is
    set to NaN first: what `to_empty` hands back is arbitrary, NaN makes a value left unfilled show."""
    from rl.rollout.engine import HFRolloutEngine

    allocate = loading._allocate

    def poisoned(module, lm, device, tied):
        allocate(module, lm, device, tied)
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.data.fill_(float("nan"))

    monkeypatch.setattr(loading, "_allocate", poisoned)
    plain = build_model(None, pretrained_path=path)
    skeleton = build_model(None, pretrained_path=path, device="meta")
    if not recompute_buffers:  # the control: the rotary inv_freq stays what the allocation left
        skeleton._init_weights = lambda module: None
    engine = HFRolloutEngine(loading.materialize(skeleton, "cpu"))
    engine.load_weights(plain.state_dict())
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        want, got = plain(input_ids=ids).logits, engine.model(input_ids=ids).logits
    lm = engine.model
    return want, got, lm.get_output_embeddings().weight is lm.get_input_embeddings().weight


def test_the_rollout_replica_is_allocated_empty_and_the_sync_makes_it_the_plain_load(folders, monkeypatch):
    want, got, tied = _replica_logits(folders["llama", True], monkeypatch, recompute_buffers=True)
    assert tied and torch.equal(got, want)
    want, got, _ = _replica_logits(folders["llama", True], monkeypatch, recompute_buffers=False)
    assert not torch.equal(got, want) and got.isnan().any()  # control: a buffer left unfilled shows


def test_a_random_init_model_builds_on_meta_with_the_random_models_shapes():
    meta, real = build_model("qwen3", device="meta"), build_model("qwen3")
    with pytest.raises(ValueError, match=r"materialize: \d+ tensors of the model already hold values"):
        loading.materialize(real, "cpu")  # a loaded model: allocating would lose its weights
    assert all(t.is_meta for t in meta.state_dict().values())
    assert {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in real.state_dict().items()}

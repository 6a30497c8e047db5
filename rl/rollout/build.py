"""`build_engine`: the rollout engine the config names, built on the replica choice of rl/rollout/replica.py.

    replica mode "sharded"       -> PolicyRolloutEngine over the training shards (no copy)
    rollout.engine=hf  (keep)    -> HFRolloutEngine over an unsharded copy of the policy, allocated
                                    empty on the device and filled by the first sync
    rollout.engine=vllm (keep)   -> VLLMRolloutEngine (rl/rollout/vllm_engine.py)

Every engine gets the policy's weights once here, bucket by bucket (rl/rollout/sync.py).
`evaluation_engine`: the held-out evaluation's (the rollout engine, or at max_staleness >= 2 and on
dedicated rollout ranks the policy).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

import torch

from model.loading import materialize
from model.lora import has_adapters, merged_state_dict
from model.models import compute_copy
from model.moe import is_moe
from rl.rollout.engine import HFRolloutEngine, PolicyRolloutEngine, RolloutEngine
from rl.rollout.replica import ReplicaMode, RolloutEngineName, choose_replica
from rl.rollout.sync import resolve_bucket_bytes, sync_weights
from rl.rollout.vllm_checks import require_vllm
from rl.rollout.vllm_engine import VLLMRolloutEngine, engine_gpu
from rl.tasks.base import longest_sample


def build_engine(cfg, dims, task, actor, new_model, teacher=None, max_staleness: int = 0) -> RolloutEngine:
    """The rollout engine `cfg.rollout.engine` names, holding the policy's weights (`teacher`: the
    distillation teacher, or None, and `max_staleness`, the resolved rollout.max_staleness, for
    the memory plan).
    `new_model(device=None)` builds a fresh unsharded policy-shaped model (on meta: the HF engine's copy; for
    vLLM it is saved once as the checkpoint folder of a random-init run)."""
    stop = task.stop_token_id
    r = cfg.rollout
    # a copy computes in the training compute dtype (model.param_dtype as validate resolved it, else the masters'):
    # no systematic rollout/train gap from the dtype
    compute = cfg.model.param_dtype or cfg.model.dtype
    bucket = resolve_bucket_bytes(actor.model, r.sync_bucket_bytes)  # smaller than the largest tensor: an error
    # rollout.replica: keep a copy, or generate from the sharded policy
    replica = choose_replica(cfg, dims, actor, teacher, max_staleness=max_staleness)
    if dims.rank == 0:
        logging.getLogger("train").info("%s", replica.describe())
    if replica.mode == ReplicaMode.SHARDED:
        engine: RolloutEngine = PolicyRolloutEngine(
            actor, stop_token_id=stop, group=torch.distributed.group.WORLD if dims.distributed else None)
    elif RolloutEngineName(r.engine) is RolloutEngineName.HF:
        # the copy's storage only: the sync below fills every weight (no checkpoint read, no host copy)
        engine = HFRolloutEngine(materialize(compute_copy(new_model("meta"), getattr(torch, compute.value)), dims.device),
                                 stop_token_id=stop)
    else:
        tp_group = None
        if dims.distributed and r.tensor_parallel_size > 1:
            tp_group, _ = torch.distributed.new_subgroups(group_size=r.tensor_parallel_size)
        engine = vllm_engine(cfg, dims, task, new_model, bucket, tp_group=tp_group, moe=is_moe(actor.model))
    engine.sync_bucket_bytes, engine.replica = bucket, replica
    sync_weights(engine, actor.model)  # bucket by bucket (rl/rollout/sync.py); nothing for the sharded policy
    return engine


# vLLM's share of its GPU when rollout.gpu_memory_utilization is null: beside a colocated trainer (which holds its
# shards, optimizer state and activations there), or on a dedicated generator's GPU, where only the generator
# process itself shares it: its CUDA context, its NCCL groups and a push's received tensors, one or two at a time (in
# the masters' dtype, then copied to host for the engine): 15% left for those (12 GiB of an 80 GiB GPU)
GPU_SHARE = {"colocated": 0.3, "dedicated": 0.85}


def vllm_engine(cfg, dims, task, new_model, bucket: int, *, tp_group=None, moe: bool = False,
                alone: bool = False) -> VLLMRolloutEngine:
    """The `VLLMRolloutEngine` of `cfg.rollout` over `model.pretrained_path` (a random-init model: a
    folder written for it), holding the checkpoint's weights until its first `load_weights`. `moe`
    (the policy is an MoE): with `algo.routing_replay` the engine records its routes on the records.
    `alone`: a dedicated generator's (rl/rollout/dedicated.py): no collective while it is built, and an
    engine of its own (vLLM's one-rank layout, its engine core in a process of its own that sees only the
    generator's GPU, `engine_gpu`; no sleep mode). `rollout.gpu_memory_utilization` null: `GPU_SHARE`."""
    require_vllm()
    r = cfg.rollout
    model_dir = cfg.model.pretrained_path
    if model_dir is None:  # a random-init model: vLLM loads a folder, so write one (one per node)
        model_dir = _random_init_folder(new_model, dims, alone=alone)
    compute = cfg.model.param_dtype or cfg.model.dtype
    own = {"world_size": 1, "in_process": False} if alone else {}
    if alone and dims.device.type == "cuda":
        own["gpu"] = engine_gpu(dims.device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    share = r.gpu_memory_utilization
    return VLLMRolloutEngine(
        model_dir, stop_token_id=task.stop_token_id, device=dims.device.type, dtype=compute.value,
        max_model_len=engine_max_len(cfg, task), seed=cfg.seed, sync_bucket_bytes=bucket,
        tensor_parallel_size=r.tensor_parallel_size,
        gpu_memory_utilization=GPU_SHARE["dedicated" if alone else "colocated"] if share is None else share,
        enable_sleep_mode=r.enable_sleep_mode and not alone, enforce_eager=r.enforce_eager,
        kv_cache_gb=r.kv_cache_gb, tp_group=tp_group, routed_experts=cfg.algo.routing_replay and moe,
        lora=cfg.model.lora, **own)


def evaluation_engine(dims, task, actor, engine: RolloutEngine, max_staleness: int) -> RolloutEngine:
    """The held-out evaluation's engine: the rollout `engine`, idle at a step's start and holding the
    policy it starts from (max_staleness=1: the thread starts the next rollout at `take`); with
    max_staleness >= 2 the rollout thread's (holding an older policy), and on dedicated rollout ranks
    (`dims.rollout_ranks`: the trainers hold no engine, `engine` is the push) the policy itself
    generates (PolicyRolloutEngine: its FSDP shards, gathered layer by layer, in lockstep over the
    trainers, `dims.trainer_group`: no generator takes part)."""
    if max_staleness < 2 and not dims.rollout_ranks:
        return engine
    return PolicyRolloutEngine(actor, stop_token_id=task.stop_token_id, group=dims.trainer_group)


def engine_max_len(cfg, task) -> int | None:
    """vLLM's `max_model_len`: `rollout.max_model_len`, else the longest sample the task can
    make (`rl.tasks.base.longest_sample`: the longest prompt plus every turn's reply and the
    environment's answers between turns) with the longer of the training and the evaluation
    reply budgets; None (the model's own limit) when the task does not say how long its prompts are."""
    if cfg.rollout.max_model_len is not None:
        return int(cfg.rollout.max_model_len)
    return longest_sample(task, max(cfg.task.max_new_tokens, cfg.eval.max_new_tokens or 0))


def _random_init_folder(new_model, dims, *, alone: bool = False) -> str:
    """The folder vLLM loads a random-init policy from, on this node's temporary storage. Its
    weights only give vLLM the shapes (the first sync replaces every one), so its name is a
    digest of what it holds (the model's config, LoRA or not): a restarted run, or another run
    of the same model, finds it already written instead of leaving a new copy each start. The
    name is drawn by rank 0 (the same on every rank); the first rank of each node (LOCAL_RANK 0)
    writes it under a temporary name and renames it into place, so nodes sharing the folder's
    filesystem or not both find it; every rank waits for it. `alone` (a dedicated generator, which
    builds its engine while the trainers build theirs): the name drawn here, the folder written by this
    rank if missing, no collective."""
    from runtime.parallel_dims import decided_on_rank0

    def draw() -> str:
        return f"rl-vllm-init-{_model_digest(new_model('meta'))}"

    folder = os.path.join(tempfile.gettempdir(), draw() if alone else decided_on_rank0(dims, draw))
    if (alone or int(os.environ.get("LOCAL_RANK", "0")) == 0) and not os.path.isdir(folder):
        model = new_model()
        # transformers >= 5 writes on global rank 0 alone once a process group exists; this is each node's copy
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
        part = f"{folder}.part-{os.getpid()}"
        # LoRA: the checkpoint of the base under stock names (adapters start at B = 0: merged = base)
        model.save_pretrained(part, state_dict=merged_state_dict(model) if has_adapters(model) else None)
        try:
            os.rename(part, folder)
        except OSError:  # another rank renamed its copy first (one shared temporary folder)
            shutil.rmtree(part, ignore_errors=True)
    if dims.distributed and not alone:
        torch.distributed.barrier()
    return folder


def _model_digest(model) -> str:
    """12 hex digits naming what `save_pretrained` of `model` writes: its full config (the
    transformers version included) and whether it carries adapters."""
    text = model.config.to_json_string(use_diff=False) + f"lora={has_adapters(model)}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]

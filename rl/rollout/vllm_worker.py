"""The code of the vLLM rollout engine that runs inside vLLM's worker process.

vLLM imports `WorkerExtension` by name (`worker_extension_cls`, set by rl/rollout/vllm_engine.py's
`llm_kwargs`) and mixes it into its worker class; the trainer-side engine (vllm_engine.py) calls
its methods with `LLM.collective_rpc(name, args=...)`. This module imports no trainer code: the
worker process loads it on its own.

Weight sync: `reload_weights(weights_iterator=..., is_checkpoint_format=True)` (vLLM's in-place
reload: it re-runs the layers' weight processing, which a plain `load_weights` after start-up
skips), fed either by the safetensors buckets the trainer writes under /dev/shm
(`rl_reload_from_shm`: bucket k is read once it appears, then unlinked) or by the trainer's
(name, tensor) iterator itself when the worker lives in the trainer's process
(`rl_reload_from_iterator`).

MoE routing replay (R3, `algo.routing_replay`): `rl_record_routes` hooks every MoE router
of vLLM's model (`BaseRouter.set_capture_fn`, the hook vLLM's own capturer binds) and keeps
the top-k expert ids of each token its forwards compute in a `RouteStore`, keyed by the
token's prefix (so a token computed once for several samples, vLLM's prefix cache, is found
for each); `rl_take_routes` hands them to the engine after a generation.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

POLL_S = 0.002  # how often each side of the /dev/shm sync looks for the other's next file


# ------------------------------------------------------- routed experts
_ROOT_KEY = 0x5EED  # the prefix key before a sequence's first token


def prefix_keys(tokens: Sequence[int], start: int = _ROOT_KEY) -> list[int]:
    """key[p] = hash((key[p-1], tokens[p])): one key per token naming its whole prefix (ints
    hash alike in every process, unlike str / bytes under PYTHONHASHSEED)."""
    keys, key = [], start
    for t in tokens:
        key = hash((key, int(t)))
        keys.append(key)
    return keys


class RouteStore:
    """In the vLLM worker: the top-k expert ids `[L, K]` of every token its forwards computed
    since the last `clear`, keyed by the token's prefix (`prefix_keys`). A request's keys are
    kept while it runs: the tokens it did not compute itself (prefix-cache hits) are hashed
    from its prompt the first time it shows up."""

    def __init__(self, layers: int, top_k: int) -> None:
        self.layers, self.top_k = layers, top_k
        self.step: list[torch.Tensor | None] = [None] * layers  # this forward's [n, K] per MoE layer
        self.chunks: list[np.ndarray] = []  # [n, L, K] int16 per forward
        self.where: dict[int, tuple[int, int]] = {}  # prefix key -> (chunk, row)
        self.keys: dict[str, list[int]] = {}  # request id -> keys of its tokens so far
        self.from_cache = 0  # tokens hashed from a prompt, not computed by their request (prefix-cache hits)

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.step[layer] = topk_ids.clone()  # the router's output may be a reused buffer

    def end_forward(self, req_ids: Sequence[str], starts: np.ndarray, positions: torch.Tensor,
                    input_ids: torch.Tensor, token_ids: np.ndarray) -> None:
        """File the forward's routes: request i holds rows `starts[i]:starts[i+1]` (vLLM's
        `query_start_loc`) at consecutive positions; `token_ids [reqs, max_len]` its tokens."""
        step, self.step = self.step, [None] * self.layers
        n = int(starts[len(req_ids)])
        if n == 0:
            return
        if any(s is None for s in step):
            missing = [i for i, s in enumerate(step) if s is None]
            raise RuntimeError(f"routed experts: MoE layers {missing} did not route this forward ({n} tokens)")
        chunk = len(self.chunks)
        self.chunks.append(torch.stack([s[:n] for s in step], 1).to("cpu", torch.int16).numpy())
        pos, tok = positions[:n].tolist(), input_ids[:n].tolist()
        for i, req in enumerate(req_ids):
            a, b = int(starts[i]), int(starts[i + 1])
            if a == b:
                continue
            p0 = pos[a]
            if pos[b - 1] != p0 + b - a - 1:
                raise RuntimeError(f"routed experts: request {req} has positions {pos[a:b]}, not consecutive")
            keys = self.keys.setdefault(req, [])
            if len(keys) < p0:  # its prefix came from the cache: hash it from its prompt
                self.from_cache += p0 - len(keys)
                keys += prefix_keys(token_ids[i, len(keys):p0].tolist(), keys[-1] if keys else _ROOT_KEY)
            del keys[p0:]
            keys += prefix_keys(tok[a:b], keys[-1] if keys else _ROOT_KEY)
            for r, key in zip(range(a, b), keys[p0:]):
                self.where[key] = (chunk, r)

    def routes(self, sequence: Sequence[int]) -> np.ndarray:
        """`[T, L, K]` int16 for a token sequence; -1 where no forward computed the token."""
        found = [self.where.get(k) for k in prefix_keys(sequence)]
        out = np.full((len(sequence), self.layers, self.top_k), -1, dtype=np.int16)
        for t, at in enumerate(found):
            if at is not None:
                out[t] = self.chunks[at[0]][at[1]]
        return out

    def clear(self) -> None:
        self.chunks, self.where, self.keys, self.from_cache = [], {}, {}, 0


# ------------------------------------------------------- worker extension
class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); its methods run in the
    worker, called with `LLM.collective_rpc(name, args=...)`."""

    rl_route_store: RouteStore | None = None  # set by rl_record_routes

    def rl_record_routes(self) -> int:
        """Hook every MoE router of the model and the V1 runner's forward so that each
        forward's top-k expert ids land in `rl_route_store`. Returns the MoE layer count."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runner = self.model_runner
        if not isinstance(runner, GPUModelRunner):
            raise RuntimeError(f"routed experts need vLLM's V1 model runner, this worker runs {type(runner).__name__} "
                               "(VLLM_USE_V2_MODEL_RUNNER=0)")
        moe = sorted((m for m in runner.get_model().modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)
        if not moe:
            raise RuntimeError("routed experts: the vLLM model has no MoE layer")
        store = self.rl_route_store = RouteStore(len(moe), runner.model_config.get_num_experts_per_tok())
        for slot, m in enumerate(moe):
            if not isinstance(m.router, BaseRouter):
                raise RuntimeError(f"routed experts: MoE layer {m.layer_id} has router {type(m.router).__name__}, "
                                   "which has no capture hook")
            m.router.set_capture_fn(partial(store.capture, slot))
        forward = runner._model_forward

        def recorded_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            batch = runner.input_batch
            reqs = batch.num_reqs
            store.end_forward(batch.req_ids[:reqs], runner.query_start_loc.np[:reqs + 1], kwargs["positions"],
                              kwargs["input_ids"], batch.token_ids_cpu)
            return out

        runner._model_forward = recorded_forward
        return len(moe)

    def rl_take_routes(self, sequences: list[list[int]]) -> tuple[list[bytes], int]:
        """The routes `[T, L, K]` int16 of each token sequence (raw bytes: they cross the RPC
        pipe as is) and the count of prefix-cache tokens among them, then forget everything."""
        store = self.rl_route_store
        out = [store.routes(seq).tobytes() for seq in sequences], store.from_cache
        store.clear()
        return out

    def _rl_after_reload(self) -> None:
        """vLLM 0.32's in-place reload skips the CPU MoE experts' prepack on a weight update
        (`UnquantizedFusedMoEMethod._setup_kernel` runs `fused_experts.process_weights_after_loading`
        on the first load only): the reloaded w13 / w2 stay in the checkpoint layout, which the
        CPU kernel reads as packed (0.027 max log-prob gap on the tiny MoE, 5e-7 fresh). Prepack
        them again. The recorded routes came from the old weights: forgotten."""
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        for m in self.model_runner.get_model().modules():
            kernel = m.quant_method.moe_kernel if isinstance(m, RoutedExperts) else None
            if kernel is not None and isinstance(kernel.fused_experts, CPUUnquantizedExperts):
                kernel.fused_experts.process_weights_after_loading(m)
        if self.rl_route_store is not None:
            self.rl_route_store.clear()

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
                    time.sleep(POLL_S)
                with safe_open(path, framework="pt", device="cpu") as f:
                    items = [(name, f.get_tensor(name)) for name in f.keys()]
                os.unlink(path)  # read: the trainer may write the next one
                for name, value in items:
                    count["tensors"] += 1
                    count["bytes"] += value.numel() * value.element_size()
                    yield name, value
                k += 1

        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        self._rl_after_reload()
        return {"reload_s": time.perf_counter() - t0, **count}

    def rl_reload_from_iterator(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """In-process worker (external_launcher): the trainer's (name, tensor) iterator itself."""
        t0 = time.perf_counter()
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        self._rl_after_reload()
        return {"reload_s": time.perf_counter() - t0}

"""Rollout engines: prompts -> unpadded per-sample `Experience` records.

The engine only generates; it never sees the task. One RL step reads:

    prompts = task.prompts(n, seed=...)                    # [(prompt_ids [P], meta)]
    records = engine.generate([p for p, _ in prompts], prompt_indices=..., max_new_tokens=...,
                              temperature=..., seed=...)   # one record per sample
    assign_rewards(task, records, [m for _, m in prompts])  # rl.tasks.calls: sets rec.rewards
    (both lines are rl/rollout/episodes.py `run_episodes`; a multi-turn task: one generate per turn)
    ... buffer -> plan -> collate -> train -> optimizer step ...
    sync_weights(engine, policy)                           # rl/rollout/sync.py: bucket by bucket

What a record holds (contract of packing/experience.py, no batch axis, no padding):
`sequences [T]` (prompt + response), `action_mask [T-1]` True on the slots whose target
is a response token (slots P-1 .. T-2), `rollout_log_probs [T-1]` fp32 log-prob of each
sampled token under the sampling distribution `log_softmax(logits / temperature)` (0 on
prompt slots), `routed_experts [L, K, T]` (MoE; None for dense), and 0-d
`response_length`, `total_length`, `prompt_index`. A sample stops after `stop_token_id`
(kept as its last response token) or at `max_new_tokens`.

Sampling: rl/rollout/sampler.py (a sample's tokens depend on its seed, never on the batch).

`HFRolloutEngine` is a KV-cache sampling loop over a Hugging Face causal LM. A chunk's
distinct prompts are prefilled once and their cache copied to every sample that repeats
one (a GRPO group shares its prompt); the cache reserves room for the new tokens. Prompts of a
chunk are left-padded; the attention mask hides pad keys and per-row `position_ids` start
at 0 at each prompt's first real token, so pad tokens change no real token's numbers
(beyond float rounding, ~1e-7 in fp32). The decode loop stays on the model's device: the host
reads one small tensor every `check_every` steps, not the logits at every step
(tests/test_decode_syncs.py counts it).

Routing (MoE): the engine's copy runs the training forward's `MoEBlock`s (unsharded,
model/moe.py) and records routing with the same `record_routing` context training uses:
the top-k ids the live forward chose, prompt tokens at prefill, response token j at the
decode step that feeds it. The last response token is never fed to sample a successor,
so MoE generation runs one extra decode step that only feeds it (its logits are dropped).
The recorded routing is thus exactly the routing the generation used, which is what
routing replay (R3) reproduces in training.

`PolicyRolloutEngine` (`rollout.replica=sharded`) runs the same loop on the training policy
itself: no replica, no weight sync. Under FSDP2 each decoder layer is all-gathered for its
forward and freed after it (`reshard_after_forward`), the root's parameters (embeddings,
final norm, lm head) for the whole `generate` call; so every forward is a collective over
the policy's ranks, and `generate` runs in lockstep on all of them: the same number of
chunks (a rank with fewer runs a one-token stand-in chunk) and of decode steps (a chunk
stops when every rank's rows have stopped). A sample's tokens are those of the replica:
the same weights, the same loop, the same per-sample noise.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F

from runtime.compat import reset_iter_state
from model.logprobs import logits_fp32
from model.lora import has_adapters, is_adapter
from model.moe import is_moe, moe_blocks, record_routing, shard_experts
from packing.experience import Experience
from packing.layout import padded_positions
from rl.rollout.chunk import Chunk, Decoded, left_pad
from rl.rollout.kv_cache import reserve, select_rows
from rl.rollout.sampler import sample_inverse_cdf, sample_seeds, signed, uniform_noise

# ----------------------------------------------------------------- interface
class RolloutEngine(abc.ABC):
    """Generates unpadded `Experience` records; a vLLM-backed engine implements the same."""

    needs_sync = True  # False: generates from the training policy's own weights (nothing to load)
    _base_loaded = False  # set by `load_weights` once LoRA's frozen base is in

    def __init__(self, *, stop_token_id: int | None = None) -> None:
        self.stop_token_id = stop_token_id
        self.on_progress = None  # called as on_progress(decode="t/T", rows="b/B") while a generation runs, or None
        self.sync_bucket_bytes: int | None = None  # weight sync bucket (rl/rollout/sync.py); None: the default
        self.replica = None  # the start-up memory plan that chose this engine (rl/rollout/replica.py), if any
        self.loaded_bytes = 0  # bytes the last `load_weights` received (LoRA: the adapters only, model/lora.py)

    @property
    def holds_base(self) -> bool:
        """True when the copy has LoRA adapters (model/lora.py) and its frozen base weights
        are loaded: a sync then sends the adapters only (rl/rollout/sync.py)."""
        return self._base_loaded

    def sleep(self) -> None:
        """Free what the engine holds for generation until the next weight sync (the trainer
        calls it when the rollout is done and the engine idles until the sync); here nothing."""

    @abc.abstractmethod
    def generate(
        self,
        prompts: Sequence[torch.Tensor],
        *,
        prompt_indices: Sequence[int],
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ) -> list[Experience]:
        """One record per prompt, in order: `prompts[i]` is a 1-D `[P_i]` tensor of token ids,
        `prompt_indices[i]` its GRPO group id (repeat a prompt to draw several samples).
        `temperature=0` decodes greedily (evaluation); log-probs are then of softmax(logits)."""

    @abc.abstractmethod
    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace all policy weights (strict: every state-dict entry, same names and shapes)."""


def check_prompt(i: int, prompt: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """`prompts[i]` as a CPU int64 `[P]` tensor; an error naming the index for anything else
    (not 1-D, empty, not integer, ids outside [0, vocab_size); vocab_size None: not checked)."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.numel() == 0:
        shape = tuple(prompt.shape) if isinstance(prompt, torch.Tensor) else type(prompt).__name__
        raise ValueError(f"prompts[{i}] must be a non-empty 1-D tensor of token ids [P], got {shape}")
    if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
        raise ValueError(f"prompts[{i}] must hold integer token ids, got dtype {prompt.dtype}")
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or (vocab_size and hi >= vocab_size):
        raise ValueError(f"prompts[{i}] holds ids in [{lo}, {hi}], outside the vocabulary [0, {vocab_size})")
    return prompt.detach().to("cpu", torch.int64)


def make_record(
    prompt: torch.Tensor,
    response: torch.Tensor,
    log_probs: torch.Tensor,
    prompt_index: int,
    routed_experts: torch.Tensor | None = None,
    actions: torch.Tensor | None = None,
) -> Experience:
    """An unpadded record from `prompt [P]`, `response [R]`, the sampled tokens' `log_probs [R]`
    and optional `routed_experts [L, K, P + R]`. `actions [R]` bool: which response tokens the
    policy sampled (None: all; a multi-turn episode's environment tokens are not, and its
    `log_probs` hold 0 there): the action mask is True on the slots that score them."""
    P, R = prompt.numel(), response.numel()
    if P < 1 or R < 1:
        raise ValueError(f"make_record: prompt [{P}] and response [{R}] must each hold at least one token")
    if log_probs.shape != (R,):
        raise ValueError(f"make_record: log_probs has shape {tuple(log_probs.shape)}, expected ({R},) like response")
    if actions is not None and actions.shape != (R,):
        raise ValueError(f"make_record: actions has shape {tuple(actions.shape)}, expected ({R},) like response")
    T = P + R
    action_mask = torch.zeros(T - 1, dtype=torch.bool)
    action_mask[P - 1 :] = True if actions is None else actions.bool()  # slot k scores token k+1
    rollout_log_probs = torch.zeros(T - 1, dtype=torch.float32)
    rollout_log_probs[P - 1 :] = log_probs.float()
    return Experience(
        sequences=torch.cat([prompt, response]).to(torch.int64),
        action_mask=action_mask,
        rollout_log_probs=rollout_log_probs,
        routed_experts=routed_experts,
        response_length=torch.tensor(R),
        total_length=torch.tensor(T),
        prompt_index=torch.tensor(int(prompt_index)),
    )


# ------------------------------------------------------------ HF embedded engine
class HFRolloutEngine(RolloutEngine):
    """Embedded generation with an unsharded copy of the policy (a HF causal LM, eval, no grad).

    `max_batch_size` caps the rows of one generation chunk (prompts are sorted by length
    before chunking to keep left padding small; results do not depend on it).
    `attn_implementation` is set on the model: the KV-cache loop needs a backend that
    honours a padding mask and a cache. The default, model/attention.py's "varlen" (the
    training forward's), takes sdpa with the model's mask there and keeps GQA in the kernel.
    `sleep` releases the copy's weights for the training step; the next sync refills them.
    """

    asleep = False  # the copy's weights released by `sleep` until the next full `load_weights`
    check_every = 8  # decode steps between two host reads of the stop / non-finite flags (`_generate_chunk`)
    # fp32 on one CPU thread: the LM head multiplied by this many vocabulary rows at a time (`_forward`;
    # None: one matmul); the same logits, bit for bit (tests/test_rollout.py)
    head_rows: int | None = 1024

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        stop_token_id: int | None = None,
        max_batch_size: int | None = None,
        attn_implementation: str | None = "varlen",
    ) -> None:
        super().__init__(stop_token_id=stop_token_id)
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 (or None for one chunk)")
        self.model = model
        self.max_batch_size = max_batch_size
        self.group = None  # a process group every generate call runs in lockstep with (PolicyRolloutEngine)
        self._run = model.model  # what a forward calls: the decoder stack (the head is applied in `_forward`)
        importlib.import_module("model.attention")  # registers "varlen" (here: the module imports without transformers)
        if attn_implementation is not None and model.config._attn_implementation != attn_implementation:
            model.set_attn_implementation(attn_implementation)
        model.eval().requires_grad_(False)
        if is_moe(model) and not moe_blocks(model, strict=False):
            shard_experts(model, None)  # the training forward's blocks, every expert local
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self._released: dict[str, int] = {}  # state-dict name -> its storage's bytes before `sleep`
        self._adapters = has_adapters(model)  # LoRA (model/lora.py): the base is loaded once
        self._base_loaded = False

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def is_moe(self) -> bool:
        return bool(moe_blocks(self.model, strict=False))

    # ------------------------------------------------------------- weights
    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every weight in, one `(name, tensor)` at a time (a generator such as
        `rl.rollout.sync.full_parameter_buckets` never holds the whole model). Strict: the same
        names and shapes as the rollout model's state dict; a name or shape error is raised
        as soon as it is seen, a missing name after the last tensor (the tensors copied
        before an error stay copied: reload the full weights after fixing the source).
        A copy with LoRA adapters whose base is loaded takes the adapter tensors alone (the
        base is frozen: kept once, never resent); each is cast to the copy's dtype."""
        own = self.model.state_dict()
        items = weights.items() if isinstance(weights, Mapping) else weights
        seen, received = set(), 0
        for name, value in items:
            if name not in own:
                raise KeyError(f"load_weights: unexpected tensor {name!r}: the rollout model has no such state-dict entry")
            if tuple(value.shape) != tuple(own[name].shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(own[name].shape)}")
            storage = own[name].untyped_storage()
            if storage.nbytes() == 0 and self._released.get(name):  # released by `sleep`: storage again, then values
                storage.resize_(self._released[name])
            own[name].copy_(value)  # state_dict() tensors alias the parameters: copy_ updates them in place
            seen.add(name)
            received += value.numel() * value.element_size()
        missing = sorted(set(own) - seen)
        if self._adapters and self._base_loaded:  # adapters only: the base stays as loaded
            missing = [n for n in missing if is_adapter(n)]
        if missing:
            raise KeyError(f"load_weights: {len(missing)} state-dict entries were not given: {_head(missing)}")
        self.asleep, self._released, self.loaded_bytes = False, {}, received
        self._base_loaded = self._adapters

    def sleep(self) -> None:
        """Release the copy's weights until the next `load_weights` (the trainer calls it after
        the rollout): training never reads the copy and the sync after the update rewrites
        every state-dict entry (strict), so their storage is free for the training step (the
        tensors keep their shapes; `load_weights` gives each its storage back before copying
        into it). Non-persistent buffers (rotary `inv_freq`) stay. A storage that cannot be
        resized (memory-mapped from a file) is kept."""
        if self._adapters:  # the base is kept (loaded once); the adapters are a few MiB
            return
        own = self.model.state_dict()
        # every name's storage size first: a tied weight is one storage under two names
        self._released = {name: t.untyped_storage().nbytes() for name, t in own.items()
                          if t.untyped_storage().resizable()}
        for name in self._released:
            own[name].untyped_storage().resize_(0)
        self.asleep = True

    # ---------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[torch.Tensor],
        *,
        prompt_indices: Sequence[int],
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ) -> list[Experience]:
        if self.asleep:
            raise RuntimeError("generate: the rollout copy's weights were released by sleep() and not reloaded since: "
                               "load_weights (the weight sync) with every state-dict entry comes first")
        prompts = [self._check_prompt(i, p) for i, p in enumerate(prompts)]
        if len(prompt_indices) != len(prompts):
            raise ValueError(f"prompt_indices has {len(prompt_indices)} entries, expected {len(prompts)} (one per prompt)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        longest = max((p.numel() for p in prompts), default=0) + max_new_tokens
        if limit is not None and longest > limit:
            raise ValueError(f"prompt + max_new_tokens reaches {longest} tokens, over max_position_embeddings={limit}")

        seeds = sample_seeds(seed, prompt_indices)
        order = sorted(range(len(prompts)), key=lambda i: prompts[i].numel())
        size = self.max_batch_size or max(len(order), 1)
        chunks = [order[start : start + size] for start in range(0, len(order), size)]
        records: list[Experience | None] = [None] * len(prompts)
        for k in range(self._agree([len(chunks)])[0]):
            if k >= len(chunks):  # lockstep: the peers still generate, so run their collectives on a stand-in
                self._generate_chunk([torch.zeros(1, dtype=torch.int64)], [0], max_new_tokens, float(temperature))
                continue
            chunk = chunks[k]
            outs = self._generate_chunk([prompts[i] for i in chunk], [seeds[i] for i in chunk],
                                        max_new_tokens, float(temperature))
            for i, (response, log_probs, routing) in zip(chunk, outs):
                records[i] = make_record(prompts[i], response, log_probs, prompt_indices[i], routing)
        return records  # type: ignore[return-value]

    def _agree(self, values: list[int] | torch.Tensor, reduced: int | None = None) -> list[int]:
        """The element-wise max of `values` (of its first `reduced` entries; None: all) over the
        lockstep group (one all-reduce; `values` itself without a group) as host ints: what every
        rank of a collective generation must agree on, read with what it need not. A device
        tensor is reduced where it lies and read once (one host sync)."""
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64, device=self.device)
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(t[:reduced], op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def _check_prompt(self, i: int, prompt: torch.Tensor) -> torch.Tensor:
        return check_prompt(i, prompt, self.vocab_size)

    def _generate_chunk(
        self, prompts: list[torch.Tensor], seeds: list[int], max_new_tokens: int, temperature: float
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Left-padded KV-cache sampling of one chunk -> per row (response [R], log_probs [R],
        routed_experts [L, K, P + R] or None).

        Identical prompts (a GRPO group's samples) are prefilled once: the prefill runs over
        the distinct prompts and its cache, logits and routing are copied to every row that
        repeats one. The cache reserves room for every new token up front (rl/rollout/kv_cache.py),
        so a decode step writes its keys/values in place instead of re-concatenating them.

        The decode loop keeps everything on the model's device and reads nothing back per
        step (a GPU's host would otherwise wait for the device at every token): sampling,
        the stop bookkeeping and the non-finite check are device ops; the host reads one
        small tensor every `check_every` steps (which rows have stopped? did a row's logits
        go non-finite, and at which step?). A chunk whose rows all stop runs at most
        `check_every - 1` steps more than it needs; those steps feed the stop token to
        stopped rows, and their tokens are dropped, so the samples do not depend on it.
        The attention mask of a decode step is known on the host (the left padding is fixed
        at prefill): `_decode_masks` hands it to the model built, not for it to inspect.

        The batch shrinks as rows stop: at each check the rows that stopped are dropped
        from the batch (cache, logits, positions, masks, seeds), so a long answer does not
        keep every finished row decoding. A row's draws come from its own counter stream
        (`uniform_noise(seed, step)`), so dropping its neighbours changes none of its
        tokens (up to the batch-size rounding the module docstring describes). A row stays
        in the batch for the forward that feeds its last token (MoE: that forward records
        the token's routing); in lockstep a rank whose rows have all stopped keeps one,
        since its peers' forwards are collectives. `live` (host) and `rows` (device) are
        the same row list twice: the loop indexes with `rows` without a copy per step."""
        c = self._start_chunk(prompts, seeds, max_new_tokens)
        record = record_routing(self.model) if self.is_moe else contextlib.nullcontext()
        with record as rec:
            self._prefill(c, rec, max_new_tokens)
            cdf = torch.empty(c.B, self.vocab_size, dtype=torch.float64, device=c.device) if temperature else None
            for step in range(max_new_tokens):
                tok = self._sample(c, step, temperature, cdf)
                last, keep = step == max_new_tokens - 1, None
                if last or (step + 1) % self.check_every == 0:
                    going, keep = self._check(c, step, max_new_tokens)
                    last = last or not going
                if last and not self.is_moe:
                    break  # dense: the last token needs no forward
                # feed the sampled tokens: logits for the next step, routing for these tokens
                c.position = c.position + 1
                c.mask = c.decode_masks(step, c.mask)
                c.logits = self._forward(tok[:, None], c.mask, c.position, c.cache, c.device)
                if last:
                    break  # MoE: that extra forward only recorded the last tokens' routing
                if keep is not None and len(keep) < len(c.live):  # drop the stopped rows (keep one in lockstep)
                    self._drop_rows(c, keep or [0], rec, max_new_tokens)
        c.decoded.close_segment(c.rows, rec)
        return c.responses()

    def _start_chunk(self, prompts: list[torch.Tensor], seeds: list[int], max_new_tokens: int) -> Chunk:
        """The chunk's prefill inputs (its distinct prompts left-padded, and `inverse`, each
        row's distinct prompt) and its decode state, on the model's device."""
        from transformers import DynamicCache  # local: the module imports without transformers

        c = Chunk()
        c.device, c.B = device, B = self.device, len(prompts)
        first: dict[tuple[int, ...], int] = {}
        inverse = torch.tensor([first.setdefault(tuple(p.tolist()), len(first)) for p in prompts])
        distinct = list({u: p for p, u in zip(prompts, inverse.tolist())}.values())  # in order of first use
        c.lens = [p.numel() for p in prompts]
        c.P = max(c.lens)
        c.cache = DynamicCache(config=self.model.config)
        c.shrinks = all(hasattr(layer, "batch_select_indices") for layer in c.cache.layers)
        if not c.shrinks:
            distinct, inverse = prompts, torch.arange(B)  # a cache whose rows cannot be copied: prefill every row
        c.distinct = len(distinct)
        ids, mask = left_pad(distinct, c.P)
        position = padded_positions(mask)
        c.ids, c.mask, c.position, c.inverse = (t.to(device) for t in (ids, mask, position, inverse))
        c.decode_masks = self._decode_masks(c.lens, c.P, max_new_tokens)
        c.seeds = torch.tensor([signed(s) for s in seeds], dtype=torch.int64, device=device)
        c.live = list(range(B))  # the chunk's rows still in the batch, in batch order (host)
        c.rows = torch.arange(B, device=device)  # the same on the device
        c.decoded = Decoded(B, self.stop_token_id if self.stop_token_id is not None else 0, device)
        c.n_new = torch.full((B,), max_new_tokens, device=device)  # response length per row [B]
        c.done = torch.zeros(B, dtype=torch.bool, device=device)  # [B]
        c.bad_at = torch.full((B,), max_new_tokens, device=device)  # first step with non-finite logits per row [B]
        return c

    def _prefill(self, c: Chunk, rec, max_new_tokens: int) -> None:
        """One forward over the distinct prompts; its logits, cache and routing copied to every
        row; then the cache reserves room for the new tokens."""
        c.logits = self._forward(c.ids, c.mask, c.position, c.cache, c.device)
        if c.distinct < c.B:  # the distinct prompts' rows -> every row
            c.logits = c.logits[c.inverse.to(c.logits.device)]
            select_rows(c.cache, c.inverse)
            if rec is not None:
                for steps in rec.per_layer:
                    steps[-1] = steps[-1][c.inverse.to(steps[-1].device)]
            c.mask, c.position = c.mask[c.inverse], c.position[c.inverse]
        c.position = c.position[:, -1:]
        reserve(c.cache, max_new_tokens)

    def _sample(self, c: Chunk, step: int, temperature: float, cdf: torch.Tensor | None) -> torch.Tensor:
        """Decode step `step`'s tokens `[b]` from the last logits (device ops only): drawn, or
        the fill token on a row that had stopped; the stop and non-finite bookkeeping."""
        rows = c.rows
        logp = c.logits.float()  # [b, V]; the forward's own output (or a copy): changed in place
        if temperature not in (0, 1):
            logp.div_(temperature)
        logp = torch.log_softmax(logp, dim=-1, out=logp)
        was_done = c.done[rows]
        bad = torch.isnan(logp.sum(-1)) & ~was_done  # inf/NaN logits: raised at the next check
        c.bad_at[rows] = torch.where(bad & (c.bad_at[rows] > step), step, c.bad_at[rows])
        if temperature == 0:  # greedy (evaluation): log-probs are of softmax(logits)
            drawn = logp.argmax(-1)
        else:
            drawn = sample_inverse_cdf(logp, uniform_noise(c.seeds, step), out=cdf[: len(c.live)])
        tok = torch.where(was_done, torch.full_like(drawn, c.decoded.fill), drawn)
        c.decoded.add(tok, logp.gather(-1, tok[:, None])[:, 0])
        if self.stop_token_id is not None:
            stopped = ~was_done & (tok == self.stop_token_id)
            c.n_new[rows] = torch.where(stopped, step + 1, c.n_new[rows])
            c.done[rows] = was_done | stopped
        return tok

    def _check(self, c: Chunk, step: int, max_new_tokens: int) -> tuple[bool, list[int] | None]:
        """The host read of a check: one read (one all-reduce in lockstep), so every rank raises,
        or stops, at the same step. -> (does a row still go?, the batch positions to keep, or
        None where the cache cannot drop rows)."""
        flags = torch.cat([torch.stack([max_new_tokens - c.bad_at.min(), (~c.done).any().long()]), c.done.long()])
        first_bad, going, *stopped_rows = self._agree(flags, reduced=2)
        if first_bad:
            raise _diverged(max_new_tokens - first_bad)
        keep = [k for k, i in enumerate(c.live) if not stopped_rows[i]] if c.shrinks else None
        if self.on_progress is not None:  # signs of life in a long generation, at the host read
            self.on_progress(decode=f"{step + 1}/{max_new_tokens}", rows=f"{c.B - sum(stopped_rows)}/{c.B}")
        return bool(going), keep

    def _drop_rows(self, c: Chunk, keep: list[int], rec, max_new_tokens: int) -> None:
        """The batch shrinks to its positions `keep`: the decoded segment closes, and the cache,
        logits, positions, masks and seeds keep those rows."""
        sel = torch.tensor(keep, device=c.device)
        c.decoded.close_segment(c.rows, rec)
        c.live, c.rows = [c.live[k] for k in keep], c.rows[sel]
        c.logits, c.position, c.seeds = c.logits[sel], c.position[sel], c.seeds[sel]
        c.mask = None if c.mask is None else c.mask[sel]
        select_rows(c.cache, sel)
        c.decode_masks = self._decode_masks([c.lens[i] for i in c.live], c.P, max_new_tokens)

    def _decode_masks(self, lens: list[int], P: int, max_new_tokens: int):
        """A function `(step, previous mask) -> mask` giving the attention mask of a decode step, for
        rows of prompt lengths `lens` left-padded to `P` (the first previous mask: the
        prefill's 2D `[B, P]`). With an sdpa mask builder (sdpa, varlen, cp_varlen) it returns
        what that builder would for one query, built from the host's lengths: None without
        padding, else the 4D boolean padding mask `[B, 1, 1, P + step + 1]` (views of one
        buffer), which transformers takes as is; given the 2D mask, sdpa's builder reads it to
        see whether it may drop it (a host sync per step). Other builders get the 2D mask grown
        by a column per step."""
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        from model.attention import varlen_mask

        device = self.device
        builder = ALL_MASK_ATTENTION_FUNCTIONS.get(self.model.config._attn_implementation)
        if builder not in (sdpa_mask, varlen_mask):
            return lambda step, mask: torch.cat([mask, torch.ones(len(lens), 1, dtype=mask.dtype, device=device)], 1)
        if min(lens) == P:
            return lambda step, mask: None
        keys = torch.ones(len(lens), 1, 1, P + max_new_tokens, dtype=torch.bool)
        for i, n in enumerate(lens):
            keys[i, ..., : P - n] = False
        keys = keys.to(device)
        return lambda step, mask: keys[..., : P + step + 1]

    def _forward(self, ids, mask, position, cache, device) -> torch.Tensor:
        """Logits `[B, V]` fp32 of the last position: the causal LM's own `lm_head(hidden[:, -1:])`
        (its `logits_to_keep=1`), with the head's weight detached: a weight that requires grad
        (the training policy's) picks another CPU matmul path, ~5e-7 apart in fp32. In a 16-bit
        compute dtype the logits are fp32 as the trainer's (model/logprobs.py `logits_fp32`), not
        rounded to bf16 before the log-softmax. fp32 on one CPU thread: the head by `head_rows`
        vocabulary rows at a time, each slice the same strided `F.linear` (the same kernel, so the
        same logits bit for bit; a contiguous 2-D input takes another path, ~1e-6 apart)."""
        hidden = self._run(
            input_ids=ids.to(device), attention_mask=None if mask is None else mask.to(device),
            position_ids=position.to(device), past_key_values=cache, use_cache=True,
        ).last_hidden_state
        weight = self.model.get_output_embeddings().weight.detach()
        if hidden.dtype != torch.float32 or weight.dtype != torch.float32:
            return logits_fp32(hidden[:, -1], weight)
        if (self.head_rows is None or weight.device.type != "cpu" or weight.shape[0] <= self.head_rows
                or torch.get_num_threads() > 1):
            return F.linear(hidden[:, -1:, :], weight)[:, -1]
        # one thread: MKL streams a whole head (113 MB on SmolLM2) ~20% slower at 8-32 rows than slices of it
        # (docs/benchmarks.md); with two, each slice's parallel region waits on a busy core: one matmul
        return torch.cat([F.linear(hidden[:, -1:, :], w)[:, -1] for w in weight.split(self.head_rows)], -1)


# ------------------------------------------------- generation from the policy itself
class PolicyRolloutEngine(HFRolloutEngine):
    """Generation with the training policy itself (`rollout.replica=sharded`): no unsharded
    copy, no weight sync (`needs_sync = False`); every step's rollout sees the latest update.

    `policy` is the module FSDP2 wrapped last (the Actor, `policy.model` its causal LM), or
    the unwrapped policy of a one-process run. The decoder stack is called through the root's
    FSDP forward hooks (`register_fsdp_forward_method`), so the root's parameters are
    gathered once per `generate` and freed after it (`reshard`), and each decoder layer's
    own hooks gather it for its forward and free it after (`reshard_after_forward`, FSDP2's
    default below the root): at most a layer or two of unsharded weights beside the shards.
    `group`: the ranks FSDP gathers over (all of them), with which `generate` runs in
    lockstep (non-finite logits on one rank raise on every rank). The policy is put in eval
    mode for the call and back after; its attention implementation and `requires_grad` are
    left as training set them. With `model.param_dtype` set, FSDP gathers in that dtype, so
    generation computes in it as training does (a replica computes in `model.dtype`): the
    tokens equal the replica's when the two dtypes are the same.
    """

    needs_sync = False
    _FORWARD = "_rollout_forward"  # the root's method that FSDP treats as a forward

    def __init__(self, policy: torch.nn.Module, *, stop_token_id: int | None = None,
                 max_batch_size: int | None = None, group=None) -> None:
        RolloutEngine.__init__(self, stop_token_id=stop_token_id)
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 (or None for one chunk)")
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

        model = policy.model
        self.policy, self.model, self.max_batch_size, self.group = policy, model, max_batch_size, group
        self.fsdp = isinstance(policy, FSDPModule)
        if self.fsdp and not hasattr(policy, self._FORWARD):
            setattr(policy, self._FORWARD, model.model.__call__)  # a plain attribute (a bound method)
            register_fsdp_forward_method(policy, self._FORWARD)
        self._run = getattr(policy, self._FORWARD) if self.fsdp else model.model
        if is_moe(model) and not moe_blocks(model, strict=False):
            raise ValueError("PolicyRolloutEngine: the MoE policy has no MoEBlocks; parallelize it first "
                             "(model/parallelize.py applies expert parallelism)")
        self.vocab_size = model.get_output_embeddings().weight.shape[0]  # a DTensor's shape is the global one

    def load_weights(self, weights) -> None:
        raise TypeError("PolicyRolloutEngine generates from the training policy's own weights: there is nothing "
                        "to load (sync_weights skips engines with needs_sync=False)")

    def sleep(self) -> None:
        """Nothing to release: the weights are the training policy's."""

    def generate(self, prompts: Sequence[torch.Tensor], **kwargs) -> list[Experience]:
        """`HFRolloutEngine.generate` on the policy: a collective over `group`, which every
        rank calls the same number of times (with its own prompts, maybe none)."""
        training = self.policy.training
        self.policy.eval()
        try:
            return super().generate(prompts, **kwargs)
        except BaseException:
            if self.fsdp:
                reset_iter_state(self.policy)  # an aborted forward leaves FSDP's per-iteration state undefined
            raise
        finally:
            if self.fsdp:
                self.policy.reshard()  # the root's gathered embeddings and lm head
            self.policy.train(training)


def _diverged(step: int) -> FloatingPointError:
    return FloatingPointError(f"the policy's next-token logits are not finite (NaN/inf) at response token {step}: "
                              f"its weights have diverged")


def _head(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... (+{len(items) - n})" if len(items) > n else "") if items else "none"

"""How close to the machine: its measured roofline and the work each phase of a step must do.

The machine (measured in the process that reports against it, with its threads):

    gemm_peak(dtype, shapes)  the best FLOP/s of a torch matmul sweep at the model's shapes
                              (`model_shapes`: tokens x hidden -> q/o, k/v, MLP, head), fp32 and bf16
    bandwidth()               bytes read + written per second by a large tensor copy

The work (counted, nothing timed), by packing/flops.py's `flop_cost` convention (2 FLOPs per
weight per token forward, twice that backward; causal attention `t**2 / 2` query-key pairs,
`4 * head_dim` FLOPs each per head forward), the count docs/design.md's shared-prompt table
and bench/prefix.py use:

    training_flops   forward + backward of the body on the shared-prompt pack (each group's
                     prompt once, every response over it) and the LM head on action tokens only
    step_flops       the same from a step's metrics (samples, group, tokens, response_length, action_tokens)
    rollout_flops    a step's generation from the same metrics: the prefill and a decode step per token
    prefill_cost     the engine's prefill: forward of the body over the distinct prompts, the head
                     on each prompt's last token; bytes: the weights once and the KV written
    decode_cost      one decode step of `rows` rows at context `context`: forward of every matmul
                     weight (head included) per row and attention over the context; bytes: the
                     weights once and every row's KV read (and one token's written)

A phase's fraction is then its FLOP/s over the GEMM peak, or its bytes/s over the bandwidth.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch


def _dims(config) -> dict:
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    return dict(layers=text.num_hidden_layers, hidden=text.hidden_size, heads=heads,
                kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                vocab=text.vocab_size, intermediate=getattr(text, "intermediate_size", None))


def matmul_weights(config) -> tuple[int, int]:
    """(weights of the body's matmuls, of the LM head): what one token multiplies by."""
    from packing.flops import flop_cost

    d = _dims(config)
    head = d["hidden"] * d["vocab"]
    return round(flop_cost(config).linear / 6) - head, head


def training_flops(config, groups: Sequence[tuple[int, Sequence[int]]], action_tokens: int | None = None) -> float:
    """Forward + backward FLOPs of one update over `groups`, each `(prompt tokens, [response
    tokens per sample])`: the body on the shared-prompt pack (packing/planner.py
    `microbatch_cost`: each prompt once) and the head on `action_tokens` (default: every response token)."""
    from packing.flops import FlopCost, flop_cost
    from packing.planner import microbatch_cost

    cost = flop_cost(config)
    body_w, head_w = matmul_weights(config)
    body = FlopCost(linear=6.0 * body_w, attention=cost.attention)
    total, scored = 0.0, 0
    for prompt, responses in groups:
        n = len(responses)
        total += microbatch_cost(range(n), [prompt + r for r in responses], body, [0] * n, [prompt] * n)
        scored += sum(responses)
    return total + 6.0 * head_w * (scored if action_tokens is None else action_tokens)


def step_flops(config, row: dict) -> float:
    """Training FLOPs of a step from its metrics: `samples` samples in groups of `group` sharing a
    prompt, of the step's mean prompt and response lengths (`tokens / samples - response_length`,
    `response_length`: exact for the linear terms, the attention's square from the means), the head
    on `action_tokens`."""
    n, group, r = row["samples"], row["group"], row["response_length"]
    prompt = row["tokens"] / n - r
    return training_flops(config, [(prompt, [r] * group)] * (n // group), row["action_tokens"])


def rollout_flops(config, row: dict) -> float:
    """Generation FLOPs of a step from the same metrics as `step_flops`: the prefill of its distinct
    prompts (`samples / group`, the mean prompt length) and a decode forward per response token but
    each sample's last, at the mean context (prompt + half the response: linear in it)."""
    n, group, r = row["samples"], row["group"], row["response_length"]
    prompt = row["tokens"] / n - r
    return (prefill_cost(config, [prompt] * (n // group))[0]
            + decode_cost(config, max(r - 1, 0) * n, prompt + r / 2)[0])


def prefill_cost(config, prompts: Sequence[int], dtype_bytes: int = 4) -> tuple[float, float]:
    """(FLOPs, bytes) of the engine's prefill of the distinct prompts `prompts` (token counts):
    the body's forward over every prompt token, the head on each prompt's last token; the
    weights read once, every token's keys and values written."""
    from packing.flops import flop_cost

    d = _dims(config)
    body_w, head_w = matmul_weights(config)
    att = flop_cost(config).attention / 3  # forward only
    flops = sum(2.0 * body_w * p + att * p * p for p in prompts) + 2.0 * head_w * len(prompts)
    kv = 2 * d["layers"] * d["kv_heads"] * d["head_dim"] * sum(prompts)
    return flops, float(dtype_bytes * (body_w + head_w + kv))


def decode_cost(config, rows: int, context: float, dtype_bytes: int = 4) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step: `rows` rows, each attending over `context` keys (its
    prompt and the tokens so far); every matmul weight, head included, once per row; the
    weights read once, each row's cached keys and values read."""
    from packing.flops import flop_cost

    d = _dims(config)
    body_w, head_w = matmul_weights(config)
    att = flop_cost(config).attention / 3  # forward FLOPs per t**2, i.e. t**2 / 2 pairs: 2 * att a pair
    flops = rows * (2.0 * (body_w + head_w) + 2.0 * att * context)
    kv = rows * 2 * d["layers"] * d["kv_heads"] * d["head_dim"] * (context + 1)
    return flops, float(dtype_bytes * (body_w + head_w + kv))


# ----------------------------------------------------------------- the machine
def model_shapes(config, tokens: Sequence[int]) -> list[tuple[int, int, int]]:
    """(M, K, N) of the model's matmuls (a token count by a weight `[N, K]`): q/o, k/v, gate/up,
    down, head, at each token count (a decode batch, a prefill, a training pack)."""
    d = _dims(config)
    h, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    weights = {(h, q), (h, kv), (h, d["vocab"])}
    if d["intermediate"]:
        weights |= {(h, d["intermediate"]), (d["intermediate"], h)}
    return [(m, k, n) for m in tokens for k, n in sorted(weights)]


def _best_seconds(fn, repeats: int, budget_s: float) -> float:
    fn()  # warm: first-call allocations, oneDNN primitive creation
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
        if spent > budget_s:
            break
    return best


def gemm_peak(dtype: torch.dtype, shapes: Sequence[tuple[int, int, int]], *, repeats: int = 5,
              budget_s: float = 1.0) -> dict:
    """The best FLOP/s of `x [M, K] @ w[N, K].T` (F.linear, as the model runs them) over
    `shapes`, best of `repeats` per shape: {"flops_per_s": peak, "at": [M, K, N]}."""
    best, at = 0.0, None
    for m, k, n in shapes:
        x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
        s = _best_seconds(lambda: torch.nn.functional.linear(x, w), repeats, budget_s)
        if 2.0 * m * k * n / s > best:
            best, at = 2.0 * m * k * n / s, [m, k, n]
    return {"flops_per_s": best, "at": at}


def bandwidth(nbytes: int = 256 * 2**20, *, repeats: int = 5) -> float:
    """Bytes read + written per second by `dst.copy_(src)` of `nbytes` (best of `repeats`),
    far above the caches."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _best_seconds(lambda: dst.copy_(src), repeats, budget_s=5.0)


def machine(config, tokens: Sequence[int], *, quick: bool = False) -> dict:
    """The roofline of this process: fp32 and bf16 GEMM peaks at the model's shapes and the
    memory bandwidth (`quick`: fewer repeats, a smaller copy)."""
    shapes = model_shapes(config, tokens)
    reps = 2 if quick else 5
    f32 = gemm_peak(torch.float32, shapes, repeats=reps)
    bf16 = gemm_peak(torch.bfloat16, shapes, repeats=reps)
    return {"gemm_fp32_flops_per_s": f32["flops_per_s"], "gemm_fp32_at": f32["at"],
            "gemm_bf16_flops_per_s": bf16["flops_per_s"], "gemm_bf16_at": bf16["at"],
            "bandwidth_bytes_per_s": bandwidth(64 * 2**20 if quick else 256 * 2**20, repeats=reps),
            "threads": torch.get_num_threads()}


# ----------------------------------------------------------------- the engine
def job_prompts(vocab: int, rows: int, prompt: int) -> tuple[list[torch.Tensor], list[int]]:
    """`rows` prompts in groups of 8 (a GRPO group) sharing a random `prompt`-token prompt, and
    their group ids."""
    gen = torch.Generator().manual_seed(0)
    distinct = [torch.randint(0, vocab, (prompt,), generator=gen) for _ in range(max(1, rows // 8))]
    index = [i * len(distinct) // rows for i in range(rows)]
    return [distinct[i] for i in index], index


def engine_phases(model, rows: int, prompt: int, new: int, repeats: int, *, temperature: float = 1.0
                  ) -> tuple[float, float]:
    """(prefill seconds, decode seconds a step) of the transformers engine on `model` (or an
    `HFRolloutEngine`): `rows` rows in groups of 8 sharing a random `prompt`-token prompt, no stop
    token, sampled at `temperature` (0: greedy); the prefill is a generation of one token, a step
    the difference to one of `new + 1` tokens over `new`; medians of `repeats` pairs."""
    from rl.rollout.engine import HFRolloutEngine

    engine = model if isinstance(model, HFRolloutEngine) else HFRolloutEngine(model)
    prompts, index = job_prompts(engine.vocab_size, rows, prompt)

    def timed(n: int) -> float:
        t = time.perf_counter()
        engine.generate(prompts, prompt_indices=index, max_new_tokens=n, temperature=temperature, seed=0)
        return time.perf_counter() - t

    timed(2)  # warm
    pairs = [(timed(1), timed(new + 1)) for _ in range(repeats)]
    return statistics.median(a for a, _ in pairs), statistics.median((b - a) / new for a, b in pairs)

"""What does the shared-prompt forward buy? Training fwd+bwd and the old-log-prob forward, shared vs unshared.

One GRPO group per microbatch: a prompt of P tokens repeated for n samples, each with a
response of P/4 tokens, collated once as the trainer does (THD pack, `[1, n (P + P/4)]`).
Each case runs the trainer's actor (`Actor(actions_only=True)`) with `share_prompts` on and
off, side by side (interleaved medians, bench/common.py):

    fwd+bwd        the update: log-probs and entropy, a policy-gradient loss, backward
    old_log_probs  the scoring forward (`Trainer.score`): eval, no grad

For each model: `shared` says whether the shared path was taken (model/actor.py
`_shared_prompt_view` returned a view on every shared-arm forward); where it was not (today
every MoE model: it switches itself off for `MoEBlock`s) the two arms run the same pack and
the ratio is ~1.0x, reported as "not shared". `body_token_ratio` (tokens through the
transformer body, n(P + R) / (P + nR)) and `flop_ratio` (fwd+bwd FLOPs of the unshared pack
over the shared one: the body by packing/flops.py's `FlopCost` and packing/planner.py's `microbatch_cost`, linear
layers and attention, plus the LM head on the response tokens, the same in both) are what
transfers to a GPU, where the time follows the FLOPs more closely than on this CPU.
Models (random init, built from their configs, nothing downloaded):

    dense-tiny    qwen3, the test models' shape (2 layers, hidden 64)
    smollm2-135m  llama with SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads, vocab 49152)
    moe-tiny      qwen3_moe, the test shape (8 experts, top-2)
    moe-large     qwen3_moe, 8 layers, hidden 512, 16 experts of 512, top-2, vocab 32000

    python bench/prefix.py [--quick] [--models a,b] [--prompts 512,2048,8192] [--samples 8,16]
        [--large-prompts 512] [--layers N] [--repeats N] [--name prefix]

By default the tiny models run the full grid (P 512/2K/8K x n 8/16) and the two larger ones
P=512 (--large-prompts; the full grid of SmolLM2 at 8K x 16 is ~160k tokens a forward, hours
on 2 CPU cores): ~10 min of CPU time. `--quick`: the tiny models at P=512 and 2048, n=8,
one repeat (~20 s). SmolLM2's layer shape at 2K x 16 within 24 GB of host memory (6 of its
30 layers, bench/results/prefix-smollm2-6l.json):

    python bench/prefix.py --models smollm2-135m --large-prompts 2048 --samples 16 --layers 6 \
        --name prefix-smollm2-6l
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, interleaved_medians, quick_flag, setup  # noqa: E402

import torch  # noqa: E402

MODELS = {
    "dense-tiny": ("qwen3", {}),
    "smollm2-135m": ("llama", dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                   head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                                   rope_theta=100000.0)),
    "moe-tiny": ("qwen3_moe", {}),
    "moe-large": ("qwen3_moe", dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                                    head_dim=64, intermediate_size=1024, num_experts=16, num_experts_per_tok=2,
                                    moe_intermediate_size=512, vocab_size=32000)),
}
TINY = ("dense-tiny", "moe-tiny")
SMALL = 50_000  # tokens of a pack whose case is cheap enough to repeat


def build(name: str, max_len: int, layers: int | None = None):
    """The actor's causal LM, as the trainer builds it: MoE blocks in place (every expert local).
    `layers`: fewer decoder layers of the same shape (the larger models' long packs fit in memory)."""
    from model.models import build_model
    from model.moe import is_moe, shard_experts

    family, over = MODELS[name]
    if layers is not None:
        over = {**over, "num_hidden_layers": layers}
    lm = build_model(family, seed=0, max_position_embeddings=max(max_len, 2048), **over)
    if is_moe(lm):
        shard_experts(lm, None)
    return lm


def group_pack(prompt: int, samples: int, vocab: int, seed: int = 0):
    """One GRPO group collated: the prompt's P ids repeated, each sample's P/4 response ids its own."""
    from packing import Experience, make_experience_batch

    gen = torch.Generator().manual_seed(seed)
    response = max(prompt // 4, 1)
    ids = torch.randint(0, vocab, (prompt,), generator=gen)
    records = []
    for _ in range(samples):
        T = prompt + response
        mask = torch.arange(T - 1) >= prompt - 1
        records.append(Experience(
            sequences=torch.cat([ids, torch.randint(0, vocab, (response,), generator=gen)]), action_mask=mask,
            advantages=torch.randn(T - 1, generator=gen).where(mask, torch.zeros(())),
            response_length=torch.tensor(response), total_length=torch.tensor(T), prompt_index=torch.tensor(0)))
    return make_experience_batch(records, packed=True), response


@contextlib.contextmanager
def shared_views():
    """Counts `_shared_prompt_view` calls and how many returned a view (the shared path taken)."""
    import model.actor as actor_module

    original = actor_module._shared_prompt_view
    seen = {"calls": 0, "views": 0}

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        seen["calls"] += 1
        seen["views"] += out is not None
        return out

    actor_module._shared_prompt_view = counted
    try:
        yield seen
    finally:
        actor_module._shared_prompt_view = original


def flops(lm, prompt: int, response: int, samples: int) -> tuple[float, float]:
    """(fwd+bwd FLOPs of the unshared pack, of the shared one), bench/roofline.py's count: the
    body by packing/flops.py's `FlopCost`, the LM head on the response tokens only in both (the
    actor's `actions_only`; `flop_cost` counts the head on every token)."""
    from roofline import training_flops

    return (training_flops(lm.config, [(prompt, [response])] * samples),
            training_flops(lm.config, [(prompt, [response] * samples)]))


def case(name: str, lm, prompt: int, samples: int, repeats: int, warmup: int) -> dict:
    from model.actor import Actor

    pack, response = group_pack(prompt, samples, lm.config.vocab_size)
    actors = {arm: Actor(lm, actions_only=True, share_prompts=arm == "shared") for arm in ("shared", "unshared")}
    mask = pack.action_mask.float()

    def update(actor):
        actor.train()
        lm.zero_grad(set_to_none=True)
        lp, ent = actor(pack, return_entropy=True)
        (((-pack.advantages * lp - 0.01 * ent) * mask).sum() / mask.sum()).backward()

    @torch.no_grad()
    def score(actor):
        actor.eval()
        actor(pack)

    fns = {}
    for arm, actor in actors.items():
        fns[f"fwd_bwd_{arm}"] = lambda actor=actor: update(actor)
        fns[f"old_log_probs_{arm}"] = lambda actor=actor: score(actor)
    with shared_views() as seen:
        times = interleaved_medians(fns, repeats, warmup=warmup)
    taken = seen["views"] == seen["calls"] > 0  # only the shared arm asks; every one of its forwards shared
    unshared_flops, shared_flops = flops(lm, prompt, response, samples)
    tokens = samples * (prompt + response)
    row = {"model": name, "layers": lm.config.num_hidden_layers, "prompt": prompt, "response": response, "samples": samples, "tokens": tokens,
           "body_tokens_shared": prompt + samples * response, "shared": taken,
           "body_token_ratio": round(tokens / (prompt + samples * response), 3),
           "flop_ratio": round(unshared_flops / shared_flops, 3)}
    for what in ("fwd_bwd", "old_log_probs"):
        s, u = times[f"{what}_shared"], times[f"{what}_unshared"]
        row[f"{what}_s"] = {"shared": round(s[CLOCK], 4), "unshared": round(u[CLOCK], 4)}
        row[f"{what}_speedup"] = round(u[CLOCK] / s[CLOCK], 3)
    return row


CLOCK = "cpu"


def main() -> None:
    global CLOCK
    parser = quick_flag(__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--prompts", default="512,2048,8192", help="prompt lengths of the tiny models")
    parser.add_argument("--large-prompts", default="512", help="prompt lengths of smollm2-135m and moe-large")
    parser.add_argument("--samples", default="8,16", help="samples per prompt")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers of smollm2-135m and moe-large (default: their own; fewer keep a long "
                             "pack within host memory: the layer shape and the head stay)")
    parser.add_argument("--name", default="prefix", help="results file bench/results/<name>.json (default prefix)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds (default: 3 for tiny-model packs up to 50k tokens, after a warm-up round; "
                             "else 1, no warm-up; --quick 1)")
    args = parser.parse_args()
    setup(args)
    CLOCK = args.clock
    models = args.models.split(",")
    for m in models:
        if m not in MODELS:
            parser.error(f"--models: unknown model {m!r}; expected some of {list(MODELS)}")
    prompts = [int(x) for x in args.prompts.split(",")]
    large_prompts = [int(x) for x in args.large_prompts.split(",")]
    samples = [int(x) for x in args.samples.split(",")]
    if args.quick:
        models, prompts, samples = [m for m in models if m in TINY], [512, 2048], [8]

    rows = []
    for name in models:
        grid = prompts if name in TINY else large_prompts
        lm = build(name, max(grid) + max(grid) // 4, None if name in TINY else args.layers)
        for p in grid:
            for n in samples:
                small = name in TINY and n * (p + p // 4) <= SMALL  # cheap: repeated, after a warm-up round
                reps = args.repeats or (3 if small and not args.quick else 1)
                row = case(name, lm, p, n, reps, warmup=1 if small else 0)
                rows.append(row)
                print(f"{name:13s} P={p:5d} n={n:2d} tokens {row['tokens']:6d} shared={str(row['shared']):5s} "
                      f"fwd+bwd {row['fwd_bwd_s']['unshared']:8.3f} / {row['fwd_bwd_s']['shared']:8.3f} s "
                      f"= {row['fwd_bwd_speedup']:5.2f}x  old-log-probs {row['old_log_probs_speedup']:5.2f}x  "
                      f"body tokens {row['body_token_ratio']:5.2f}x  FLOPs {row['flop_ratio']:5.2f}x", flush=True)
        del lm

    def pick(model, prompt, n):
        return next((r for r in rows if (r["model"], r["prompt"], r["samples"]) == (model, prompt, n)), None)

    summary = {"bench": "prefix", "quick": args.quick, "cases": len(rows)}
    for name in models:  # the headline figure: 2K prompts x 16 samples, and every model's best
        r = pick(name, 2048, 16) or max((r for r in rows if r["model"] == name), key=lambda r: r["tokens"])
        key = f"{name}_P{r['prompt']}_n{r['samples']}"
        summary[f"{key}_fwd_bwd_speedup"] = r["fwd_bwd_speedup"] if r["shared"] else "not shared"
        summary[f"{key}_old_log_probs_speedup"] = r["old_log_probs_speedup"] if r["shared"] else "not shared"
        summary[f"{key}_flop_ratio"] = r["flop_ratio"]
    emit(args.name, summary, {"rows": rows}, clock=CLOCK)


if __name__ == "__main__":
    main()

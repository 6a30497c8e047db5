"""Which CPU varlen attention should a pack use? Forward+backward time of each candidate on a
short-sequence and a long-sequence pack, and its packed-vs-padded parity on the tiny models.

Candidates (same signature as `model.attention._per_sequence_sdpa`):
* `held_keys`: one masked sdpa per sequence with its keys zero-extended to the pack's
  longest sequence (the former default: it reproduced the padded batch's rounding on one
  kernel set).
* `per_sequence`: the default, `model.attention._per_sequence_sdpa`: one `is_causal` sdpa
  per sequence, `S_i x S_i`, GQA by `enable_gqa`.
* `per_sequence_repeat_kv`: the same with K/V repeated per query head first (as
  transformers' sdpa does for a masked batch).
* `block_diagonal`: one sdpa over the whole pack with an `[N, N]` document-causal mask.
* FlexAttention with a document mask: probed; torch 2.13 has no CPU backward for it.

Parity is `core_parity` of scripts/parity_check.py (dense and MoE, packed vs padded log-probs,
entropy, grads) with the candidate patched in, in eps32 units relative to the values'
magnitude; the tolerance is `PARITY_ULPS` of scripts/parity_check.py. The winner is the
fastest candidate within it, summed over both packs.

    python bench/attention.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, interleaved_medians, lengths, quick_flag, setup  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.integrations.sdpa_attention import repeat_kv  # noqa: E402

import model.attention as attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64  # the attention of bench/step.py's model


# ------------------------------------------------------------------ candidates
def held_keys(module, query, key, value, bounds, dropout, scaling):
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    spans = list(zip(bounds[:-1], bounds[1:]))
    width = max(e - s for s, e in spans)
    causal = torch.ones(width, width, dtype=torch.bool, device=query.device).tril()
    outs = []
    for s, e in spans:
        grow = (0, 0, 0, width - (e - s))
        outs.append(F.scaled_dot_product_attention(
            query[:, :, s:e], F.pad(key[:, :, s:e], grow), F.pad(value[:, :, s:e], grow),
            attn_mask=causal[: e - s], dropout_p=dropout, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def per_sequence_repeat_kv(module, query, key, value, bounds, dropout, scaling):
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    outs = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout,
                                           is_causal=True, scale=scaling)
            for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def block_diagonal(module, query, key, value, bounds, dropout, scaling):
    n = query.shape[2]
    lens = torch.tensor(bounds).diff()
    seg = torch.repeat_interleave(torch.arange(len(lens)), lens)
    mask = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


DEFAULT = "per_sequence"  # what model/attention.py ships
CANDIDATES = {DEFAULT: attention._per_sequence_sdpa, "held_keys": held_keys,
              "per_sequence_repeat_kv": per_sequence_repeat_kv, "block_diagonal": block_diagonal}


def flex_probe() -> dict:
    """Does FlexAttention (document mask) run forward+backward on CPU?"""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seg = torch.tensor([0] * 40 + [1] * 24)
    mask = create_block_mask(lambda b, h, q, k: (seg[q] == seg[k]) & (k <= q), None, None, 64, 64, device="cpu")
    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    try:
        flex_attention(q, k, v, block_mask=mask).sum().backward()
        return {"forward_backward_on_cpu": True}
    except Exception as exc:  # noqa: BLE001 - the answer is the exception
        return {"forward_backward_on_cpu": False, "error": f"{type(exc).__name__}: {exc}"[:200]}


# ---------------------------------------------------------------------- packs
def packs(quick: bool) -> dict[str, list[int]]:
    """short: many GRPO-length sequences; long: a few long ones."""
    short = lengths("lognormal", 16 if quick else 32, seed=1, max_len=512, prompt=(16, 64))
    long = lengths("lognormal", 4 if quick else 8, seed=2, max_len=4096, prompt=(64, 256))
    long = [max(n, 512) for n in long]
    return {"short": short, "long": long}


def time_fwd_bwd(seq_lens: list[int], repeats: int, names) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(0)
    n = sum(seq_lens)
    bounds = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    q = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen, requires_grad=True)
    k = torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen, requires_grad=True)
    v = torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen, requires_grad=True)
    grad = torch.randn(1, n, HEADS, HEAD_DIM, generator=gen)
    module = torch.nn.Module()
    module.num_key_value_groups = HEADS // KV_HEADS

    def run(fn):
        def step():
            q.grad = k.grad = v.grad = None
            fn(module, q, k, v, bounds, 0.0, HEAD_DIM**-0.5).backward(grad)
        return step

    return interleaved_medians({name: run(CANDIDATES[name]) for name in names}, repeats=repeats)


def parity(names) -> dict[str, dict]:
    from scripts.parity_check import PARITY_ULPS, core_parity

    original, out = attention._per_sequence_sdpa, {}
    try:
        for name in names:
            attention._per_sequence_sdpa = CANDIDATES[name]
            figures = {m: core_parity(m) for m in ("qwen3", "qwen3_moe")}
            worst = max(v for f in figures.values() for k, v in f.items() if not k.startswith("control"))
            out[name] = {"worst_eps": worst, "within": worst <= PARITY_ULPS, **figures}
    finally:
        attention._per_sequence_sdpa = original
    return out


def main() -> dict:
    args = quick_flag(__doc__.splitlines()[0]).parse_args()
    setup(args)
    repeats = 3 if args.quick else 5
    clock = args.clock
    names = list(CANDIDATES)
    details = {"packs": {}, "flex_attention": flex_probe()}
    total = dict.fromkeys(names, 0.0)
    for pack_name, seq_lens in packs(args.quick).items():
        # the [N, N] mask of block_diagonal on the long pack costs minutes: skip it where it cannot win
        pack_names = [n for n in names if not (n == "block_diagonal" and sum(seq_lens) > 6000)]
        times = time_fwd_bwd(seq_lens, repeats, pack_names)
        for name in names:
            total[name] += times[name][clock] if name in times else float("inf")
        details["packs"][pack_name] = {"n_seqs": len(seq_lens), "tokens": sum(seq_lens), "max_len": max(seq_lens),
                                       "fwd_bwd_s": times}
        print(f"{pack_name}: {len(seq_lens)} seqs, N={sum(seq_lens)}, S_max={max(seq_lens)}: "
              + ", ".join(f"{k} {v[clock] * 1e3:.1f} ms" for k, v in times.items()))
    details["parity"] = parity(names)
    for name, p in details["parity"].items():
        print(f"parity {name}: worst {p['worst_eps']:.2f} eps32 relative (within: {p['within']})")
    print(f"flex_attention: {details['flex_attention']}")
    eligible = [n for n in names if details["parity"][n]["within"]]
    best = min(eligible, key=total.get)
    short, long = details["packs"]["short"]["fwd_bwd_s"], details["packs"]["long"]["fwd_bwd_s"]
    return emit("attention", {
        "best": best,
        "default_is_best": best == DEFAULT,
        "short_speedup_vs_held_keys": round(short["held_keys"][clock] / short[best][clock], 3),
        "long_speedup_vs_held_keys": round(long["held_keys"][clock] / long[best][clock], 3),
        "worst_parity_eps": round(details["parity"][best]["worst_eps"], 3),
        "flex_backward_on_cpu": details["flex_attention"]["forward_backward_on_cpu"],
        "quick": args.quick,
    }, details, clock=clock)


if __name__ == "__main__":
    main()

"""What does packing buy per training step? Actor forward+backward, packed vs padded.

A ~23M-parameter Qwen3 built from config (random init, fp32, no download) scores one
microbatch of GRPO-like samples (bench/common.py length mixes) with log-probs and
entropy, and back-propagates a token-mean policy-gradient loss. Packed and padded steps
run interleaved (after one warm-up each); the figure is the median of process CPU time,
one thread (bench/common.py; `--threads 2 --clock wall` on an idle machine; both clocks
are recorded in bench/results/step.json).

    speedup           = padded step time / packed step time
    ideal_token_ratio = padded tokens (B x T_max) / real tokens (N)
    efficiency        = speedup / ideal_token_ratio   (goal >= 0.95)

Above 1, the pack also saves attention work (`S_i^2` instead of `T_max^2` per sequence);
below 1, something in the pack costs more per token than the padded batch.
The last line reports the mix with the lowest efficiency.

    python bench/step.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, interleaved_medians, lengths, quick_flag, records, setup  # noqa: E402

import torch  # noqa: E402

# Overrides of the tiny Qwen3 (model/models.py TINY), scaled up so that attention and the output head
# weigh as in a real step: ~23M parameters, 12.6M in the embeddings and lm head (vocab 16384 x 384),
# 10.3M in 6 layers
MODEL = dict(vocab_size=16384, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, head_dim=64,
             intermediate_size=1152, max_position_embeddings=4096)
STEP_MIXES = ("lognormal", "bimodal")
SAMPLES = 8  # one microbatch
MAX_LEN = 512
PROMPT = (16, 64)


def build():
    from model.actor import Actor
    from model.models import build_model

    lm = build_model("qwen3", seed=0, **MODEL)
    return Actor(lm), sum(p.numel() for p in lm.parameters())


def microbatch(mix: str, quick: bool) -> list:
    seq_lens = lengths(mix, SAMPLES, seed=0, max_len=256 if quick else MAX_LEN, prompt=PROMPT)
    return records(seq_lens, vocab=MODEL["vocab_size"], prompt=PROMPT)


def train_step(actor, batch, *, keep_grads: bool = False) -> None:
    """Forward (log-probs + entropy), token-mean loss, backward; grads dropped unless `keep_grads`
    (then the next step accumulates into them, as microbatches of one optimizer step do)."""
    log_probs, entropy = actor(batch, return_entropy=True)
    mask = batch.action_mask.float()
    loss = ((-batch.advantages * log_probs - 0.01 * entropy) * mask).sum() / mask.sum()
    loss.backward()
    if not keep_grads:
        actor.zero_grad(set_to_none=True)


def measure(mix: str, *, quick: bool, repeats: int, actor=None, clock: str = "cpu") -> dict:
    from packing.collate import make_experience_batch

    actor = actor or build()[0]
    items = microbatch(mix, quick)
    packed, padded = make_experience_batch(items, packed=True), make_experience_batch(items, packed=False)
    times = interleaved_medians({"packed": lambda: train_step(actor, packed),
                                 "padded": lambda: train_step(actor, padded)}, repeats=repeats)
    real, processed = packed.sequences.numel(), padded.sequences.numel()
    speedup = times["padded"][clock] / times["packed"][clock]
    ideal = processed / real
    return {"mix": mix, "samples": len(items), "real_tokens": real, "padded_tokens": processed,
            "max_len": max(packed.packed_seq_lens), "packed_s": times["packed"][clock],
            "padded_s": times["padded"][clock], "speedup": speedup, "ideal_token_ratio": ideal,
            "efficiency": speedup / ideal, "times": times}


def main() -> dict:
    args = quick_flag(__doc__.splitlines()[0]).parse_args()
    setup(args)
    torch.manual_seed(0)
    actor, params = build()
    repeats = 2 if args.quick else 3
    per_mix = {}
    for mix in STEP_MIXES:
        r = measure(mix, quick=args.quick, repeats=repeats, actor=actor, clock=args.clock)
        per_mix[mix] = r
        print(f"{mix}: {r['samples']} samples, N={r['real_tokens']} real vs {r['padded_tokens']} padded tokens "
              f"(T_max={r['max_len']}): packed {r['packed_s']:.3f} s, padded {r['padded_s']:.3f} s, "
              f"speedup {r['speedup']:.2f} / ideal {r['ideal_token_ratio']:.2f} = efficiency {r['efficiency']:.3f}")
    worst = min(per_mix.values(), key=lambda r: r["efficiency"])
    return emit("step", {"speedup": round(worst["speedup"], 3),
                         "ideal_token_ratio": round(worst["ideal_token_ratio"], 3),
                         "efficiency": round(worst["efficiency"], 3), "mix": worst["mix"],
                         "params_m": round(params / 1e6, 1), "quick": args.quick},
                {"per_mix": per_mix, "model": MODEL, "repeats": repeats}, clock=args.clock)


if __name__ == "__main__":
    main()

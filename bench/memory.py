"""Does a pack's memory scale with its tokens? Peak memory of one training microbatch
(actor forward+backward, bench/step.py's model and mixes), packed vs padded.

Each measurement is a fresh process (`--child`): build the model and the batch, run a
2-token warm-up step (thread pools, dispatch caches), then reset the kernel's RSS
high-water mark (`/proc/self/clear_refs`, 5) and run one step; the figure is
`VmHWM - VmRSS before the step`: the step's own peak. glibc is told to serve every
allocation over 64 KiB by mmap (`MALLOC_MMAP_THRESHOLD_`), so freed tensors leave RSS
at once and the high-water mark follows the live tensors.

    packed_over_padded = packed peak / padded peak
    token_ratio        = real tokens / padded tokens   (goal: packed_over_padded <= 1.15 x this)

On the long-tail (bimodal) mix two more measurements explain the gap: the pack with the
former CPU attention (`held_keys`, bench/attention.py: every sequence's K/V kept at the
pack's longest length for backward), and both layouts with a small log-prob byte budget
(`SMALL_BUDGET`: several chunks, each recomputed in backward; the `[rows, V]` buffer is a
floor that does not shrink with the tokens).

The log-prob stage alone (`token_log_probs` forward + backward with an entropy term, the
Actor's head) is measured at vocabulary 151,936 (Qwen) and at 16,384 (this bench's model)
and 256, each with 4 chunks' worth of tokens and with exactly one chunk (the kept regime):
its temporaries (peak minus the hidden/weight gradients it must return) should be about
the byte budget whatever the vocabulary, since rows = budget // (4 V).
The last line reports the mix furthest above its token ratio.

    python bench/memory.py [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, quick_flag, setup  # noqa: E402
from procfs import reset_peak, status  # noqa: E402

# name -> (layout / attention case, log-prob byte budget; None = the Actor's default): the
# figure, then the investigation of the long-tail mix: the former attention, and a small
# budget that shows the `[rows, V]` fp32 log-softmax buffer as a floor
SMALL_BUDGET = 8 * 2**20  # 128 rows at this bench's vocabulary (16,384)
CASES = {"packed": ("packed", None), "padded": ("padded", None)}
INVESTIGATE = {"held_keys": ("held_keys", None), "packed_small_budget": ("packed", SMALL_BUDGET),
               "padded_small_budget": ("padded", SMALL_BUDGET)}
# the log-prob stage alone: vocabularies, byte budget, hidden size, chunks' worth of tokens
STAGE_VOCABS, STAGE_BUDGET, STAGE_HIDDEN, STAGE_CHUNKS = (151_936, 16_384, 256), 64 * 2**20, 64, (1, 4)


def child(mix: str, case: str, quick: bool, chunk_bytes: int | None) -> dict:
    import gc

    import torch

    if mix == "logprob":  # case "<vocab>x<chunks>"
        vocab, chunks = case.split("x")
        return stage_child(int(vocab), int(chunks))

    import step
    from packing.collate import make_experience_batch

    actor = step.build()[0]
    if chunk_bytes is not None:
        actor.chunk_bytes = chunk_bytes
    if case == "held_keys":
        import attention as bench_attention

        import model.attention

        model.attention._per_sequence_sdpa = bench_attention.held_keys
    items = step.microbatch(mix, quick)
    batch = make_experience_batch(items, packed=case != "padded")
    # warm-up on one sample; its parameter grads stay allocated, as between the microbatches
    # of one optimizer step, so the figure is what the microbatch itself adds
    step.train_step(actor, make_experience_batch(items[:1], packed=case != "padded"), keep_grads=True)
    gc.collect()
    before = status("VmRSS")
    reset_peak()  # reset VmHWM to the current RSS
    step.train_step(actor, batch, keep_grads=True)
    peak = status("VmHWM") - before
    return {"mix": mix, "case": case, "tokens": batch.sequences.numel(), "peak_bytes": peak,
            "threads": torch.get_num_threads()}


def stage_child(vocab: int, chunks: int) -> dict:
    """Peak of `token_log_probs` forward + backward at `vocab`, `chunks` x the budget's rows."""
    import gc

    import torch

    from model.logprobs import chunk_rows, token_log_probs

    gen = torch.Generator().manual_seed(0)
    rows = chunk_rows(vocab, STAGE_BUDGET)
    n = rows * chunks
    hidden = torch.randn(n, STAGE_HIDDEN, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, STAGE_HIDDEN, generator=gen) * 0.05).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=gen)

    def run(h, t):
        lp, ent = token_log_probs(h, weight, t, chunk_bytes=STAGE_BUDGET, return_entropy=True)
        (lp.sum() - 0.01 * ent.sum()).backward()

    run(hidden[:4].detach().requires_grad_(), targets[:4])  # warm-up (thread pools, dispatch)
    weight.grad = None
    gc.collect()
    before = status("VmRSS")
    reset_peak()
    run(hidden, targets)
    peak = status("VmHWM") - before
    returned = (hidden.numel() + weight.numel()) * 4  # the gradients the stage must hand back
    return {"vocab": vocab, "rows": rows, "tokens": n, "chunks": chunks, "peak_bytes": peak,
            "temporaries_bytes": peak - returned, "budget_bytes": STAGE_BUDGET}


def run_child(mix: str, case: str, chunk_bytes: int | None, quick: bool, threads: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    cmd = [sys.executable, __file__, "--child", mix, case, "--threads", str(threads)] + (["--quick"] if quick else [])
    cmd += ["--chunk-bytes", str(chunk_bytes)] if chunk_bytes else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory child {mix}/{case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> dict:
    parser = quick_flag(__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("MIX", "CASE"), help=argparse_hidden())
    parser.add_argument("--chunk-bytes", type=int, default=None, help=argparse_hidden())
    args = parser.parse_args()
    setup(args)
    if args.child:
        print(json.dumps(child(*args.child, args.quick, args.chunk_bytes)))
        return {}

    import step

    per_mix = {}
    for mix in step.STEP_MIXES:
        cases = {**CASES, **(INVESTIGATE if mix == "bimodal" else {})}  # the long-tail mix: the one that misses
        with ThreadPoolExecutor(max_workers=2) as pool:  # peaks are per process: two at a time is fine
            done = dict(zip(cases, pool.map(lambda c: run_child(mix, *c, args.quick, args.threads), cases.values())))
        mib = {name: r["peak_bytes"] / 2**20 for name, r in done.items()}
        tokens = {name: done[name]["tokens"] for name in CASES}
        token_ratio = tokens["packed"] / tokens["padded"]
        ratio = mib["packed"] / mib["padded"]
        per_mix[mix] = {"peak_mib": mib, "tokens": tokens, "token_ratio": token_ratio, "packed_over_padded": ratio,
                        "over_token_ratio": ratio / token_ratio}
        print(f"{mix}: peak packed {mib['packed']:.1f} MiB, padded {mib['padded']:.1f} MiB: "
              f"packed/padded {ratio:.3f} vs token ratio {token_ratio:.3f} ({ratio / token_ratio:.2f}x)")
        if "held_keys" in mib:
            small = mib["packed_small_budget"] / mib["padded_small_budget"]
            per_mix[mix].update(held_keys_over_padded=mib["held_keys"] / mib["padded"],
                                small_budget_packed_over_padded=small, small_budget_over_token_ratio=small / token_ratio)
            print(f"  packed with the former held-keys attention: {mib['held_keys']:.1f} MiB "
                  f"(+{mib['held_keys'] - mib['packed']:.1f}); with a {SMALL_BUDGET >> 20} MiB log-prob budget: packed "
                  f"{mib['packed_small_budget']:.1f}, padded {mib['padded_small_budget']:.1f} MiB, ratio {small:.3f} "
                  f"({small / token_ratio:.2f}x the token ratio)")

    stage_cases = [f"{v}x{c}" for v in STAGE_VOCABS for c in STAGE_CHUNKS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        stage = list(pool.map(lambda case: run_child("logprob", case, None, args.quick, args.threads), stage_cases))
    for r in stage:
        print(f"log-prob stage, vocab {r['vocab']}: {r['tokens']} tokens ({r['chunks']} x {r['rows']} rows): "
              f"temporaries {r['temporaries_bytes'] / 2**20:.1f} MiB = {r['temporaries_bytes'] / r['budget_bytes']:.2f}"
              f" x the {r['budget_bytes'] >> 20} MiB budget (peak {r['peak_bytes'] / 2**20:.1f} MiB)")
    spread = [r["temporaries_bytes"] / r["budget_bytes"] for r in stage]
    name = max(per_mix, key=lambda m: per_mix[m]["over_token_ratio"])
    worst = per_mix[name]
    return emit("memory", {"packed_over_padded": round(worst["packed_over_padded"], 3),
                           "token_ratio": round(worst["token_ratio"], 3),
                           "over_token_ratio": round(worst["over_token_ratio"], 3), "mix": name,
                           "logprob_stage_over_budget": [round(min(spread), 2), round(max(spread), 2)],
                           "quick": args.quick},
                {"per_mix": per_mix, "logprob_stage": stage})


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()

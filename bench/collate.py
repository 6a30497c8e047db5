"""Is the collate cheap? The project's THD pack vs nemo-automodel's, and its share of a step.

1. Token fields on ~200k tokens (lognormal mix, 2048-token limit): the concatenated ids and
   `packing.layout.packed_positions` (+ the lengths) vs nemo-automodel 0.7.0's `pack_features_for_thd` +
   `packed_sequence_thd_collater` (the reference schema). AutoModel gets its natural input,
   python lists of ids prepared beforehand (their conversion is not timed). `identical`:
   input_ids, position_ids (dtype and values) and seq_lens equal.
2. The full `make_experience_batch` (every action field, episode scalars) on the same
   records, packed and padded.
3. The collate of bench/step.py's microbatch as a share of its packed training step
   (read from bench/results/step.json; measured here if absent).

    python bench/collate.py [--quick]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, emit, interleaved_medians, lengths, quick_flag, records, setup  # noqa: E402

import torch  # noqa: E402

TARGET_TOKENS = 200_000


def corpus(quick: bool) -> list:
    target = TARGET_TOKENS // (4 if quick else 1)
    seq_lens = lengths("lognormal", 4096, seed=0, max_len=2048)
    total, n = 0, 0
    while total < target:
        total, n = total + seq_lens[n], n + 1
    return records(seq_lens[:n], vocab=32000)


def automodel_pack(features: list[dict]) -> dict:
    from nemo_automodel.components.datasets.utils import pack_features_for_thd, packed_sequence_thd_collater

    return packed_sequence_thd_collater([pack_features_for_thd(features)])


def ours_pack(seqs: list[torch.Tensor]) -> tuple:
    from packing.layout import packed_positions

    lens = [s.numel() for s in seqs]
    return torch.cat(seqs).to(torch.int64).unsqueeze(0), packed_positions(lens), lens


def identical(ours: tuple, ref: dict) -> bool:
    ids, pos, lens = ours
    return (ids.dtype == ref["input_ids"].dtype and torch.equal(ids, ref["input_ids"])
            and pos.dtype == ref["position_ids"].dtype and torch.equal(pos, ref["position_ids"])
            and lens == ref["seq_lens"][0].tolist())


def step_seconds(clock: str, quick: bool) -> tuple[dict[str, float], bool]:
    """Packed step seconds per mix of bench/step.py (its results file, or a quick run here),
    and whether they are of step.py's `--quick` microbatch."""
    path = RESULTS / "step.json"
    if path.exists():
        data = json.loads(path.read_text())
        if data["summary"].get("clock", "cpu") == clock:
            return {m: r["packed_s"] for m, r in data["details"]["per_mix"].items()}, data["summary"]["quick"]
    import step

    actor = step.build()[0]
    return {m: step.measure(m, quick=quick, repeats=2, actor=actor, clock=clock)["packed_s"]
            for m in step.STEP_MIXES}, quick


def main() -> dict:
    args = quick_flag(__doc__.splitlines()[0]).parse_args()
    setup(args)
    from packing.collate import make_experience_batch

    import step

    items = corpus(args.quick)
    seqs = [r.sequences for r in items]
    features = [{"input_ids": s.tolist()} for s in seqs]
    same = identical(ours_pack(seqs), automodel_pack(features))
    repeats = 5 if args.quick else 11
    tokens = interleaved_medians({"ours": lambda: ours_pack(seqs), "automodel": lambda: automodel_pack(features)},
                                 repeats=repeats)
    full = interleaved_medians({"packed": lambda: make_experience_batch(items, packed=True),
                                "padded": lambda: make_experience_batch(items, packed=False)}, repeats=repeats)
    c = args.clock
    speedup = tokens["automodel"][c] / tokens["ours"][c]
    n_tokens = sum(s.numel() for s in seqs)
    print(f"token fields, {len(seqs)} sequences, {n_tokens} tokens: ours {tokens['ours'][c] * 1e3:.2f} ms, "
          f"automodel {tokens['automodel'][c] * 1e3:.1f} ms ({speedup:.1f}x), byte-identical: {same}")
    print(f"full Experience collate: packed {full['packed'][c] * 1e3:.2f} ms, padded {full['padded'][c] * 1e3:.2f} ms")

    per_step, (steps, step_quick) = {}, step_seconds(c, args.quick)
    for mix, step_s in steps.items():
        mb = step.microbatch(mix, quick=step_quick)
        t = interleaved_medians({"collate": lambda: make_experience_batch(mb, packed=True)}, repeats=repeats)
        per_step[mix] = {"collate_s": t["collate"][c], "step_s": step_s, "pct": 100 * t["collate"][c] / step_s}
        print(f"{mix}: collate of step.py's microbatch {t['collate'][c] * 1e3:.2f} ms = "
              f"{per_step[mix]['pct']:.3f}% of its packed step ({step_s:.3f} s)")
    return emit("collate", {
        "identical": same, "speedup_vs_automodel": round(speedup, 1),
        "collate_pct_of_step": round(max(r["pct"] for r in per_step.values()), 4),
        "tokens": n_tokens, "ours_ms": round(tokens["ours"][c] * 1e3, 3),
        "automodel_ms": round(tokens["automodel"][c] * 1e3, 2),
        "experience_collate_ms": round(full["packed"][c] * 1e3, 2), "quick": args.quick,
    }, {"token_fields": tokens, "experience_collate": full, "per_step": per_step, "sequences": len(seqs)}, clock=c)


if __name__ == "__main__":
    main()

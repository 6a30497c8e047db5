"""Per-rank causal attention work under context parallelism: zigzag vs contiguous sharding.

For one seeded pack of uneven sequences, prints for cp=2 and cp=4 each CP rank's
attention work (`runtime.cp_shard.attention_work`: visible keys summed over its real queries)
and token count, under the zigzag layout (rank r keeps chunks r and 2cp-1-r of every
sequence) and under contiguous sharding (rank r keeps chunks 2r and 2r+1), with the
max/min ratio. No processes, no model: the layout alone decides the balance. The last
line is one JSON object (`zigzag_imbalance`: the worst zigzag max/min over cp=2, 4); the
output is also written to bench/results/cp_balance.out and cp_balance.json.

    python bench/cp_balance.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, emit  # noqa: E402

import torch  # noqa: E402

from runtime.cp_shard import attention_work, cp_layout  # noqa: E402
from packing.collate import make_experience_batch  # noqa: E402
from packing.experience import Experience  # noqa: E402

LENGTHS = [1000, 517, 2048, 301, 64, 3, 1200]  # uneven on purpose, a 3-token one included


def main() -> dict:
    gen = torch.Generator().manual_seed(0)
    pack = make_experience_batch([Experience(sequences=torch.randint(0, 256, (n,), generator=gen)) for n in LENGTHS],
                                 packed=True)
    lines, summary = [f"pack of {len(LENGTHS)} sequences, lengths {LENGTHS}, N={sum(LENGTHS)}"], {}
    for cp in (2, 4):
        for zigzag in (True, False):
            layouts = [cp_layout(pack, cp, r, zigzag=zigzag) for r in range(cp)]
            work = [attention_work(lay) for lay in layouts]
            tokens = [lay.num_local for lay in layouts]
            name = f"cp{cp}_{'zigzag' if zigzag else 'contiguous'}"
            summary[name] = round(max(work) / min(work), 4)
            lines.append(f"{name:>16}: work/rank {work}  max/min {max(work) / min(work):.4f}  "
                         f"tokens/rank {tokens} (N_pad={sum(layouts[0].padded_lens)})")
    for line in lines:
        print(line)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cp_balance.out").write_text("\n".join(lines) + "\n")
    worst = max(v for k, v in summary.items() if k.endswith("zigzag"))
    return emit("cp_balance", {"zigzag_imbalance": worst, "contiguous_imbalance": max(
        v for k, v in summary.items() if k.endswith("contiguous")), "max_over_min_work": summary})


if __name__ == "__main__":
    main()

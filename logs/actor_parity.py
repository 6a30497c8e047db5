"""Padded vs packed forward: the same numbers, or how far apart.

For a tiny dense Qwen3 and a tiny Qwen3-MoE (fp32, CPU) and one seeded batch of uneven
samples, prints the max |padded - packed| of `action_log_probs`, `entropy` and critic
`values` on every scored slot (action_mask True), and of the parameter gradients of a
token-mean loss (max over parameters of max |g_pad - g_pack|, over the largest |g| entry).
The last line is one JSON object; the output is also written to logs/actor_parity.out.

    python logs/actor_parity.py

logs/parity_control.py runs the same comparison with the pack's boundaries withheld.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model.actor import Actor, Critic  # noqa: E402
from model.models import build_model  # noqa: E402
from packing.collate import make_experience_batch  # noqa: E402
from packing.experience import Experience  # noqa: E402

LENGTHS = [5, 200, 37, 120, 9, 64]  # uneven on purpose: 5..200 tokens
SEED = 0
MODELS = {"dense": "qwen3", "moe": "qwen3_moe"}
# The stock init (0.02) gives near-uniform next-token distributions (entropy ~ ln V) on which
# even a leaking pack barely moves the entropy; 0.2 makes them peaked, like a trained model's.
INIT = dict(initializer_range=0.2)


def make_batch(lengths=LENGTHS, *, vocab: int = 256, seed: int = SEED) -> list[Experience]:
    """Seeded records: random ids, a random prompt/response split, random advantages."""
    gen = torch.Generator().manual_seed(seed)
    records = []
    for n in lengths:
        prompt = int(torch.randint(1, n, (1,), generator=gen))  # >= 1 response token
        records.append(
            Experience(
                sequences=torch.randint(0, vocab, (n,), generator=gen),
                action_mask=torch.arange(n - 1) >= prompt - 1,
                advantages=torch.randn(n - 1, generator=gen),
            )
        )
    return records


def withhold_boundaries(pack: Experience) -> Experience:
    """The pack's tokens as ONE sequence: positions 0..N-1, no cu_seqlens (a [1, N] padded row).

    Its outputs are `[1, N-1]`; `as_pack_layout` puts them on the pack's `[1, N]` axis.
    """
    ids = pack.sequences
    return Experience(sequences=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool))


def as_pack_layout(t: torch.Tensor) -> torch.Tensor:
    """`[1, N-1]` outputs of one long row -> `[1, N]` (slot k of both scores token k+1)."""
    return torch.nn.functional.pad(t, (0, 1))


def per_sample(values: torch.Tensor, batch: Experience) -> list[torch.Tensor]:
    """Action-axis outputs of a padded or packed batch -> one `[T_i - 1]` tensor per sample."""
    return [r.action_log_probs for r in dataclasses.replace(batch, action_log_probs=values).split()]


def max_scored_diff(a: torch.Tensor, batch_a: Experience, b: torch.Tensor, batch_b: Experience, records) -> float:
    """max |a - b| over every scored slot (action_mask True) of every sample."""
    worst = 0.0
    for x, y, rec in zip(per_sample(a, batch_a), per_sample(b, batch_b), records):
        worst = max(worst, (x - y)[rec.action_mask].abs().max().item())
    return worst


def token_mean_loss(log_probs: torch.Tensor, entropy: torch.Tensor, batch: Experience) -> torch.Tensor:
    """A policy-gradient-shaped token-mean loss over scored slots (layout-invariant)."""
    mask = batch.action_mask.float()
    return ((-batch.advantages * log_probs - 0.01 * entropy) * mask).sum() / mask.sum()


def grads(module: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def grad_diff(g_a: dict, g_b: dict) -> float:
    """max over params of max |g_a - g_b|, over the largest |g_a| entry."""
    if g_a.keys() != g_b.keys():
        raise ValueError(f"gradients of different parameters: {sorted(g_a.keys() ^ g_b.keys())}")
    scale = max(g.abs().max().item() for g in g_a.values())
    return max((g_a[n] - g_b[n]).abs().max().item() for n in g_a) / scale


def compare(name: str, records, padded: Experience, fed: Experience, pack: Experience, relayout=lambda t: t) -> dict:
    """Actor and critic on the padded batch vs on `fed`, read back in the layout of `pack`.

    `fed` is the pack itself (parity) or the pack with its boundaries withheld (control);
    `relayout` maps the outputs of `fed` onto the pack's `[1, N]` axis.
    """
    actor = Actor(build_model(name, seed=SEED, **INIT), chunk_size=64).train()
    lp_pad, ent_pad = actor(padded, return_entropy=True)
    lp_pack, ent_pack = (relayout(t) for t in actor(fed, return_entropy=True))
    g_pad = grads(actor, token_mean_loss(lp_pad, ent_pad, padded))
    g_pack = grads(actor, token_mean_loss(lp_pack, ent_pack, pack))
    critic = Critic(build_model(name, seed=SEED + 1, **INIT), seed=SEED)
    with torch.no_grad():
        v_pad, v_pack = critic(padded), relayout(critic(fed))
    return {
        "logp": max_scored_diff(lp_pad, padded, lp_pack, pack, records),
        "entropy": max_scored_diff(ent_pad, padded, ent_pack, pack, records),
        "grad": grad_diff(g_pad, g_pack),
        "values": max_scored_diff(v_pad, padded, v_pack, pack, records),
    }


class Report:
    """print() that also keeps the lines for the .out file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self, path: pathlib.Path) -> None:
        path.write_text("\n".join(self.lines) + "\n")


def run(title: str, out_file: str, feed=lambda pack: pack, relayout=lambda t: t) -> dict:
    """Padded vs `feed(pack)` for both models; print, write logs/`out_file`, return the summary."""
    torch.set_num_threads(min(2, torch.get_num_threads()))
    records = make_batch()
    padded = make_experience_batch(records, packed=False)
    pack = make_experience_batch(records, packed=True)
    report = Report()
    report(title)
    report(f"lengths {LENGTHS}  scored slots {int(padded.action_mask.sum())}  pack N={pack.sequences.shape[1]}  "
           f"padded {tuple(padded.sequences.shape)}  fp32  {INIT}  torch {torch.__version__}")
    summary = {}
    for kind, name in MODELS.items():
        diffs = compare(name, records, padded, feed(pack), pack, relayout)
        report(f"{kind:5s} ({name:9s}) max|diff| on scored slots: log-probs {diffs['logp']:.3e}  "
               f"entropy {diffs['entropy']:.3e}  values {diffs['values']:.3e}  grad (rel) {diffs['grad']:.3e}")
        summary.update({f"{kind}_logp": diffs["logp"], f"{kind}_grad": diffs["grad"],
                        f"{kind}_entropy": diffs["entropy"]})
    keys = ("dense_logp", "moe_logp", "dense_grad", "moe_grad", "dense_entropy", "moe_entropy")
    ordered = {k: summary[k] for k in keys}
    report(json.dumps(ordered))
    report.save(ROOT / "logs" / out_file)
    return ordered


def main() -> dict:
    return run("padded [B, T] vs packed [1, N] (boundaries from packed_seq_lens)", "actor_parity.out")


if __name__ == "__main__":
    main()

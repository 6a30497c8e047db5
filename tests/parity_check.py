"""fp32 parity tolerances that hold on every CPU kernel set, and the core parity checks.

torch picks its CPU kernels at start-up (`ATEN_CPU_CAPABILITY=default|avx2|avx512`) and
splits reductions by thread count, so the same packed-vs-padded forward rounds
differently on different machines: "bit-exact on CPU" is a property of one kernel set.
A parity assertion therefore bounds the difference in units of fp32 epsilon relative to
the values' magnitude:

    max |a - b| <= k * eps32 * max |a|          (eps32 = 2**-23 ~ 1.19e-7)

and prints the measured figure. `PARITY_ULPS` is k for every parity check of the suite
(packed vs padded, ep=2 and cp=2/4 vs one process, replay, suffix): the worst measured
over kernel sets {default, avx2, avx512} x {1, 2} threads (AVX512 machine, torch 2.13)
is 4.3 eps (MoE entropy, values ~5.5; log-probs <= 0.7 eps, grads <= 3.2 eps of the
largest gradient), so k = 16 is "a few ulps" with ~4x headroom. Every control must miss
by `CONTROL_MARGIN` x k: the closest, the ep=2 wrong-expert-owner control, is 4.3e4 eps
(2700 x k); a leak across sequences is > 3e5 eps.

Run as a program, this module runs the core checks (dense and MoE, packed vs padded
log-probs, entropy and gradients, plus the withheld-boundaries control) under whatever
kernel set its environment forces, once per thread count asked for, and prints one JSON
line: tests/test_portable_parity.py launches it once per kernel set with 1 and 2 threads.

    ATEN_CPU_CAPABILITY=avx2 python tests/parity_check.py --threads 1,2
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps
PARITY_ULPS = 16  # k: see the module docstring
CONTROL_MARGIN = 1000  # a control must miss the tolerance by at least this factor


def ulps(diff: float, scale: float) -> float:
    """`diff` in units of fp32 epsilon relative to `scale` (the values' magnitude)."""
    return _float(diff) / (EPS32 * max(_float(scale), 1e-30))


def _float(x) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def assert_parity(what: str, diff: float, scale: float, k: float = PARITY_ULPS) -> float:
    """Assert `diff <= k * eps32 * scale`, print the figure, return it in eps units."""
    u = ulps(diff, scale)
    diff, scale = _float(diff), _float(scale)
    print(f"{what}: max|a-b| {diff:.3g} = {u:.2f} eps32 of max|a| {scale:.3g} (limit {k})")
    assert u <= k, f"{what}: max|a-b| {diff:.3g} = {u:.2f} eps32 relative to {scale:.3g}, limit {k}"
    return u


def assert_control_fails(what: str, diff: float, scale: float, k: float = PARITY_ULPS) -> float:
    """A control must break parity by orders of magnitude: `diff >= CONTROL_MARGIN * k * eps32 * scale`."""
    u = ulps(diff, scale)
    diff, scale = _float(diff), _float(scale)
    print(f"control {what}: max|a-b| {diff:.3g} = {u:.3g} eps32 of max|a| {scale:.3g} "
          f"(must be >= {CONTROL_MARGIN} x {k})")
    assert u >= CONTROL_MARGIN * k, f"control {what}: only {u:.3g} eps32 apart; it no longer tests anything"
    return u


def max_abs(tensors) -> float:
    return max(float(t.detach().abs().max()) for t in tensors)


# --------------------------------------------------------------- the core checks
LENGTHS = [5, 61, 17, 40, 2, 9]  # as tests/test_actor.py: uneven, with a 1-slot sample


def core_parity(name: str) -> dict:
    """Packed vs padded log-probs, entropy and grads of one tiny model; and the control.

    Returns each figure in eps32 units relative to the padded values' magnitude.
    """
    import dataclasses

    from model.actor import Actor
    from model.models import build_model
    from packing.collate import make_experience_batch
    from packing.experience import Experience
    from testing.records import make_records

    records = make_records(LENGTHS, seed=1)
    padded = make_experience_batch(records, packed=False)
    pack = make_experience_batch(records, packed=True)
    model = build_model(name, seed=0)
    actor = Actor(model, chunk_bytes=32 * 4 * model.config.vocab_size)  # 32-row log-prob chunks

    def scored(values, batch):  # per sample, scored slots only
        rows = dataclasses.replace(batch, action_log_probs=values).split()
        return [row.action_log_probs[r.action_mask] for row, r in zip(rows, records)]

    def diff(a, batch_a, b, batch_b):
        xs, ys = scored(a, batch_a), scored(b, batch_b)
        return max_abs(x - y for x, y in zip(xs, ys)), max_abs(xs)

    def grads(lp, ent, batch):
        mask = batch.action_mask.float()
        loss = ((-batch.advantages * lp - 0.01 * ent) * mask).sum() / mask.sum()
        actor.zero_grad(set_to_none=True)
        loss.backward()
        out = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
        actor.zero_grad(set_to_none=True)
        return out

    lp_pad, ent_pad = actor(padded, return_entropy=True)
    lp_pack, ent_pack = actor(pack, return_entropy=True)
    g_pad, g_pack = grads(lp_pad, ent_pad, padded), grads(lp_pack, ent_pack, pack)
    with torch.no_grad():  # control: the pack as ONE sequence (no boundaries) leaks across samples
        one_row = Experience(sequences=pack.sequences, attention_mask=torch.ones_like(pack.sequences, dtype=torch.bool))
        lp_leak = torch.nn.functional.pad(actor(one_row), (0, 1))
    return {
        "log_probs": ulps(*diff(lp_pad, padded, lp_pack, pack)),
        "entropy": ulps(*diff(ent_pad, padded, ent_pack, pack)),
        "grads": ulps(max_abs(g_pad[n] - g_pack[n] for n in g_pad), max_abs(g_pad.values())),
        "control_log_probs": ulps(*diff(lp_pad.detach(), padded, lp_leak, pack)),
    }


def main() -> None:
    import argparse
    import json
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default=None, help="comma-separated thread counts, run one after the other")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: model, packing, tests
    runs = {}
    for threads in [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        runs[str(torch.get_num_threads())] = {name: core_parity(name) for name in ("qwen3", "qwen3_moe")}
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "threads": runs}))


if __name__ == "__main__":
    main()

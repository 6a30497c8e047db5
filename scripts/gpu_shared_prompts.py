"""Device check of the shared-prompt forward on CUDA (dense and MoE tiny models, fp32).

Per model: log-probs, entropy and gradients of the shared forward vs the unshared pack (eps32
relative to the values' magnitude), MoE aux loss / token count / expert load / recorded
routing, and the host syncs CUDA itself reports in one forward (`torch.cuda.set_sync_debug_mode`,
one warning per synchronizing call, by file:line). Last line: one JSON object.

    python scripts/gpu_shared_prompts.py      # needs a CUDA device (launch/gpu_check.sh checks the
                                              # shared-prompt kernel in bf16 in its `kernels` section)
"""

from __future__ import annotations

import collections
import json
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.actor import Actor  # noqa: E402
from model.models import build_model  # noqa: E402
from model.moe import (expert_load, moe_blocks, record_routing, reset_expert_load, router_aux_loss,  # noqa: E402
                       shard_experts)
from packing.collate import make_experience_batch  # noqa: E402
from testing.records import grpo_records  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps


def ulps(diff, scale) -> float:
    return float(diff) / (EPS32 * max(float(scale), 1e-30))


def syncs_of(fn) -> dict:
    """`file:line` -> count of the synchronizing calls CUDA reports while `fn()` runs."""
    torch.cuda.synchronize()
    hits: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            hits[f"{Path(w.filename).name}:{w.lineno}"] += 1
    return dict(hits)


def run(model, pack, share: bool) -> dict:
    actor = Actor(model, share_prompts=share, actions_only=True)
    moe = bool(moe_blocks(model, strict=False))
    model.zero_grad(set_to_none=True)
    if moe:
        reset_expert_load(model)
    with router_aux_loss(model, enabled=moe) as aux, (record_routing(model) if moe else torch.enable_grad()) as rec:
        lp, ent = actor(pack, return_entropy=True)
    mask = pack.action_mask.float()
    loss = ((-pack.advantages * lp - 0.01 * ent) * mask).sum() / mask.sum()
    out = {"lp": lp.detach(), "ent": ent.detach()}
    if moe:
        tokens = torch.stack([n for _, n in aux])
        balance = sum(a * n for a, n in aux) / tokens.sum()
        loss = loss + 0.01 * balance
        out.update(aux=balance.detach(), tokens=tokens, load=expert_load(model)["per_layer"],
                   routed=rec.routed_experts)
    loss.backward()
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    if pack.sequences.is_cuda:  # CUDA reports its own syncs; the CPU count is tests/test_host_syncs.py's
        with torch.no_grad():
            out["syncs"] = syncs_of(lambda: actor(pack))
    return out


LIMIT_EPS = 16  # the suite's fp32 parity limit (tests/parity_check.py)


def figures(device: str = "cuda") -> dict:
    """Every figure above per family, and `ok`: each within LIMIT_EPS, every MoE count equal."""
    cuda = device == "cuda"
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    records = grpo_records()
    ok = True
    for family in ("qwen3", "qwen3_moe"):
        model = build_model(family, seed=0).to(device)
        if family.endswith("moe"):
            shard_experts(model, None)
        pack = make_experience_batch(records, packed=True).to(device)
        actor = Actor(model, share_prompts=True)
        with torch.no_grad():
            actor(pack)  # warm-up (lazy CUDA init, kernels)
        plain, shared = run(model, pack, False), run(model, pack, True)
        act = pack.action_mask
        fig = {
            "log_probs_eps": ulps((plain["lp"] - shared["lp"])[act].abs().max(), plain["lp"][act].abs().max()),
            "entropy_eps": ulps((plain["ent"] - shared["ent"])[act].abs().max(), plain["ent"][act].abs().max()),
            "grads_eps": ulps(max(float((plain["grads"][n] - g).abs().max()) for n, g in shared["grads"].items()),
                              max(float(g.abs().max()) for g in plain["grads"].values())),
            "syncs_unshared": plain.get("syncs"), "syncs_shared": shared.get("syncs"),
            "rows": [pack.sequences.shape[1], pack.shared_prompts.keep.numel()],
        }
        if "aux" in plain:
            fig.update(aux_eps=ulps((plain["aux"] - shared["aux"]).abs(), plain["aux"].abs()),
                       tokens_equal=bool(torch.equal(plain["tokens"], shared["tokens"])),
                       load_equal=bool(torch.equal(plain["load"], shared["load"])),
                       routed_equal=bool(torch.equal(plain["routed"], shared["routed"])))
        result[family] = fig
        ok = ok and all(v <= LIMIT_EPS for k, v in fig.items() if k.endswith("_eps"))
        ok = ok and all(v for k, v in fig.items() if k.endswith("_equal"))
        print(family, fig, file=sys.stderr, flush=True)
    return {"ok": ok, **result}


if __name__ == "__main__":
    assert torch.cuda.is_available(), "needs a CUDA device"
    print(json.dumps(figures("cuda")))

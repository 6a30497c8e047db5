"""The suite runs on torch 2.11-2.14: every name a supported release lacks goes through
runtime/compat.py, and the fallback gives the same numbers as the newer name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from testing.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
NEWER = ("all_gather_single", "reduce_scatter_single")  # torch >= 2.13 only


def test_only_the_compat_layer_calls_collectives_that_older_torch_lacks():
    """A direct `dist.all_gather_single(...)` anywhere else would fail on torch 2.11/2.12."""
    pattern = re.compile(rf"\b(?:dist|distributed)\.({'|'.join(NEWER)})\s*\(")
    offenders = [f"{path.relative_to(ROOT)}:{n}" for folder in ("model", "runtime", "rl", "packing", "scripts", "launch")
                 for path in (ROOT / folder).rglob("*.py") if path.name != "compat.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    offenders += [f"train.py:{n}" for n, line in enumerate((ROOT / "train.py").read_text().splitlines(), 1)
                  if pattern.search(line)]
    assert offenders == []


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """This rank's K/V-like tensor `[2, 3, 5, 4]`, the weights of its loss on the gathered
    `[2, 3, 10, 4]`, and its `torch.chunk` shares of two weights of 5 and 3 rows."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(2, 3, 5, 4, generator=gen)
    w = torch.randn(2, 3, 10, 4, generator=gen)
    full = [torch.randn(5, 6, generator=torch.Generator().manual_seed(7)), torch.arange(3 * 2.0).view(3, 2)]
    return x, w, [t.chunk(2)[rank] if rank < len(t.chunk(2)) else t[:0] for t in full]


def gathers_rank(rank: int, world: int, remove_newer: bool) -> dict:
    """The suite's two gathers on 2 gloo ranks: the context-parallel K/V gather forward (all-gather)
    and backward (reduce-scatter), and the weight sync's dim-0 gather of uneven shards; with
    `remove_newer`, torch's 2.13-only names are deleted first, as on torch 2.11/2.12."""
    import torch.distributed as dist

    if remove_newer:
        for name in NEWER:
            delattr(dist, name)
        with pytest.raises(AttributeError):  # the control: the newer names are really gone
            dist.all_gather_single
    from runtime.cp_shard import gather_tokens
    from rl.rollout.sync import _gather_dim0

    x, w, shares = _inputs(rank)
    x.requires_grad_(True)
    gathered = gather_tokens(x, dist.group.WORLD, dim=2)
    (gathered * w).sum().backward()
    full = _gather_dim0(shares, [(5, 6), (3, 2)], dist.group.WORLD)
    return {"gathered": gathered.detach(), "grad": x.grad, "full": full}


@pytest.mark.slow
def test_gathers_without_the_torch_2_13_collectives_equal_the_newer_ones():
    newer = run_distributed(gathers_rank, 2, False)
    older = run_distributed(gathers_rank, 2, True)
    (x0, w0, _), (x1, w1, _) = _inputs(0), _inputs(1)
    want_gathered = torch.cat([x0, x1], dim=2)
    want_grads = [(w0 + w1)[:, :, :5], (w0 + w1)[:, :, 5:]]  # each rank's slice, summed over the ranks' losses
    want_full = [torch.randn(5, 6, generator=torch.Generator().manual_seed(7)), torch.arange(3 * 2.0).view(3, 2)]
    for rank in range(2):
        for key in ("gathered", "grad"):
            assert torch.equal(older[rank][key], newer[rank][key]), (rank, key)
        assert all(torch.equal(a, b) for a, b in zip(older[rank]["full"], newer[rank]["full"]))
        assert torch.equal(newer[rank]["gathered"], want_gathered)
        torch.testing.assert_close(newer[rank]["grad"], want_grads[rank], rtol=1e-6, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(newer[rank]["full"], want_full))


def test_every_shim_is_still_needed_by_the_oldest_supported_torch():
    """The deletion test: once the oldest supported torch has a name, its shim goes (this fails)."""
    from runtime import compat

    stale = [name for name, since in compat.SINCE.items() if compat.OLDEST_TORCH >= since]
    assert stale == [], f"torch {compat.OLDEST_TORCH} has {stale}: delete their shims from runtime/compat.py"
    assert set(compat.SINCE) == {*NEWER, "reset_iter_state"}


def test_only_the_compat_layer_resets_fsdp_iteration_state():
    offenders = [f"{path.relative_to(ROOT)}:{n}" for folder in ("model", "runtime", "rl", "launch")
                 for path in (ROOT / folder).rglob("*.py") if path.name != "compat.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if ".reset_iter_state(" in line]
    assert offenders == []


@pytest.mark.parametrize("newer", [True, False], ids=["torch-2.13", "without-reset_iter_state"])
def test_an_aborted_sharded_generation_leaves_fsdp_idle_and_the_next_one_equal(monkeypatch, newer):
    """A one-rank FSDP2 policy generating (rollout.replica=sharded) whose second decoder layer raises
    mid-generation: the layer's error reaches the caller (on torch 2.11 it was an AttributeError,
    `reset_iter_state` missing), FSDP's states are idle with no forward root, and the next generation
    equals one never interrupted. Control: without the reset the aborted forward's root is still set."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    from runtime import compat
    from model.actor import Actor
    from model.models import build_model
    from runtime.parallel_dims import init_distributed
    from model.parallelize import parallelize
    from rl.rollout.engine import PolicyRolloutEngine

    if not newer:
        monkeypatch.delattr(FSDPModule, "reset_iter_state")
    try:
        dims = init_distributed(device="cpu", one_rank_group=True)
        actor = parallelize(Actor(build_model("qwen3", seed=0, vocab_size=64)), dims)
        engine = PolicyRolloutEngine(actor)
        prompts, kw = [torch.arange(4, 10), torch.arange(5, 9)], dict(prompt_indices=[0, 1], max_new_tokens=6,
                                                                      temperature=0.7, seed=1)
        want = engine.generate(prompts, **kw)
        calls = []

        def boom(module, args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("layer 1 failed")

        state = actor._get_fsdp_state()
        for reset in (lambda root: None, compat.reset_iter_state):  # the control first
            monkeypatch.setattr("rl.rollout.engine.reset_iter_state", reset)
            calls.clear()
            hook = actor.model.model.layers[1].register_forward_pre_hook(boom)
            with pytest.raises(RuntimeError, match="layer 1 failed"):
                engine.generate(prompts, **kw)
            hook.remove()
            if reset is not compat.reset_iter_state:
                assert state._state_ctx.iter_forward_root is not None
                compat.reset_iter_state(actor)
        assert state._state_ctx.iter_forward_root is None
        assert all(s._training_state == TrainingState.IDLE for s in state._state_ctx.all_states)
        got = engine.generate(prompts, **kw)
        assert all(torch.equal(a.sequences, b.sequences) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
                   for a, b in zip(want, got))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

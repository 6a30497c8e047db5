"""world=4 gradients after sync equal one process on the same global batch."""

import pytest
from distributed import run_distributed

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "name,ep,cp,packed",
    [("qwen3", 1, 1, True), ("qwen3_moe", 2, 1, True), ("qwen3", 1, 2, True), ("qwen3", 1, 2, False),
     ("qwen3_moe", 1, 2, True),
     ("qwen3_moe", 2, 2, True)],
    ids=["dense-dp4", "moe-dp4-ep2", "dense-dp2-cp2", "dense-dp2-cp2-padded", "moe-dp2-cp2", "moe-dp2-cp2-ep2"],
)
def test_world4_gradients_match_one_process(name, ep, cp, packed):
    from dist_train_worker import grad_sync_checks

    for rank, r in enumerate(run_distributed(grad_sync_checks, 4, name, ep, cp, packed, timeout=240)):
        assert r["microbatches"] >= 1
        for kind, diff in r["diffs"].items():
            assert diff <= 1e-5, f"rank {rank} {kind}: max |diff| {diff} (max |grad| {r['scale']})"
        if ep > 1:
            assert r["expert_params"] > 0


def test_control_without_the_sync_gradients_differ():
    from dist_train_worker import grad_sync_checks

    results = run_distributed(grad_sync_checks, 4, "qwen3", 1, 1, True, True, timeout=240)
    assert max(r["diffs"]["dense"] for r in results) > 1e-3

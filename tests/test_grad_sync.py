"""world=4 gradients after sync equal one process on the same global batch."""

import pytest
from distributed import run_distributed

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name,ep", [("qwen3", 1), ("qwen3_moe", 2)])
def test_world4_gradients_match_one_process(name, ep):
    from dist_train_worker import grad_sync_checks

    for rank, r in enumerate(run_distributed(grad_sync_checks, 4, name, ep, timeout=240)):
        assert r["microbatches"] >= 1
        for kind, diff in r["diffs"].items():
            assert diff <= 1e-5, f"rank {rank} {kind}: max |diff| {diff} (max |grad| {r['scale']})"
        if ep > 1:
            assert r["expert_params"] > 0


def test_control_without_the_sync_gradients_differ():
    from dist_train_worker import grad_sync_checks

    results = run_distributed(grad_sync_checks, 4, "qwen3", 1, True, timeout=240)
    assert max(r["diffs"]["dense"] for r in results) > 1e-3

"""A rank the planner gives an empty microbatch (too few samples to go round) runs a
zero-weight forward/backward on a stand-in sample, so its collectives (FSDP, the EP
all-to-all, the gradient norm) stay in step with its peers and the step's numbers equal
one process's."""

import pytest

from testing.distributed import run_distributed
from testing.inprocess import steps_rank

pytestmark = pytest.mark.slow

# 4 prompts x 3 samples in 2 mini-batches: 6 samples per mini-batch over dp=4. A sample has
# 4..12 prompt + 12 new tokens (16..24), so with batch.max_tokens=30 no two share a
# microbatch: two ranks run 2 microbatches, the other two 1 and an empty one.
OVERRIDES = ("task.prompts_per_step=4", "task.samples_per_prompt=3", "algo.mini_batches=2", "batch.max_tokens=30",
             "trainer.progress=false")
KEYS = ("loss", "policy_loss", "grad_norm", "entropy", "approx_kl", "clip_ratio")


def test_empty_microbatches_keep_four_ranks_in_step_and_match_one_process():
    one = steps_rank(0, 1, OVERRIDES, 2)[0]
    four = run_distributed(steps_rank, 4, OVERRIDES + ("parallel.ep=2",), 2)
    assert one["empty_microbatches"] == 0
    assert sum(r[0]["empty_microbatches"] for r in four) > 0  # the case under test happened
    for a, b in zip(one["metrics"], four[0][0]["metrics"]):
        assert a["reward_mean"] == b["reward_mean"] and a["tokens"] == b["tokens"]
        for key in KEYS:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])

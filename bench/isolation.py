"""What `task.isolation=process` costs (rl/tasks/processes.py) beside `thread`: a reward call, an
episode on a new and on a reused worker, a worker's own memory, and how soon a busy call is killed.

    python bench/isolation.py [--resident-mb 100]

`--resident-mb` fills the trainer's process with that much memory first (the zygote is forked from
it, as from the trainer when its task is built: a bigger process forks slower).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
import torch  # noqa: E402

from rl.tasks.calls import UserCalls  # noqa: E402


def reward(prompt_ids, response_ids):
    return float(len(response_ids) % 2)


def busy():
    while True:
        pass


class Env:
    def reset(self, prompt):
        return [{"role": "user", "content": "x"}]

    def step(self, text):
        return "y", 0.0, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resident-mb", type=int, default=100)
    parser.add_argument("--episodes", type=int, default=32)
    args = parser.parse_args()
    ballast = torch.ones(args.resident_mb * 2 ** 18)  # noqa: F841 - resident memory, as a trainer has
    for isolation in ("thread", "process"):
        calls = UserCalls("skip", 60.0, isolation)
        calls.run(reward, [1], [2])
        n, start = 500, time.perf_counter()
        for _ in range(n):
            calls.run(reward, list(range(200)), list(range(100)))
        print(f"{isolation}: {(time.perf_counter() - start) / n * 1e3:.3f} ms per reward call")
        calls.close()
    calls = UserCalls("skip", 60.0, "process")
    for label in ("new workers", "reused workers"):
        start = time.perf_counter()
        envs = [calls.environment(Env) for _ in range(args.episodes)]
        for env in envs:
            calls.run(env.reset, {})
            calls.run(env.step, "a")
        for env in envs:
            calls.release(env)
        print(f"process: {(time.perf_counter() - start) / args.episodes * 1e3:.2f} ms per episode on {label} "
              f"(reset, step)")
    workers = [p for p in psutil.Process().children(recursive=True) if p.pid != calls._pool.zygote]
    uss = sorted(p.memory_full_info().uss for p in workers)[len(workers) // 2] / 2 ** 20
    print(f"process: {uss:.1f} MiB of its own memory per worker (median of {len(workers)})")
    calls.close()
    calls = UserCalls("skip", 0.2, "process")
    calls.run(reward, [1], [2])  # the pool started
    start = time.perf_counter()
    with calls.guard("busy"):
        calls.run(busy, what="busy")
    print(f"process: a busy call with task.timeout_s=0.2 killed after {time.perf_counter() - start:.2f} s")
    calls.close()


if __name__ == "__main__":
    main()

"""bench/async.py's figures from metrics, and its simulator: pure functions, no run, no timing.

The simulator's one_step_off step is max(generate, train) + sync + exposed, sync's is the sum:
equal phases give the 2x bound, a rollout 3x as long as training (3 + 1) / 3. The control: with
nothing to hide behind (train 0) the speed-up is 1x, so the bound is the overlap's and not a
constant; and the weight sync, which waits for both, is never hidden.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench():
    # `async` is a keyword: the module is loaded from its file (it imports nothing heavy at the top)
    spec = importlib.util.spec_from_file_location("bench_async", ROOT / "bench" / "async.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12)


def test_the_simulator_hides_the_shorter_phase_behind_the_longer():
    predict = bench().predict
    equal = predict(1.0, 1.0)
    assert close(equal["speedup"], 2.0) and close(equal["hidden"], 1.0)
    rollout_bound = predict(3.0, 1.0)  # the GPU-like ratio: generation 3x training
    assert close(rollout_bound["speedup"], 4 / 3) and close(rollout_bound["hidden"], 1 / 3)
    assert close(rollout_bound["sync_step_s"], 4.0) and close(rollout_bound["one_step_off_step_s"], 3.0)
    train_bound = predict(0.5, 1.0)  # all of the generation hides
    assert close(train_bound["speedup"], 1.5) and close(train_bound["hidden"], 1.0)
    # the ratio, not the scale: seconds x 7 give the same speed-up
    assert close(predict(21.0, 7.0)["speedup"], rollout_bound["speedup"])


def test_control_nothing_to_hide_behind_and_the_weight_sync_are_not_overlapped():
    predict = bench().predict
    assert close(predict(1.0, 0.0)["speedup"], 1.0) and close(predict(0.0, 1.0)["speedup"], 1.0)
    with_sync = predict(1.0, 1.0, sync=1.0)  # (1 + 1 + 1) / (max(1, 1) + 1): below the 2x bound
    assert close(with_sync["speedup"], 1.5)
    exposed = predict(3.0, 1.0, exposed=1.0)  # one_step_off's own take cost: (3 + 1) / (3 + 1)
    assert close(exposed["speedup"], 1.0)
    with pytest.raises(ValueError, match="train=-1"):
        predict(1.0, -1.0)


def test_phases_and_steady_steps_from_the_trainers_metrics():
    b = bench()
    sync = [{"step": k, "step_s": 1.0 + k, "rollout_s": 0.6, "weight_sync_s": 0.1} for k in range(4)]
    assert [m["step"] for m in b.steady("sync", sync)] == [1, 2, 3]  # step 0 warms up
    assert b.phases("sync", sync[2]) == pytest.approx({"generate": 0.6, "train": 2.3, "sync": 0.1, "step": 3.0})
    off = [{"step": 0, "step_s": 2.0, "rollout_s": 1.0, "weight_sync_s": 0.1, "rollout_generate_s": 0.6,
            "rollout_publish_wait_s": 0.2, "rollout_overlap": 0.5, "rollout_staleness_max": 0.0}]
    off += [{**off[0], "step": k, "rollout_s": 0.05, "rollout_staleness_max": 1.0} for k in (1, 2, 3)]
    assert [m["step"] for m in b.steady("one_step_off", off)] == [1, 2]  # step 0 at staleness 0; 3: nothing ahead
    assert [m["step"] for m in b.steady("async", off)] == []  # the control: none at staleness 2
    got = b.phases("one_step_off", off[1])
    assert got["train"] == pytest.approx(2.0 - 0.05 - 0.2 - 0.1) and got["exposed"] == 0.05
    assert got["generate"] == 0.6 and got["wait"] == 0.2 and got["overlap"] == 0.5
    assert "cores_busy" not in got  # the bench adds the step's process CPU seconds: then CPU / wall
    assert b.phases("one_step_off", {**off[1], "process_cpu_s": 3.0})["cores_busy"] == pytest.approx(1.5)


def test_the_staleness_histogram_counts_samples_and_refuses_a_mixed_rollout():
    b = bench()
    steps = [{"step": k, "rollout_staleness_mean": float(s), "rollout_staleness_max": float(s)}
             for k, s in enumerate([0, 1, 1, 1, 2])]
    assert b.staleness_histogram(steps, 16) == {"0": 16, "1": 48, "2": 16}
    mixed = [{"step": 3, "rollout_staleness_mean": 0.5, "rollout_staleness_max": 1.0}]  # control
    with pytest.raises(ValueError, match="step 3: rollout_staleness_mean=0.5"):
        b.staleness_histogram(mixed, 16)


def test_the_event_simulator_agrees_with_the_formula_and_a_deeper_queue_absorbs_varying_rollouts():
    """Constant phases: max_staleness 1 (one_step_off) and 2 step at max(generate, train) +
    sync (the thread loads each version as long as the sync writes it), as `predict` says, up to
    the first step's warm-up over n steps. Rollouts alternating long and short at equal mean
    (the control for the queue): max_staleness=1 (one_step_off) waits for every long
    one; at max_staleness=2 a long rollout runs beside two steps' training, so it steps faster."""
    b = bench()
    n = 400
    for g, t, sync in [(3.0, 1.0, 0.2), (0.5, 1.0, 0.2), (1.0, 1.0, 0.0)]:
        want = b.predict(g, t, sync)["one_step_off_step_s"]
        for staleness in (1, 2):
            assert b.simulate([g] * n, t, sync, staleness=staleness) == pytest.approx(want, rel=2 * g / n)
    varying = [1.8, 0.2] * (n // 2)  # mean 1.0 = train
    off = b.simulate(varying, 1.0, 0.1)
    assert off == pytest.approx((1.8 + 1.0) / 2 + 0.1, rel=0.01)  # a long rollout stalls its step
    # ahead by two: generation and training each take their mean, plus the sync (the load, in the thread)
    assert b.simulate(varying, 1.0, 0.1, staleness=2) == pytest.approx(1.0 + 0.1, rel=0.01)
    with pytest.raises(ValueError, match="staleness=0"):
        b.simulate(varying, 1.0, staleness=0)


def test_dedicated_ranks_by_hand_on_a_tiny_case_and_the_pacing_control():
    """R = 1 of N = 2 ranks generates, the other trains, k = 1, equal seconds (1 s each) and a push
    of 0.5 s. By hand: rollout 0 [0, 1] (version 0), rollout 1 [1, 2] (version 0); step 0 trains
    [1, 2], pushes [2, 2.5]; rollout 2 needs version 1: [2.5, 3.5]; step 1 [2.5, 3.5], push to 4;
    rollout 3 [4, 5] ...: a step every 1.5 s (train + push), the generator idle 0.5 s of each, the
    trainer never, every rollout after the first one version old. Controls: k = 0 (rollout j waits
    for version j) steps at 1 + 1 + 0.5; without pacing the generator never waits, steps as fast,
    and its rollouts fall further and further behind."""
    b = bench()
    assert b.dedicated_phases(1.0, 1.0, 2, 1, train_eff=1.0) == (2.0, 2.0)  # each side has half the ranks
    assert b.dedicated_phases(1.0, 1.0, 2, 1, train_eff=0.9) == pytest.approx((2.0, 1.8))  # one rank: no DP loss
    assert b.dedicated_phases(1.0, 1.0, 2, 1, gen_exponent=0.5)[0] == pytest.approx(math.sqrt(2))
    n = 40
    paced = b.simulate_dedicated([1.0] * n, 1.0, 0.5, staleness=1)
    assert close(paced["step_s"], 1.5) and close(paced["generator_idle_s"], 0.5) and paced["trainer_idle_s"] == 0
    assert paced["staleness"] == {"0": 1, "1": n - 1}
    assert b.predict_dedicated(1.0, 1.0, 0.5, 1) == pytest.approx(
        {"step_s": 1.5, "trainer_idle_s": 0.0, "generator_idle_s": 0.5})
    serial = b.simulate_dedicated([1.0] * n, 1.0, 0.5, staleness=0)
    assert close(serial["step_s"], 2.5) and serial["staleness"] == {"0": n}
    assert close(serial["trainer_idle_s"], 1.0) and close(serial["generator_idle_s"], 1.5)
    free = b.simulate_dedicated([1.0] * n, 1.0, 0.5, staleness=None)
    assert close(free["step_s"], 1.5) and free["generator_idle_s"] == 0
    assert max(int(s) for s in free["staleness"]) > 10  # a third of a rollout per step further behind
    with pytest.raises(ValueError, match="rollout_ranks=2, ranks=2"):
        b.dedicated_phases(1.0, 1.0, 2, 2)


def test_the_dedicated_event_simulation_agrees_with_its_formula_and_keeps_each_rollouts_version():
    """Constant phases: k = 0 steps at generate + train + push, k >= 1 at the slower side (the
    stage's wait never binds there). Varying rollouts: every rollout has exactly version j - k
    whatever the timing, and a deeper k absorbs the variation (the control: k = 1 waits for every
    long rollout)."""
    b = bench()
    n = 200
    for g, t, p in [(3.0, 1.0, 0.2), (0.5, 1.0, 0.2), (1.0, 1.0, 0.0), (1.0, 0.4, 0.7)]:
        for k in (0, 1, 2, 3):
            got = b.simulate_dedicated([g] * n, t, p, staleness=k)
            want = b.predict_dedicated(g, t, p, k)
            assert got["step_s"] == pytest.approx(want["step_s"], rel=1e-9), (g, t, p, k)
            assert got["trainer_idle_s"] == pytest.approx(want["trainer_idle_s"], abs=1e-9), (g, t, p, k)
            assert got["generator_idle_s"] == pytest.approx(want["generator_idle_s"], abs=1e-9), (g, t, p, k)
    varying = [1.8, 0.2] * (n // 2)  # mean 1.0 = train + push
    k1 = b.simulate_dedicated(varying, 0.9, 0.1, staleness=1)
    k2 = b.simulate_dedicated(varying, 0.9, 0.1, staleness=2)
    assert k1["staleness"] == {"0": 1, "1": n - 1} and k2["staleness"] == {"0": 1, "1": 1, "2": n - 2}
    assert k1["step_s"] == pytest.approx((1.8 + 1.0) / 2, rel=1e-9)  # a long rollout stalls its step
    assert k2["step_s"] == pytest.approx(1.0, rel=1e-9)  # two ahead: each side at its mean
    with pytest.raises(ValueError, match="staleness=-1"):
        b.simulate_dedicated(varying, 1.0, 0.0, staleness=-1)


def test_linear_scaling_makes_the_best_split_colocated_syncs_step_and_sublinear_decode_beats_it():
    """With generation linear in rows, training at full data-parallel efficiency and no bytes to
    move, the best R balances the two sides and steps at exactly generate + train: colocated sync's
    step on all N ranks. The control: decode whose seconds grow as rows^0.63 (a generator's larger
    batch costs less than its share) makes the split faster than sync; a slow link slower."""
    b = bench()
    linear = b.predict_placements(1.0, ranks=8, train=10.0, push_bytes=0.0, train_eff=1.0)
    assert linear["best_rollout_ranks"] == 4 and close(linear["dedicated_step_s"], 20.0)
    assert close(linear["colocated_sync_step_s"], 20.0) and close(linear["colocated_async_step_s"], 10.0)
    # dedicated beats the free-overlap bound only where overlapping halves each phase's speed (2x)
    assert close(linear["breakeven_slowdown"], 2.0)
    assert close(b.predict_placements(3.0, ranks=8, train=10.0, push_bytes=0.0, train_eff=1.0)["dedicated_step_s"],
                 40.0)  # R = 6: 30 x 8/6 = 40 and 10 x 8/2 = 40
    sub = b.predict_placements(1.0, ranks=8, train=10.0, push_bytes=0.0, train_eff=1.0, gen_exponent=0.63)
    assert sub["dedicated_step_s"] < 20.0 and sub["best_rollout_ranks"] < 4
    slow = b.predict_placements(1.0, ranks=8, train=10.0, push_gbps=1.25, train_eff=1.0)  # 16.4 GB over 10 GbE
    assert close(slow["push_s"], 13.12) and slow["best_rollout_ranks"] == 3  # the trainers take a rank to pay for it
    assert close(slow["dedicated_step_s"], 10.0 * 8 / 5 + 13.12)  # R = 3: 16 s training + the push > 80/3 s rollout
    assert close(slow["colocated_sync_step_s"], 20.0 + b.MODEL_BYTES / (b.SYNC_GBPS * 1e9))  # its sync in the node


def _colocated_run(n: int, generate: float, train: float, sync: float) -> list[dict]:
    return [{"step": s, "step_s": generate + train + sync, "rollout_s": generate, "weight_sync_s": sync}
            for s in range(n)]


def _dedicated_run(n: int, k: int, generate: float, train: float, push: float, samples: int = 32) -> list[dict]:
    """Trainer 0's metrics of a dedicated run stepping as `predict_dedicated` says (steady state
    from step k + 1; before it and after step n - k - 1 the run is off it by 10 s: the windows)."""
    step = generate + train + push if not k else max(generate, train + push)
    out = []
    for s in range(n):
        off = 10.0 if s < k + 1 or s >= n - k else 0.0
        out.append({"step": s, "step_s": step + off, "rollout_s": step - train - push + off, "weight_sync_s": push,
                    "generator_generate_s": generate, "generator_wait_s": step - generate,
                    "weight_sync_bytes": 4096.0, "rollout_staleness_mean": float(min(s, k)),
                    "rollout_staleness_max": float(min(s, k))})
    return out


def test_the_dedicated_check_predicts_from_colocated_phases_and_flags_a_miss_over_15_percent():
    """Colocated phases generate 0.6, train 0.25 and a 0.05 s push: the dedicated step is
    max(0.6, 0.3) = 0.6 at k = 1 and 0.9 at k = 0. Runs that step so give error 0 (the
    steady windows leave out steps 0..k and the last k, which are 10 s off), the trainer's idle
    0.3 at k = 1, the staleness histogram by samples. The control: a k = 1 run whose generator
    is 1.3x slower than colocated (0.78 s a step) misses by +30% and is flagged, while the
    formula on its own phases still holds (error_own_phases 0)."""
    b = bench()
    colocated = [_colocated_run(8, 0.6, 0.25, 0.001), _colocated_run(8, 0.6, 0.25, 0.001)]
    runs = {1: [_dedicated_run(10, 1, 0.6, 0.25, 0.05)], 0: [_dedicated_run(10, 0, 0.6, 0.25, 0.05)]}
    assert [m["step"] for m in b.steady_dedicated(runs[1][0], 1)] == list(range(2, 9))
    assert [m["step"] for m in b.steady_dedicated(runs[0][0], 0)] == list(range(1, 10))
    got = b.check_dedicated({1: colocated, 0: colocated}, runs, 0.05, 32)
    k1, k0 = got["k1"], got["k0"]
    assert k1["ratio"] == pytest.approx(0.6 / 0.25)
    assert k1["predicted"]["step_s"] == pytest.approx(0.6) and k0["predicted"]["step_s"] == pytest.approx(0.9)
    assert k1["error"] == pytest.approx(0.0, abs=1e-12) and k0["error"] == pytest.approx(0.0, abs=1e-12)
    assert k1["within_tolerance"] and k0["within_tolerance"]
    assert k1["measured"]["trainer_idle"] == pytest.approx(0.3) and k1["predicted"]["trainer_idle_s"] == pytest.approx(0.3)
    assert k1["simulated"]["step_s"] == pytest.approx(0.6, rel=1e-9)  # constant phases: the event simulation agrees
    assert k1["staleness_histogram"] == {"0": 32, "1": 9 * 32} and k0["staleness_histogram"] == {"0": 10 * 32}
    assert k1["push_bytes"] == [4096.0]
    slow = b.check_dedicated({1: colocated}, {1: [_dedicated_run(10, 1, 0.78, 0.25, 0.05)]}, 0.05, 32)["k1"]  # control
    assert slow["error"] == pytest.approx(0.3) and not slow["within_tolerance"]
    assert slow["generate_slowdown"] == pytest.approx(1.3) and slow["error_own_phases"] == pytest.approx(0.0, abs=1e-12)

"""Multi-turn episodes (rl/rollout/episodes.py, `task=arithmetic_retry`): token-in / token-out.

* an episode's record is exactly the engine's tokens with the environment's between them:
  turn 1 is the single-turn sample, turn 2 what the engine generates from the context, the
  observation's ids in between (the stop token not doubled), the action mask False there;
* the environment decides when an episode ends; its reward and bad answers are checked;
* the trainer and the held-out evaluation run it (sync, one_step_off, packed and padded,
  two ranks generating from the sharded policy in lockstep).

The tokenizer is the small BPE of tests/test_tasks.py (chat turns `<|role|>text<|end|>`);
the model a tiny random Llama of its vocabulary: nothing is downloaded.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from testing.inprocess import steps_rank, trainer
from test_arithmetic import tiny_llama  # noqa: F401 - fixture
from test_tasks import tokenizer, tokenizer_dir  # noqa: F401 - fixtures

from model.models import build_model
from rl.rollout.engine import HFRolloutEngine
from rl.rollout.episodes import run_episodes
from rl.seeds import derive
from rl.tasks.calls import Status
from rl.tasks.answers import math_reward
from rl.tasks.arithmetic import ArithmeticRetryTask, RetryEnvironment
from rl.tasks.registry import build_task
from testing.distributed import run_distributed


@pytest.fixture(scope="module")
def end_id(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|end|>")


def _task(tokenizer_dir, **options):
    return build_task("arithmetic_retry", tokenizer_path=str(tokenizer_dir), **options)


def _engine(tiny_llama, task):
    return HFRolloutEngine(build_model(None, pretrained_path=str(tiny_llama)), stop_token_id=task.stop_token_id)


def _batch(task, prompts: int, samples: int):
    drawn = task.prompts(prompts, seed=3)
    ids = [p for p, _ in drawn for _ in range(samples)]
    metas = [m for _, m in drawn for _ in range(samples)]
    return ids, metas, [i for i in range(prompts) for _ in range(samples)]


@pytest.mark.parametrize("stop", ["end", "eos"])
def test_an_episode_is_the_engines_tokens_with_the_environments_between(tiny_llama, tokenizer_dir, end_id, stop):
    """stop=end: the chat template's end-of-turn is the stop token (ChatML-like), so an
    observation after a reply that stopped does not repeat it; stop=eos: it never is."""
    task = _task(tokenizer_dir, **({"stop_token_id": end_id} if stop == "end" else {}))
    engine = _engine(tiny_llama, task)
    ids, metas, index = _batch(task, 3, 3)
    kw = dict(max_new_tokens=6, temperature=1.0, seed=5)
    records = run_episodes(engine, task, ids, metas, prompt_indices=index, **kw)
    singles = engine.generate(ids, prompt_indices=index, **kw)  # the single-turn samples of the same call
    observation = task.observation_ids(task.feedback)
    assert observation[0] == end_id  # the template closes the assistant turn first
    twice = dropped = 0
    for k, (rec, single, meta) in enumerate(zip(records, singles, metas)):
        P, n1 = ids[k].numel(), single.sequences.numel()
        assert torch.equal(rec.sequences[:n1], single.sequences)  # turn 1 = the single-turn sample
        assert torch.equal(rec.rollout_log_probs[:n1 - 1], single.rollout_log_probs)
        assert int(rec.prompt_index) == index[k] and int(rec.response_length) == rec.sequences.numel() - P
        if int(rec.turns) == 1:
            assert torch.equal(rec.action_mask, single.action_mask)
            continue
        twice += 1
        obs = observation[1:] if int(single.sequences[-1]) == task.stop_token_id == observation[0] else observation
        dropped += len(obs) < len(observation)
        n2 = n1 + len(obs)
        assert rec.sequences[n1:n2].tolist() == obs
        (second,) = engine.generate([rec.sequences[:n2]], prompt_indices=[derive(1, index[k], k % 3)], **kw)
        assert torch.equal(rec.sequences, second.sequences)  # turn 2: the engine's tokens, verbatim
        want = torch.zeros(rec.sequences.numel() - 1, dtype=torch.bool)
        want[P - 1:n1 - 1] = True
        want[n2 - 1:] = True
        assert torch.equal(rec.action_mask, want)  # a hole on the observation's slots
        # log-probs: those of the batched call, equal to this one up to left-padding rounding (engine.py)
        torch.testing.assert_close(rec.rollout_log_probs[n2 - 1:], second.rollout_log_probs[n2 - 1:],
                                   rtol=0, atol=1e-5)
        assert not rec.rollout_log_probs[n1 - 1:n2 - 1].any()
        reply = task.decode(rec.sequences[n2:])
        assert float(rec.rewards) == math_reward(reply, meta["answer"])
    assert twice >= 6  # a random model is wrong: most episodes take the second turn
    if stop == "end":
        assert dropped  # some reply stopped on <|end|>: its observation starts after it
    else:
        assert not dropped  # control: the stop token is not the template's end-of-turn


class _Scripted(ArithmeticRetryTask):
    """Every other episode is solved on its first reply (whatever it says)."""

    def environment(self):
        env = _Solved(self) if getattr(self, "_count", 0) % 2 else RetryEnvironment(self)
        self._count = getattr(self, "_count", 0) + 1
        return env


class _Solved(RetryEnvironment):
    def step(self, response_text):
        return None, 1.0, True


def test_the_environment_ends_the_episode_and_its_answers_are_checked(tiny_llama, tokenizer_dir):
    task = _Scripted(str(tokenizer_dir))
    engine = _engine(tiny_llama, task)
    ids, metas, index = _batch(task, 2, 2)
    kw = dict(max_new_tokens=5, temperature=1.0, seed=1)
    records = run_episodes(engine, task, ids, metas, prompt_indices=index, **kw)
    assert [int(r.turns) for r in records][1::2] == [1, 1] and [float(r.rewards) for r in records][1::2] == [1.0, 1.0]
    assert all(r.action_mask[ids[0].numel() - 1:].all() for r in records[1::2])  # one reply: no hole

    class Bad(RetryEnvironment):
        def __init__(self, task, reply):
            super().__init__(task)
            self.reply = reply

        def step(self, response_text):
            return self.reply

    for reply, match in [((None, 0.0, False), r"observation None with done=False for sample 0"),
                         (("again", math.nan, False), r"Bad.step returned nan .* for record 0"),
                         (("again", "1", True), r"Bad.step returned '1' \(str\)")]:
        task.environment = lambda reply=reply: Bad(task, reply)
        with pytest.raises(ValueError, match=match):
            run_episodes(engine, task, ids[:1], metas[:1], prompt_indices=[0], **kw)

    class OtherFirstTurn(RetryEnvironment):
        def reset(self, prompt):
            return self.task.messages(prompt["problem"] + " ")

    task.environment = lambda: OtherFirstTurn(task)
    with pytest.raises(ValueError, match=r"sample 0 \(prompt index 0\): the environment's first turn renders"):
        run_episodes(engine, task, ids[:1], metas[:1], prompt_indices=[0], **kw)


def test_a_multiturn_task_must_fit_every_turn_in_max_tokens(tokenizer_dir):
    from testing.inprocess import compose

    from rl.config import check_task_fits

    task = _task(tokenizer_dir)
    run = ("task=arithmetic_retry", f"task.tokenizer_path={tokenizer_dir}", "task.max_new_tokens=8")
    longest = task.max_prompt_len + 2 * 8 + task.max_observation_len
    check_task_fits(compose(*run, f"batch.max_tokens={longest}"), task)
    with pytest.raises(ValueError, match=rf"plus 2 replies of task.max_new_tokens=8 and 1 observations .* = {longest}"):
        check_task_fits(compose(*run, f"batch.max_tokens={longest - 1}"), task)
    with pytest.raises(ValueError, match=r"algo.overlong_buffer .* multi-turn \(task.options.max_turns=2\)"):
        check_task_fits(compose(*run, "batch.max_tokens=4096", "algo.overlong_buffer=4"), task)


def test_the_vllm_engine_holds_every_turn_of_an_episode(tokenizer_dir):
    """rollout.engine=vllm sizes `max_model_len` as start-up sizes a sample (rl/rollout/build.py
    `engine_max_len`): turn 2's context is the prompt, reply 1 and the answer, so a length of
    prompt + one reply (what it was) refuses turn 2. Computed without vLLM (the engine is not built)."""
    from testing.inprocess import compose

    from rl.rollout.build import engine_max_len

    task = _task(tokenizer_dir, max_turns=3)
    run = ("task=arithmetic_retry", f"task.tokenizer_path={tokenizer_dir}", "task.max_new_tokens=8",
           "task.options.max_turns=3", "rollout.engine=vllm", "batch.max_tokens=4096")
    cfg = compose(*run, check=False)  # validate would look for vLLM
    every_turn = task.max_prompt_len + 3 * 8 + 2 * task.max_observation_len
    assert engine_max_len(cfg, task) == every_turn > task.max_prompt_len + 8
    assert engine_max_len(compose(*run, "eval.max_new_tokens=20", check=False), task) == every_turn + 3 * 12
    assert engine_max_len(compose(*run, "rollout.max_model_len=100", check=False), task) == 100  # the setting wins
    single = build_task("arithmetic", tokenizer_path=str(tokenizer_dir))  # the control: one turn, one reply
    assert engine_max_len(compose(*run, check=False), single) == single.max_prompt_len + 8


def _run(tiny_llama, tokenizer_dir, *extra):
    return ("model=pretrained", f"model.pretrained_path={tiny_llama}", "model.dtype=float32", "task=arithmetic_retry",
            f"task.tokenizer_path={tokenizer_dir}", "task.prompts_per_step=2", "task.samples_per_prompt=4",
            "task.max_new_tokens=6", "trainer.progress=false", "trainer.lr=1e-3", *extra)


def test_the_trainer_trains_on_episodes_and_evaluates_both_turns(tiny_llama, tokenizer_dir):
    tr = trainer(*_run(tiny_llama, tokenizer_dir, "eval.every=2", "eval.num_prompts=8"))
    records = tr.source.records(0, 0, 0)
    assert any(int(r.turns) == 2 and not r.action_mask[int(r.action_mask.nonzero()[0]):].all() for r in records)
    metrics = [tr.step(s) for s in range(2)]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    first = metrics[0]
    assert 1.0 <= first["eval_turns_mean"] <= 2.0 and first["eval_accuracy_turn1"] <= first["eval_accuracy"]
    assert 1.0 <= first["turns_mean"] <= 2.0  # the stand-ins carry each episode's turns
    single = [a.replace("arithmetic_retry", "arithmetic") for a in _run(tiny_llama, tokenizer_dir, "eval.every=0")]
    assert "turns_mean" not in trainer(*single).step(0)  # control: a single-turn task logs none
    # the token-mean normalizer counts sampled tokens only: fewer than the tokens after the prompts
    assert first["action_tokens"] < first["response_length"] * 8


def test_a_step_reports_its_turns_decode_steps_and_microbatches_as_it_goes(tiny_llama, tokenizer_dir):
    """The progress bar's feed (train.py's `trainer.on_progress`): a multi-turn step reports each
    turn, the decode steps and live rows at every host read of the engine, then each training
    microbatch, in that order; nothing is reported when no one listens."""
    tr = trainer(*_run(tiny_llama, tokenizer_dir, "eval.every=0"))
    seen = []
    tr.on_progress = lambda **now: seen.append(now)
    tr.step(0)
    kinds = [next(iter(f)) for f in seen]
    assert kinds[0] == "turn" and seen[0] == {"turn": "1/2"} and {"turn": "2/2"} in seen
    decode = [f for f in seen if "decode" in f]
    assert decode and all(f["decode"].split("/")[1] == "6" and f["rows"].endswith("/8") for f in decode[:1])
    train = [f["train"] for f in seen if "train" in f]
    assert train and train[0] == f"0/{train[0].split('/')[1]}" and kinds.index("train") > max(
        i for i, k in enumerate(kinds) if k in ("turn", "decode"))
    tr.on_progress = None  # the control: a trainer without a listener runs the same step silently
    assert math.isfinite(tr.step(1)["loss"])


def test_packed_and_padded_one_step_off_and_async_train_on_episodes(tiny_llama, tokenizer_dir):
    run = _run(tiny_llama, tokenizer_dir, "eval.every=0")
    packed = [trainer(*run).step(s) for s in range(2)]
    padded = [trainer(*run, "batch=padded").step(s) for s in range(2)]
    for a, b in zip(packed, padded):  # the same samples and the same numbers in either layout
        assert a["reward_mean"] == b["reward_mean"] and a["action_tokens"] == b["action_tokens"]
        for key in ("loss", "entropy", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), key
    off = trainer(*run, "rollout.mode=one_step_off", "algo.tis_cap=2.0")
    got = [off.step(s) for s in range(3)]
    assert all(math.isfinite(m["loss"]) for m in got) and got[-1]["rollout_staleness_max"] == 1.0
    assert got[0]["reward_mean"] == packed[0]["reward_mean"]  # step 0's rollout is generated now, as in sync

    # async, two steps ahead: episodes from the thread; the held-out evaluation from the policy itself
    asy = trainer(*_run(tiny_llama, tokenizer_dir, "eval.every=1", "eval.num_prompts=6"), "rollout.mode=async",
                  "algo.tis_cap=2.0", "rollout.max_staleness=2")
    before = trainer(*_run(tiny_llama, tokenizer_dir, "eval.every=1", "eval.num_prompts=6")).evaluate()
    got = [asy.step(s) for s in range(3)]
    assert [m["rollout_staleness_max"] for m in got] == [0.0, 1.0, 2.0] and all(math.isfinite(m["loss"]) for m in got)
    assert got[0]["reward_mean"] == packed[0]["reward_mean"]
    assert got[0]["eval_accuracy"] == before["eval_accuracy"]  # version 0 on the policy = version 0 on the copy
    assert got[0]["eval_accuracy_turn1"] == before["eval_accuracy_turn1"]


@pytest.mark.slow
def test_two_ranks_play_episodes_in_lockstep_from_the_sharded_policy(tiny_llama, tokenizer_dir):
    """`rollout.replica=sharded`: every generate is a collective over both ranks, and every
    rank calls it once per turn whatever its own episodes do; the run equals the replica's."""
    run = _run(tiny_llama, tokenizer_dir, "eval.every=1", "eval.num_prompts=6", "parallel.dp=2")
    sharded = run_distributed(steps_rank, 2, (*run, "rollout.replica=sharded"), 2, timeout=300)
    replica = run_distributed(steps_rank, 2, (*run, "rollout.replica=keep"), 2, timeout=300)
    for a, b in zip(sharded[0][0]["metrics"], replica[0][0]["metrics"]):
        assert a["reward_mean"] == b["reward_mean"] and a["eval_turns_mean"] == b["eval_turns_mean"]
        assert a["turns_mean"] == b["turns_mean"]  # gathered over both ranks
        assert a["env_steps"] == a["turns_mean"] * 8  # every reply answered, counted on both ranks and summed
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"]))


# ------------------------------------------------------- the user's own environment
class SayNumber:
    """A user's environment (`task=environment task.options.environment=tests.test_multiturn:SayNumber`):
    the reply must contain the line's `number`; a wrong one gets `hint` (an environment
    option) and another turn."""

    def __init__(self, hint: str = "No. Say the number.") -> None:
        self.hint, self.number = hint, None

    def reset(self, prompt: dict) -> list[dict]:
        self.number = str(prompt["number"])
        return [{"role": "user", "content": prompt["prompt"]}]

    def step(self, response_text: str):
        if self.number in response_text:
            return None, 1.0, True
        return self.hint, 0.0, False


def _env_run(tiny_llama, tokenizer_dir, tmp_path, *extra):
    import json

    lines = [{"prompt": f"What is {a} plus {b}?", "number": a + b} for a in range(6) for b in range(3)]
    for name, rows in (("train.jsonl", lines[:12]), ("heldout.jsonl", lines[12:])):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ("model=pretrained", f"model.pretrained_path={tiny_llama}", "model.dtype=float32", "task=environment",
            f"task.prompts_path={tmp_path / 'train.jsonl'}", f"task.tokenizer_path={tokenizer_dir}",
            "task.options.environment=tests.test_multiturn:SayNumber",
            f"task.options.heldout_path={tmp_path / 'heldout.jsonl'}", "task.options.max_observation_len=24",
            "task.prompts_per_step=2", "task.samples_per_prompt=4", "task.max_new_tokens=6",
            "trainer.progress=false", "trainer.lr=1e-3", *extra)


def test_a_users_environment_trains_and_evaluates_from_the_config(tiny_llama, tokenizer_dir, tmp_path):
    """`task=environment`: prompts from the user's JSONL, episodes played by the user's class
    (built with `environment_options`), its rewards; held-out lines from `heldout_path`."""
    run = _env_run(tiny_llama, tokenizer_dir, tmp_path, "eval.every=1", "eval.num_prompts=6",
                   "+task.options.environment_options.hint='Wrong, say it.'")
    tr = trainer(*run)
    assert tr.task.environment().hint == "Wrong, say it."  # the option reaches the class
    records = tr.source.records(0, 0, 0)
    hint = tr.task.observation_ids("Wrong, say it.")
    for rec in records:
        replies = _replies(rec)
        assert len(replies) == int(rec.turns)
        if len(replies) == 2:  # the hint's tokens sit between the replies, outside the action mask
            gap = replies[1][0] - replies[0][-1] - 1
            assert gap in (len(hint), len(hint) - 1)  # less the end-of-turn the first reply stopped on
        prompt = tr.task.decode(rec.sequences[:rec.sequences.numel() - int(rec.response_length)])
        number = str(sum(int(v) for v in re.fullmatch(r"What is (\d+) plus (\d+)\?", prompt.strip()).groups()))
        said = [number in tr.task.decode(rec.sequences[torch.tensor(r)]) for r in replies]
        assert float(rec.rewards) == float(any(said)) and not any(said[:-1])  # the class's reward; a hit ends it
    assert any(int(r.turns) == 2 for r in records)  # a random model mostly misses: second turns happen
    metrics = [tr.step(s) for s in range(2)]
    assert all(math.isfinite(m["loss"]) for m in metrics) and 1.0 <= metrics[0]["turns_mean"] <= 2.0
    assert 1.0 <= metrics[0]["eval_turns_mean"] <= 2.0 and "eval_accuracy" in metrics[0]


def _replies(rec) -> list[list[int]]:
    """The positions of each reply's tokens: the runs of the action mask (mask slot j scores token j + 1)."""
    runs: list[list[int]] = []
    for j in rec.action_mask.nonzero().flatten().tolist():
        if runs and runs[-1][-1] == j:
            runs[-1].append(j + 1)
        else:
            runs.append([j + 1])
    return runs


def test_a_users_environment_is_checked_by_name(tiny_llama, tokenizer_dir, tmp_path):
    run = _env_run(tiny_llama, tokenizer_dir, tmp_path, "eval.every=0")
    without = [a for a in run if not a.startswith("task.options.environment=")]
    with pytest.raises(ValueError, match=r"task.options.environment: required but not set"):
        trainer(*without)
    with pytest.raises(ValueError, match=r"task.options.environment 'SayNumber' is not of the form 'module:"):
        trainer(*without, "task.options.environment=SayNumber")
    with pytest.raises(ValueError, match=r"task.options.environment 'tests.test_multiturn:Nope': module"):  # at validate
        trainer(*without, "task.options.environment=tests.test_multiturn:Nope")
    no_heldout = [a for a in run if not a.startswith("task.options.heldout_path=")]
    with pytest.raises(ValueError, match=r"eval.every > 0 with task=environment needs task.options.heldout_path"):
        trainer(*no_heldout, "eval.every=1")
    # an answer longer than max_observation_len is cut, not an error (rl/rollout/episodes.py): its text's tokens
    # cut at their end, the template's frame kept (<|end|><|user|> ... <|end|><|assistant|>), status `truncated`
    short = trainer(*run, "task.options.max_observation_len=6")
    tok = short.task.tokenizer
    end, assistant = tok.convert_tokens_to_ids("<|end|>"), tok.convert_tokens_to_ids("<|assistant|>")
    full = short.task.observation_ids("No. Say the number.")
    assert len(full) > 6
    records = short.source.records(0, 0, 0)
    cut = 0
    for rec in records:
        replies = _replies(rec)
        if len(replies) == 2:
            gap = rec.sequences[replies[0][-1] + 1:replies[1][0]].tolist()
            assert len(gap) <= 6 and gap[-2:] == [end, assistant]  # the next turn starts where the template puts it
            head = full[1:] if gap[0] != full[0] else full  # less the <|end|> the first reply stopped on
            assert gap[:-2] == head[:len(gap) - 2]  # the start of the answer kept, its end cut
            assert int(rec.status) == Status.TRUNCATED
            cut += 1
        else:
            assert int(rec.status) == Status.DONE
    assert cut
    metrics = short.step(0)
    assert metrics["episodes_truncated"] >= 1 and metrics["episodes_error"] == 0.0
    # the control: a long enough limit cuts nothing
    assert all(int(r.status) != Status.TRUNCATED for r in trainer(*run).source.records(0, 0, 0))

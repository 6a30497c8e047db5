"""Tool calls (rl/tasks/tools.py) in multi-turn episodes (rl/rollout/episodes.py), `task=python_tool`
(rl/tasks/tool_task.py): the chat template declares the tools, a reply's call is parsed, the tool
runs (the `python` tool in the sandbox), its message enters the episode as tokens the model did not
sample (action mask False), and what fails in a tool ends or annotates that episode only.

The tokenizer is the small BPE of tests/test_tasks.py with a chat template that renders tools and
`tool` messages (as Qwen's does, in its own markup); the "model" is a scripted engine (the replies
are the test), or the tiny random Llama for the trainer run.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from testing.inprocess import trainer
from test_arithmetic import tiny_llama  # noqa: F401 - fixture
from test_tasks import tokenizer, tokenizer_dir  # noqa: F401 - fixtures

from rl.rollout.engine import make_record
from rl.rollout.episodes import episode_metrics, run_episodes
from rl.tasks.calls import assign_rewards
from rl.tasks.calls import Status, UserCalls
from rl.tasks.registry import build_task
from rl.tasks.sandbox import Limits
from rl.tasks.tools import Tool, Toolbox, ToolCall, ToolOutput, python_tool

TOOL_CHAT = ("{%- if tools %}<|system|>Tools: {% for t in tools %}{{ t | tojson }}{% endfor %}<|end|>{% endif %}"
             "{%- for m in messages %}{% if m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}"
             "</tool_response><|end|>{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
             "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
FAST = {"wall_s": 3.0, "cpu_s": 1, "memory_mb": 256, "max_processes": 4, "max_output_bytes": 256}


def call(code: str) -> str:
    return '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>' % _json(code)


def _json(text: str) -> str:
    import json

    return json.dumps(text)


@pytest.fixture(scope="module")
def end_id(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|end|>")


def _task(tokenizer_dir, end_id, **options):
    return build_task("python_tool", tokenizer_path=str(tokenizer_dir), chat_template=TOOL_CHAT, stop_token_id=end_id,
                      sandbox=FAST, **options)


class Scripted:
    """An 'engine' whose replies are `script(context_text, turn) -> reply text` (turn: tool messages
    seen so far); each reply ends with the stop token. No model: the episode's bookkeeping is the test."""

    def __init__(self, tokenizer, stop: int, script) -> None:
        self.tokenizer, self.stop_token_id, self.script = tokenizer, stop, script

    def generate(self, prompts, *, prompt_indices, max_new_tokens, temperature, seed):
        out = []
        for p, i in zip(prompts, prompt_indices):
            text = self.tokenizer.decode(p.tolist())
            reply = self.tokenizer.encode(self.script(text, text.count("<tool_response>")), add_special_tokens=False)
            ids = torch.tensor(reply + [self.stop_token_id])
            out.append(make_record(p, ids, torch.full((ids.numel(),), -0.5), int(i)))
        return out


def _problem(text: str) -> str:
    return re.search(r"What is (.+?)\?", text).group(1)


def _uses_python(text: str, turn: int) -> str:
    """Computes the problem with the python tool, then answers with what it printed."""
    if turn == 0:
        return "Let me compute. " + call(f"print({_problem(text)})")
    return "The result is " + re.findall(r"<tool_response>(.*?)</tool_response>", text)[-1]


def _play(task, engine, prompts):
    ids, metas = [p for p, _ in prompts], [m for _, m in prompts]
    return run_episodes(engine, task, ids, metas, prompt_indices=list(range(len(ids))), max_new_tokens=64,
                        temperature=1.0, seed=0)


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize("fmt, text, expected", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>',
     [("python", {"code": "print(1)"})]),
    ("hermes", '<tool_call>{"name": "python", "arguments": {"code": "a"}}</tool_call> then '
               '<tool_call>{"name": "python", "arguments": {"code": "b"}}</tool_call>',
     [("python", {"code": "a"}), ("python", {"code": "b"})]),
    ("hermes", '<tool_call>[{"name": "python", "arguments": {"code": "a"}}]</tool_call>',  # SmolLM2 writes a list
     [("python", {"code": "a"})]),
    ("mistral", '[TOOL_CALLS][{"name": "python", "arguments": {"code": "a"}}]', [("python", {"code": "a"})]),
    ("llama3", '<|python_tag|>{"name": "python", "parameters": {"code": "a"}}', [("python", {"code": "a"})]),
    ("markdown", "Let me compute:\n```python\nprint(38 * 17)\n```\nand\n```py\nx = 1\nprint(x)\n```",
     [("python", {"code": "print(38 * 17)\n"}), ("python", {"code": "x = 1\nprint(x)\n"})]),
    ("markdown", "The answer is `42`, see ```text\n42\n```.", []),
    ("hermes", "The answer is 42.", []),  # the controls: no call in plain text, whatever the format
    ("mistral", "The answer is 42.", []),
    ("llama3", "The answer is {42}.", []),
])
def test_each_format_parses_its_calls_and_plain_text_has_none(tokenizer, fmt, text, expected):
    box = Toolbox([python_tool()], tokenizer, tool_format=fmt, chat_template=TOOL_CHAT)
    calls = box.parse_text(text)
    assert [(c.name, c.arguments) for c in calls] == expected and all(c.problem is None for c in calls)


def test_a_call_the_model_got_wrong_is_answered_not_raised(tokenizer):
    box = Toolbox([python_tool()], tokenizer, chat_template=TOOL_CHAT)
    for text, says in (("<tool_call>{not json</tool_call>", "JSON object"),
                       ('<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>', "no tool named 'bash'"),
                       ('<tool_call>{"name": "python", "arguments": {"source": "1"}}</tool_call>', "missing ['code']")):
        (bad,) = box.parse_text(text)
        out = box.run(bad)
        assert bad.problem is not None and out.status == "bad_call" and says in out.text, (text, out)
    good = box.run(ToolCall("python", {"code": "print(2 + 3)"}))  # the control: a right call runs
    assert good == ToolOutput("5", "ok")


def test_the_prompt_declares_the_tools_and_a_result_renders_as_the_tool_message(tokenizer_dir, tokenizer, end_id):
    task = _task(tokenizer_dir, end_id)
    (ids, meta), = task.prompts(1, seed=0)
    text = tokenizer.decode(ids.tolist())
    assert text.startswith('<|system|>Tools: {"type": "function", "function": {"name": "python"')
    assert text.endswith(f"<|user|>What is {meta['problem']}? You may run Python with the python tool. End your "
                         f"reply with the result.<|end|><|assistant|>")
    plain = build_task("arithmetic", tokenizer_path=str(tokenizer_dir), chat_template=TOOL_CHAT)
    assert "Tools:" not in tokenizer.decode(plain.prompts(1, seed=0)[0][0].tolist())  # control: no tools, none declared
    assert tokenizer.decode(task.toolbox.message_ids([ToolOutput("73")])) == \
        "<|end|><|user|><tool_response>73</tool_response><|end|><|assistant|>"


def test_a_template_that_ignores_tools_gets_them_described_in_the_system_turn(tokenizer_dir, tokenizer, end_id):
    from test_tasks import CHAT  # `<|role|>text<|end|>`, no tools (as SmolLM2-135M-Instruct's)

    task = build_task("python_tool", tokenizer_path=str(tokenizer_dir), chat_template=CHAT, system_prompt="Be brief.")
    assert not task.toolbox.declared_by_template
    text = tokenizer.decode(task.prompts(1, seed=0)[0][0].tolist())
    assert text.startswith("<|system|>Be brief.\n\nYou may call one or more functions")
    assert '"name": "python"' in text and "<tool_call>" in text
    declared = _task(tokenizer_dir, end_id)  # the control: a template that declares tools is left to do it
    assert declared.toolbox.declared_by_template
    assert "You may call" not in tokenizer.decode(declared.prompts(1, seed=0)[0][0].tolist())


# ------------------------------------------------------------------ episodes
def test_a_tool_call_runs_and_its_output_enters_the_episode_as_observation_tokens(tokenizer_dir, tokenizer, end_id):
    task = _task(tokenizer_dir, end_id)
    engine = Scripted(tokenizer, end_id, _uses_python)
    prompts = task.prompts(3, seed=1)
    records = _play(task, engine, prompts)
    for rec, (prompt, meta) in zip(records, prompts):
        P = prompt.numel()
        reply1 = tokenizer.encode(_uses_python(tokenizer.decode(prompt.tolist()), 0), add_special_tokens=False)
        tool = task.toolbox.message_ids([ToolOutput(str(meta["answer"]))])[1:]  # the reply's <|end|> closed the turn
        reply2 = tokenizer.encode(f"The result is {meta['answer']}", add_special_tokens=False)
        assert rec.sequences.tolist() == prompt.tolist() + reply1 + [end_id] + tool + reply2 + [end_id]
        n1, n2 = P + len(reply1) + 1, P + len(reply1) + 1 + len(tool)
        mask = rec.action_mask  # slot k scores token k + 1
        assert mask[P - 1:n1 - 1].all() and mask[n2 - 1:].all()  # the replies: sampled
        assert not mask[n1 - 1:n2 - 1].any()  # the tool message: a hole, like an environment's answer
        assert (rec.rollout_log_probs[n1 - 1:n2 - 1] == 0).all()
        assert float(rec.rewards) == 1.0 and int(rec.turns) == 2 and int(rec.status) == Status.DONE
    # the control: without tools the same first reply is plain text, scored by the arithmetic reward (its
    # last number is the problem's last operand, not the result)
    plain = build_task("arithmetic", tokenizer_path=str(tokenizer_dir), chat_template=TOOL_CHAT, stop_token_id=end_id)
    singles = Scripted(tokenizer, end_id, _uses_python).generate([p for p, _ in prompts],
                                                                prompt_indices=[0, 1, 2], max_new_tokens=64,
                                                                temperature=1.0, seed=0)
    assign_rewards(plain, singles, [m for _, m in prompts])
    assert [float(r.rewards) for r in singles] == [0.0, 0.0, 0.0]


def test_a_reply_without_a_call_is_the_answer(tokenizer_dir, tokenizer, end_id):
    task = _task(tokenizer_dir, end_id)
    engine = Scripted(tokenizer, end_id, lambda text, turn: str(eval(_problem(text))))
    records = _play(task, engine, task.prompts(2, seed=2))
    assert [int(r.turns) for r in records] == [1, 1] and [float(r.rewards) for r in records] == [1.0, 1.0]
    assert all(r.action_mask[-int(r.response_length):].all() for r in records)


def _boom(code: str) -> str:
    raise RuntimeError("the tool's server is down")


def _hang(code: str) -> str:
    import time

    time.sleep(30)
    return "late"


def test_what_fails_in_a_tool_ends_or_annotates_its_episode_and_the_others_go_on(tokenizer_dir, tokenizer, end_id):
    """Sample 0: code that loops forever (the sandbox stops it: the model reads the status and answers);
    1: a call that is not JSON (answered `bad_call`); 2: a tool that raises and 3: one that hangs past
    task.timeout_s (those episodes end: error, timeout); 4: a right call (the control)."""
    task = _task(tokenizer_dir, end_id)
    params = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    task.toolbox = Toolbox([python_tool(Limits(**FAST)), Tool("boom", "raises", params, _boom),
                            Tool("hang", "hangs", params, _hang)], tokenizer, chat_template=TOOL_CHAT)
    prompts = task.prompts(5, seed=3)
    first = {0: call("while True:\n    pass"), 1: "<tool_call>{oops</tool_call>",
             2: call("1").replace('"python"', '"boom"'), 3: call("1").replace('"python"', '"hang"')}
    order = {_problem(tokenizer.decode(p.tolist())): k for k, (p, _) in enumerate(prompts)}

    def script(text, turn):
        k = order[_problem(text)]
        if turn == 0 and k in first:
            return first[k]
        return _uses_python(text, turn)

    task.calls = UserCalls("skip", timeout_s=4.0)
    records = _play(task, Scripted(tokenizer, end_id, script), prompts)
    texts = [tokenizer.decode(r.sequences.tolist()) for r in records]
    stopped = ("status: cpu_limit" in texts[0]) or ("status: timeout" in texts[0])  # which comes first: the load
    assert stopped and int(records[0].turns) == 2
    assert "status: bad_call" in texts[1] and int(records[1].turns) == 2
    assert [int(r.status) for r in records] == [Status.DONE, Status.DONE, Status.ERROR, Status.TIMEOUT, Status.DONE]
    assert [float(r.rewards) for r in records][2:] == [0.0, 0.0, 1.0]
    assert episode_metrics(records)["episodes_error"] == 1.0 and episode_metrics(records)["episodes_timeout"] == 1.0
    with pytest.raises(RuntimeError, match="server is down"):  # the control: on_error=raise stops at the failure
        task.calls = UserCalls("raise", None)
        _play(task, Scripted(tokenizer, end_id, script), prompts[2:3])


def test_a_long_tool_output_is_cut_to_max_observation_len(tokenizer_dir, tokenizer, end_id):
    frame = len(_task(tokenizer_dir, end_id).toolbox.message_ids([ToolOutput("")]))
    task = _task(tokenizer_dir, end_id, max_observation_len=frame + 10)
    engine = Scripted(tokenizer, end_id, lambda text, turn: call("print('7' * 200)") if turn == 0 else "7")
    (rec,) = _play(task, engine, task.prompts(1, seed=4))
    assert int(rec.status) == Status.TRUNCATED and int(rec.turns) == 2
    holes = int((~rec.action_mask[-int(rec.response_length):]).sum())
    assert holes == frame + 10  # cut to the limit (after the <|end|> the reply already closed, dropped)
    text = tokenizer.decode(rec.sequences.tolist())
    assert re.search(r"<tool_response>7+</tool_response><\|end\|><\|assistant\|>7<\|end\|>$", text)  # frame kept
    tight = _task(tokenizer_dir, end_id, max_observation_len=frame - 2)  # the control: not even the frame fits
    (ended,) = _play(tight, engine, tight.prompts(1, seed=4))
    assert int(ended.status) == Status.TRUNCATED and int(ended.turns) == 1


@pytest.mark.slow
def test_a_turns_tool_calls_overlap(tokenizer_dir, tokenizer, end_id, monkeypatch):
    """Four samples each run code that sleeps 1.5 s: on the pool's threads the turn takes about one
    sleep, not four (the control: a pool of one thread takes them one after the other)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from rl.rollout import episode

    task = _task(tokenizer_dir, end_id)
    engine = Scripted(tokenizer, end_id, lambda text, turn: call("import time\ntime.sleep(1.5)\nprint('slept')")
                      if turn == 0 else "done")
    prompts = task.prompts(4, seed=5)
    seconds = []
    for pool in (None, ThreadPoolExecutor(1)):
        if pool is not None:
            monkeypatch.setattr(episode, "_tool_pool", pool)
        start = time.monotonic()
        records = _play(task, engine, prompts)
        seconds.append(time.monotonic() - start)
        assert all("<tool_response>slept</tool_response>" in tokenizer.decode(r.sequences.tolist()) for r in records)
    assert seconds[0] < 4.5 <= 6.0 <= seconds[1], seconds


# ------------------------------------------------------------------ the trainer
@pytest.mark.slow
def test_the_trainer_runs_python_tool_episodes(tiny_llama, tokenizer_dir):
    tr = trainer("model=pretrained", f"model.pretrained_path={tiny_llama}", "model.dtype=float32", "task=python_tool",
                 f"task.tokenizer_path={tokenizer_dir}", f"+task.options.chat_template={TOOL_CHAT!r}",
                 "task.prompts_per_step=2", "task.samples_per_prompt=2", "task.max_new_tokens=8",
                 "task.options.max_observation_len=32", "trainer.progress=false", "eval.every=0")
    metrics = [tr.step(s) for s in range(2)]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert metrics[0]["episodes_error"] == 0.0 and metrics[0]["episodes_timeout"] == 0.0

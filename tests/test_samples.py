"""What the model wrote (rl/rollout/samples.py): each step's first `trainer.log_samples` episodes in
<run>/samples.jsonl (and a W&B table / MLflow artifact), and the step's tool and environment counts
in metrics.jsonl.

Episodes are played by the scripted engine of tests/test_tools.py (the replies are the test); the
trainer runs use the tiny random Llama with the small BPE of tests/test_tasks.py.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from testing.inprocess import trainer
from test_arithmetic import tiny_llama  # noqa: F401 - fixture
from test_tasks import tokenizer, tokenizer_dir  # noqa: F401 - fixtures
from test_tools import FAST, TOOL_CHAT, Scripted, _play, _problem, _task, _uses_python, call, end_id  # noqa: F401

from rl.rollout.samples import sample_rows, turn_counts
from rl.tasks.calls import assign_rewards
from rl.tasks.registry import build_task
from rl.tasks.tools import Tool, Toolbox, python_tool
from rl.tasks.sandbox import Limits
from rl.tasks.calls import UserCalls
from rl.trainer.metrics import MetricsWriter

ROOT = Path(__file__).resolve().parents[1]


def _boom(code: str) -> str:
    raise RuntimeError("the tool's server is down")


def test_tool_episodes_give_their_calls_results_and_statuses_and_the_counts_add_up(tokenizer_dir, tokenizer, end_id):
    """Sample 0 computes with python (ok); 1 writes a call that is not JSON (bad_call); 2 runs code that
    raises (the sandbox's `error`, the episode goes on); 3 calls a tool that raises (its episode ends:
    tool_failed); 4 prints more than max_observation_len allows (its tool message is cut)."""
    task = _task(tokenizer_dir, end_id, max_observation_len=200)  # the bad call's and the error's messages fit
    params = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    task.toolbox = Toolbox([python_tool(Limits(**FAST)), Tool("boom", "raises", params, _boom)], tokenizer,
                           chat_template=TOOL_CHAT)
    task.calls = UserCalls("skip", timeout_s=10.0)
    prompts = task.prompts(5, seed=3)
    order = {_problem(tokenizer.decode(p.tolist())): k for k, (p, _) in enumerate(prompts)}
    first = {1: "<tool_call>{oops</tool_call>", 2: call("1 / 0"), 3: call("1").replace('"python"', '"boom"'),
             4: call("print('7' * 200)")}

    def script(text, turn):
        k = order[_problem(text)]
        if k in first:
            return first[k] if turn == 0 else "The answer is 0"
        return _uses_python(text, turn)

    records = _play(task, Scripted(tokenizer, end_id, script), prompts)
    counts = turn_counts(records, task)
    assert counts["tool_calls"] == 5 and counts["tool_bad_calls"] == 1 and counts["tool_failed"] == 1
    assert counts["tool_status_ok"] == 2 and counts["tool_status_error"] == 1 and counts["tool_messages_cut"] == 1
    assert counts["tool_calls"] == counts["tool_bad_calls"] + counts["tool_failed"] + sum(
        v for k, v in counts.items() if k.startswith("tool_status_"))
    assert counts["env_steps"] == 4 and counts["env_answers_cut"] == 0  # sample 3 never reached the environment

    rows = sample_rows(records, task, step=7, places=[10, 11, 12, 13, 14])
    assert [r["sample"] for r in rows] == [10, 11, 12, 13, 14] and {r["step"] for r in rows} == {7}
    assert [r["status"] for r in rows] == ["done", "done", "done", "error", "truncated"]
    assert [r["reward"] for r in rows] == [float(r.rewards) for r in records]
    ok = rows[0]
    assert "What is" in ok["prompt"] and ok["turns_taken"] == 2 == len(ok["turns"])
    (tool,) = ok["turns"][0]["tool_calls"]
    answer = str(prompts[0][1]["answer"])
    assert tool == {"name": "python", "arguments": {"code": f"print({_problem(ok['prompt'])})"}, "status": "ok",
                    "result": answer}
    assert f"<tool_response>{answer}</tool_response>" in ok["turns"][0]["message"]  # what the model read next
    assert ok["turns"][0]["reply"].startswith("Let me compute.") and ok["turns"][0]["reply"].endswith("<|end|>")
    assert ok["turns"][1] == {"reply": f"The result is {answer}<|end|>", "environment": {"reward": 1.0, "answer": None}}
    assert rows[1]["turns"][0]["tool_calls"][0]["status"] == "bad_call"
    assert rows[2]["turns"][0]["tool_calls"][0]["status"] == "error"
    assert "ZeroDivisionError" in rows[2]["turns"][0]["tool_calls"][0]["result"]
    failed = rows[3]["turns"][0]
    assert failed["failed"] == "error" and failed["tool_calls"] == [
        {"name": "boom", "arguments": {"code": "1"}, "status": None, "result": None}] and "message" not in failed
    cut = rows[4]["turns"][0]
    assert cut["cut"] is True and cut["tool_calls"][0]["result"] == "7" * 200  # the whole output; the message cut
    assert cut["message"].count("7") < 200
    # the reply and message spans tile the response: decoded back to back they are the whole episode
    for row, rec in zip(rows, records):
        whole = tokenizer.decode(rec.sequences[-int(rec.response_length):].tolist())
        assert "".join(t["reply"] + t.get("message", "") for t in row["turns"]) == whole
        assert row["response_length"] == int(rec.response_length)
    # the control: a single-turn task's record has no trace; its row is one turn, its whole reply
    plain = build_task("arithmetic", tokenizer_path=str(tokenizer_dir), chat_template=TOOL_CHAT, stop_token_id=end_id)
    (prompt, meta), = plain.prompts(1, seed=0)
    singles = Scripted(tokenizer, end_id, _uses_python).generate([prompt], prompt_indices=[0], max_new_tokens=64,
                                                                temperature=1.0, seed=0)
    assign_rewards(plain, singles, [meta])
    (row,) = sample_rows(singles, plain, step=0)
    assert row["turns"] == [{"reply": tokenizer.decode(singles[0].sequences[prompt.numel():].tolist())}]
    assert row["status"] == "done" and row["sample"] == 0 and row["turns_taken"] == 1 and row["reward"] == 0.0
    assert turn_counts(singles, plain) == {}


def test_strip_thinking_keeps_the_turn_spans_on_the_shortened_replies(tokenizer_dir, tokenizer, end_id):
    """task.strip_thinking shortens past replies in the record: the spans follow (the control: the
    last reply, trained, keeps its reasoning)."""
    task = _task(tokenizer_dir, end_id)
    task.strip_thinking = True
    task.without_thinking = lambda ids: ids[len(tokenizer.encode("Let me compute. ", add_special_tokens=False)):]
    records = _play(task, Scripted(tokenizer, end_id, _uses_python), task.prompts(1, seed=1))
    (row,) = sample_rows(records, task, step=0)
    assert not row["turns"][0]["reply"].startswith("Let me") and row["turns"][0]["reply"].startswith("<tool_call>")
    assert row["turns"][1]["reply"].startswith("The result is")
    whole = tokenizer.decode(records[0].sequences[-int(records[0].response_length):].tolist())
    assert "".join(t["reply"] + t.get("message", "") for t in row["turns"]) == whole


def test_samples_jsonl_continues_on_resume_and_no_samples_write_no_file(tmp_path):
    rows = lambda step: [{"step": step, "sample": k, "reward": float(step)} for k in range(2)]  # noqa: E731
    writer = MetricsWriter(tmp_path)
    for step in range(3):
        writer.log({"step": step, "reward_mean": 0.0}, rows(step))
    writer.close(plot=False)
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sample"]) for r in lines] == [(s, k) for s in range(3) for k in range(2)]
    resumed = MetricsWriter(tmp_path, resume_step=2)  # redoes step 2
    resumed.log({"step": 2, "reward_mean": 0.0}, rows(2))
    resumed.close(plot=False)
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 0, 1, 1, 2, 2]  # step 2 once
    off = tmp_path / "off"  # the control: trainer.log_samples=0 gives no rows
    writer = MetricsWriter(off)
    writer.log({"step": 0, "reward_mean": 0.0}, [])
    writer.close(plot=False)
    assert (off / "metrics.jsonl").exists() and not (off / "samples.jsonl").exists()


def test_samples_reach_a_wandb_table_and_an_mlflow_artifact(tmp_path, monkeypatch):
    """W&B offline (its table file in the offline run's media) and MLflow's file store (an artifact a step)."""
    import mlflow

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    rows = [{"step": 0, "sample": 0, "prompt": "What is 1+2?", "turns": [{"reply": "3", "tool_calls": []}],
             "reward": 1.0, "status": "done"}]
    writer = MetricsWriter(tmp_path, loggers=["wandb", "mlflow"], project="p")
    writer.log({"step": 0, "reward_mean": 1.0}, rows)
    writer.log({"step": 1, "reward_mean": 0.5}, [])  # no samples this step: no table, no artifact
    writer.close(plot=False)
    tables = glob.glob(f"{tmp_path}/wandb/offline-run-*/files/media/table/samples_*.table.json")
    assert len(tables) == 1, tables
    table = json.loads(Path(tables[0]).read_text())
    assert table["columns"] == ["step", "sample", "prompt", "turns", "reward", "status"]
    assert table["data"] == [[0, 0, "What is 1+2?", json.dumps(rows[0]["turns"]), 1.0, "done"]]
    run_id = json.loads((tmp_path / "loggers.json").read_text())["mlflow"]
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == ["samples/step_000000.jsonl"]
    local = client.download_artifacts(run_id, "samples/step_000000.jsonl", str(tmp_path / "down"))
    assert [json.loads(x) for x in Path(local).read_text().splitlines()] == rows


# ------------------------------------------------------------------ the trainer
@pytest.mark.slow
def test_a_python_tool_run_logs_its_calls_and_counts_them(tiny_llama, tokenizer_dir, tokenizer, tmp_path):
    """The trainer with the python tool, its replies scripted (a call, then the answer the tool printed):
    the step's first samples show the call, its result and status; the metrics count every call."""
    tr = trainer("model=pretrained", f"model.pretrained_path={tiny_llama}", "model.dtype=float32", "task=python_tool",
                 f"task.tokenizer_path={tokenizer_dir}", f"+task.options.chat_template={TOOL_CHAT!r}",
                 "task.prompts_per_step=2", "task.samples_per_prompt=2", "task.max_new_tokens=40",
                 "task.options.max_observation_len=64", "trainer.progress=false", "eval.every=0",
                 "trainer.log_samples=3")
    tr.source.engine = Scripted(tokenizer, tr.task.stop_token_id, _uses_python)
    writer = MetricsWriter(tmp_path)
    for step in range(2):
        metrics = tr.step(step)
        assert metrics["tool_calls"] == 4 == metrics["tool_status_ok"] and metrics["env_steps"] == 4
        assert metrics["tool_bad_calls"] == metrics["tool_failed"] == metrics["tool_messages_cut"] == 0
        assert metrics["reward_mean"] == 1.0 and metrics["episodes_done"] == 4
        writer.log(metrics, tr.samples)
    writer.close(plot=False)
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sample"]) for r in rows] == [(s, k) for s in range(2) for k in range(3)]
    for row in rows:
        (tool,) = row["turns"][0]["tool_calls"]
        assert tool["name"] == "python" and tool["status"] == "ok"
        assert tool["result"] == str(eval(_problem(row["prompt"])))
        assert row["turns"][1]["reply"] == f"The result is {tool['result']}<eos>"  # <eos>: the task's stop token
        assert row["reward"] == 1.0


@pytest.mark.slow
def test_train_py_writes_the_replies_and_rewards_of_each_step(tiny_llama, tokenizer_dir, tmp_path):
    """`python train.py` on arithmetic (the tiny random Llama): samples.jsonl holds each step's first
    trainer.log_samples episodes, decoded, with their rewards and statuses."""
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", f"hydra.run.dir={out}", "model=pretrained",
           f"model.pretrained_path={tiny_llama}", "model.dtype=float32", "task=arithmetic",
           f"task.tokenizer_path={tokenizer_dir}", "task.prompts_per_step=2", "task.samples_per_prompt=2",
           "task.max_new_tokens=6", "trainer.max_steps=2", "trainer.log_samples=3", "trainer.progress=false",
           "trainer.plot=false", "checkpoint.final=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sample"]) for r in rows] == [(s, k) for s in range(2) for k in range(3)]
    for row in rows:
        assert row["prompt"].startswith("<|user|>What is") and row["prompt"].endswith("<|assistant|>")
        (turn,) = row["turns"]
        assert isinstance(turn["reply"], str) and turn["reply"] and row["status"] == "done"
        assert row["reward"] in (0.0, 1.0) and 1 <= row["response_length"] <= 6
    for step in range(2):  # the rows' rewards are the step's (4 samples: the first 3 logged)
        logged = [r["reward"] for r in rows if r["step"] == step]
        assert sum(logged) <= metrics[step]["reward_mean"] * 4 <= sum(logged) + 1

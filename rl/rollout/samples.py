"""What the episodes did: the step's tool and environment counts (metrics.jsonl) and the rows of
`<run>/samples.jsonl` (`trainer.log_samples`), from the records of this rank.

    counts = turn_counts(records, task)      # summed over the DP ranks by the trainer's metrics
                                             # (dedicated rollout ranks: over the generators, on trainer 0)
    rows = sample_rows(records, task, step=3, places=[0, 1])

Counts, per step, over the step's samples (a multi-turn task; `tool_*` for a task with tools,
rl/tasks/tool_task.py):

    tool_calls            the calls parsed from replies and run (a call in the last turn is not run)
    tool_bad_calls        calls the model got wrong (not JSON, no such tool, wrong arguments)
    tool_status_<kind>    the other calls by the status of their output: the sandbox's (ok, error,
                          timeout, cpu_limit, memory_limit, refused, killed: rl/tasks/sandbox.py
                          `Outcome`); `other` for a tool's own status
    tool_failed           calls in a turn whose tool raised or ran past task.timeout_s (the
                          episode ended: episodes_error / episodes_timeout)
    tool_messages_cut     tool messages cut to task.options.max_observation_len
    env_steps             replies answered by the environment's `step`
    env_answers_cut       environment answers cut to task.options.max_observation_len

so tool_calls = tool_bad_calls + the tool_status_* + tool_failed.

A row (one JSON object per episode; text decoded with the task's tokenizer, special tokens kept,
so the chat template shows; a task without a tokenizer gives ids, `prompt_ids` / `reply_ids`):

    {"step": 3, "sample": 0, "prompt_index": 48, "prompt": "<|im_start|>user ...",
     "turns": [{"reply": "...<tool_call>...", "tool_calls": [{"name": "python", "arguments": {...},
                "status": "ok", "result": "42"}], "message": "<|im_start|>user <tool_response>..."},
               {"reply": "The answer is 42.<|im_end|>", "environment": {"reward": 1.0, "answer": null}}],
     "reward": 1.0, "status": "done", "response_length": 57, "turns_taken": 2}

`sample` is the episode's place in the step (every rank's samples in the trainer's order); a
turn's `message` is the answer or tool message as the model read it next (after a cut), a tool
call's `result` the tool's whole output (status and result null when the tool raised: the turn's
`failed`); `cut` and `failed` appear when set. A single-turn task's
episode is one turn, its reply. A record without a trace (a multi-turn rollout restored from a
checkpoint) shows its whole response as one turn.
"""

from __future__ import annotations

from typing import Any, Sequence

from packing.experience import Experience
from rl.tasks.base import Task, is_multi_turn
from rl.tasks.calls import Status
from rl.tasks.sandbox import Outcome

TOOL_STATUSES = (*(o.value for o in Outcome), "other")  # tool_status_<kind>


def turn_counts(records: Sequence[Experience], task: Task) -> dict[str, float]:
    """The counts of the module docstring over `records`: the same keys for every call with the
    same task (the trainer sums them over the DP ranks), none for a single-turn task."""
    if not is_multi_turn(task):
        return {}
    keys = ["env_steps", "env_answers_cut"]
    if task.toolbox is not None:
        keys += ["tool_calls", "tool_bad_calls", "tool_failed", "tool_messages_cut",
                 *(f"tool_status_{s}" for s in TOOL_STATUSES)]
    counts = dict.fromkeys(keys, 0.0)
    for rec in records:
        for turn in getattr(rec, "trace", None) or ():
            if turn.environment:
                counts["env_steps"] += 1
                counts["env_answers_cut"] += turn.cut
            for _, output in turn.calls:
                counts["tool_calls"] += 1
                if output is None:
                    counts["tool_failed"] += 1
                elif output.status == "bad_call":
                    counts["tool_bad_calls"] += 1
                else:
                    kind = output.status if output.status in TOOL_STATUSES else "other"
                    counts[f"tool_status_{kind}"] += 1
            if turn.calls and not turn.environment:
                counts["tool_messages_cut"] += turn.cut
    return counts


def sample_rows(records: Sequence[Experience], task: Task, *, step: int,
                places: Sequence[int] | None = None) -> list[dict]:
    """One row per record (the module docstring); `places`: each record's place in the step (None:
    0, 1, ...)."""
    tokenizer = getattr(task, "tokenizer", None)

    def text(key: str, ids: Any) -> dict:
        ids = [int(i) for i in ids]
        if tokenizer is None:
            return {f"{key}_ids": ids}
        return {key: tokenizer.decode(ids, skip_special_tokens=False)}

    rows = []
    for k, rec in enumerate(records):
        response_length = int(rec.response_length)
        prompt = rec.sequences[:rec.sequences.numel() - response_length]
        response = rec.sequences[prompt.numel():]
        trace = getattr(rec, "trace", None)
        turns = [_turn(t, response, text) for t in trace] if trace else [text("reply", response)]
        row = {"step": step, "sample": places[k] if places is not None else k, "prompt_index": int(rec.prompt_index),
               **text("prompt", prompt), "turns": turns, "reward": float(rec.rewards),
               "status": Status(int(rec.status)).label if rec.status is not None else None,
               "response_length": response_length, "turns_taken": len(turns)}
        if rec.policy_version is not None:
            row["policy_version"] = int(rec.policy_version)
        rows.append(row)
    return rows


def _turn(turn, response, text) -> dict:
    out = text("reply", response[turn.reply[0]:turn.reply[1]])
    if turn.calls:
        out["tool_calls"] = [{"name": call.name, "arguments": call.arguments,
                              "status": output.status if output is not None else None,
                              "result": output.text if output is not None else None}  # None: see `failed`
                             for call, output in turn.calls]
    if turn.environment:
        out["environment"] = {"reward": turn.reward, "answer": turn.answer}
    if turn.message is not None:
        out.update(text("message", response[turn.message[0]:turn.message[1]]))
    if turn.cut:
        out["cut"] = True
    if turn.failed is not None:
        out["failed"] = turn.failed
    return out

"""Past thinking kept or stripped between turns (`task.options.strip_thinking`, rl/rollout/episodes.py
`forget_thinking`): with a Qwen3-like template, which renders an earlier assistant turn without its
`<think>` block, the stripped context of turn 2 is exactly the template's rendering of the
conversation; kept (the default), it is the replies' own tokens. The tokenizer is the small BPE of
tests/test_tasks.py with `<think>` and `</think>` added as single tokens."""

from __future__ import annotations

import json

import pytest
import torch
from test_tasks import tokenizer_dir  # noqa: F401 - fixture

from rl.rollout.engine import make_record
from rl.rollout.episodes import run_episodes
from rl.tasks.registry import build_task

QWEN3_LIKE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
              "{% set c = m['content'].split('</think>')[-1].lstrip('\\n') %}{% else %}{% set c = m['content'] %}"
              "{% endif %}<|{{ m['role'] }}|>{{ c }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>"
              "{% endif %}")
KEEPS = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # the control: past thinking rendered
REPLIES = ["<think>\nthree and four\n</think>\n\n8", "<think>again</think>7"]


class SaySeven:
    def reset(self, prompt: dict) -> list[dict]:
        return [{"role": "user", "content": prompt["prompt"]}]

    def step(self, response_text: str):
        return (None, 1.0, True) if "7" in response_text else ("No.", 0.0, False)


class Scripted:
    """An engine that gives every sample reply k at turn k, and records the contexts it was given."""

    def __init__(self, tokenizer, stop: int) -> None:
        self.tokenizer, self.stop_token_id, self.contexts = tokenizer, stop, []

    def generate(self, prompts, *, prompt_indices, max_new_tokens, temperature, seed):
        self.contexts.append([p.tolist() for p in prompts])
        reply = REPLIES[len(self.contexts) - 1]
        response = torch.tensor(self.tokenizer.encode(reply, add_special_tokens=False) + [self.stop_token_id])
        return [make_record(p, response, torch.full((response.numel(),), -0.5), i)
                for p, i in zip(prompts, prompt_indices)]


@pytest.fixture(scope="module")
def thinking_tokenizer(tokenizer_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    path = tmp_path_factory.mktemp("tok") / "thinking-bpe"
    tok.save_pretrained(path)
    return path


def _play(path, tmp_path, template: str, strip: bool):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "What is 3 plus 4?"}) + "\n")
    task = build_task("environment", prompts_path=str(tmp_path / "p.jsonl"), tokenizer_path=str(path),
                      environment="test_thinking:SaySeven", chat_template=template, strip_thinking=strip,
                      max_observation_len=16)
    end = task.tokenizer.convert_tokens_to_ids("<|end|>")
    engine = Scripted(task.tokenizer, end)
    (prompt, meta), = task.prompts(1, seed=0)
    (record,) = run_episodes(engine, task, [prompt], [meta], prompt_indices=[0], max_new_tokens=16,
                             temperature=1.0, seed=0)
    conversation = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": REPLIES[0]},
                    {"role": "user", "content": "No."}]
    return task, engine, record, task.encode_messages(conversation)


@pytest.mark.parametrize("template", [QWEN3_LIKE, KEEPS])
def test_stripped_past_thinking_is_what_a_qwen3_like_template_renders(thinking_tokenizer, tmp_path, template):
    task, engine, record, rendered = _play(thinking_tokenizer, tmp_path, template, strip=True)
    turn2 = engine.contexts[1][0]
    think = task.tokenizer.convert_tokens_to_ids("<think>")
    assert think not in turn2 and float(record.rewards) == 1.0 and int(record.turns) == 2
    if template == QWEN3_LIKE:
        assert turn2 == rendered  # token-level stripping = the template's own rendering of the history
    else:
        assert turn2 != rendered and think in rendered  # control: a template that keeps thinking renders it
    # the record: the stripped history as context (no action), the last reply (thinking kept) as the actions
    n = record.sequences.numel() - int(record.response_length)
    assert record.sequences.tolist()[:len(turn2)] == turn2 and think in record.sequences[len(turn2):].tolist()
    assert not record.action_mask[:len(turn2) - 1].any() and record.action_mask[len(turn2) - 1:].all()
    assert n < len(turn2)


def test_kept_past_thinking_is_the_replies_own_tokens(thinking_tokenizer, tmp_path):
    task, engine, record, rendered = _play(thinking_tokenizer, tmp_path, QWEN3_LIKE, strip=False)
    turn2 = engine.contexts[1][0]
    first = task.tokenizer.encode(REPLIES[0], add_special_tokens=False)
    assert turn2 != rendered and turn2[len(engine.contexts[0][0]):][:len(first)] == first  # the default: kept
    assert int(record.action_mask.sum()) == len(first) + 1 + len(task.tokenizer.encode(REPLIES[1])) + 1


def test_strip_thinking_needs_think_tokens(tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match=r"task.options.strip_thinking=true but '<think>' is not one token"):
        build_task("arithmetic_retry", tokenizer_path=str(tokenizer_dir), strip_thinking=True)

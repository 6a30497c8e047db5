"""Text tasks (rl/tasks/files.py `math`), the answer checker, and `assign_rewards`'s reward checks.

The tokenizer is trained here on generated text (the `tokenizers` library) and saved to a
temp folder: nothing is downloaded.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # reward functions are imported as "tests.test_tasks:..." from the repo root
    sys.path.insert(0, str(ROOT))

from packing import Experience  # noqa: E402
from rl.tasks.answers import answers_match, extract_answer, math_reward  # noqa: E402
from rl.tasks.base import Task  # noqa: E402
from rl.tasks.calls import assign_rewards  # noqa: E402
from rl.tasks.files import FileTask, MathTask  # noqa: E402
from rl.tasks.registry import build_task  # noqa: E402

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# ------------------------------------------------------- reward functions (by name)
def length_reward(response_text, answer, **meta):
    return float(len(response_text.split()) == int(answer))


def bad_reward(response_text, returns, **meta):
    return returns  # the test passes the value to return through the meta


# ------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [f"What is {a} plus {b}? The answer is \\boxed{{{a + b}}}." for a in range(40) for b in range(0, 40, 3)]
    texts += [f"Compute {a} times {b}. So {a} * {b} = {a * b}, final answer {a * b}"
              for a in range(12) for b in range(12)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<eos>", "<pad>", "<|user|>", "<|system|>", "<|assistant|>", "<|end|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = CHAT
    path = tmp_path_factory.mktemp("tok") / "tiny-bpe"
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


ROWS = [{"prompt": "What is 3 plus 4?", "answer": "7"}, {"prompt": "Compute 6 times 7.", "answer": 42, "level": 2}]


def scored(task, prompt_ids, response_ids, prompt_index=0, meta=None):
    """A record of prompt + response, scored by `task` with `meta`; returns its reward."""
    ids = list(prompt_ids) + list(response_ids)
    rec = Experience(sequences=torch.tensor(ids), response_length=torch.tensor(len(response_ids)),
                     prompt_index=torch.tensor(prompt_index))
    (rec,) = assign_rewards(task, [rec], [meta if meta is not None else {"answer": "7"}])
    return float(rec.rewards)


# --------------------------------------------------------------- the math task
def test_math_task_tokenizes_prompts_and_rewards_the_decoded_text(tmp_path, tokenizer_dir, tokenizer):
    path = write_jsonl(tmp_path / "math.jsonl", ROWS)
    task = build_task("math", prompts_path=str(path), tokenizer_path=str(tokenizer_dir), vocab_size=len(tokenizer),
                      reward_fn=None, chat_template=None)  # None options are dropped: the defaults
    assert isinstance(task, MathTask) and isinstance(task, Task) and len(task) == 2
    assert task.stop_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<eos>")
    by_ids = {tuple(ids.tolist()): meta for ids, meta in task.prompts(2, seed=0)}
    # the default chat template is the tokenizer's, as for the other text tasks
    chat = [tokenizer.encode(f"<|user|>{row['prompt']}<|end|><|assistant|>", add_special_tokens=False) for row in ROWS]
    assert by_ids == {tuple(chat[0]): {"answer": "7"}, tuple(chat[1]): {"answer": 42, "level": 2}}
    plain = MathTask(path, tokenizer_dir, chat_template=None)  # the control: the prompt text as is
    assert sorted(tuple(ids.tolist()) for ids, _ in plain.prompts(2, seed=0)) == sorted(
        tuple(tokenizer.encode(row["prompt"])) for row in ROWS)
    right = tokenizer.encode("3 plus 4 is \\boxed{7}") + [tokenizer.eos_token_id]
    wrong = tokenizer.encode("The answer is 8")
    assert task.reward([1], right, {"answer": "7"}) == 1.0  # eos is not part of the text
    assert task.reward([1], wrong, {"answer": "7"}) == 0.0
    assert task.reward([1], tokenizer.encode("so 6 * 7 = 42"), {"answer": 42, "level": 2}) == 1.0
    assert scored(task, [5, 6], right) == 1.0


def test_math_task_chat_template(tmp_path, tokenizer_dir, tokenizer):
    path = write_jsonl(tmp_path / "math.jsonl", ROWS[:1])
    own = MathTask(path, tokenizer_dir, chat_template="tokenizer", system_prompt="Box the answer.")
    (ids, _), = own.prompts(1, seed=0)
    rendered = "<|system|>Box the answer.<|end|><|user|>What is 3 plus 4?<|end|><|assistant|>"
    assert ids.tolist() == tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenizer.decode(ids.tolist()) == rendered
    custom = MathTask(path, tokenizer_dir, chat_template="Q: {{ messages[-1]['content'] }} A:")
    (ids, _), = custom.prompts(1, seed=0)
    assert tokenizer.decode(ids.tolist()) == "Q: What is 3 plus 4? A:"


def test_math_task_takes_a_text_reward_function_by_name(tmp_path, tokenizer_dir, tokenizer):
    path = write_jsonl(tmp_path / "math.jsonl", [{"prompt": "Say three words", "answer": 3}])
    task = build_task("math", prompts_path=str(path), tokenizer_path=str(tokenizer_dir),
                      reward_fn="tests.test_tasks:length_reward")
    assert task.reward([1], tokenizer.encode("one two three"), {"answer": 3}) == 1.0
    assert task.reward([1], tokenizer.encode("one two"), {"answer": 3}) == 0.0
    # the no-signal warning's hint (rl/trainer/guard.py) names the reward in use: this one, or the answer checker's rule
    assert task.signal_hint() == ("check the reward (tests.test_tasks:length_reward) on a few replies: it never told "
                                  "them apart")
    checked = build_task("math", prompts_path=str(path), tokenizer_path=str(tokenizer_dir))
    assert checked.signal_hint().startswith("the reward (rl.tasks.answers:math_reward) compares the reply's last "
                                            "\\boxed{...}, else its last number, with the answer")


def test_math_task_errors(tmp_path, tokenizer_dir):
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(FileNotFoundError, match=r"task.tokenizer_path: folder not found: '.*no-such-tokenizer'") as e:
        build_task("math", prompts_path=str(good), tokenizer_path=str(missing))
    assert "huggingface" not in str(e.value).lower() and "repo" not in str(e.value).lower()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"task.tokenizer_path: '.*empty' holds no loadable tokenizer"):
        MathTask(good, empty)
    no_answer = write_jsonl(tmp_path / "na.jsonl", [ROWS[0], {"prompt": "2 plus 2?"}])
    with pytest.raises(ValueError, match=r"na.jsonl:2 has no \['answer'\] \(keys: \['prompt'\]\)"):
        MathTask(no_answer, tokenizer_dir)
    with pytest.raises(ValueError, match="task.options.system_prompt needs task.options.chat_template"):
        MathTask(good, tokenizer_dir, system_prompt="hi", chat_template=None)
    with pytest.raises(FileNotFoundError, match=r"task.prompts_path: prompts file '.*nope.jsonl' does not exist"):
        MathTask(tmp_path / "nope.jsonl", tokenizer_dir)
    with pytest.raises(ValueError, match="vocabulary"):
        build_task("math", prompts_path=str(good), tokenizer_path=str(tokenizer_dir), vocab_size=8)


def test_file_task_takes_a_tokenizer_path(tmp_path, tokenizer_dir, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 1 plus 2?", "answer": 3}])
    task = build_task("file", prompts_path=str(path), reward_fn="tests.test_rollout:my_reward",
                      tokenizer_path=str(tokenizer_dir))
    (ids, meta), = task.prompts(1, seed=0)
    assert ids.tolist() == tokenizer.encode("What is 1 plus 2?") and meta == {"answer": 3}
    assert task.stop_token_id == tokenizer.eos_token_id
    with pytest.raises(FileNotFoundError, match="task.tokenizer_path: folder not found"):
        FileTask(path, "tests.test_rollout:my_reward", tokenizer_path=tmp_path / "missing")


# ------------------------------------------------------------ the answer checker
@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{7}.", "7"),
    ("first \\boxed{3}, then corrected: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box, braces balanced
    ("\\boxed{x^{2}+1} and then 5", "x^{2}+1"),  # a box wins over a later number
    ("We get 12 apples, then 1,234.5 in total", "1,234.5"),  # no box: the last number
    ("the difference is -3", "-3"),
    ("half is 3/4 of it", "3/4"),
    ("no digits here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("predicted, reference, same", [
    ("7", 7, True), ("7.0", "7", True), ("1,234.5", "1234.5", True), ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{3}{4}", "3/4", True), ("$42$", "42", True), ("-3", "3", False), ("x^{2}+1", "x^{2} + 1", True),
    ("7", "8", False), ("1/0", "0", False),
])
def test_answers_match(predicted, reference, same):
    assert answers_match(predicted, reference) is same


def test_math_reward():
    assert math_reward("3 + 4 = \\boxed{7}", answer="7") == 1.0
    assert math_reward("I think it is 7", answer=7, level=3) == 1.0  # extra meta keys are accepted
    assert math_reward("I think it is 8", answer="7") == 0.0
    assert math_reward("no idea", answer="7") == 0.0


# --------------------------------------------------------- score's reward checks
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, None, True, "0.5", "abc"],
                         ids=["nan", "inf", "-inf", "None", "bool", "str-number", "str"])
def test_score_rejects_a_reward_that_is_not_a_finite_number(tmp_path, tokenizer_dir, value):
    path = write_jsonl(tmp_path / "math.jsonl", ROWS[:1])
    task = MathTask(path, tokenizer_dir, reward_fn="tests.test_tasks:bad_reward")
    pattern = (rf"reward function tests.test_tasks:bad_reward returned {_re(repr(value))} \({type(value).__name__}\) "
               rf"for record 0 \(prompt index 5\)")
    with pytest.raises(ValueError, match=pattern):
        scored(task, [5], [6, 7], prompt_index=5, meta={"answer": "7", "returns": value})


def _re(s):
    import re

    return re.escape(s)


@pytest.mark.parametrize("value", [1, 0.25, np.float32(0.5), torch.tensor(0.75)],
                         ids=["int", "float", "numpy", "tensor"])
def test_score_accepts_real_numbers(tmp_path, tokenizer_dir, value):
    path = write_jsonl(tmp_path / "math.jsonl", ROWS[:1])
    task = MathTask(path, tokenizer_dir, reward_fn=lambda response_text, **meta: value)
    assert scored(task, [5], [6]) == float(value)


def test_score_names_a_builtin_task_reward():
    class Broken(Task):
        min_vocab_size, stop_token_id = 8, None

        def prompts(self, n, seed):
            return []

        def reward(self, prompt_ids, response_ids, meta):
            return None

    with pytest.raises(ValueError, match=r"reward function Broken.reward returned None \(NoneType\) for record 0 "
                                         r"\(prompt index 3\)"):
        scored(Broken(), [1], [2], prompt_index=3)


# ------------------------------------------------------- JSONL lines in epochs
def test_a_jsonl_task_walks_its_lines_in_seeded_epochs(tmp_path):
    """Every line once per epoch, in an order the run's seed draws; a step's prompts are
    positions step * prompts_per_step.. of that stream, so a resume needs no state. The control:
    drawing each step's prompts with `prompts(n, seed)` (what the trainer did) leaves lines unseen."""
    path = write_jsonl(tmp_path / "lines.jsonl", [{"prompt_ids": [4 + i, 3], "line": i, "answer": 7}
                                                   for i in range(10)])
    task = FileTask(path, "tests.test_rollout:my_reward")
    line = lambda prompts: [m["line"] for _, m in prompts]  # noqa: E731
    stream = line(task.prompts_at(0, 30, seed=1))
    for epoch in range(3):
        assert sorted(stream[10 * epoch:10 * epoch + 10]) == list(range(10))  # each line once per epoch
    assert stream[:10] != stream[10:20]  # each epoch its own order
    steps = [line(task.prompts_at(4 * k, 4, seed=1)) for k in range(5)]  # prompts_per_step=4: steps cross epochs
    assert sum(steps, []) == stream[:20]  # step k's prompts: a function of (seed, k) alone
    assert line(task.prompts_at(0, 10, seed=2)) != stream[:10]  # another seed, another order
    assert sorted(line(task.prompts_at(0, 10, seed=2))) == list(range(10))
    drawn = sum((line(task.prompts(4, seed=1_000_003 + k)) for k in range(5)), [])  # with replacement, per step
    assert len(set(drawn[:10])) < 10 or len(set(drawn)) < 10


def test_the_trainer_takes_each_line_once_per_epoch(tmp_path):
    from testing.inprocess import trainer

    path = write_jsonl(tmp_path / "lines.jsonl", [{"prompt_ids": [4 + i, 5, 6], "answer": 7} for i in range(8)])
    run = ("task=file", f"task.prompts_path={path}", "task.reward_fn=tests.test_rollout:my_reward",
           "task.prompts_per_step=4", "task.samples_per_prompt=2", "task.max_new_tokens=2", "trainer.progress=false")
    firsts = lambda tr, s: sorted({int(r.sequences[0]) for r in tr.source.records(s, 0, s)})  # noqa: E731
    tr = trainer(*run)
    seen = firsts(tr, 0) + firsts(tr, 1)
    assert sorted(seen) == list(range(4, 12))  # two steps: the epoch, every line once
    assert firsts(trainer(*run), 1) == firsts(tr, 1)  # step 1 without step 0 before it (a resume): the same lines
    assert firsts(trainer(*run, "seed=5"), 0) != firsts(tr, 0)  # another seed: another order


# ------------------------------------------------------------- enable_thinking
THINKING = CHAT.replace("{% if add_generation_prompt %}<|assistant|>{% endif %}",
                        "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not "
                        "enable_thinking %}<think></think>{% endif %}{% endif %}")  # as Qwen3's template does


def test_enable_thinking_reaches_a_template_that_reads_it(tmp_path, tokenizer_dir, tokenizer):
    """`task.options.enable_thinking=false` opens an empty think block after the generation
    prompt, in the prompt and in every environment answer (the next turn starts after it); None
    passes nothing. The control: a template that does not read it renders the same either way."""
    path = write_jsonl(tmp_path / "math.jsonl", ROWS)
    ids = lambda template, **kw: build_task("math", prompts_path=str(path), tokenizer_path=str(tokenizer_dir),  # noqa: E731
                                            chat_template=template, **kw).items[0][0]
    think = tokenizer.encode("<think></think>", add_special_tokens=False)
    off, on, unset = ids(THINKING, enable_thinking=False), ids(THINKING, enable_thinking=True), ids(THINKING)
    assert off[-len(think):] == think and off[:-len(think)] == on == unset
    assert ids(CHAT, enable_thinking=False) == ids(CHAT)  # the control
    retry = build_task("arithmetic_retry", tokenizer_path=str(tokenizer_dir), chat_template=THINKING,
                       enable_thinking=False)
    assert retry.observation_ids("Again.")[-len(think):] == think
    assert retry.prompts(1, seed=0)[0][0].tolist()[-len(think):] == think
    from testing.inprocess import compose

    cfg = compose("task=arithmetic_retry", f"task.tokenizer_path={tokenizer_dir}", "task.options.enable_thinking=false")
    assert cfg.task.options["enable_thinking"] is False  # a task.options switch (conf/task/*.yaml: null = not passed)


# ------------------------------------------------------------- a task's reward is its kind's
def test_each_task_kind_is_rewarded_by_its_own_part():
    """A task is built from parts, not mixins (rl/tasks/base.py): a multi-turn kind (an environment
    factory) has no single-turn `reward` to fall back on, a single-turn kind has its reward and no
    environment, and no kind has two bases (whose method order once resolved python_tool's and
    environment's `reward` to arithmetic's and file's). The control: that old shape, an environment on
    top of `arithmetic` inheriting its math_reward, is refused by `check_parts` (and `run_episodes`,
    which calls it before the engine), as is a task with neither."""
    from rl.rollout.episodes import run_episodes
    from rl.tasks.arithmetic import ArithmeticTask, RetryEnvironment
    from rl.tasks.base import check_parts, is_multi_turn
    from rl.tasks.registry import TASKS, TaskName

    multi = {TaskName.ARITHMETIC_RETRY, TaskName.PYTHON_TOOL, TaskName.ENVIRONMENT}
    for name, cls in TASKS.items():
        task = object.__new__(cls)  # the class's parts, without building its tokenizer or data
        assert is_multi_turn(task) == (name in multi), name
        assert (cls.reward is Task.reward) == (name in multi), name
        assert all(len(k.__bases__) == 1 for k in cls.__mro__[:-2]), (name, cls.__mro__)
        check_parts(task)

    class Mixed(ArithmeticTask):  # the control: a retry episode over arithmetic, its single-turn reward inherited
        def environment(self):
            return RetryEnvironment(self)

    with pytest.raises(TypeError, match=r"Mixed has an environment and a single-turn reward \(ArithmeticTask.reward\)"):
        check_parts(object.__new__(Mixed))
    with pytest.raises(TypeError, match=r"Mixed has an environment and a single-turn reward"):
        run_episodes(None, object.__new__(Mixed), [], [], prompt_indices=[], max_new_tokens=1, temperature=1.0, seed=0)

    class Neither(Task):
        def prompts(self, n, seed):
            return []

    with pytest.raises(TypeError, match="Neither has neither a reward nor an environment"):
        check_parts(Neither())

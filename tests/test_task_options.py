"""`task.options` are checked at start-up, before any tokenizer or model is built and before a run
folder exists (rl/tasks/registry.py `check_options`, run by `rl.config.validate`): each error names
its config key. In-process, every case goes through `check_command_line`, what train.py runs before
Hydra makes the run folder, with the tokenizer loader and the model builder made to fail if called;
one end-to-end run of train.py shows there is no folder and the message is printed once."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import check_command_line

ROOT = Path(__file__).resolve().parents[1]

ENVS = '''
class NoReset:
    def step(self, reply):
        return None, 0.0, True


class Guess:
    def __init__(self, target: int = 3, *, hint: str = "higher or lower"):
        self.target = target

    def reset(self, prompt):
        return [{"role": "user", "content": prompt["prompt"]}]

    def step(self, reply):
        return None, float(reply.strip() == str(self.target)), True
'''


@pytest.fixture
def nothing_built(monkeypatch):
    """Loading a tokenizer (transformers' AutoTokenizer, what rl/tasks/chat.py load_tokenizer calls)
    or building a model (any transformers PreTrainedModel) raises."""
    import transformers

    def built(*args, **kwargs):
        raise AssertionError("a tokenizer or a model was built")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", built)
    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", built)


def test_the_fixture_catches_a_tokenizer_or_a_model(nothing_built, tmp_path):  # the control
    from model.models import build_model
    from rl.tasks.registry import build_task

    with pytest.raises(AssertionError, match="was built"):
        build_task("reasoning_gym", tokenizer_path=str(tmp_path), dataset="countdown")
    with pytest.raises(AssertionError, match="was built"):
        build_model("qwen3_moe", vocab_size=64)


def refused(*argv: str) -> str:
    with pytest.raises(ValueError) as e:
        check_command_line(list(argv))
    return str(e.value)


@pytest.fixture
def envs(tmp_path, monkeypatch):
    """A module of environment classes on sys.path, and a tokenizer folder for task=environment."""
    module = f"envs_{tmp_path.name}"
    (tmp_path / f"{module}.py").write_text(ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["task=environment", f"task.tokenizer_path={tmp_path}"], module


# ----------------------------------------------------------------------- reasoning-gym
def test_an_unknown_reasoning_gym_dataset_names_the_closest(nothing_built):
    message = refused("task=reasoning_gym", "task.options.dataset=count_downn")
    assert message.startswith("task.options.dataset: 'count_downn' is not a reasoning-gym dataset; did you mean "
                              "countdown?"), message
    message = refused("task=reasoning_gym", "task.options.datasets={chain_summ: {weight: 2}}")
    assert message.startswith("task.options.datasets.chain_summ: 'chain_summ' is not a reasoning-gym dataset; did "
                              "you mean chain_sum?"), message
    check_command_line(["task=reasoning_gym", "task.options.dataset=countdown"])  # the control


def test_a_reasoning_gym_run_without_a_dataset_says_neither_is_set(nothing_built):
    message = refused("task=reasoning_gym")
    assert "needs task.options.dataset=NAME" in message and message.endswith("neither is set"), message
    assert "not both" not in message


def test_a_reasoning_gym_run_with_both_dataset_and_datasets_says_not_both(nothing_built):
    message = refused("task=reasoning_gym", "task.options.dataset=chain_sum", "task.options.datasets={countdown: {}}")
    assert message.startswith("task.options.dataset='chain_sum' and task.options.datasets={'countdown': {}}: give one "
                              "of the two, not both"), message


def test_a_misspelt_reasoning_gym_config_field_names_the_closest(nothing_built):
    message = refused("task=reasoning_gym", "task.options.dataset=chain_sum", "task.options.dataset_config={min_term: 2}")
    assert message.startswith("task.options.dataset_config.min_term: chain_sum's config (ChainSumConfig) has no such "
                              "field; did you mean min_terms?"), message
    message = refused("task=reasoning_gym", "task.options.dataset=chain_sum",
                      "task.options.dataset_config={min_terms: 5, max_terms: 2}")  # the dataset's own validate()
    assert message.startswith("task.options.dataset_config={'min_terms': 5, 'max_terms': 2}: reasoning-gym's "
                              "ChainSumConfig refused it (AssertionError: max_terms must be >= min_terms)"), message


def test_an_option_the_task_does_not_take_names_the_closest(nothing_built):
    message = refused("task=reasoning_gym", "+task.options.datset=chain_sum")
    assert message.startswith("task.options.datset: task=reasoning_gym has no such option; did you mean dataset? Its "
                              "options: dataset, dataset_config, datasets,"), message
    message = refused("task=arithmetic", "+task.options.prompts_path=x.jsonl")
    assert message == "task.options.prompts_path: not a task option; set task.prompts_path"


# ------------------------------------------------------------------------------- tools
def test_an_unknown_tool_names_the_key_and_the_tools(nothing_built):
    message = refused("task=python_tool", "task.options.tools=[pyhton]")
    assert message == "task.options.tools[0]='pyhton': no such tool; did you mean python? (the built-in tools: python)"
    message = refused("task=python_tool", "+task.options.sandbox.wall=2")
    assert message.startswith("task.options.sandbox.wall: no such limit; did you mean wall_s?"), message
    assert refused("task=python_tool", "task.options.sandbox.cpu_s=0") == ("task.options.sandbox.cpu_s=0: expected a "
                                                                          "positive number")
    # the choices as users type them, the closest first (as trainer.loggers' and sandbox.backend's errors)
    assert refused("task=python_tool", "task.options.tool_format=markdwn") == (
        "task.options.tool_format='markdwn': expected one of hermes, mistral, llama3, tokenizer, markdown; "
        "did you mean markdown?")
    check_command_line(["task=python_tool"])  # the control


# ------------------------------------------------------------------------ environments
def test_an_environment_class_without_reset_is_refused(nothing_built, envs):
    args, module = envs
    message = refused(*args, f"task.options.environment={module}:NoReset")
    assert message.startswith(f"task.options.environment: <class '{module}.NoReset'> has no `reset` method"), message
    check_command_line([*args, f"task.options.environment={module}:Guess"])  # the control


def test_a_misspelt_environment_option_names_environment_options_and_the_class(nothing_built, envs):
    args, module = envs
    message = refused(*args, f"task.options.environment={module}:Guess", "+task.options.environment_options.targt=4")
    assert message == (f"task.options.environment_options.targt: {module}:Guess takes no keyword 'targt'; did you "
                       "mean target? (its constructor's keywords: target, hint)")
    check_command_line([*args, f"task.options.environment={module}:Guess",
                        "+task.options.environment_options.target=4"])  # the control


def test_an_environment_option_the_constructor_requires_is_named(nothing_built):
    message = refused("task=environment", f"task.tokenizer_path={ROOT}",
                      "task.options.environment=rl.tasks.environment:TextArena")
    assert message == ("task.options.environment_options: rl.tasks.environment:TextArena needs env_id (its constructor "
                       "has no default for them); set task.options.environment_options.env_id=...")


def test_the_environment_interface_is_a_closed_choice(nothing_built, envs):
    args, module = envs
    message = refused(*args, f"task.options.environment={module}:Guess", "task.options.interface=gymm")
    assert message == "task.options.interface='gymm': expected one of auto, text, messages, gym; did you mean gym?"


# ------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_train_py_refuses_a_bad_task_option_without_a_folder_and_says_it_once(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", "task=reasoning_gym", "task.options.dataset=count_downn",
                           f"hydra.run.dir={run}"], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-2000:]
    assert out.count("'count_downn' is not a reasoning-gym dataset; did you mean countdown?") == 1, out[-2000:]
    assert "Traceback" not in out and "model.kernels" not in out  # no traceback, nothing built (no kernel chosen)
    assert not run.exists()  # no run folder, no FAILED

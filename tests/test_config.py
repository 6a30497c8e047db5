"""Bad input is caught at start-up, before any model is built, each error naming its config key.

In-process: Hydra's compose API on conf/ gives the config train.py would get from the same
overrides; `load` and `validate` are what train.py runs first."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from testing.inprocess import SMALL, compose, trainer
from rl.config import RANGES, check_task_fits
from rl.tasks.registry import build_task

ROOT = Path(__file__).resolve().parents[1]


def refused(*overrides: str, world_size: int = 1) -> str:
    with pytest.raises(ValueError) as e:
        compose(*overrides, world_size=world_size)
    return str(e.value)


# ----------------------------------------------------------- keys left unset
def test_pretrained_model_without_its_path_is_refused():
    """It used to train a random model: the group's '???' merged onto the schema's None."""
    assert "model.pretrained_path: required but not set" in refused("model=pretrained")


@pytest.mark.parametrize("task, keys", [("file", ["task.prompts_path", "task.reward_fn"]),
                                        ("math", ["task.prompts_path", "task.tokenizer_path"])])
def test_a_task_without_its_files_names_every_unset_key(task, keys):
    message = refused(f"task={task}")
    assert all(k in message for k in keys), message
    assert "task.prompts_path" in refused(f"task={task}", f"task.{keys[1].split('.')[1]}=x")  # one still unset


def test_required_keys_set_on_the_command_line_are_accepted(tmp_path):
    cfg = compose("model=pretrained", f"model.pretrained_path={tmp_path}", check=False)
    assert cfg.model.pretrained_path == str(tmp_path)


def test_a_pretrained_path_that_is_not_a_local_folder_is_refused(tmp_path):
    message = refused("model=pretrained", "model.pretrained_path=Qwen/Qwen3-0.6B")
    assert "model.pretrained_path='Qwen/Qwen3-0.6B': folder not found" in message and "huggingface" not in message


# --------------------------------------------------------------------- sizes
@pytest.mark.parametrize("key", ["task.prompts_per_step", "task.samples_per_prompt", "batch.max_tokens",
                                 "task.max_new_tokens"])
@pytest.mark.parametrize("value", [0, -2])
def test_sizes_must_be_positive(key, value):
    assert refused(f"{key}={value}").startswith(f"{key}={value}: expected a positive number")


def test_the_temperature_is_checked_once_at_start_up():  # engines, Actor and log-prob head trust it
    for value in (0, -2):
        assert refused(f"model.temperature={value}").startswith(f"model.temperature={float(value)}: expected a positive")


def test_prompts_per_step_must_divide_over_dp():
    message = refused("task.prompts_per_step=6", world_size=4)
    assert message.startswith("task.prompts_per_step=6 does not divide over dp=4"), message


def test_grpo_with_one_sample_per_prompt_is_refused():
    message = refused("task.samples_per_prompt=1")
    assert "algo.advantage=grpo" in message and "task.samples_per_prompt=1" in message


def test_max_tokens_below_the_longest_possible_sample_is_refused():
    """target_token prompts have up to 12 tokens; with 12 new tokens a sample reaches 24."""
    cfg = compose("batch.max_tokens=23")  # validate cannot know the prompts: accepted
    task = build_task("target_token", vocab_size=64)
    with pytest.raises(ValueError, match=r"batch.max_tokens=23 is below the longest possible sample: .* = 24"):
        check_task_fits(cfg, task)
    check_task_fits(compose("batch.max_tokens=24"), task)


def test_max_tokens_check_runs_when_the_trainer_is_built(tmp_path, monkeypatch):
    """A prompts file's longest prompt counts (here 30 tokens + 12 new > 40)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n{"prompt_ids": [%s]}\n' % ", ".join(["9"] * 30))
    (tmp_path / "my_rewards.py").write_text("def one(prompt_ids, response_ids):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"batch.max_tokens=40 .* up to 30 tokens, plus task.max_new_tokens=12"):
        trainer(*SMALL, "task=file", f"task.prompts_path={prompts}", "task.reward_fn=my_rewards:one",
                "batch.max_tokens=40")


# ----------------------------------------------------------- device, layout
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    assert refused("trainer.device=cuda").startswith("trainer.device=cuda but CUDA is not available")


@pytest.mark.parametrize("key", ["model.dtype", "model.param_dtype"])
def test_float16_on_cpu_is_refused(key):
    """Measured: model.dtype=float16 on CPU samples from NaN probabilities at step 1."""
    assert refused(f"{key}=float16", "trainer.device=cpu").startswith(f"{key}=float16 on cpu")
    compose(f"{key}=bfloat16", "trainer.device=cpu")


def test_ep_must_divide_the_expert_count():
    message = refused("parallel.ep=4", "+model.overrides.num_experts=6", world_size=4)
    assert message.startswith("parallel.ep=4 does not divide model.overrides.num_experts=6"), message
    compose("parallel.ep=4", "+model.overrides.num_experts=8", world_size=4)  # the control: 2 experts per rank


def test_ep_must_divide_a_checkpoints_expert_count_under_either_name(tmp_path):
    """transformers 5 saves qwen3_moe's num_experts as num_local_experts (its attribute_map): the
    start-up check read num_experts alone and let ep=4 over 6 experts through to the model build."""
    import json

    from model.models import build_model

    for experts in (6, 8):
        build_model("qwen3_moe", seed=0, num_experts=experts).save_pretrained(tmp_path / str(experts))
    saved = json.loads((tmp_path / "6" / "config.json").read_text())
    assert saved.get("num_local_experts") == 6 and "num_experts" not in saved  # the name the check must follow
    run = ("model=pretrained", "parallel.ep=4")
    message = refused(*run, f"model.pretrained_path={tmp_path / '6'}", world_size=4)
    assert message.startswith(f"parallel.ep=4 does not divide num_experts of {tmp_path / '6' / 'config.json'}=6"), message
    compose(*run, f"model.pretrained_path={tmp_path / '8'}", world_size=4)  # the control: 2 experts per rank


def test_ep_must_divide_dp():
    assert refused("parallel.ep=3", world_size=4).startswith("parallel.ep=3 does not divide dp=4")


# ------------------------------------------------------------ reward values
@pytest.mark.parametrize("value", ['"0.5"', '"abc"', "None"])
def test_a_reward_that_is_not_a_number_names_the_function_the_prompt_and_the_value(tmp_path, monkeypatch, value):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join('{"prompt_ids": [%d, 5, 6]}\n' % i for i in range(4, 12)))
    module = f"bad_rewards_{tmp_path.name}"  # one module per case (imports are cached)
    (tmp_path / f"{module}.py").write_text(f"def reward(prompt_ids, response_ids):\n    return {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose(*SMALL, "task=file", f"task.prompts_path={prompts}", f"task.reward_fn={module}:reward")
    with pytest.raises(ValueError) as e:  # building the task: before any model, not after the first rollout
        build_task(cfg.task.name, prompts_path=cfg.task.prompts_path, reward_fn=cfg.task.reward_fn, vocab_size=64)
    message = str(e.value)
    assert f"reward function {module}:reward (called once at start-up on a probe sample) returned" in message, message
    assert repr(eval(value)) in message


def test_a_reward_that_raises_is_caught_at_start_up(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [4, 5, 6], "answer": 3}\n')
    (tmp_path / "strict_rewards.py").write_text("def reward(prompt_ids, response_ids, answer):\n"
                                               "    return 1.0 / (len(response_ids) - 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"strict_rewards:reward raised ZeroDivisionError: .* on a probe sample at "
                                         r"start-up \(a prompt of the task, response ids \[4\], keywords \['answer'\]\)"):
        build_task("file", prompts_path=str(prompts), reward_fn="strict_rewards:reward", vocab_size=64)


def test_a_custom_import_is_resolved_at_start_up_saying_where_it_was_looked_for(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [4, 5, 6]}\n')
    message = refused("task=file", f"task.prompts_path={prompts}", "task.reward_fn=my_missing_rewards:score")
    assert message.startswith("task.reward_fn 'my_missing_rewards:score': cannot import module 'my_missing_rewards': "
                              "no my_missing_rewards.py in the working directory") and "PYTHONPATH" in message, message
    (tmp_path / "my_found_rewards.py").write_text("def score(prompt_ids, response_ids):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)  # the control: the working directory is searched (train.py's folder is sys.path[0])
    compose("task=file", f"task.prompts_path={prompts}", "task.reward_fn=my_found_rewards:score")
    assert "has no attribute 'scor'" in refused("task=file", f"task.prompts_path={prompts}",
                                                "task.reward_fn=my_found_rewards:scor")


# ---------------------------------------------------------------- end to end
@pytest.mark.slow
def test_train_py_refuses_an_unset_key_before_building_a_model(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "model=pretrained", f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "model.pretrained_path: required but not set" in proc.stderr, proc.stderr[-2000:]
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing was built: not even the run folder


@pytest.mark.parametrize("override,key,registered", [
    ("algo.policy_loss=ppoo", "algo.policy_loss", "['cispo', 'gspo', 'ppo']"),
    ("algo.advantage=gea", "algo.advantage", "['distill', 'gae', 'grpo', 'reinforce_pp', 'reinforce_pp_baseline', 'rloo']"),
])
def test_a_name_outside_a_registry_names_the_key_and_the_registered_names(override, key, registered):
    message = refused(override)  # at start-up, before any model is built
    assert message.startswith(f"{key}={override.split('=')[1]!r}: not a registered") and registered in message


@pytest.mark.parametrize("override,key,choice", [
    ("algo.loss_agg=token-sum", "algo.loss_agg", "seq-mean-token-sum-norm"),
    ("algo.kl_estimator=k4", "algo.kl_estimator", "k3"),
    ("algo.old_log_probs=engine", "algo.old_log_probs", "rollout"),
    ("trainer.lr_schedule=linear", "trainer.lr_schedule", "cosine"),
])
def test_a_value_outside_a_closed_choice_names_the_key_and_the_choices(override, key, choice):
    message = refused(override)  # while Hydra merges the override: before anything runs
    assert message.startswith(f"{override}: expected one of ") and choice in message.split(", "), message


def test_a_list_item_outside_its_choice_names_the_item_and_the_choices_as_typed():
    """It printed `trainer.loggers[0]=?` and the members' upper-case names."""
    assert refused("trainer.loggers=[jsonl,tensorbord]") == ("trainer.loggers[1]=tensorbord: expected one of jsonl, "
                                                              "tensorboard, wandb, mlflow")
    assert refused("trainer.loggers=[jsnl]").startswith("trainer.loggers[0]=jsnl: expected one of jsonl,")
    assert compose("trainer.loggers=[jsonl,tensorboard]").trainer.loggers[1].value == "tensorboard"  # the control


# ------------------------------------------------------------ unknown keys
def test_a_misspelt_key_names_the_closest_valid_keys_not_hydras_plus():
    """Hydra's own text recommended `+trainer.max_step=1`, which composes and is then ignored."""
    for override in ("trainer.max_step=1", "+trainer.max_step=1", "++trainer.max_step=1"):
        message = refused(override)
        assert message.startswith("trainer.max_step: no such key; did you mean trainer.max_steps"), message
        assert "lr_schedule" in message and "+trainer" not in message  # the section's keys, no '+' advice
    assert compose("trainer.max_steps=1").trainer.max_steps == 1  # the control: the right key
    message = refused("trainr.lr=1")
    assert message.startswith("trainr: no such key; did you mean trainer") and "The keys of the config: algo" in message


def test_a_key_missing_from_a_free_form_dict_says_how_to_add_one():
    message = refused("model.overrides.num_expert=4")
    assert message.startswith("model.overrides.num_expert: no such key") and "+model.overrides.num_expert=" in message
    assert compose("+model.overrides.num_experts=4").model.overrides["num_experts"] == 4  # the control
    # no close key: the sentence still ends before the section's keys
    message = refused("task=math", "task.prompts_path=x", "task.tokenizer_path=x", "task.options.answer_tagg=x")
    assert message.startswith("task.options.answer_tagg: no such key. The keys of task.options: "), message


# ---------------------------------------------------------- numeric ranges
def _out_of(check) -> float:
    from rl.config.checks import _fraction, _non_negative

    return {_fraction: 1.5, _non_negative: -1}.get(check, 0)


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_numeric_field_is_checked_against_its_range(key):
    value = _out_of(RANGES[key][0])
    message = refused(f"{key}={value}")
    assert message.startswith(f"{key}=") and f": expected {RANGES[key][1]}" in message, message


def test_a_negative_learning_rate_names_trainer_lr_before_a_model_is_built():
    assert refused("trainer.lr=-1") == "trainer.lr=-1.0: expected >= 0"
    compose("trainer.lr=0")  # the control: lr=0 trains nothing, and is allowed (tests use it)


# ---------------------------------------------------------------- the math task
def test_the_readme_math_command_composes_and_math_defaults_to_the_tokenizers_chat_template():
    readme = ["model=pretrained", "model.pretrained_path=DIR", "task=math", "task.prompts_path=gsm8k.jsonl",
              "task.tokenizer_path=DIR", "task.options.chat_template=tokenizer", "task.max_new_tokens=256"]
    options = {"chat_template": "tokenizer", "enable_thinking": None}  # None: not passed to the template
    assert compose(*readme, check=False).task.options == options
    assert compose(*readme[:-2], check=False).task.options == options  # the default


def test_math_takes_the_models_folder_as_its_tokenizer_as_arithmetic_does():
    run = ["model=pretrained", "model.pretrained_path=DIR", "task=math", "task.prompts_path=gsm8k.jsonl"]
    for task in ("math", "arithmetic"):
        assert compose(*run[:2], f"task={task}", *run[3:], check=False).task.tokenizer_path == "DIR"
    assert compose(*run, "task.tokenizer_path=TOK", check=False).task.tokenizer_path == "TOK"  # given: kept
    # a random-init model has no folder: the key is named as unset, before any model or tokenizer
    assert refused("task=math", "task.prompts_path=x").startswith("task.tokenizer_path: required but not set")


def test_an_environment_takes_the_models_folder_as_its_tokenizer_as_math_does():
    env = ["task=environment", "task.prompts_path=train.jsonl", "task.options.environment=my_envs:Guess"]
    run = ["model=pretrained", "model.pretrained_path=DIR", *env]
    assert compose(*run, check=False).task.tokenizer_path == "DIR"
    assert compose(*run, "task.tokenizer_path=TOK", check=False).task.tokenizer_path == "TOK"  # given: kept
    # a random-init model has no folder: the key is named as unset, before any model or tokenizer
    assert refused(*env).startswith("task.tokenizer_path: required but not set")


def test_a_pretrained_checkpoint_trains_at_its_own_learning_rate_and_a_high_one_warns(tmp_path):
    """model=pretrained (and model=smollm2, which is it with a folder) set trainer.lr=1e-5; the tiny
    random models keep the schema's 3e-3; an experiment or the command line still set their own."""
    from rl.config import FULL_FINETUNE_MAX_LR, learning_rate_warning

    pretrained = ("model=pretrained", f"model.pretrained_path={tmp_path}")
    assert compose(*pretrained, check=False).trainer.lr == 1e-5
    assert compose("model=smollm2", check=False).trainer.lr == 1e-5
    assert compose(check=False).trainer.lr == compose("model=dense_tiny", check=False).trainer.lr == 3e-3
    assert compose("+experiment=smollm2_arithmetic_lora", check=False).trainer.lr == 2e-4  # LoRA's own
    assert compose(*pretrained, "trainer.lr=1e-6", check=False).trainer.lr == 1e-6
    # the README's own-model command resolves to it (what `python train.py ... --cfg job` prints)
    assert compose(*pretrained, "task=arithmetic", check=False).trainer.lr == 1e-5

    assert learning_rate_warning(compose(*pretrained, check=False)) is None
    assert learning_rate_warning(compose(*pretrained, f"trainer.lr={FULL_FINETUNE_MAX_LR}", check=False)) is None
    message = learning_rate_warning(compose(*pretrained, "trainer.lr=3e-3", check=False))
    assert message.startswith(f"trainer.lr=0.003 is above 0.0001 for full fine-tuning of the pretrained checkpoint "
                              f"model.pretrained_path={tmp_path}"), message
    assert learning_rate_warning(compose(*pretrained, "trainer.lr=3e-3", "model.lora.rank=8", check=False)) is None
    assert learning_rate_warning(compose("trainer.lr=3e-3", check=False)) is None  # a tiny random model


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_a_kl_reward_that_nothing_would_read_is_refused(advantage):
    message = refused(f"algo.advantage={advantage}", "algo.kl_coef=0.01", "algo.kl_mode=reward")
    assert "algo.kl_mode=reward" in message and f"algo.advantage={advantage}" in message
    compose("algo=ppo")  # gae reads it per token: accepted
    for token_level in ("reinforce_pp", "reinforce_pp_baseline"):  # and so does the REINFORCE++ pair
        compose(f"algo.advantage={token_level}", "algo.kl_coef=0.01", "algo.kl_mode=reward")


def test_reinforce_pp_takes_its_kl_as_a_reward_never_as_a_loss():
    message = refused("algo.advantage=reinforce_pp", "algo.kl_coef=0.01")  # kl_mode: loss by default
    assert "algo.kl_mode=loss" in message and "set algo.kl_mode=reward" in message, message
    compose("algo.advantage=reinforce_pp_baseline", "algo.kl_coef=0.01")  # a baseline with a KL loss: accepted


def test_a_missing_matplotlib_is_found_at_start_up_and_the_plot_skipped(monkeypatch):
    """trainer.plot needs matplotlib after the last step: without it start-up warns and turns the plot
    off before any model is built (issue 52.5: a run trained to the end, then failed on the import).
    train.py asks once, on rank 0 (plot_warning), not in validate, which every rank runs twice."""
    import importlib.util

    from rl.config import plot_warning

    find_spec = importlib.util.find_spec
    cfg = compose("model=dense_tiny", "trainer.device=cpu")
    assert plot_warning(cfg) is None and cfg.trainer.plot is True  # the control: installed here
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else
                        find_spec(name, *a))
    cfg = compose("model=dense_tiny", "trainer.device=cpu")
    assert cfg.trainer.plot is True  # validate does not look it up
    message = plot_warning(cfg)
    assert cfg.trainer.plot is False
    assert "matplotlib is not installed" in message and "trainer.plot=false" in message
    cfg = compose("model=dense_tiny", "trainer.device=cpu", "trainer.plot=false")
    assert plot_warning(cfg) is None and cfg.trainer.plot is False  # asked for no plot: nothing to say

"""docs/config-reference.md is the schema's: regenerating it from rl/config/schema.py and conf/
(scripts/config_reference.py) gives the committed page byte for byte, so a field added,
renamed, re-typed, re-defaulted or re-commented without regenerating the page fails here."""

import re
from dataclasses import dataclass, field
from pathlib import Path

from scripts.config_reference import PAGE, field_comments, render
from rl.config import Config, TrainerConfig
from rl.tasks.options import MEANINGS, option_parameters
from rl.tasks.registry import TASKS

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = ".venv/bin/python scripts/config_reference.py > docs/config-reference.md"


def test_the_committed_config_reference_is_generated_from_the_schema():
    assert PAGE.read_text() == render(), f"docs/config-reference.md is stale: run {REGENERATE}"


def test_the_readme_and_the_configuration_page_link_the_reference():
    assert "docs/config-reference.md" in (ROOT / "README.md").read_text()
    assert "(config-reference.md)" in (ROOT / "docs" / "configuration.md").read_text()


@dataclass
class _Trainer(TrainerConfig):
    # a knob the control adds,
    warmup_knob: int = 7  # read above and beside the field


@dataclass
class _Config(Config):
    trainer: _Trainer = field(default_factory=_Trainer)


def test_an_added_field_changes_the_reference():  # the control
    page = render(_Config)
    row = ("| `trainer.warmup_knob` | int | `7` |  |  | a knob the control adds, read above and beside the field |")
    assert row in page.splitlines()
    assert page != render() and page.replace(row + "\n", "") == render()


def test_a_field_s_comment_is_the_lines_above_it_and_its_trailing_comment():
    assert field_comments(_Trainer) == {"warmup_knob": "a knob the control adds, read above and beside the field"}
    assert field_comments(TrainerConfig)["max_bad_steps"] == "consecutive non-finite updates skipped before the run stops"
    assert field_comments(_BareTrainer) == {"bare_knob": ""}


# ------------------------------------------------------------ every row means something
def cells(line: str) -> list[str]:
    """A table row's cells (an escaped `\\|` stays in its cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def empty_meanings(page: str) -> list[str]:
    """The keys (and config group options) of the page's tables whose last cell, the meaning, is empty."""
    return [cells(line)[0] for line in page.splitlines() if line.startswith("| `") and not cells(line)[-1]]


def test_every_row_of_the_reference_has_a_meaning():
    """A key added without a comment (rl/config/schema.py) or a task option without a meaning
    (rl/tasks/options.py MEANINGS) fails here."""
    assert empty_meanings(render()) == []


@dataclass
class _BareTrainer(TrainerConfig):
    bare_knob: int = 0


@dataclass
class _Bare(Config):
    trainer: _BareTrainer = field(default_factory=_BareTrainer)


def test_a_field_or_a_task_option_without_a_meaning_is_found(monkeypatch):  # the controls
    assert empty_meanings(render(_Bare)) == ["`trainer.bare_knob`"]
    monkeypatch.delitem(MEANINGS, "answer_tag")
    assert empty_meanings(render()) == ["`task.options.answer_tag`"]


# ------------------------------------------------------------ what the page lists
def rows(page: str) -> dict[str, list[str]]:
    """key -> the cells after it, for every table row of the page (a key listed twice: its last row)."""
    return {cells(line)[0]: cells(line)[1:] for line in page.splitlines() if line.startswith("| `")}


def test_every_task_option_of_every_task_kind_has_a_row():
    page = render()
    for name, cls in TASKS.items():
        section = page.split(f"#### task={name.value}\n", 1)[1].split("\n#", 1)[0]
        listed = set(rows(section))
        assert {f"`task.options.{k}`" for k in option_parameters(cls)} <= listed, name
    keys = rows(page)
    for key in ("dataset", "datasets", "datasets.NAME.weight", "answer_tag", "answer_pattern", "environment",
                "environment_options", "interface", "max_turns", "tools", "tool_format", "sandbox.wall_s",
                "sandbox.max_output_bytes", "chat_template", "template"):
        assert f"`task.options.{key}`" in keys, key
    assert keys["`task.options.tool_format`"][0] == "one of `hermes`, `mistral`, `llama3`, `tokenizer`, `markdown`"
    # python_tool's group sets a smaller output cut than the sandbox's default
    assert keys["`task.options.sandbox.max_output_bytes`"][1:3] == ["`4096`", "`1024`"]
    assert keys["`task.options.environment`"][2] == "required"


def test_defaults_are_written_as_users_type_them():
    page = render()
    keys = rows(page)
    assert keys["`trainer.loggers`"][:3] == ["list of one of `jsonl`, `tensorboard`, `wandb`, `mlflow`", "`[jsonl]`",
                                            "`[jsonl]`"]
    assert keys["`model.lora.rank`"][:2] == ["int", "`0`"]  # model.lora expanded: a row per field
    assert keys["`model.lora.target_modules`"][1].startswith("`[q_proj, k_proj")
    assert "`model.lora`" not in keys
    assert keys["`task.options.answer_tag`"][1] == "`answer`" and keys["`model.pretrained_path`"][1] == "`null`"
    for python_repr in ("LoraSettings(", "<Logger", "'jsonl'", "None`", "True`", "False`"):
        assert python_repr not in page, python_repr


def test_the_configuration_pages_group_list_names_every_option_under_conf():
    """docs/configuration.md's `Groups:` paragraph lists each conf/<group>/ option by name (the reference's
    generated `Config groups` section describes them); an option added under conf/ and left out fails here."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    groups = text[text.index("Groups: "):].split("\n\n")[0]
    missing = [f"{d.name}/{f.stem}" for d in sorted((ROOT / "conf").iterdir()) if d.is_dir()
               for f in sorted(d.glob("*.yaml")) if not re.search(rf"\b{f.stem}\b", groups)]
    assert not missing, f"docs/configuration.md's Groups paragraph does not name {missing}"

"""docs/config-reference.md is the schema's: regenerating it from rl/config.py and conf/
(scripts/config_reference.py) gives the committed page byte for byte, so a field added,
renamed, re-typed, re-defaulted or re-commented without regenerating the page fails here."""

from dataclasses import dataclass, field
from pathlib import Path

from scripts.config_reference import PAGE, field_comments, render
from rl.config import Config, TrainerConfig

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
    assert field_comments(TrainerConfig)["lr"] == ""

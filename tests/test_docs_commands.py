"""Every `python train.py ...` command in README.md and docs/ composes as written: its
overrides go through train.py's own composition (`rl.config.compose`, then `load`), so a
command with a misspelt key, a wrong type or a missing `+` fails here. Commands that need a
real model or files are composed only; the others are validated too, as train.py would."""

import re
import shlex
from pathlib import Path

import pytest

from rl.config import compose, load, validate

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def commands(text: str) -> list[str]:
    """The `python train.py` commands of a Markdown text: inline (`...`, possibly wrapped over
    lines) or in a code block (to the end of the line, joining backslash continuations), each
    without its trailing # comment."""
    found = []
    for m in re.finditer(r"python train\.py", text):
        if text[m.start() - 1] == "`":  # inline code
            command = text[m.start():text.index("`", m.end())]
        else:
            end = m.end()
            while True:
                eol = text.find("\n", end)
                eol = len(text) if eol < 0 else eol
                if not text[:eol].rstrip().endswith("\\"):
                    break
                end = eol + 1
            command = text[m.start():eol]
        command = " ".join(command.replace("\\\n", " ").split())
        found.append(command.split(" #")[0].strip())
    return found


CASES = [(doc.relative_to(ROOT).as_posix(), command) for doc in DOCS for command in commands(doc.read_text())]


def overrides(command: str) -> list[str]:
    """The command's Hydra overrides; a sweep (-m) at the first value of each swept key."""
    args = shlex.split(command)[2:]
    out = []
    for arg in args:
        if arg in ("-m", "--multirun"):
            continue
        key, _, value = arg.partition("=")
        out.append(f"{key}={value.split(',')[0]}" if "-m" in args and "," in value else arg)
    return out


def test_the_docs_hold_the_commands_this_test_checks():
    assert len(CASES) >= 15, CASES
    assert any("task=math" in c and "task.options.chat_template=tokenizer" in c for _, c in CASES)
    assert any("resume=auto" in c for _, c in CASES)


@pytest.mark.parametrize("doc, command", CASES, ids=[f"{d}:{c[16:60]}" for d, c in CASES])
def test_a_documented_command_composes_as_written(doc, command):
    cfg = load(compose(overrides(command)))
    if not any(needs in command for needs in NEEDS_MORE):  # runs here as it stands: its start-up checks pass too
        validate(cfg, world_size=1)


# what a command needs beyond this checkout: a checkpoint, files, an extra, the SmolLM2 model
NEEDS_MORE = ("_path=", "reward_fn=", "engine=vllm", "+experiment=", "model=smollm2")


def test_a_command_with_a_wrong_key_fails_the_check():  # the control
    with pytest.raises(ValueError, match="did you mean trainer.max_steps"):
        load(compose(overrides("python train.py trainer.max_step=1")))
    with pytest.raises(ValueError, match="task.options.chat_templat: no such key"):
        load(compose(overrides("python train.py task=math task.options.chat_templat=tokenizer")))

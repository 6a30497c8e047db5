"""A static trace of `Trainer.step` (ast over rl/trainer/trainer.py): each stage enters each other
room at most once, and trainer.py imports nothing it does not use.

The stages are `step`'s own body and each call `step` makes of a Trainer method; a stage's trace takes in the
Trainer methods it calls in turn, at each call site (a helper called twice counts twice). An entry
is a call site (a loop's call is one), counted by its target:
  - a name trainer.py imports from the library (rl/, packing/, runtime/): its module;
  - a method of a part the trainer holds from another room (`self.rollout_scheduler.take(...)`,
    `self.engine...`, `self.task...`, train.py's `self.on_progress(...)`): that attribute.
The stage's own work is not an entry: calls on what the trainer trains and scores (`OWN`: the
models, their optimizers, the objective, the guard, the KL and LR controllers, the stage peaks),
on the network itself (model/: forward, MoE counters and aux loss, gradient clipping are the
training), on local objects, torch and the standard library.
"""

import ast
from collections import Counter
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[1] / "rl" / "trainer" / "trainer.py"
LIBRARY = ("rl", "packing", "runtime")  # model/ is the network the stages run: their own work
OWN = {"actor", "critic", "reference", "teacher", "optimizer", "critic_optimizer", "scheduler", "kl_ctl",
       "objective", "guard", "stage_peaks"}


def _imports(tree: ast.Module) -> dict[str, str]:
    """Every name the module imports at its top -> the module it comes from (`import a.b as c`: c -> a.b)."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names |= {a.asname or a.name: node.module for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0]: a.name for a in node.names}
    return names


def _self_attr(node: ast.expr) -> str | None:
    """`x` of `self.x`, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _calls(node: ast.AST):
    """The calls under `node` in source order."""
    return sorted((n for n in ast.walk(node) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))


def trace(source: str) -> tuple[dict[str, Counter], set[str]]:
    """Each stage's entries (room -> call sites) and the imported names never used."""
    tree = ast.parse(source)
    imported = _imports(tree)
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    methods = {f.name: f for f in trainer.body if isinstance(f, ast.FunctionDef)}
    assert OWN <= {_self_attr(t) for f in ast.walk(methods["__init__"]) if isinstance(f, ast.Assign)
                   for t in ast.walk(f.targets[0])}, "OWN names an attribute Trainer.__init__ does not set"

    def target(call: ast.Call) -> tuple[str, str] | None:
        """("method", a Trainer method), ("room", what it enters), or None (the stage's own work)."""
        f = call.func
        if isinstance(f, ast.Name) and imported.get(f.id, "").split(".")[0] in LIBRARY:
            return "room", imported[f.id]
        if (name := _self_attr(f)) in methods:
            return "method", name
        if name is not None and name not in OWN:  # a callable the trainer holds: self.on_progress(...)
            return "room", f"self.{name}"
        if isinstance(f, ast.Attribute) and (part := _self_attr(f.value)) is not None and part not in OWN:
            return "room", f"self.{part}"
        return None

    def entries(node: ast.AST, inside: tuple[str, ...], found: Counter) -> Counter:
        for call in _calls(node):
            kind, name = target(call) or (None, None)
            if kind == "method":
                assert name not in inside, f"Trainer.{name} calls itself"
                entries(methods[name], inside + (name,), found)
            elif kind == "room":
                found[name] += 1
        return found

    stages = {"step": Counter()}
    for call in _calls(methods["step"]):  # step's own entries; each method it calls is a stage (one per call:
        kind, name = target(call) or (None, None)  # `_release_memory` after each of three stages)
        if kind == "method":
            key = name if name not in stages else f"{name}:{call.lineno}"
            stages[key] = entries(methods[name], ("step", name), Counter())
        elif kind == "room":
            stages["step"][name] += 1
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return stages, set(imported) - used


def _twice(stages: dict[str, Counter]) -> dict[str, dict[str, int]]:
    return {stage: {room: n for room, n in rooms.items() if n > 1} for stage, rooms in stages.items()
            if any(n > 1 for n in rooms.values())}


def test_each_stage_of_the_step_enters_each_room_once_and_every_import_is_used():
    stages, unused = trace(TRAINER.read_text())
    assert {"step", "rollout", "plan", "collate", "score", "advantages", "train", "metrics"} <= set(stages)
    assert stages["rollout"]["self.rollout_scheduler"] == 1  # the whole rollout stage, one call
    assert _twice(stages) == {}
    assert unused == set()


def test_control_a_second_entry_or_an_unused_import_is_caught():
    """The stage as it was (the scheduler's `take` and then `rest` from `step`; dynamic sampling's
    filter twice) and an import left behind: each is reported."""
    source = TRAINER.read_text()
    stage = "            rollouts = self.rollout_scheduler.rollouts(step, log_samples=n)\n"
    assert stage in source
    source = source.replace(stage, stage + "            self.rollout_scheduler.rest()\n"
                            "            filter_uniform_groups(rollouts.samples)\n"
                            "            filter_uniform_groups(rollouts.samples)\n")
    source = source.replace("import math\n", "import math\nfrom rl.tasks.reward import filter_uniform_groups\n"
                            "from rl.rollout.samples import turn_counts\n")
    stages, unused = trace(source)
    assert _twice(stages) == {"rollout": {"self.rollout_scheduler": 2, "rl.tasks.reward": 2}}
    assert unused == {"turn_counts"}

"""The step as typed stages (rl/trainer/trainer.py): their order, and what each returns."""

import inspect
import sys
import typing

from testing.inprocess import SMALL, trainer
from rl.trainer.trainer import MiniBatch, Rollouts, StepPlan, Stats, Trainer

STAGES = ["rollout", "plan", "collate", "score", "advantages", "train", "metrics"]


def test_one_step_runs_the_stages_in_order_and_each_returns_its_type():
    tr = trainer(*SMALL, "trainer.max_steps=1", "eval.every=0")
    calls, returned = [], {}
    methods = {inspect.unwrap(f).__code__ for f in vars(Trainer).values() if callable(f)}  # score: no_grad-wrapped

    def profile(frame, event, arg):  # the Trainer methods `step` calls (directly or via a decorator)
        parent = frame.f_back
        if parent is not None and parent.f_code not in methods:  # a decorator's wrapper: its caller
            parent = parent.f_back
        if frame.f_code in methods and parent is not None and parent.f_code is Trainer.step.__code__:
            if event == "call":
                calls.append(frame.f_code.co_name)
            elif event == "return":
                returned[frame.f_code.co_name] = arg

    sys.setprofile(profile)
    try:
        tr.step(0)
    finally:
        sys.setprofile(None)
    assert [c for c in calls if not c.startswith("_")] == STAGES  # private helpers (_release_memory) are not stages
    hints = {name: typing.get_type_hints(getattr(Trainer, name)).get("return") for name in STAGES}
    assert hints["rollout"] is Rollouts and hints["plan"] is StepPlan and hints["train"] is Stats
    assert isinstance(returned["rollout"], Rollouts) and isinstance(returned["plan"], StepPlan)
    assert all(isinstance(mb, MiniBatch) for mb in returned["collate"]) and isinstance(returned["train"], Stats)
    assert not {"_local", "sampling"} & set(vars(tr))  # nothing handed between stages through the trainer

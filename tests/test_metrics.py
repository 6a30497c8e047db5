"""Run output: metrics.jsonl and TensorBoard continue a resumed run without its redone steps."""

from rl.trainer.metrics import MetricsWriter, plot_curves


def tensorboard_steps(folder, tag="reward_mean") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def test_a_resumed_run_replaces_the_steps_it_redoes_in_jsonl_and_tensorboard(tmp_path):
    first = MetricsWriter(tmp_path, tensorboard=True)
    for step in range(5):  # killed after step 4; its checkpoint holds 2 steps
        first.log({"step": step, "reward_mean": float(step)})
    first.close(plot=False)

    resumed = MetricsWriter(tmp_path, tensorboard=True, resume_step=2)
    for step in (2, 3):
        resumed.log({"step": step, "reward_mean": 10.0 + step})
    resumed.close(plot=False)

    lines = [(m["step"], m["reward_mean"]) for m in resumed.history]
    assert lines == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
    assert tensorboard_steps(tmp_path / "tensorboard") == lines


def test_control_without_purging_tensorboard_shows_both_histories(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for values in ((0.0, 1.0, 2.0), (None, 11.0)):  # a second writer redoing step 1, no purge_step
        tb = SummaryWriter(str(tmp_path))
        for step, value in enumerate(values):
            if value is not None:
                tb.add_scalar("reward_mean", value, step)
        tb.close()
    assert len(tensorboard_steps(tmp_path)) > 3  # step 1 twice (and the stale step 2)


def test_the_curves_draw_evaluations_only_where_they_were_made(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = {}
    original = matplotlib.axes.Axes.plot

    def spy(self, x, y, *args, label=None, **kwargs):
        drawn[label] = (list(x), list(y))
        return original(self, x, y, *args, label=label, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    history = [{"step": s, "reward_mean": 0.1 * s, **({"eval_accuracy": 0.5} if s % 5 == 0 else {})}
               for s in range(11)]
    assert plot_curves(history, tmp_path / "curves.png").stat().st_size > 0
    assert drawn["eval_accuracy"] == ([0, 5, 10], [0.5, 0.5, 0.5])  # no gaps, no NaN
    assert drawn["reward_mean"][0] == list(range(11))


def test_metrics_jsonl_is_never_left_empty(tmp_path):
    """A run that fails before its first step leaves no metrics.jsonl, not an empty one; the
    first line makes it. Control: a run with one step has exactly that line."""
    failed = MetricsWriter(tmp_path)
    failed.close(plot=False)
    assert not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')  # a run resumed from step 0
    MetricsWriter(tmp_path, resume_step=0).close(plot=False)
    assert not (tmp_path / "metrics.jsonl").exists()
    one = MetricsWriter(tmp_path)
    one.log({"step": 0, "reward_mean": 0.5})
    one.close(plot=False)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "reward_mean": 0.5}\n'


def test_a_failed_run_writes_its_error_to_the_log_and_a_failed_file(tmp_path):
    import logging

    from rl.trainer.metrics import FAILED, run_failed

    handler = logging.FileHandler(tmp_path / "train.log")
    logging.getLogger().addHandler(handler)
    try:
        try:
            raise RuntimeError("the reward server is down")
        except RuntimeError as e:
            run_failed(tmp_path, e)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    log = (tmp_path / "train.log").read_text()
    assert "the run failed" in log and "Traceback" in log and "RuntimeError: the reward server is down" in log
    assert "RuntimeError: the reward server is down" in (tmp_path / FAILED).read_text()
    MetricsWriter(tmp_path).close(plot=False)  # the run continued in its folder (resume): no longer failed
    assert not (tmp_path / FAILED).exists()

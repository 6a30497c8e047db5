"""RL post-training: `torchrun --nproc-per-node 8 train.py [hydra overrides]`.

The story of a run: check the config -> process groups and device -> policy, critic,
reference (each parallelized: EP, activation checkpointing, FSDP2), rollout engine, task
-> loop over steps (rollout -> plan -> collate -> score -> updates -> weight sync -> log).
The work lives in packing/, model/ and rl/.
"""

import logging
import os
import sys

from runtime.allocator import allocator_mode

allocator_mode()  # RL_ALLOCATOR checked before anything is built (runtime/allocator.py)

import hydra  # noqa: E402
import torch  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from tqdm import tqdm  # noqa: E402

from runtime.library_noise import silence_library_noise  # noqa: E402
from runtime.parallel_dims import ParallelDims, init_distributed  # noqa: E402
from rl.trainer.checkpoint import Checkpointer  # noqa: E402
from rl.config import (Config, check_command_line, learning_rate_warning, load, plot_warning, register,  # noqa: E402
                       validate)
from rl.trainer.metrics import MetricsWriter, code_commit, run_failed  # noqa: E402
from rl.trainer.run_folder import Held, RunFolderInUse, claim, register_run_id, start_folder  # noqa: E402
from rl.trainer.stop import StopSignal  # noqa: E402

register()
register_run_id()
log = logging.getLogger("train")


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> dict:
    out_dir = HydraConfig.get().runtime.output_dir
    try:
        return run(dict_cfg, out_dir)
    except RunFolderInUse:  # another run's folder: its train.log and FAILED mark are left alone
        raise
    except (Exception, KeyboardInterrupt) as error:  # the error and its traceback in train.log, the folder FAILED
        run_failed(out_dir, error)
        raise


def run(dict_cfg: DictConfig, out_dir: str) -> dict:
    silence_library_noise()  # before the imports that print it (torchao's kernels, its enums)
    from rl.trainer.build import build_generator, build_trainer  # transformers, the model code: after the checks

    cfg, dims, held = start_up(dict_cfg, out_dir)
    ckpt = Checkpointer(cfg, dims, out_dir)  # checkpoint.* and resume checked before any model is built
    if dims.generates:  # parallel.rollout_ranks: this rank only generates (rl/rollout/dedicated.py)
        return generate(build_generator(cfg, dims), ckpt, cfg, dims, held)

    trainer = build_trainer(cfg, dims)
    start = ckpt.resume(trainer)  # steps already done: 0, or those of the checkpoint `resume` names

    writer = MetricsWriter(out_dir, enabled=dims.rank == 0, loggers=cfg.trainer.loggers, resume_step=start,
                           project=cfg.trainer.project, config=OmegaConf.to_container(dict_cfg, resolve=True))
    if dims.rank == 0:  # the only rank that logs INFO: its two git calls are not repeated on every rank
        log.info("run folder %s; dp=%d cp=%d ep=%d rollout_ranks=%d on %s; code at commit %s", out_dir, dims.dp,
                 dims.cp, dims.ep, dims.rollout_ranks, dims.device, code_commit() or "unknown (not a git checkout)")
    bar = tqdm(range(start, cfg.trainer.max_steps), disable=dims.rank != 0 or not cfg.trainer.progress, desc="train")
    shown, now = {}, {}  # the last step's figures; what the running step is doing (decode t/T, turn, train i/n)

    def progress(**fields: str) -> None:
        now.update(fields)
        bar.set_postfix(shown | now, refresh=True)

    trainer.on_progress = progress if not bar.disable else None
    stopped = None  # the steps done when a stop signal (SIGTERM, SIGUSR1) ended the run early
    with StopSignal(dims) as stop:  # rl/trainer/stop.py: every rank stops after the same step
        for step in bar:
            now.clear()
            metrics = trainer.step(step)  # with the held-out evaluation of the policy it started from, when due
            writer.log(metrics, trainer.samples)  # samples: rank 0's first trainer.log_samples episodes of the step
            if "eval_accuracy" in metrics:
                log.info("step %d held-out accuracy %s (%d problems, %.0f s)", step, _accuracy(metrics),
                         len(trainer.heldout), metrics["eval_s"])
                shown["eval_acc"] = f"{metrics['eval_accuracy']:.3f}"
            log.info("step %d reward %.4f loss %.4g grad_norm %.4g tokens/s %.0f", step, metrics["reward_mean"],
                     metrics["loss"], metrics["grad_norm"], metrics["tokens_per_s"])
            shown.update(reward=f"{metrics['reward_mean']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
            bar.set_postfix(shown)
            saved = ckpt.after_step(trainer, step + 1)  # every checkpoint.every steps, and after the last
            if step + 1 < cfg.trainer.max_steps and stop.requested():
                stopped = step + 1
                saved = saved or ckpt.save(trainer, stopped)
                log.info("%s: stopped after %d of %d steps with the checkpoint %s; continue the run with resume=auto "
                         "(or resume=%s)", stop.received or "a stop signal on another rank", stopped,
                         cfg.trainer.max_steps, saved, saved)
                break
    if cfg.eval.every and start < cfg.trainer.max_steps and stopped is None:  # the trained policy
        final = {"step": cfg.trainer.max_steps, **trainer.evaluate()}
        writer.log(final)
        log.info("after %d steps: held-out accuracy %s (%d problems)", cfg.trainer.max_steps,
                 _accuracy(final), len(trainer.heldout))
    writer.close(plot=cfg.trainer.plot)
    held.close()
    if torch.distributed.is_initialized():  # a clean exit: no communicator torn down under a live thread
        torch.distributed.destroy_process_group()
    return writer.history[-1] if writer.history else {}


def generate(generator, ckpt: Checkpointer, cfg: Config, dims: ParallelDims, held: Held) -> dict:
    """A dedicated generator's run: its part of the checkpoint resumed (its queued rollouts, the
    policy the trainers push), then each step's rollout and checkpoint, in the trainers' step order,
    until the last step or a stop signal (the same collectives as the trainers': every rank stops
    after the same step and writes its part of the same checkpoint)."""
    start = ckpt.resume(generator)
    with StopSignal(dims) as stop:
        for step in range(start, cfg.trainer.max_steps):
            generator.step(step)
            saved = ckpt.after_step(generator, step + 1)
            if step + 1 < cfg.trainer.max_steps and stop.requested():
                if saved is None:
                    ckpt.save(generator, step + 1)
                break
    generator.close()
    held.close()
    torch.distributed.destroy_process_group()
    return {}


def start_up(dict_cfg: DictConfig, out_dir: str) -> tuple[Config, ParallelDims, Held]:
    """The config checked and resolved (`validate`'s return), the process group and device, the run
    folder claimed, the start-up warnings logged: before any model is built."""
    checked = validate(load(dict_cfg), world_size=int(os.environ.get("WORLD_SIZE", "1")))
    cfg, sizes = checked.cfg, checked.dims
    # model.param_dtype is FSDP2's mixed precision: one process gets a one-rank group to apply it
    dims = init_distributed(sizes.dp, sizes.cp, sizes.ep, device=cfg.trainer.device.value,
                            rollout_ranks=sizes.rollout_ranks, one_rank_group=cfg.model.param_dtype is not None)
    if dims.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)  # train.log gets one copy of each line
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1 if dims.ranks > 1 else torch.get_num_threads())

    # the run folder (and checkpoint.dir) locked for the run's life and seen by every rank, else a refusal on every rank
    held = claim([out_dir, cfg.checkpoint.dir], dims)
    if dims.rank == 0:  # the rank that logs and plots: each warning once, in the run's own train.log (after the claim)
        for warning in filter(None, (learning_rate_warning(cfg), plot_warning(cfg))):  # no matplotlib: plot off
            log.warning(warning)
    return cfg, dims, held


def _accuracy(metrics: dict) -> str:
    """The held-out accuracy as logged; a multi-turn task's with its first reply's."""
    if "eval_accuracy_turn1" in metrics:
        return f"{metrics['eval_accuracy']:.3f} (first reply {metrics['eval_accuracy_turn1']:.3f})"
    return f"{metrics['eval_accuracy']:.3f}"


if __name__ == "__main__":
    silence_library_noise()  # the check below reads a pretrained checkpoint's family: transformers, torchao
    try:  # the command line checked in seconds, before the heavy imports and before a run folder exists
        checked = check_command_line(sys.argv[1:])
        folder = start_folder(*checked) if checked is not None else None  # the run id, agreed by every rank
    except ValueError as e:
        sys.exit(f"config error: {e}")
    except RunFolderInUse as e:  # before Hydra writes into the other run's folder
        sys.exit(f"error: {e}")
    if folder is not None:
        sys.argv.append(f"hydra.run.dir={folder}")  # resume=auto: this experiment's newest run, continued in place
    main()

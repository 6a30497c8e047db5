"""RL post-training: `torchrun --nproc-per-node 8 train.py [hydra overrides]`.

The story of a run: check the config -> process groups and device -> policy, critic,
reference (each parallelized: EP, activation checkpointing, FSDP2), rollout engine, task
-> loop over steps (rollout -> plan -> collate -> score -> updates -> weight sync -> log).
The work lives in packing/, model/ and rl/.
"""

import logging
import os

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm import tqdm

from model.actor import Actor, Critic
from model.models import build_model
from model.parallel_dims import init_distributed
from model.parallelize import full_parameters, parallelize
from rl.config import Config, load, register, validate
from rl.metrics import MetricsWriter
from rl.rollout import HFRolloutEngine
from rl.tasks import build_task
from rl.trainer import Trainer

register()
log = logging.getLogger("train")


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> dict:
    cfg: Config = load(dict_cfg)
    validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep, device=cfg.trainer.device.value)
    if dims.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)  # train.log gets one copy of each line
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1 if dims.world_size > 1 else torch.get_num_threads())

    m = cfg.model
    dtype = getattr(torch, m.dtype.value)
    param_dtype = getattr(torch, m.param_dtype.value) if m.param_dtype is not None else None

    def new_model():
        return build_model(m.name.value, pretrained_path=m.pretrained_path, seed=cfg.seed, dtype=dtype, **m.overrides)

    def shard(module):
        return parallelize(module, dims, param_dtype=param_dtype,
                           activation_checkpointing=cfg.trainer.activation_checkpointing)

    actor = shard(Actor(new_model(), temperature=m.temperature, chunk_size=m.logprob_chunk_size, dims=dims))
    critic = shard(Critic(new_model(), dims=dims)) if cfg.algo.uses_critic else None
    reference = None
    if cfg.algo.kl_coef:
        reference = shard(Actor(new_model().requires_grad_(False), temperature=m.temperature, dims=dims))

    task = build_task(cfg.task.name, prompts_path=cfg.task.prompts_path, reward_fn=cfg.task.reward_fn,
                      tokenizer_path=cfg.task.tokenizer_path, vocab_size=actor.model.config.vocab_size,
                      **cfg.task.options)
    engine = HFRolloutEngine(new_model().to(dims.device), stop_token_id=getattr(task, "stop_token_id", None))
    engine.load_weights(full_parameters(actor.model))
    trainer = Trainer(cfg, dims, actor=actor, critic=critic, reference=reference, engine=engine, task=task)

    out_dir = HydraConfig.get().runtime.output_dir
    writer = MetricsWriter(out_dir, enabled=dims.rank == 0, tensorboard=cfg.trainer.tensorboard)
    log.info("run folder %s; dp=%d cp=%d ep=%d on %s", out_dir, dims.dp, dims.cp, dims.ep, dims.device)
    bar = tqdm(range(cfg.trainer.max_steps), disable=dims.rank != 0 or not cfg.trainer.progress, desc="train")
    for step in bar:
        metrics = trainer.step(step)
        writer.log(metrics)
        log.info("step %d reward %.4f loss %.4g grad_norm %.4g tokens/s %.0f", step, metrics["reward_mean"],
                 metrics["loss"], metrics["grad_norm"], metrics["tokens_per_s"])
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                        pad_eff=f"{metrics['padding_efficiency']:.2f}")
    writer.close(plot=cfg.trainer.plot)
    return writer.history[-1] if writer.history else {}


if __name__ == "__main__":
    main()

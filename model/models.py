"""`build_model`: a tiny seeded causal LM of a supported family, or a local checkpoint.

A family is a Hugging Face `model_type` whose attention goes through transformers'
attention interface (so the "varlen" attention of model/attention.py sees every layer)
and whose output head is a bias-free linear layer over the last hidden state. The dense
families share one forward path; `qwen3_moe` is the expert-parallel one (model/moe.py).

A checkpoint's family comes from its `config.json` (`model_type`): nothing else has to
name it, and an unsupported `model_type` is refused before any weight is read. Random-init
models and checkpoints are built with transformers directly, on every device (the trainer
loads a checkpoint sharded, model/loading.py). Nothing is downloaded.

`device="meta"` builds a checkpoint's module tree without storage (the dtype, config and
attention of a plain load): model/loading.py then fills each rank's shard of it after
sharding, so no rank reads the whole checkpoint.
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch
import transformers
from transformers import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM

from model.attention import VARLEN  # importing it registers the "varlen" attention
from model.families import DENSE, FAMILIES, MOE

# The tiny random-init shape every family shares (tests, benches and `model=dense_tiny`).
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=2048,
)
TINY_MOE = dict(
    TINY,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,  # every layer sparse
    mlp_only_layers=[],
)

# what a family changes of the shared tiny shape: phi3's and qwen2's configs have no head_dim field
# (their attention derives hidden / heads), phi3's default special token ids lie outside the tiny vocabulary
_NO_HEAD_DIM = {k: v for k, v in TINY.items() if k != "head_dim"}
_TINY = {"phi3": {**_NO_HEAD_DIM, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}, "qwen2": _NO_HEAD_DIM,
         "qwen3_moe": TINY_MOE}
# model_type -> (config class, model class, tiny defaults), for every family of model/families.py
MODELS = {name: (CONFIG_MAPPING[name], MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[name]], _TINY.get(name, TINY))
          for name in FAMILIES}

# read by the modeling code although the config's __init__ does not name them
_EXTRA_KEYS = {"head_dim", "rope_theta"}
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def family(name: str, *, key: str = "model.name", config: dict | None = None) -> str:
    """`name` if it is a supported family; else an error naming it and the supported ones
    (an MoE checkpoint, by its config's expert fields, is told that only qwen3_moe is)."""
    if name not in MODELS:
        moe = "moe" in name.lower() or any(k in (config or {}) for k in _MOE_KEYS)
        kind = "MoE family" if moe else "model family"
        raise ValueError(f"{key}={name!r}: unsupported {kind}; supported: dense {sorted(DENSE)}, "
                         f"MoE (expert parallel) {sorted(MOE)}")
    return name


def checkpoint_family(path: str | Path, *, key: str = "model.pretrained_path") -> str:
    """The family of the checkpoint folder `path`, read from its `config.json` (no weights
    are read); errors name the folder (as config `key`) and what is missing or unsupported."""
    folder = Path(path)
    config, fields = folder / "config.json", checkpoint_config(folder)
    if fields is None:
        raise ValueError(f"{key}={str(path)!r}: no config.json in the folder (a Hugging Face "
                         f"checkpoint folder, as written by save_pretrained, is expected)")
    if fields.get("model_type") is None:
        raise ValueError(f"{key}={str(path)!r}: config.json has no model_type")
    name = family(fields["model_type"], key=f"model_type in {config}", config=fields)  # unsupported: said first
    if not any((folder / w).is_file() for w in _WEIGHTS):
        raise ValueError(f"{key}={str(path)!r}: no weights in the folder (expected one of "
                         f"{list(_WEIGHTS)})")
    return name


def checkpoint_config(path: str | Path) -> Mapping[str, Any] | None:
    """The fields of the checkpoint folder `path`'s config.json (read-only), None without one. Read once
    per version of the file (its path, size and modification time): the start-up checks, the teacher's
    and the trainer's build ask for it again and again."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    stat = config.stat()
    return _read_config(str(config.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _read_config(path: str, size: int, mtime_ns: int) -> Mapping[str, Any]:
    return MappingProxyType(json.loads(Path(path).read_text()))


def model_config_value(cfg: Any, key: str) -> tuple[Any, str]:
    """A Hugging Face config field of the run's model (`cfg.model`, rl/config/schema.py) and where
    it comes from, read without building the model: `model.overrides`, else the checkpoint's
    config.json, else the tiny family default."""
    if key in cfg.model.overrides:
        return cfg.model.overrides[key], f"model.overrides.{key}"
    if cfg.model.pretrained_path is not None:
        fields = checkpoint_config(cfg.model.pretrained_path)
        return config_field(fields or {}, key), f"{key} of {Path(cfg.model.pretrained_path) / 'config.json'}"
    return MODELS[cfg.model.name.value][2].get(key), f"model.overrides.{key} (default)"


def config_field(fields: Mapping[str, Any], key: str) -> Any:
    """The field `key` of a checkpoint's config.json `fields`, also where its family's config class
    saves it under another name (its `attribute_map`: transformers 5 writes qwen3_moe's `num_experts`
    as `num_local_experts`); None when absent."""
    family = MODELS.get(fields.get("model_type"))
    return fields.get(key, fields.get(family[0].attribute_map.get(key, key)) if family else None)


def check_expert_split(experts: int | None, ep: int, what: str, where: str = "") -> None:
    """`parallel.ep` divides the expert count `experts` (None or 0: a dense model), named `what` from `where`, at
    start-up: what model/moe.py's `ExpertParallelExperts` would refuse once the model is built."""
    if experts and ep > 1 and experts % ep:
        raise ValueError(f"parallel.ep={ep} does not divide {what}={experts}{where}: each EP rank holds "
                         "num_experts / ep experts")


def model_family(cfg: Any) -> str:
    """The run's model family: the checkpoint's `model_type` (checked against `model.name`
    when both are given), else `model.name`."""
    if cfg.model.pretrained_path is None:
        return cfg.model.name.value
    found = checkpoint_family(cfg.model.pretrained_path)
    if cfg.model.name is not None and cfg.model.name.value != found:
        raise ValueError(f"model.name={cfg.model.name.value!r} but model.pretrained_path={cfg.model.pretrained_path!r} "
                         f"holds a {found!r} checkpoint (set model.name=null: the checkpoint names its family)")
    return found


def build_model(
    name: str | None = "qwen3",
    *,
    pretrained_path: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = VARLEN,
    device: str | torch.device | None = None,
    **config_overrides,
) -> transformers.PreTrainedModel:
    """A causal LM on CPU: tiny random weights of family `name` seeded by `seed`, or the
    checkpoint at `pretrained_path` (its family from its config.json; a `name` given too
    must agree). With `device="meta"`: the same model without its weights (every tensor on
    the meta device), for `model.loading.load_sharded` or `model.loading.materialize`.

    `config_overrides` are Hugging Face config fields (e.g. `num_hidden_layers=4`); an
    unknown key raises a ValueError naming it. The global RNG is left untouched.
    """
    meta = device is not None and torch.device(device).type == "meta"
    if device is not None and not meta:
        raise ValueError(f"build_model: device={device!r}, expected None (CPU) or 'meta'")
    if pretrained_path is not None:
        found = checkpoint_family(pretrained_path)
        if name is not None and name != found:
            raise ValueError(f"model.name={name!r} but the checkpoint {pretrained_path} is a {found!r} model "
                             f"(leave model.name unset: the checkpoint's config.json names its family)")
    config = model_config(name, pretrained_path=pretrained_path, **config_overrides)
    if pretrained_path is not None:
        if meta:
            return _skeleton(config, dtype, attn_implementation)
        return _load(pretrained_path, config, dtype, attn_implementation)
    model_cls = MODELS[family(name)][1]
    if meta:
        with torch.device("meta"):
            lm = model_cls(config)
        lm.set_attn_implementation(attn_implementation)
        return lm.to(dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = model_cls(config)
    lm.set_attn_implementation(attn_implementation)
    return lm.to(dtype)


def compute_copy(lm: transformers.PreTrainedModel, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """`lm` (meta or real) with its parameters in the compute `dtype` and its buffers as they are: what
    FSDP2's `MixedPrecisionPolicy(param_dtype=dtype)` computes with (it casts parameters only, so the
    rotary `inv_freq` stays fp32). The rollout copy built this way samples from the training forward's
    numbers. A tied head stays tied (one parameter)."""
    for param in lm.parameters():
        param.data = param.data.to(dtype)
    return lm


def model_config(name: str | None, *, pretrained_path: str | None = None,
                 **config_overrides) -> transformers.PretrainedConfig:
    """The Hugging Face config `build_model` builds its model from, without a weight: the
    checkpoint's config.json, or the tiny defaults of family `name`, with `config_overrides`."""
    if pretrained_path is not None:
        _check_keys(MODELS[checkpoint_family(pretrained_path)][0], config_overrides)
        return _config(pretrained_path, config_overrides)
    if name is None:
        raise ValueError("build_model: model.name is needed for a random-init model (no model.pretrained_path)")
    config_cls, _, tiny = MODELS[family(name)]
    _check_keys(config_cls, config_overrides)
    return config_cls(**{**tiny, **config_overrides})


def _config(path, overrides):
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _skeleton(config, dtype, attn_implementation) -> transformers.PreTrainedModel:
    """What `_load` builds before it reads a weight: the same config, dtype and attention,
    every tensor on meta, in eval mode (as `from_pretrained` returns a model)."""
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return lm.eval()


def _load(path, config, dtype, attn_implementation) -> transformers.PreTrainedModel:
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

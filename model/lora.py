"""LoRA adapters on the policy (`model.lora.*`; rank 0 = off, the default), through PEFT.

    apply_lora(lm, settings, seed=...)     # before parallelize: adapters injected in place, base frozen
    with adapters_disabled(lm): ...        # the reference policy: the same weights without the adapters
    merged_state_dict(lm)                  # stock names, W + (alpha / r) B A: a plain Hugging Face model's

Why PEFT and not a module of our own: `peft.inject_adapter_in_model` replaces each targeted
`nn.Linear` by a `lora.Linear` holding it (`base_layer`) and two small linears (`lora_A`,
`lora_B`), in place: the causal LM keeps its class, its `.model` / `get_output_embeddings()` /
config, so the Actor's forward, the packed THD and shared-prompt views (which only change what
attention sees: positions, boundaries, the prompt layout) and activation checkpointing (per
decoder layer) run unchanged. FSDP2 shards each decoder layer with its frozen base weights
and trainable adapters in one unit: only parameters that require grad get gradients, so
only the adapters are reduce-scattered, clipped and stepped (tests/test_lora.py checks the
packed, padded, shared-prompt, checkpointed and 2- and 4-rank FSDP2 forwards against the
model with the adapter merged into its weights). Users get the adapter format they know: the
export writes a folder `PeftModel.from_pretrained` loads.

What is adapted: `model.lora.target_modules` names linear layers by their last name (PEFT's
suffix match): attention and dense MLP projections. The MoE router (`mlp.gate`) is never
adapted, and the fused expert weights of `qwen3_moe` (3-D parameters, not linears) are not:
naming an MLP projection on an MoE model is refused at start-up (`check_targets`), naming
`model.lora.target_modules`.

Initialisation is PEFT's default (A Kaiming-uniform, B zero: the adapted policy starts as the
base), drawn from `seed` on every rank alike, on the device the model will train on when the
base is still a meta skeleton (model/loading.py fills the base and keeps the adapters).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

ADAPTER = "default"  # PEFT's adapter name: state-dict keys read "...q_proj.lora_A.default.weight"
BASE = ".base_layer"  # PEFT's name of the wrapped linear: "...q_proj.base_layer.weight"
ROUTER = ("gate", "router")  # MoE routers: never adapted
MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")  # dense MLP names; in qwen3_moe fused experts
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's `max_lora_rank` choices
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraSettings:
    """`model.lora`: rank 0 = no adapters (full fine-tuning)."""

    rank: int = 0  # the adapters' rank r; 0 = no adapters (full fine-tuning)
    alpha: float = 32.0  # the update is (alpha / rank) B A
    dropout: float = 0.0  # on the adapter's input, in training only
    # linear layers adapted, by their last name (attention and dense MLP projections; never the MoE router)
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))


def check_settings(settings: LoraSettings, *, moe: bool, engine: str) -> None:
    """The start-up checks of `model.lora.*`, each naming its field."""
    if settings.rank < 0:
        raise ValueError(f"model.lora.rank={settings.rank}: expected >= 0 (0 = no adapters)")
    if not settings.rank:
        return
    if settings.alpha <= 0:
        raise ValueError(f"model.lora.alpha={settings.alpha}: expected > 0")
    if not 0 <= settings.dropout < 1:
        raise ValueError(f"model.lora.dropout={settings.dropout}: expected in [0, 1)")
    if engine == "vllm" and settings.rank > VLLM_LORA_RANKS[-1]:
        raise ValueError(f"model.lora.rank={settings.rank} with rollout.engine=vllm: vLLM's largest adapter rank "
                         f"is {VLLM_LORA_RANKS[-1]}")
    check_targets(list(settings.target_modules), moe=moe)


def check_targets(targets: list[str], *, moe: bool) -> None:
    if not targets:
        raise ValueError("model.lora.target_modules=[]: name at least one linear layer (e.g. q_proj, v_proj)")
    router = sorted(set(targets) & set(ROUTER))
    if router:
        raise ValueError(f"model.lora.target_modules={targets} names the MoE router {router}: the router is never "
                         "adapted (routing replay and the aux loss read its live logits)")
    fused = sorted(set(targets) & set(MLP))
    if moe and fused:
        raise ValueError(f"model.lora.target_modules={targets} names MLP projections {fused} on an MoE model: its "
                         "experts are fused [E, 2I, H] / [E, H, I] parameters, which get no adapters here; "
                         "adapt attention only, e.g. model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")


def peft_config(settings: LoraSettings):
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(settings.target_modules), bias="none")


def apply_lora(lm: nn.Module, settings: LoraSettings, *, seed: int = 0,
               device: torch.device | str | None = None) -> nn.Module:
    """Inject adapters into the causal LM `lm` in place (before `parallelize`) and freeze
    everything else; returns `lm`. A meta skeleton's adapters are allocated on `device` and
    initialised, its base left for model/loading.py; with `device=None` they stay on meta
    too (the rollout engine's copy, filled whole by its first weight sync)."""
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    check_targets(list(settings.target_modules), moe=_is_moe(lm))
    inject_adapter_in_model(peft_config(settings), lm)
    lm.requires_grad_(False)
    layers = [m for m in lm.modules() if isinstance(m, LoraLayer)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in layers:
            parts = (layer.lora_A[ADAPTER], layer.lora_B[ADAPTER])
            for part in parts:
                if part.weight.is_meta and device is not None:
                    part.to_empty(device=device)
                part.requires_grad_(True)
            if not any(part.weight.is_meta for part in parts):
                layer.reset_lora_parameters(ADAPTER, True)
    return lm


def _is_moe(lm: nn.Module) -> bool:
    from model.moe import is_moe

    return is_moe(lm)


def has_adapters(module: nn.Module) -> bool:
    """True when `module` holds LoRA adapters (by name: no PEFT import for a run without them)."""
    return any(is_adapter(name) for name, _ in module.named_parameters())


def is_adapter(name: str) -> bool:
    """True for a state-dict key of an adapter tensor (`...lora_A.default.weight`)."""
    return ".lora_A." in name or ".lora_B." in name


def stock_name(name: str) -> str:
    """The Hugging Face key of a base weight (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(BASE + ".", ".")


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer holds: the adapters only when `module` has any (and then
    each must be an adapter: a trainable base weight is an error), else every parameter."""
    if not has_adapters(module):
        return list(module.parameters())
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    stray = [n for n, _ in named if not is_adapter(n)]
    if stray:
        raise RuntimeError(f"LoRA: {len(stray)} non-adapter parameters require grad (e.g. {stray[0]})")
    return [p for _, p in named]


@contextlib.contextmanager
def adapters_disabled(lm: nn.Module) -> Iterator[None]:
    """The base model: every adapter skipped (PEFT's `enable_adapters(False)`), then restored.
    The reference log-probs of a LoRA run come from here: no reference copy is built."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in lm.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@torch.no_grad()
def merged_state_dict(lm: nn.Module) -> dict[str, torch.Tensor]:
    """`lm`'s state dict under stock names with each adapter merged into its base weight
    (W + scaling B A, PEFT's `get_delta_weight`); an unsharded model. What a plain model of
    the same class loads (`load_state_dict`), and what the merged export writes."""
    from peft.tuners.lora import LoraLayer

    deltas = {f"{name}{BASE}.weight": m.get_delta_weight(ADAPTER)
              for name, m in lm.named_modules() if isinstance(m, LoraLayer)}
    out = {}
    for name, value in lm.state_dict().items():
        if is_adapter(name):
            continue
        delta = deltas.get(name)
        out[stock_name(name)] = value if delta is None else (value + delta.to(value.dtype))
    return out


def adapter_bytes(module: nn.Module) -> int:
    """Bytes of the adapter tensors (full, unsharded shapes) in their own dtype."""
    return sum(t.numel() * t.element_size() for n, t in module.state_dict().items() if is_adapter(n))

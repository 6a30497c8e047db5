"""The training cost of one sample: :class:`FlopCost` (``linear * t + attention * t**2``
FLOPs for a ``t``-token sample) and :func:`flop_cost`, which reads it from a model config.

packing/planner.py balances microbatches by it (``batch.balance=flops``); the trainer's MFU
and bench/roofline.py count by the same convention. Pure Python (no torch).
"""

# No `from __future__ import annotations`: with it, @dataclass looks the module up in
# sys.modules, which fails when a script loads this file by path (as the tests do).
import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["FlopCost", "flop_cost"]


@dataclass(frozen=True)
class FlopCost:
    """Training FLOPs (forward + backward) of one sample of ``t`` tokens:
    ``linear * t + attention * t**2``.

    ``linear`` covers the matmuls whose work grows with the token count (attention
    projections, MLP or the active experts, LM head); ``attention`` the causal score and
    value products, which grow with the square of the sample's own length (packed samples
    do not attend to each other). Only the ratio of the two matters for balancing.
    """

    linear: float
    attention: float

    def __post_init__(self) -> None:
        for name in ("linear", "attention"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v < math.inf:
                raise ValueError(f"FlopCost.{name} must be a finite number >= 0, got {v!r}")

    def __call__(self, tokens: int) -> float:
        return self.linear * tokens + self.attention * tokens * tokens


def flop_cost(config: object) -> FlopCost:
    """:class:`FlopCost` of a decoder from its Hugging Face-style config (attributes, or
    keys of a mapping; a multimodal config's ``text_config``).

    Read: ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
    ``num_key_value_heads`` (default: the heads), ``head_dim`` (default: hidden / heads),
    ``vocab_size``, and ``intermediate_size`` for a dense SwiGLU MLP. An MoE config
    (``num_experts_per_tok`` set) counts the *active* experts only: ``num_experts_per_tok``
    experts of ``moe_intermediate_size`` (default ``intermediate_size``, as in Mixtral),
    plus shared experts (``shared_expert_intermediate_size`` as in Qwen2-MoE, or
    ``n_shared_experts`` of the expert size as in DeepSeek) and the router
    (``num_experts`` / ``num_local_experts`` / ``n_routed_experts``).

    Convention (the usual model-FLOPs count): a matmul costs 2 FLOPs per weight per token
    forward and twice that backward, so ``linear = 6 * matmul weights`` (LM head included,
    embedding lookup not). Causal attention of a ``t``-token sample computes ``t**2 / 2``
    query-key pairs per head, each ``2 * head_dim`` FLOPs for the scores and as many for
    the weighted values, again x3 for the backward: ``attention = 6 * layers * heads *
    head_dim``. Not modelled: FlashAttention's recompute in the backward (~7/6 more
    attention work), sliding windows, MLA, dense layers between MoE layers.
    """
    text = config.get("text_config") if isinstance(config, Mapping) else getattr(config, "text_config", None)
    config = text or config  # a multimodal config's decoder
    layers = _config_int(config, "num_hidden_layers")
    hidden = _config_int(config, "hidden_size")
    heads = _config_int(config, "num_attention_heads")
    if min(layers, hidden, heads) < 1:
        raise ValueError(f"flop_cost: need layers, hidden size and heads >= 1, got {layers}, {hidden}, {heads}")
    kv_heads = _config_int(config, "num_key_value_heads", heads)
    head_dim = _config_int(config, "head_dim", hidden // heads)
    vocab = _config_int(config, "vocab_size")
    # q and o are hidden x (heads * head_dim); k and v hidden x (kv_heads * head_dim).
    attention_proj = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    matmul_weights = layers * (attention_proj + _mlp_weights(config, hidden)) + hidden * vocab
    return FlopCost(linear=6.0 * matmul_weights, attention=6.0 * layers * heads * head_dim)


def _mlp_weights(config: object, hidden: int) -> int:
    """Weights of one layer's MLP that a token multiplies by (gate, up and down each)."""
    active = _config_int(config, "num_experts_per_tok", 0)
    if not active:
        return 3 * hidden * _config_int(config, "intermediate_size")
    expert = _config_int(config, "moe_intermediate_size", 0) or _config_int(config, "intermediate_size")
    shared = _config_int(config, "shared_expert_intermediate_size", 0)
    shared += _config_int(config, "n_shared_experts", 0) * expert
    experts = next((n for name in ("num_experts", "num_local_experts", "n_routed_experts")
                    if (n := _config_int(config, name, 0))), 0)
    return 3 * hidden * (active * expert + shared) + hidden * experts


_REQUIRED = object()


def _config_int(config: object, name: str, default: object = _REQUIRED) -> int:
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"flop_cost: the config has no {name!r} (type {type(config).__name__})")
        return default  # type: ignore[return-value]
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"flop_cost: config {name} must be an int, got {value!r}") from None
    if v < 0:
        raise ValueError(f"flop_cost: config {name} = {v} is negative")
    return v

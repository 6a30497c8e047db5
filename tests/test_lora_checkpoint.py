"""LoRA checkpoints: adapters + their AdamW state only (DCP), a SIGKILLed run resumes bit for bit,
and the export writes a PEFT folder and a merged Hugging Face folder that score like the policy.

The run: the default tiny MoE with rank-4 adapters on attention (its experts are fused: MLP
targets are refused), a KL term whose reference is the policy with its adapters off.
"""

from __future__ import annotations

import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp

from model.lora import LoraSettings, apply_lora
from model.models import build_model
from rl.trainer.checkpoint import complete_checkpoints
from rl.trainer.export import main as export_main
from tests.test_checkpoint import RUN, launch, metrics, ok

pytestmark = pytest.mark.slow

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
        "algo.kl_coef=0.05", "trainer.lr=1e-2"]
TINY_RUN = dict(vocab_size=64, max_position_embeddings=512)  # conf/model/moe_tiny.yaml's overrides


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    ok(launch(out, *RUN, *LORA))
    return out, metrics(out)


def test_killed_lora_run_resumes_with_the_uninterrupted_metrics(uninterrupted, tmp_path):
    _, want = uninterrupted
    out = tmp_path / "run"
    killed = launch(out, *RUN, *LORA, "checkpoint.every=2", kill="after_step:5")
    assert killed.returncode == -signal.SIGKILL
    assert len(metrics(out)) == 5
    ok(launch(out, *RUN, *LORA, "checkpoint.every=2", "resume=auto"))
    got = metrics(out)
    assert got == want  # step 4 re-run once; 5..7 bit for bit (losses, KL to the adapters-off reference, sync bytes)
    assert all(m["kl"] > 0 for m in got[1:])  # the reference is the base: the adapters moved the policy away
    sync = {m["weight_sync_bytes"] for m in got}
    full_bytes = 4 * sum(p.numel() for p in build_model("qwen3_moe", **TINY_RUN).parameters())  # fp32
    assert len(sync) == 1 and 0 < sync.pop() < 0.2 * full_bytes
    # the control: a run without LoRA sends every weight
    full = tmp_path / "full"
    ok(launch(full, "trainer.max_steps=1", "trainer.plot=false", "trainer.progress=false"))
    assert metrics(full)[0]["weight_sync_bytes"] > 5 * got[0]["weight_sync_bytes"]


def test_lora_checkpoint_holds_adapters_and_exports_peft_and_merged(uninterrupted, tmp_path):
    run, _ = uninterrupted
    path = complete_checkpoints(run / "checkpoints")[-1]
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("actor.weights.")]
    moments = [k for k in keys if k.startswith("actor.optimizer.state.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)  # no base weight
    assert moments and all(".lora_A." in k or ".lora_B." in k for k in moments)

    out = tmp_path / "export"
    export_main([str(path), str(out)])
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = build_model("qwen3_moe", seed=0, **TINY_RUN)  # the run's base: the default tiny MoE, seed 0
    peft = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    # the trainer's policy: the same base, the checkpoint's adapters
    policy = apply_lora(build_model("qwen3_moe", seed=0, **TINY_RUN), LoraSettings(rank=4, alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj"]))
    state = {f"actor.weights.model.{k}": v for k, v in policy.state_dict().items() if ".lora_" in k}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = peft(ids).logits, merged(ids).logits, policy.eval()(ids).logits
        untrained = build_model("qwen3_moe", seed=0, **TINY_RUN)(ids).logits
    scale = float(c.abs().max())
    assert float((a - c).abs().max()) <= 16 * torch.finfo(torch.float32).eps * scale  # PEFT folder: the policy
    assert float((b - c).abs().max()) <= 16 * torch.finfo(torch.float32).eps * scale  # merged folder: the policy
    assert float((untrained - c).abs().max()) > 1e-3 * scale  # control: the base alone is another model

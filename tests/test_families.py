"""Any supported Hugging Face family loads from its checkpoint folder and trains packed like padded.

Each family is a tiny random checkpoint written here with `save_pretrained` (tied and untied
output heads), loaded the way a run loads it (`build_model(None, pretrained_path=...)`: the
family comes from its config.json). The parity tests carry the suite's fp32 tolerance
(tests/parity_check.py) and a control: the same pack with its boundaries withheld misses it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_records
from testing.inprocess import SMALL, compose, trainer
from omegaconf import OmegaConf
from tests.parity_check import assert_control_fails, assert_parity
from transformers import AutoModelForCausalLM

from model.actor import Actor
from model.families import FAMILIES, MOE
from model.models import DENSE, MODELS, TINY, build_model
from packing.collate import make_experience_batch
from rl.config import ModelName

# (family, tied output head): every family, llama and qwen2 tied, llama untied too
CASES = [(f, f in ("llama", "qwen2")) for f in FAMILIES] + [("llama", False)]
LENGTHS = [5, 33, 12, 2, 20]
# what the run's tiny models change of model/models.py TINY (vocabulary, context): a checkpoint the run's tasks fit
RUN_SIZE = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "conf/model/dense_tiny.yaml").overrides)


def tiny_checkpoint(folder, family: str, tied: bool, **overrides) -> str:
    """A seeded random model of `family` written as a Hugging Face folder."""
    model = build_model(family, seed=3, tie_word_embeddings=tied, **overrides)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def loaded(request, tmp_path_factory):
    family, tied = request.param
    path = tiny_checkpoint(tmp_path_factory.mktemp(family), family, tied)
    return family, tied, build_model(None, pretrained_path=path)


def per_sample_diff(a, batch_a, b, batch_b, records) -> float:
    def split(values, batch):
        starts = [0]
        if batch.is_packed:
            for n in batch.packed_seq_lens:
                starts.append(starts[-1] + n)
            return [values[0, s:e - 1] for s, e in zip(starts[:-1], starts[1:])]
        return [values[i, :r.sequences.numel() - 1] for i, r in enumerate(records)]

    return max((x - y)[r.action_mask].abs().max().item()
               for x, y, r in zip(split(a, batch_a), split(b, batch_b), records))


def test_the_family_comes_from_the_checkpoint_and_the_head_stays_tied(loaded):
    family, tied, lm = loaded
    assert lm.config.model_type == family and isinstance(lm, MODELS[family][1])
    same = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    assert same == tied


def test_packed_log_probs_and_grads_match_padded_with_a_control(loaded):
    family, _, lm = loaded
    records = make_records(LENGTHS, seed=2)
    padded, pack = make_experience_batch(records, packed=False), make_experience_batch(records, packed=True)
    actor = Actor(lm)
    lp_pad, lp_pack = actor(padded), actor(pack)
    scale = lp_pad.abs().max()
    assert_parity(f"{family} log-probs packed vs padded", per_sample_diff(lp_pad, padded, lp_pack, pack, records),
                  scale)

    def grads(lp, batch):
        actor.zero_grad(set_to_none=True)
        (-(batch.advantages * lp * batch.action_mask).sum() / batch.action_mask.sum()).backward()
        out = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
        actor.zero_grad(set_to_none=True)
        return out

    g_pad, g_pack = grads(lp_pad, padded), grads(lp_pack, pack)
    top = max(g.abs().max().item() for g in g_pad.values())
    diff = max((g_pad[n] - g_pack[n]).abs().max().item() for n in g_pad)
    assert_parity(f"{family} grads packed vs padded (relative to max |grad|)", diff / top, 1.0)

    # control: the pack as ONE sequence (no boundaries, positions 0..N-1) leaks across samples
    with torch.no_grad():
        ids = pack.sequences
        hidden = lm.model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).last_hidden_state
        logp = torch.log_softmax(lm.lm_head(hidden).float(), -1)
        leaked = logp[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        leaked = torch.cat([leaked, leaked.new_zeros(1)])[None] * pack.action_mask
    assert_control_fails(f"{family} pack without boundaries",
                         per_sample_diff(lp_pad.detach(), padded, leaked, pack, records), scale)


# ------------------------------------------------------------------ one list of families
def test_every_family_of_the_one_list_is_a_config_choice_and_builds_its_tiny_model():
    """model/families.py is the only list: the config's model.name choice and the model registry
    are that list, and each name composes as model.name and builds a tiny causal LM of its own
    model_type and the shared tiny shape, with experts exactly when it is an MoE family."""
    assert ModelName.values() == list(MODELS) == list(FAMILIES)
    ids = torch.randint(0, TINY["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(0))
    for name in FAMILIES:
        assert compose(f"model.name={name}").model.name is ModelName(name)
        lm = build_model(name)
        assert lm.config.model_type == name and type(lm).__name__.endswith("ForCausalLM"), (name, type(lm))
        shape = {k: getattr(lm.config, k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
        assert shape == {k: TINY[k] for k in shape}, (name, shape)
        experts = getattr(lm.config, "num_experts", None)
        assert bool(experts) == (name in MOE), (name, experts)
        with torch.no_grad():
            assert lm(ids).logits.shape == (1, 7, TINY["vocab_size"]), name


# ------------------------------------------------------------------ bad input
def test_an_unsupported_family_is_refused_before_any_weight_loads(tmp_path):
    for model_type, kind in (("gpt2", "model family"), ("mixtral", "MoE family")):
        folder = tmp_path / model_type
        folder.mkdir()
        fields = {"model_type": model_type, **({"num_local_experts": 8} if kind == "MoE family" else {})}
        (folder / "config.json").write_text(json.dumps(fields))
        (folder / "model.safetensors").write_bytes(b"not read")  # an unreadable file: never opened
        with pytest.raises(ValueError) as e:
            compose("model=pretrained", f"model.pretrained_path={folder}")
        message = str(e.value)
        assert f"{model_type!r}: unsupported {kind}" in message and all(f in message for f in DENSE), message
        assert "qwen3_moe" in message
    weightless = tmp_path / "gpt2_no_weights"  # a gpt2 folder without weights: the family is the first problem
    weightless.mkdir()
    (weightless / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2': unsupported model family"):
        compose("model=pretrained", f"model.pretrained_path={weightless}")


def test_a_folder_without_config_or_weights_is_refused_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"model.pretrained_path=.*: no config.json in the folder"):
        compose("model=pretrained", f"model.pretrained_path={tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"model.pretrained_path=.*: no weights in the folder"):
        compose("model=pretrained", f"model.pretrained_path={tmp_path}")


def test_a_model_name_that_disagrees_with_the_checkpoint_is_refused(tmp_path):
    path = tiny_checkpoint(tmp_path / "ck", "llama", True)
    with pytest.raises(ValueError, match=r"model.name='qwen3' but .* holds a 'llama' checkpoint"):
        compose("model=pretrained", "model.name=qwen3", f"model.pretrained_path={path}")
    assert compose("model=pretrained", f"model.pretrained_path={path}").model.name is None



def test_a_checkpoints_config_json_is_read_once_per_start_up(tmp_path, monkeypatch):
    """The start-up checks ask the student's config.json for its family (three times), its expert count and
    its vocabulary, the teacher's for its family, experts and vocabulary; train.py checks the command line
    and then validates again in the run, and the build asks once more: each file is read once
    (model/models.py checkpoint_config). Control: a file written again is read again, its new value seen."""
    from model.models import _read_config, model_config_value, model_family

    student = tiny_checkpoint(tmp_path / "student", "qwen3_moe", False, **RUN_SIZE)
    teacher = tiny_checkpoint(tmp_path / "teacher", "qwen3_moe", False, **RUN_SIZE)
    _read_config.cache_clear()
    reads, read_text = [], Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        reads.append(self.parent.name) if self.name == "config.json" else None, read_text(self, *a, **k))[1])
    run = ("model=pretrained", f"model.pretrained_path={student}", "algo.advantage=distill",
           f"algo.teacher.path={teacher}", "parallel.ep=2")
    cfg = compose(*run, world_size=2)
    compose(*run, world_size=2)
    assert model_family(cfg) == "qwen3_moe" and model_config_value(cfg, "vocab_size")[0] == RUN_SIZE["vocab_size"]
    assert sorted(reads) == ["student", "teacher"], reads
    fields = json.loads(read_text(Path(student) / "config.json"))
    (Path(student) / "config.json").write_text(json.dumps({**fields, "vocab_size": 1000}))
    assert model_config_value(cfg, "vocab_size")[0] == 1000 and sorted(reads) == ["student", "student", "teacher"]

# ----------------------------------------- tied head: train, sync, checkpoint, export
def test_a_tied_checkpoint_trains_syncs_checkpoints_and_exports_to_the_same_logits(tmp_path):
    from rl.trainer.checkpoint import save_checkpoint
    from rl.trainer.export import export

    path = tiny_checkpoint(tmp_path / "ck", "llama", True, **RUN_SIZE)
    overrides = ("model=pretrained", f"model.pretrained_path={path}", "model.dtype=float32", *SMALL)
    tr = trainer(*overrides)
    before = tr.actor.model.lm_head.weight.detach().clone()
    tr.step(0)
    lm = tr.actor.model
    assert lm.lm_head.weight is lm.get_input_embeddings().weight  # still one tensor after an update
    assert not torch.equal(lm.lm_head.weight, before)  # and it was updated
    engine = tr.engine.model
    assert torch.equal(engine.lm_head.weight, lm.lm_head.weight)  # the rollout copy got the new weights

    saved = save_checkpoint(tr, tmp_path / "checkpoints", 1, compose(*overrides), tr.dims)
    out = export(saved, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.config.tie_word_embeddings and exported.config.model_type == "llama"
    ids = torch.randint(0, RUN_SIZE["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, engine(ids).logits, rtol=0, atol=1e-5)


# ------------------------------------------- CP, FSDP2 and activation checkpointing
@pytest.mark.slow
def test_a_tied_llama_checkpoint_under_cp2_fsdp2_and_activation_checkpointing_runs_like_one_process(tmp_path):
    """torchrun 2 ranks, cp=2 (the FSDP2 mesh spans both) with activation checkpointing vs one
    process: the same rollouts (rewards) and the same losses to fp32 rounding."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = tiny_checkpoint(tmp_path / "ck", "llama", True, **RUN_SIZE)
    common = ["model=pretrained", f"model.pretrained_path={path}", "model.dtype=float32", "trainer.max_steps=3",
              "task.prompts_per_step=4", "task.samples_per_prompt=4", "trainer.progress=false", "trainer.plot=false",
              "checkpoint.final=false"]

    def run(name, *extra, nproc=1):
        out = tmp_path / name
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        f"--nproc-per-node={nproc}"]
        proc = subprocess.run([*launcher, "train.py", f"hydra.run.dir={out}", *common, *extra], cwd=root,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    one = run("one")
    cp2 = run("cp2", "parallel.cp=2", "trainer.activation_checkpointing=true", nproc=2)
    assert [m["reward_mean"] for m in cp2] == [m["reward_mean"] for m in one]
    for a, b in zip(one, cp2):
        for key in ("loss", "entropy", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])

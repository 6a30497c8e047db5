"""A checkpoint's policy as a Hugging Face folder: `python -m rl.trainer.export CKPT OUT`.

    python -m rl.trainer.export outputs/<run>/checkpoints/step_00000020 exported/
    python -m rl.trainer.export outputs/<run>/checkpoints exported/     # the newest complete checkpoint
    AutoModelForCausalLM.from_pretrained("exported/")            # the trained policy
    python train.py model=pretrained model.pretrained_path=exported/

OUT gets config.json and model.safetensors (`save_pretrained`), plus the tokenizer when the
run named one (task.tokenizer_path, or a tokenizer in model.pretrained_path). The model is
rebuilt in one process from the checkpoint's hf_config.json (the original pretrained folder
is not needed) and DCP fills its state dict in place from the policy's saved weights,
gathering the shards of whatever layout saved them; the optimizer state is not read. Peak
memory is one copy of the model.

A LoRA run (`model.lora.rank > 0`, model/lora.py) checkpoints its adapters only: the base is
rebuilt as the run built it (`model.pretrained_path`, or the seed's random init), the adapters
are read into a PEFT model of it, and OUT gets two folders: `OUT/adapter/`, the PEFT adapter
(`PeftModel.from_pretrained(base, "OUT/adapter")`), and OUT itself, the merged Hugging Face
model (W + (alpha / r) B A, PEFT's `merge_and_unload`).

A policy that never moved is exported with a warning (logger `export`), found exactly: LoRA
adapters whose lora_B tensors are all zero (their start: the merged model is the base); full
fine-tuning weights equal, tensor for tensor, to the run's start: model.pretrained_path's
safetensors files read one tensor at a time (no second model in memory; no verdict when a
weight is not found there), or a random-init model rebuilt from the seed. A run whose every
step had no reward signal (or trainer.lr=0) writes its starting point.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from runtime.library_noise import quiet_single_process, silence_library_noise

silence_library_noise()  # before transformers and peft import torchao (its kernels' and enums' noise)

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import yaml  # noqa: E402

from model.lora import LoraSettings, is_adapter, peft_config  # noqa: E402
from model.models import MODELS, build_model, family  # noqa: E402
from rl.trainer.checkpoint import find_checkpoint  # noqa: E402

log = logging.getLogger("export")

POLICY = "actor.weights."  # checkpoint keys of the policy: "actor.weights." + Actor state-dict name
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the policy of `checkpoint` (a checkpoint folder, or a folder of them: the newest)
    to the Hugging Face folder `out`; returns `out`."""
    path, out = find_checkpoint(checkpoint), Path(out)
    saved = yaml.safe_load((path / "config.yaml").read_text())
    if saved["model"].get("lora", {}).get("rank"):
        return _export_lora(path, out, saved)
    hf_config = path / "hf_config.json"
    config_cls, model_cls, _ = MODELS[family(json.loads(hf_config.read_text())["model_type"])]
    config = config_cls.from_json_file(str(hf_config))
    dtype = getattr(torch, saved["model"]["dtype"])
    config.dtype = dtype
    model = model_cls(config).to(dtype)
    # Actor names its causal LM `model`: the LM's "lm_head.weight" is the Actor's "model.lm_head.weight"
    state = {f"{POLICY}model.{k}": v for k, v in model.state_dict().items()}
    stored = {k for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata if k.startswith(POLICY)}
    missing, extra = sorted(state.keys() - stored), sorted(stored - state.keys())
    if missing or extra:
        raise ValueError(f"export: checkpoint {path} does not hold a {model_cls.__name__}: "
                         f"missing {missing[:3]}, unexpected {extra[:3]}")
    with quiet_single_process():
        dcp.load(state, checkpoint_id=path, no_dist=True)  # in place into the model's tensors
    if _unchanged(model, saved):
        log.warning("export: the weights of %s equal the run's starting weights (%s), tensor for tensor: no update "
                    "changed the policy, %s", path, saved["model"]["pretrained_path"] or "the random init of seed "
                    f"{saved['seed']}", _WHY)
    model.save_pretrained(out)
    _copy_tokenizer(saved, out)
    return out


def _export_lora(path: Path, out: Path, saved: dict) -> Path:
    """The adapters of `path` on the run's base: `out/adapter` (PEFT) and `out` (merged)."""
    from peft import get_peft_model

    m = saved["model"]
    settings = LoraSettings(**m["lora"])
    base = build_model(m["name"], pretrained_path=m["pretrained_path"], seed=saved["seed"],
                       dtype=getattr(torch, m["dtype"]), **m["overrides"])  # as the trainer built it
    peft_model = get_peft_model(base, peft_config(settings))
    # PEFT's names "base_model.model.<LM key>" <- the checkpoint's "actor.weights.model.<LM key>"
    own = {k: v for k, v in peft_model.state_dict().items() if is_adapter(k)}
    state = {f"{POLICY}model.{k.removeprefix('base_model.model.')}": v for k, v in own.items()}
    # adapter entries only: checkpoints before the fix in sharded_state also hold a tied lm_head.weight
    stored = {k for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
              if k.startswith(POLICY) and is_adapter(k)}
    if state.keys() != stored:
        raise ValueError(f"export: checkpoint {path} does not hold the adapters of model.lora={m['lora']}: "
                         f"missing {sorted(state.keys() - stored)[:3]}, unexpected {sorted(stored - state.keys())[:3]}")
    with quiet_single_process():
        dcp.load(state, checkpoint_id=path, no_dist=True)  # in place into the adapters
    b = [v for k, v in own.items() if ".lora_B." in k]
    if not any(bool(v.any()) for v in b):
        log.warning("export: all %d lora_B tensors of %s are zero, as they start: the adapters change nothing and the "
                    "merged model is the base; %s", len(b), path, _WHY)
    peft_model.peft_config["default"].base_model_name_or_path = (
        str(Path(m["pretrained_path"]).resolve()) if m["pretrained_path"] else None)
    peft_model.save_pretrained(out / "adapter")
    peft_model.merge_and_unload().save_pretrained(out)
    _copy_tokenizer(saved, out)
    return out


_WHY = ("the usual causes: trainer.lr=0, or no step with reward signal (train.log warns 'no prompt group had "
        "rewards that differ' and names what the task's reward reads)")


def _unchanged(model: torch.nn.Module, saved: dict) -> bool:
    """Whether `model`'s weights equal, exactly, those the run started from (the module docstring);
    False when not every weight could be compared."""
    m, state = saved["model"], model.state_dict()
    if not m.get("pretrained_path"):
        start = build_model(m["name"], seed=saved["seed"], dtype=getattr(torch, m["dtype"]),
                            **m["overrides"]).state_dict()
        return start.keys() == state.keys() and all(torch.equal(v, start[k]) for k, v in state.items())
    from safetensors import safe_open

    first = {v.data_ptr(): k for k, v in reversed(list(state.items()))}  # a tied weight: its first name only
    wanted, compared = {k for k, v in state.items() if first[v.data_ptr()] == k}, set()
    for file in sorted(Path(m["pretrained_path"]).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in wanted.intersection(f.keys()):
                if not torch.equal(state[key], f.get_tensor(key).to(state[key].dtype)):
                    return False
                compared.add(key)
    return compared == wanted


def _copy_tokenizer(saved: dict, out: Path) -> None:
    for folder in (saved["task"].get("tokenizer_path"), saved["model"].get("pretrained_path")):
        if folder and any((Path(folder) / f).is_file() for f in _TOKENIZER_FILES):
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(folder, local_files_only=True).save_pretrained(out)
            return


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rl.trainer.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (step_N) or a folder of them (the newest is taken)")
    parser.add_argument("out", help="the Hugging Face folder to write")
    args = parser.parse_args(argv)
    out = export(args.checkpoint, args.out)
    print(f"exported {find_checkpoint(args.checkpoint)} -> {out}")


if __name__ == "__main__":
    main()

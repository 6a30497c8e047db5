"""The GPU check: on one GPU node, in under 8 minutes, one JSON line of figures (last line).

    launch/gpu_check.sh                                      # every section, on CUDA
    python launch/gpu_check.py --device cpu --sections parity,shared,cp   # the CPU rehearsal (tests/test_launch.py)

Sections, each in its own process(es) with a time limit (a failure is recorded and the
next section still runs; the exit code is 1 when any section failed):

  parity  packed [1, N] vs padded [B, T] log-probs of a tiny Qwen3 and Qwen3-MoE (bf16 on
          CUDA: the varlen kernel of model.attention=auto for the pack, torch's own or
          flash-attn, model/kernels.py; masked sdpa for the padded batch), as
          max |diff| over max |log-prob| on the scored slots, plus the control that
          withholds the pack's boundaries (it must break the tolerance). MoE routing is
          recorded on the padded forward and replayed (R3) in both, so a near-tie in the
          router cannot flip an expert between layouts; the live-routing figure is shown too.
  shared  the shared-prompt forward (each GRPO prompt once) vs the unshared pack, dense and
          MoE, fp32: log-probs, entropy, gradients, MoE aux loss, token counts, expert load,
          recorded routing; and the host syncs CUDA reports in one forward
          (scripts/gpu_shared_prompts.py).
  cp      the actor with cp=2 (torchrun, 2 ranks; NCCL on CUDA) vs the same actor in one
          process on each rank, packed and padded, fp32 and (CUDA) bf16.
  grads   world-size gradient parity on NCCL: the rank body of tests/test_fsdp.py
          (scripts/dist_train_worker.py, FSDP2) under torchrun instead of the gloo test launcher.
  layout  `python train.py` vs `torchrun --nproc-per-node 4 train.py parallel=cp2_ep2`
          (2 GPUs: parallel=ep2): reward, loss and grad_norm of the first 3 steps.
  train   the 20-step `make train` (torchrun, parallel=cp2_ep2 on 4 or 8 GPUs) on CUDA:
          reward of the first and last step.
  async   the rollout thread on its own CUDA stream (rl/rollout/producer.py), 4 steps of the
          default job: rollout.mode=async at max_staleness=1 vs one_step_off (the same samples:
          reward, loss, grad_norm within the layout tolerance), async at max_staleness=2 (its
          staleness 0, 1, 2, 2), and the overlap each measured.

Every run folder and log lands in --work (default outputs/gpu_check/<time>).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SECTIONS = ("parity", "shared", "cp", "grads", "layout", "async", "train")  # async before train: never run on CUDA yet
LIMIT_S = {"parity": 150, "shared": 120, "cp": 150, "grads": 240, "layout": 240, "train": 300, "async": 90}  # per run
BUDGET_S = 460  # all sections together: the check stays under 8 minutes
LENGTHS = [5, 200, 37, 120, 9, 64]  # uneven samples, longer than scripts/parity_check.py's CPU ones
MODELS = {"dense": "qwen3", "moe": "qwen3_moe"}
# max |diff| / max |log-prob|: 64 fp32 eps (4 x PARITY_ULPS of scripts/parity_check.py, the bound measured on
# CPU kernel sets), 2 bf16 eps
TOLERANCE = {torch.float32: 64 * torch.finfo(torch.float32).eps, torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps}
GRAD_TOL = 1e-5  # tests/test_fsdp.py's bound (params relative to max |param|, grad norms relative)
LAYOUT_TOL = 1e-4  # issue 11 item 9: same reward, loss and grad_norm for the first 3 steps
LAYOUT_KEYS = ("reward_mean", "loss", "grad_norm")
# world -> case -> (model, ep, cp, packed): the cases of tests/test_fsdp.py that fit the world
GRAD_CASES = {
    4: {"dense-dp4": ("qwen3", 1, 1, True), "moe-dp4-ep2": ("qwen3_moe", 2, 1, True),
        "dense-dp2-cp2": ("qwen3", 1, 2, True), "dense-dp2-cp2-padded": ("qwen3", 1, 2, False),
        "moe-dp2-cp2-ep2": ("qwen3_moe", 2, 2, True)},
    2: {"dense-dp2": ("qwen3", 1, 1, True), "moe-dp2-ep2": ("qwen3_moe", 2, 1, True),
        "dense-cp2": ("qwen3", 1, 2, True)},
}


# ------------------------------------------------------------- model bodies
def _records(vocab: int, seed: int = 0):
    from packing.experience import Experience

    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        prompt = int(torch.randint(1, n, (1,), generator=gen))  # >= 1 response token
        out.append(Experience(sequences=torch.randint(0, vocab, (n,), generator=gen),
                              action_mask=torch.arange(n - 1) >= prompt - 1))
    return out


def _actor(name: str, dtype: torch.dtype, dims):
    """A seeded tiny model (the same weights on every rank) in an Actor, parallelized for `dims`."""
    from model.actor import Actor
    from model.models import build_model
    from model.parallelize import parallelize

    # initializer_range 0.2: peaked next-token distributions, like a trained model's (as tests/test_actor_replay.py)
    model = build_model(name, seed=0, dtype=dtype, initializer_range=0.2)
    return parallelize(Actor(model, chunk_bytes=128 * 4 * model.config.vocab_size, dims=dims), dims).eval()


def _one_process(device: torch.device):
    from model.parallel_dims import ParallelDims

    return ParallelDims(device=device)


def _replayed(actor, records, device):
    """MoE: each record gets the routing of a padded forward (R3), so every layout routes alike."""
    from model.moe import moe_blocks, record_routing
    from packing.collate import make_experience_batch

    if not moe_blocks(actor.model, strict=False):
        return records
    padded = make_experience_batch(records, packed=False).to(device)
    with torch.no_grad(), record_routing(actor.model) as rec:
        actor(padded)
    routed = rec.routed_experts.cpu()  # [B, L, K, T]
    return [dataclasses.replace(r, routed_experts=routed[b, ..., : r.sequences.numel()]) for b, r in enumerate(records)]


@torch.no_grad()
def _scored(actor, records, packed: bool, device) -> torch.Tensor:
    """Log-probs of every scored slot (action_mask True), samples in order: the same slots in both layouts."""
    from packing.collate import make_experience_batch

    batch = make_experience_batch(records, packed=packed).to(device)
    return actor(batch)[batch.action_mask].float().cpu()


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-30))


def _device(name: str) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch.cuda.is_available() is False")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dtypes(device: torch.device) -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] if device.type == "cuda" else [torch.float32]


def worker_parity(args) -> dict:
    from model import kernels
    from packing.collate import make_experience_batch
    from packing.experience import Experience

    device = _device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel = kernels.select("auto", device, dtype)  # model.attention=auto, as a run's start-up
    out = {"dtype": str(dtype).removeprefix("torch."), "tolerance": TOLERANCE[dtype],
           "pack_attention": kernels.NAMES[kernel]}
    ok = kernel != "sdpa" or device.type == "cpu"
    if not ok:
        out["error"] = ("no varlen kernel on this GPU: torch >= 2.10 has torch.nn.attention.varlen, or "
                        "pip install -r requirements-gpu.txt (flash-attn)")
    for kind, name in MODELS.items():
        actor = _actor(name, dtype, _one_process(device))
        live = _records(actor.model.config.vocab_size)
        records = _replayed(actor, live, device)
        ref = _scored(actor, records, False, device)
        rel = _rel(ref, _scored(actor, records, True, device))
        live_ref = _scored(actor, live, False, device)
        pack = make_experience_batch(live, packed=True).to(device)  # control: the pack as one sequence
        with torch.no_grad():
            whole = Experience(sequences=pack.sequences, attention_mask=torch.ones_like(pack.sequences, dtype=torch.bool))
            control = torch.nn.functional.pad(actor(whole), (0, 1))[pack.action_mask].float().cpu()
        out[kind] = {"logp_rel": rel, "control_rel": _rel(live_ref, control), "scale": float(ref.abs().max())}
        if kind == "moe":
            out[kind]["live_routing_logp_rel"] = _rel(live_ref, _scored(actor, live, True, device))
        ok = ok and rel <= TOLERANCE[dtype] < out[kind]["control_rel"]
    return {"ok": ok, **out}


def worker_cp(args) -> dict:
    from model.parallel_dims import init_distributed

    dims = init_distributed(cp=int(os.environ.get("WORLD_SIZE", "1")), device=args.device)
    device = dims.device
    out, ok = {"cp": dims.cp, "backend": torch.distributed.get_backend()}, True
    for kind, name in MODELS.items():
        for dtype in _dtypes(device):
            one, sharded = _actor(name, dtype, _one_process(device)), _actor(name, dtype, dims)
            records = _replayed(one, _records(one.model.config.vocab_size), device)
            figures = {}
            for layout, packed in (("packed", True), ("padded", False)):
                figures[layout] = _rel(_scored(one, records, packed, device), _scored(sharded, records, packed, device))
            out[f"{kind}_{str(dtype).removeprefix('torch.')}"] = figures
            ok = ok and max(figures.values()) <= TOLERANCE[dtype]
    return {"ok": _all_ranks(ok), **out}


def worker_grads(args) -> dict:
    import torch.distributed as dist

    from model.parallel_dims import init_distributed

    from scripts.dist_train_worker import fsdp_checks  # the rank body of tests/test_fsdp.py

    init_distributed(device=args.device)  # NCCL on CUDA, gloo on CPU; each case builds its meshes on this group
    rank, world = dist.get_rank(), dist.get_world_size()
    if world not in GRAD_CASES:
        raise ValueError(f"grads: world {world}, expected one of {sorted(GRAD_CASES)}")
    out, ok = {"world": world, "backend": dist.get_backend(), "tolerance": GRAD_TOL}, True
    for case, (name, ep, cp, packed) in GRAD_CASES[world].items():
        r = fsdp_checks(rank, world, name, ep, cp, packed)  # 3 clipped AdamW steps, FSDP2 vs one process
        norm_diff = max(abs(a - b) / b for a, b in zip(r["norms"], r["one_norms"]))
        worst = [None] * world
        dist.all_gather_object(worst, max(r["param_diff"], norm_diff))
        out[case] = max(worst)
        ok = ok and out[case] <= GRAD_TOL
    return {"ok": ok, **out}


def _all_ranks(ok: bool) -> bool:
    flags = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(flags, bool(ok))
    return all(flags)


def worker_shared(args) -> dict:
    """The shared-prompt forward vs the unshared pack, dense and MoE, fp32, and the syncs CUDA
    reports in one forward (scripts/gpu_shared_prompts.py)."""
    from scripts.gpu_shared_prompts import figures

    return figures(args.device)


WORKERS = {"parity": worker_parity, "shared": worker_shared, "cp": worker_cp, "grads": worker_grads}


# ------------------------------------------------------------ metrics files
def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (did the run write its metrics there?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare_layouts(one: list[dict], many: list[dict], steps: int = 3) -> dict:
    """max |diff| per key of `LAYOUT_KEYS` over the first `steps` steps of two runs."""
    if len(one) < steps or len(many) < steps:
        raise ValueError(f"layout: runs logged {len(one)} and {len(many)} steps, expected >= {steps}")
    out = {key: max(abs(float(a[key]) - float(b[key])) for a, b in zip(one[:steps], many[:steps]))
           for key in LAYOUT_KEYS}
    return {"ok": max(out.values()) <= LAYOUT_TOL, "tolerance": LAYOUT_TOL, **out}


def summarize_async(runs: dict[str, list[dict]], steps: int = 4) -> dict:
    """async at max_staleness=1 steps as one_step_off (`compare_layouts` over every step);
    max_staleness=2 reaches staleness 2 at step 2; every run's mean overlap."""
    same = compare_layouts(runs["one_step_off"], runs["async_k1"], steps)
    staleness = [float(m["rollout_staleness_max"]) for m in runs["async_k2"]]
    want = [float(min(s, 2)) for s in range(steps)]
    overlap = {name: sum(float(m.get("rollout_overlap", 0.0)) for m in rows) / max(len(rows), 1)
               for name, rows in runs.items()}
    return {"ok": same["ok"] and staleness == want, "k1_vs_one_step_off": same, "k2_staleness": staleness,
            "overlap": overlap}


def summarize_train(rows: list[dict], steps: int) -> dict:
    """`make train` learns: all steps logged, reward rises by > 0.2 (issue 11's bar)."""
    if not rows:
        raise ValueError("train: metrics.jsonl is empty")
    first, last = float(rows[0]["reward_mean"]), float(rows[-1]["reward_mean"])
    return {"ok": len(rows) == steps and last - first > 0.2, "steps": len(rows),
            "reward_first": first, "reward_last": last}


# --------------------------------------------------------------- orchestration
class SectionFailed(RuntimeError):
    pass


@dataclasses.dataclass
class Check:
    device: str
    work: pathlib.Path
    deadline: float
    ngpu: int

    def run(self, name: str, cmd: list[str], limit: float) -> None:
        """Run `cmd` from the repo root, its output in work/<name>.log; raise SectionFailed on failure."""
        log = self.work / f"{name}.log"
        left = self.deadline - time.monotonic()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            # a session of its own: on timeout the whole tree (torchrun and its ranks) is killed
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, min(limit, left)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = f"timeout after {min(limit, left):.0f} s"
        if rc != 0:
            tail = log.read_text(errors="replace").splitlines()[-12:]
            raise SectionFailed(f"exit {rc} (log {log}): " + " | ".join(tail))

    def worker(self, name: str, nproc: int | None = None) -> dict:
        out = self.work / f"{name}.json"
        me = [str(pathlib.Path(__file__).resolve()), "--worker", name, "--out", str(out), "--device", self.device]
        launch = [sys.executable] if nproc is None else torchrun(nproc)
        try:
            self.run(name, launch + me, LIMIT_S[name])
        except SectionFailed as e:
            for error in sorted(self.work.glob(f"{name}.rank*.error")):  # the first rank that raised
                lines = error.read_text().strip().splitlines()
                raise SectionFailed(f"{error.name}: " + " | ".join(line.strip() for line in lines[-3:])) from e
            raise
        return json.loads(out.read_text())

    def train(self, name: str, run_dir: pathlib.Path, steps: int, nproc: int | None = None,
              overrides: tuple[str, ...] = ()) -> list[dict]:
        launch = [sys.executable] if nproc is None else torchrun(nproc)
        args = [str(ROOT / "train.py"), f"trainer.device={self.device}", f"trainer.max_steps={steps}",
                "trainer.progress=false", "trainer.plot=false", f"hydra.run.dir={run_dir}", *overrides]
        self.run(name, launch + args, LIMIT_S[name])
        return read_metrics(run_dir)


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def section_parity(c: Check) -> dict:
    return c.worker("parity")


def section_shared(c: Check) -> dict:
    return c.worker("shared")


def section_cp(c: Check) -> dict:
    return c.worker("cp", nproc=2)


def section_grads(c: Check) -> dict:
    return c.worker("grads", nproc=4 if c.ngpu >= 4 else 2)


def section_layout(c: Check) -> dict:
    nproc, parallel = (4, "cp2_ep2") if c.ngpu >= 4 else (2, "ep2")
    one = c.train("layout", c.work / "layout_1", 3)
    many = c.train("layout", c.work / f"layout_{nproc}", 3, nproc, (f"parallel={parallel}",))
    return {"ranks": nproc, "parallel": parallel, **compare_layouts(one, many)}


def section_train(c: Check) -> dict:
    nproc = min(8, c.ngpu)
    parallel = "cp2_ep2" if nproc in (4, 8) else "auto"  # `make train`'s layout where the world allows
    rows = c.train("train", c.work / "train", 20, nproc, (f"parallel={parallel}",))
    return {"ranks": nproc, "parallel": parallel, **summarize_train(rows, 20)}


def section_async(c: Check) -> dict:
    modes = {"one_step_off": ("rollout.mode=one_step_off",),
             "async_k1": ("rollout.mode=async", "rollout.max_staleness=1"),
             "async_k2": ("rollout.mode=async", "rollout.max_staleness=2")}
    return summarize_async({name: c.train("async", c.work / f"async_{name}", 4, None, (*extra, "algo.tis_cap=2.0"))
                            for name, extra in modes.items()})


def needs_gpus(name: str, ngpu: int, device: str) -> str | None:
    """Why a section cannot run here (None: it can)."""
    if device == "cpu":
        return None
    need = {"parity": 1, "shared": 1, "cp": 2, "grads": 2, "layout": 2, "train": 1, "async": 1}[name]
    return f"needs {need} GPUs, found {ngpu}" if ngpu < need else None


def assemble(results: dict[str, dict], env: dict, seconds: float) -> dict:
    """The one JSON line: environment, every section's figures, what failed and what was skipped."""
    failed = [n for n, r in results.items() if r.get("ok") is False]
    skipped = [n for n, r in results.items() if "skipped" in r]
    return {"ok": not failed, "failed": failed, "skipped": skipped, "seconds": round(seconds, 1), **env, **results}


def environment(device: str) -> dict:
    env = {"device": device, "torch": torch.__version__, "gpus": 0, "gpu": None, "flash_attn": None}
    if device == "cuda" and torch.cuda.is_available():
        env.update(gpus=torch.cuda.device_count(), gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
        try:
            import flash_attn

            env["flash_attn"] = flash_attn.__version__
        except ImportError:
            pass
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--work", type=pathlib.Path, default=None, help="folder for logs and run folders")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all sections together")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)  # a section's process body
    p.add_argument("--out", type=pathlib.Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        try:
            result = WORKERS[args.worker](args)
        except Exception:  # the orchestrator reports this rank's traceback, not torchrun's summary
            args.out.with_name(f"{args.out.stem}.rank{os.environ.get('RANK', '0')}.error").write_text(traceback.format_exc())
            raise
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            args.out.write_text(json.dumps(result))
        if torch.distributed.is_initialized():  # a clean exit: no communicator torn down under a live thread
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        return 0

    names = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        p.error(f"--sections: unknown {unknown}, expected a subset of {list(SECTIONS)}")
    start = time.monotonic()
    work = args.work or ROOT / "outputs" / "gpu_check" / time.strftime("%Y-%m-%d_%H-%M-%S")
    work.mkdir(parents=True, exist_ok=True)
    env = environment(args.device)
    check = Check(args.device, work, start + args.budget, env["gpus"] if args.device == "cuda" else 2)
    results = {}
    for name in names:
        t0 = time.monotonic()
        why = needs_gpus(name, check.ngpu, args.device)
        if why is not None:
            results[name] = {"skipped": why}
            continue
        if time.monotonic() >= check.deadline:  # not run is not passed
            results[name] = {"ok": False, "error": f"not run: out of time (budget {args.budget:.0f} s)"}
            continue
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        try:
            results[name] = globals()[f"section_{name}"](check)
        except Exception as e:  # a failed section is a figure too; the next one still runs
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"gpu_check: {name} ok={results[name].get('ok')} ({results[name]['seconds']} s)", file=sys.stderr, flush=True)
    report = assemble(results, {**env, "work": str(work)}, time.monotonic() - start)
    (work / "gpu_check.json").write_text(json.dumps(report) + "\n")
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

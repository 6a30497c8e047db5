"""On-policy distillation's teacher: the start-up checks, the frozen model and its self-test.

The student samples, the teacher scores each sampled token: in the score stage
(rl/trainer/trainer.py) one no-grad forward of the teacher over the step's collated pack
(the same `Actor` forward as the policy's: shared prompts, CP, EP; its own MoE routing,
never the student's replay records) puts `teacher_action_log_probs` on the batch, and the
estimator `algo.advantage=distill` (or `algo.distill_coef` added to another estimator's,
rl/algos/advantages.py) turns -(log p_student - log p_teacher) per token into advantages.

Start-up, before any model is built (`check_teacher`, from `rl.config.validate`): the keys
agree with each other, `algo.teacher.path` is a checkpoint of a supported family, and the
teacher shares the student's vocabulary (config.json `vocab_size`) and tokenizer (each
tokenizer file, the special tokens and the chat template compared by sha256). After the
teacher is built (`build_teacher`), `self_test` compares its log-probs on a few fixed
sequences with a plain transformers forward of the checkpoint and refuses a difference
above `algo.teacher.self_test_tol`.

Where the teacher lives (`algo.teacher.placement`, `TeacherPlacement`): its own FSDP2 shards on
the training device for the whole run (`sharded`), or the same shards parked in host memory
between steps and moved onto the device for the score stage only (`offload`, `teacher_on_device`).
The rollout's memory plan (rl/rollout/replica.py) counts the teacher's shard bytes either way.
With dedicated rollout ranks (`parallel.rollout_ranks`, rl/rollout/dedicated.py) the teacher is the
trainers' alone: sharded over their mesh, self-tested with the verdict shared over their group, scored
in their score stage; a generator builds none and only samples (tests/test_dedicated_distill.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl.choice import Choice

# the tokenizer files compared whole (a file one side has and the other lacks differs too)
TOKENIZER_FILES = ("tokenizer.json", "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")
# tokenizer_config.json entries compared (not the whole file: it names its own path and class)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "added_tokens_decoder",
                      "additional_special_tokens")
# the self-test's bound on max |log p_teacher - log p_plain| when algo.teacher.self_test_tol is null
SELF_TEST_TOL = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.1}
SELF_TEST_LENGTHS = (9, 6, 12)  # the fixed sequences' lengths (token ids from a fixed seed)


class TeacherPlacement(Choice):
    """`algo.teacher.placement`: where the teacher's weights live between score stages."""

    SHARDED = "sharded"  # its own FSDP2 shards on the training device, resident (no gradients, no optimizer state)
    OFFLOAD = "offload"  # the same shards in host memory, on the device only for the score stage


class DistillKL(Choice):
    """`algo.distill_kl`: what the student is trained on besides the sampled tokens' signal."""

    SAMPLED = "sampled"  # the sampled tokens' -(log p_s - log p_t) only (algo.advantage=distill, algo.distill_coef)
    TOPK = "topk"  # + the exact reverse KL over the teacher's top-k renormalized, a loss term (model/logprobs.py)


# ------------------------------------------------------------------ start-up
def distilling(algo: Any) -> bool:
    """The step reads the teacher: `algo.advantage=distill`, `algo.distill_coef > 0` or
    `algo.distill_kl=topk`."""
    return algo.advantage == "distill" or bool(algo.distill_coef) or topk_kl(algo)


def topk_kl(algo: Any) -> bool:
    """The loss has the exact top-k reverse KL term (`algo.distill_kl=topk`)."""
    return DistillKL(algo.distill_kl) is DistillKL.TOPK


def check_teacher(cfg: Any) -> None:
    """`algo.teacher.*`, `algo.distill_coef` and `algo.advantage=distill` agree, and the teacher
    checkpoint can serve the student (family, vocabulary, tokenizer), before any model loads."""
    algo, t = cfg.algo, cfg.algo.teacher
    if t.path is None:
        if distilling(algo):
            what = ("algo.advantage=distill" if algo.advantage == "distill" else
                    f"algo.distill_coef={algo.distill_coef}" if algo.distill_coef else "algo.distill_kl=topk")
            raise ValueError(f"{what} needs a teacher: set algo.teacher.path (a local checkpoint folder)")
        return
    if not distilling(algo):
        raise ValueError(f"algo.teacher.path={t.path!r} but nothing reads the teacher: set algo.advantage=distill "
                         "(the distillation signal alone), algo.distill_coef > 0 (added to the task's advantages) "
                         "or algo.distill_kl=topk (the exact top-k reverse KL as a loss term)")
    if topk_kl(algo) and not algo.distill_topk >= 2:
        raise ValueError(f"algo.distill_topk={algo.distill_topk}: expected >= 2 (over one token both renormalized "
                         "distributions are 1: the KL and its gradient would be 0 on every token)")
    if algo.advantage == "distill" and algo.distill_coef:
        raise ValueError(f"algo.advantage=distill with algo.distill_coef={algo.distill_coef}: distill is the signal "
                         "alone; algo.distill_coef adds it to another estimator's advantages (set one of the two)")
    if t.self_test_tol is not None and not t.self_test_tol > 0:
        raise ValueError(f"algo.teacher.self_test_tol={t.self_test_tol!r}: expected a positive number or null")
    if not Path(t.path).is_dir():
        raise ValueError(f"algo.teacher.path={t.path!r}: folder not found (a local checkpoint folder is expected; "
                         "nothing is downloaded)")
    from model.models import check_expert_split, checkpoint_config, checkpoint_family, config_field

    checkpoint_family(t.path, key="algo.teacher.path")
    check_expert_split(config_field(checkpoint_config(t.path), "num_experts"), cfg.parallel.ep,
                       "the teacher's num_experts", f" (algo.teacher.path={t.path!r})")
    check_vocabulary(cfg)


def check_vocabulary(cfg: Any) -> None:
    """The teacher's `vocab_size` is the student's and their tokenizers are the same files;
    else a ValueError naming both sizes, or each tokenizer item that differs."""
    from model.models import checkpoint_config, model_config_value

    path = cfg.algo.teacher.path
    student, where = model_config_value(cfg, "vocab_size")
    teacher = checkpoint_config(path).get("vocab_size")
    if teacher != student:
        raise ValueError(f"algo.teacher.path={path!r} has vocab_size={teacher} (its config.json), the student "
                         f"{student} ({where}): a teacher must share the student's vocabulary and tokenizer")
    if topk_kl(cfg.algo) and cfg.algo.distill_topk > teacher:
        raise ValueError(f"algo.distill_topk={cfg.algo.distill_topk}: above the vocabulary's {teacher} tokens "
                         f"(algo.teacher.path={path!r}); k = {teacher} is the full reverse KL")
    found = student_tokenizer(cfg)
    if found is None:  # a random-init student with no tokenizer: the vocabulary is all there is to compare
        return
    folder, fingerprint = found
    differ = tokenizer_differences(fingerprint, tokenizer_fingerprint(path))
    if differ:
        raise ValueError(f"algo.teacher.path={path!r}: its tokenizer differs from the student's ({folder}): "
                         f"{'; '.join(differ)}; a teacher must share the student's tokenizer")


def student_tokenizer(cfg: Any) -> tuple[str, dict[str, str]] | None:
    """The folder of the tokenizer the student's task uses and its `tokenizer_fingerprint`:
    task.tokenizer_path, else the student's checkpoint when it holds a tokenizer; None when
    neither does."""
    for folder in (cfg.task.tokenizer_path, cfg.model.pretrained_path):
        fingerprint = tokenizer_fingerprint(folder) if folder is not None else {}
        if fingerprint:
            return folder, fingerprint
    return None


def tokenizer_fingerprint(folder: str | Path) -> dict[str, str]:
    """sha256 of each tokenizer item of `folder` it holds: the files of `TOKENIZER_FILES` (`_file_digest`), the
    special tokens of tokenizer_config.json, and the chat template (tokenizer_config.json's
    `chat_template` or chat_template.jinja)."""
    folder, out = Path(folder), {}
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            out[name] = _file_digest(folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text()) if (folder / "tokenizer_config.json").is_file() else {}
    special = {k: config[k] for k in SPECIAL_TOKEN_KEYS if k in config}
    if special:
        out["special tokens"] = _digest(special)
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template is not None:
        out["chat template"] = _digest(template)
    return out


def _file_digest(path: Path) -> str:
    """sha256 of a tokenizer file: a JSON file's content canonically (sorted keys, no
    whitespace), tokenizer.json without its runtime `truncation` / `padding` settings (a
    save_pretrained round trip, as rl/trainer/export.py writes the teacher's, keeps the hash);
    any other file's bytes. Computed once per version of the file (its path, size and modification
    time), as model/models.py `checkpoint_config` reads config.json: train.py validates the config
    twice (the command line, then the run), and a 3.5 MB tokenizer.json takes ~0.6 s."""
    stat = path.stat()
    return _file_version_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _file_version_digest(name: str, size: int, mtime_ns: int) -> str:
    path = Path(name)
    if path.suffix != ".json":
        return hashlib.sha256(path.read_bytes()).hexdigest()
    value = json.loads(path.read_text())
    if path.name == "tokenizer.json" and isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in ("truncation", "padding")}
    return _digest(value)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tokenizer_differences(s: dict[str, str], t: dict[str, str]) -> list[str]:
    """Each tokenizer item whose hash differs between two `tokenizer_fingerprint`s (the
    student's `s`, the teacher's `t`), as 'item (student sha256 ... vs teacher ...)' or
    'item (only in the student)'."""
    out = []
    for item in sorted(set(s) | set(t)):
        if item not in t:
            out.append(f"{item} (only in the student)")
        elif item not in s:
            out.append(f"{item} (only in the teacher)")
        elif s[item] != t[item]:
            out.append(f"{item} (sha256 {s[item][:12]} in the student, {t[item][:12]} in the teacher)")
    return out


# ------------------------------------------------------------------ the teacher
def build_teacher(cfg: Any, dims, frozen, *, param_dtype: torch.dtype | None):
    """The teacher as an `Actor` (no grad, its own routing: `replay=False`), built by `frozen` the
    way the reference copy is (rl/trainer/build.py `ModelBuilder.frozen`: EP, FSDP2 shards without
    gradients or optimizer state, read shard by shard from `algo.teacher.path`; a dense teacher
    of an MoE run whole on each EP rank); self-tested when `algo.teacher.self_test`, then parked on the
    host with `algo.teacher.placement=offload`. Scored at temperature 1: the teacher's own distribution."""
    from model.models import build_model

    t, m = cfg.algo.teacher, cfg.model
    dtype = getattr(torch, (t.dtype or m.dtype).value)
    teacher = frozen(lambda device: build_model(None, pretrained_path=t.path, dtype=dtype, device=device), t.path,
                     temperature=1.0, replay=False, activation_checkpointing=False, dense_ok=True)
    if t.self_test:
        compute = param_dtype or dtype
        tol = t.self_test_tol if t.self_test_tol is not None else SELF_TEST_TOL[compute]
        self_test(teacher, t.path, dims, dtype=compute, tol=tol)
    if TeacherPlacement(t.placement) is TeacherPlacement.OFFLOAD:
        move_teacher(teacher, HOST)
    return teacher


HOST = torch.device("cpu")  # where an offloaded teacher waits between score stages


def move_teacher(teacher, device: torch.device) -> None:
    """Every shard (parameters and buffers) of `teacher` onto `device`, in place. FSDP2's
    `module.to` re-registers the moved shards with its parameter groups, so the next forward
    all-gathers from where they now are."""
    teacher.to(device)


@contextmanager
def teacher_on_device(teacher, placement, device: torch.device):
    """`algo.teacher.placement=offload`: the teacher's shards on `device` inside the block, back
    on the host after it (an exception too); `sharded`: they stay where they are."""
    if teacher is None or TeacherPlacement(placement) is TeacherPlacement.SHARDED:
        yield
        return
    move_teacher(teacher, device)
    try:
        yield
    finally:
        move_teacher(teacher, HOST)


def fixed_sequences(vocab_size: int, lengths=SELF_TEST_LENGTHS) -> list[torch.Tensor]:
    """The self-test's sequences: token ids in [0, vocab_size) from a fixed seed."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]


@torch.no_grad()
def self_test(teacher, path: str, dims, *, dtype: torch.dtype, tol: float) -> float:
    """The teacher's log-probs (its run forward: a pack on `dims.device`) of `fixed_sequences`
    against a plain transformers forward of the checkpoint (eager attention, one sequence at a
    time, on the host, rank 0; the verdict broadcast over the trainers, `dims.trainer_group`: dedicated
    generators hold no teacher and run no self-test), max |difference| <= `tol`, else a
    ValueError naming both figures. Returns the difference."""
    from transformers import AutoModelForCausalLM

    from packing import Experience, make_experience_batch

    vocab = teacher.model.get_input_embeddings().num_embeddings
    seqs = fixed_sequences(vocab)
    records = [Experience(sequences=s, action_mask=torch.ones(s.numel() - 1, dtype=torch.bool)) for s in seqs]
    pack = make_experience_batch(records, packed=True).to(dims.device)
    got = teacher(pack)[0].float().cpu()
    diff = torch.zeros((), dtype=torch.float64, device=dims.device)
    if dims.rank == 0:
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                     local_files_only=True).eval()
        want, start = [], 0
        for s in seqs:
            logits = plain(input_ids=s.unsqueeze(0)).logits[0, :-1].float()
            want.append(torch.log_softmax(logits, -1).gather(-1, s[1:].unsqueeze(-1)).squeeze(-1))
        del plain
        ends = torch.tensor(SELF_TEST_LENGTHS).cumsum(0)
        keep = torch.ones(got.numel(), dtype=torch.bool)
        keep[ends - 1] = False  # each sequence's trailing slot scores nothing
        diff.fill_(float((got[keep] - torch.cat(want)).abs().max()))
    if dims.distributed:  # over the trainers: dedicated generators (parallel.rollout_ranks) hold no teacher
        dist.broadcast(diff, src=0, group=dims.trainer_group)
    if not float(diff) <= tol:
        raise ValueError(f"algo.teacher.path={path!r}: the teacher's self-test failed: its log-probs differ from a "
                         f"plain transformers forward by up to {float(diff):.3g} on {len(seqs)} fixed sequences, "
                         f"above the bound algo.teacher.self_test_tol={tol:g}")
    return float(diff)

"""A stage's scorers from its options (`from_options`: --ref, --rm, --teacher, --judge, --reward-fn), what each
reads of a multi-turn row (`set_reads`: --reads) and what the models run in (`score_dtype`: --dtype)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlkit.scorers.base import Scorer
from rlkit.scorers.judge import JudgeScorer, parse_judges
from rlkit.scorers.logprobs import ReferenceScorer, TeacherScorer
from rlkit.scorers.reward_fns import RewardFn, RewardFnScorer
from rlkit.scorers.reward_model import RewardModelScorer


def score_dtype(device, dtype: str = "auto", bf16: bool | None = None) -> str:
    """--dtype -> what the models run in: auto is bf16 on a GPU with bf16 kernels (`bf16`: whether it has them,
    asked of torch when None), else `stored` on a GPU, fp32 on the CPU (as it always was); any other value stays."""
    if dtype != "auto":
        return dtype
    if getattr(device, "type", str(device)) != "cuda":
        return "fp32"
    if bf16 is None:
        import torch

        bf16 = torch.cuda.is_bf16_supported()
    return "bf16" if bf16 else "stored"


def from_options(ref: Path | None, rms: dict[str, Path], teacher: Path | None, judges: Sequence[str],
                 rubric: Path | None, fns: Sequence[RewardFn], *, device=None, dtype: str = "fp32",
                 trust_remote_code: bool = False, batch_tokens: int = 16384, packed: bool = True) -> list[Scorer]:
    """Every source a run scores with, checked before any model loads (the reference's hashes, the reward
    models' and the teacher's directories, the teacher's tokenizer, each judge's rubric, weights and choices), in
    the order their columns are written: reference, teacher, reward models, reward functions, judges. `dtype`:
    the resolved --dtype (`score_dtype`)."""
    kw = {"device": device, "dtype": dtype, "trust_remote_code": trust_remote_code, "batch_tokens": batch_tokens}
    refs = [ReferenceScorer(ref, packed=packed, **kw)] if ref is not None else []
    models = [RewardModelScorer(name, d, packed=packed, **kw) for name, d in rms.items()]
    teachers = [TeacherScorer(teacher, packed=packed, **kw)] if teacher is not None else []
    specs = parse_judges(judges, rubric, [*rms, *(f.name for f in fns)])
    kw["dtype"] = "fp32" if dtype in ("stored", "auto") else dtype  # a judge checkpoint is stored fp32
    return [*refs, *teachers, *models, *(RewardFnScorer(f) for f in fns), *(JudgeScorer(s, **kw) for s in specs)]


def set_reads(scorers: Sequence[Scorer], specs: Sequence[str], stage: str) -> dict[str, str]:
    """What each reward model, judge and function reads of a multi-turn row (`--reads NAME=READING` over each
    one's default, `rlkit.tasks.multi_turn.parse_reads`), set on each; -> the readings, for the manifest."""
    from rlkit.tasks import multi_turn

    named = sorted((s for s in scorers if s.name), key=lambda s: s.kind == "--reward-fn")  # functions listed last
    reads = multi_turn.parse_reads(specs, {s.name: multi_turn.default_reads() for s in named}, stage)
    for s in named:
        s.reads = reads[s.name]
    return reads

"""`rlkit score-ref`: the forward-only scorer; adds the frozen reference's log-prob of every completion
token (pi_ref) to a rollouts table.

Every completion token is scored, a multi-turn row's environment tokens too (their `loss_mask` is 0: `update`
leaves them out of the loss and of the KL, not this stage); the multi-turn columns pass through unchanged.

Reads a rollouts table (stdin or --in) and a reference made by `freeze-ref`, whose weights hash is
verified before use. Writes a 'scored' table: the input rows, in input order, plus `ref_logprobs`.
Rows are bucketed by length within each incoming batch to cut padding, and each batch is written as
soon as it is scored, so the stage streams. Log-probs use the rollout's sampling temperature, like
pi_old, and are gathered without a second full-vocabulary tensor (`rlkit.ops.logprobs`).

The reference must share the policy's tokenizer (the rollouts record its fingerprint). Reward models
(`--rm NAME=DIR`, repeatable, from `rlkit train-rm`) use the same scorer pattern on the text of
prompt + completion, re-tokenized with their own tokenizer (which may differ from the policy's), and
add one `reward/rm:NAME` component each beside `verifier`. User reward functions
(`--reward-fn NAME=FILE.py:FUNC`, repeatable, `rlkit.tasks.reward_fns`) add `reward/NAME` the same way,
batch by batch; their signatures are checked before the models load. `--teacher DIR` (on-policy distillation)
adds `teacher_logprobs`, a teacher's log-prob of every completion token, by the same forward-only scorer as the
reference (packed, micro-batched, at the rollout's temperature, bf16 on a GPU with --dtype auto); the teacher
must have the policy's tokenizer exactly (same vocabulary and special tokens: the log-probs of the same token ids
are compared), else one line; the policy that sampled the rows is refused as its own teacher as it is as its own
judge (the same weights' fingerprint, `Models.refuse_the_policy`). `--judge [NAME=]DIR[:rubric=FILE]` (or with
`--rubric FILE`) adds an LLM judge's verdict on each (prompt, response) under a yes-no or score rubric as
`reward/NAME` and `verdict/NAME` (`rlkit.tasks.judge`: hash-checked, never the policy itself). With none of --ref, --rm, --reward-fn, --teacher and --judge, the reference is the one the sampling policy was trained against: `update` records it in
every checkpoint it writes (`reference` in `rlkit.json`, path and fingerprint), so the card's
`rlkit rollout --policy ckpt/ --n 8 | rlkit score-ref` works from the first RL round on. With --rm or
--reward-fn, --teacher or --judge alone the output stays a 'rollouts' table (enough for `update --beta 0`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rlkit import stage_options
from rlkit.options import (
    Device,
    Force,
    InTable,
    JudgeRubric,
    NoPlan,
    NoVerify,
    OutTable,
    Packing,
    Reads,
    RewardFn,
    RewardTimeout,
    SandboxKind,
    SandboxWorkers,
    TrustRemoteCode,
)
from rlkit.stage_options import option

if TYPE_CHECKING:
    from rlkit.io.manifests import Manifest


@dataclass(frozen=True)
class ScoreRefConfig:
    ref: Path | None = option(None, "--ref", panel="Model", help="Frozen reference directory (made by `rlkit freeze-ref`). Without --ref, --rm and --reward-fn: the reference the sampling policy was trained against (recorded by `update` in its checkpoint).")
    # NAME=DIR reward models, each adds a `reward/rm:NAME` column
    rm: tuple[str, ...] = option((), "--rm", panel="Model", help="Reward model NAME=DIR (repeatable; or DIR, named after it): adds reward/rm:NAME.")
    # [NAME=]DIR[:rubric=FILE] LLM judges (rlkit.tasks.judge.parse_judges), each adds `reward/NAME` and `verdict/NAME`
    judge: tuple[str, ...] = option((), "--judge", panel="Model", help="LLM judge [NAME=]DIR[:rubric=FILE][,engine=hf|vllm] (repeatable; NAME defaults to DIR's folder name, the rubric to --rubric, else DIR/rubric.toml; docs/tasks-rewards.md#naming-a-judge): adds reward/NAME, the judge's verdict on each (prompt, response) under a yes-no rubric (P(yes), one forward pass) or a score rubric (its greedy answer parsed; generated on the engine named, hf by default), and verdict/NAME. The judge is hash-checked; the policy itself is refused.")
    rubric: Path | None = option(None, JudgeRubric)
    teacher: Path | None = option(None, "--teacher", panel="Model", help="Teacher checkpoint for on-policy distillation (any causal LM directory with the policy's tokenizer, e.g. a stronger RL checkpoint; the policy that sampled the rows is refused): adds teacher_logprobs, its log-prob of every completion token, which `update --algo distill` (or --teacher-coef) trains on.")
    reward_fn: tuple[str, ...] = option((), RewardFn)  # NAME=FILE.py:FUNC user reward functions, each adds `reward/NAME`
    reward_timeout: float = option(60.0, RewardTimeout)  # seconds one --reward-fn call may run (0: no limit)
    reads: tuple[str, ...] = option((), Reads)  # NAME=READING: the text of a multi-turn row a component reads
    sandbox: str | None = option(None, SandboxKind)  # bwrap: --reward-fn functions run in sandboxed workers
    sandbox_workers: int | None = option(None, SandboxWorkers)
    inp: str | None = option(None, InTable)
    out: Path | None = option(None, OutTable)
    # a `rollout --follow` stream's batches as files in a spool directory (rlkit.io.spool)
    spool: Path | None = option(None, "--spool", panel="Follow", help="On a `rollout --follow` stream: write each of its batches, scored, as its own complete Arrow file into this spool directory, for `update --follow --in SPOOL` fed by many workers (each worker a `rollout --follow --shard I/M | score-ref --spool SPOOL` pipe), instead of one stream to stdout or --out. See docs/scale-out.md.")
    device: str = option("auto", Device)  # the reference's and the reward models' (rlkit.devices)
    dtype: Literal["auto", "stored", "fp32", "bf16"] = option("auto", panel="Precision & memory", help="Dtype the reference and reward models run in: auto (bf16 on a GPU with bf16 kernels, fp32 on the CPU), stored (the reference's frozen dtype; reward models fp32), fp32 or bf16. The manifest records what auto became.")
    batch_tokens: int = option(16384, min=16, panel="Optimization", help="Token budget per forward batch.")
    packing: bool = option(True, Packing)  # sequences packed without padding in each forward batch (rlkit.ops.packing)
    # "i/N" of an input file, cut between groups; see rlkit.io.shards
    shard: str | None = option(None, panel="Engine", help="I/N: score only this job's share of --in FILE, cut between groups; `rlkit cat` joins the N outputs.")
    trust_remote_code: bool = option(False, TrustRemoteCode)
    plan: bool = option(True, NoPlan, invert=True)  # --no-plan: no memory plan when the models load on a GPU
    verify: bool = option(True, NoVerify, invert=True)  # --no-verify: no hash check of a reward model (never for a reference)
    force: bool = option(False, Force)


def score_batch(model, batch, pad_id: int, temperature: float, batch_tokens: int, packed: bool = True) -> list[list[float]]:
    """Reference log-probs for every row of a rollouts record batch, in row order."""
    return score_tokens(model, batch.column("prompt_ids").to_pylist(), batch.column("completion_ids").to_pylist(),
                        pad_id, temperature, batch_tokens, packed)


def score_tokens(model, prompts: list[list[int]], comps: list[list[int]], pad_id: int, temperature: float,
                 batch_tokens: int, packed: bool = True) -> list[list[float]]:
    """Per-token log-probs of each completion given its prompt, in input order (length-bucketed; each forward
    batch packed without padding unless packed=False, `rlkit.ops.packing`)."""
    import torch

    from rlkit import devices
    from rlkit.io.data import token_batches
    from rlkit.ops.logprobs import completion_logprobs
    from rlkit.ops.packing import layout

    out: list[list[float] | None] = [None] * len(prompts)
    device = devices.model_device(model)
    lengths = [len(p) + len(c) for p, c in zip(prompts, comps, strict=True)]
    for idx in token_batches(lengths, batch_tokens):
        seqs = layout([[*prompts[i], *comps[i]] for i in idx], [len(prompts[i]) for i in idx], packed=packed,
                      pad_id=pad_id)
        with torch.no_grad():
            lp, _ = completion_logprobs(model, seqs.to(device), temperature=temperature)
        lp = lp.cpu()  # one copy to the host per forward batch
        for r, i in enumerate(idx):
            out[i] = lp[r, : len(comps[i])].tolist()
    return out  # type: ignore[return-value]


def _score_prefs(cfg, reader, models: Models, tokenizer, out, inputs, reference: dict) -> Path | None:
    """A prefs table in, the same table out with the reference's summed log-prob of each response (DPO)."""
    import pyarrow as pa

    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.io import manifests, schemas, streams
    from rlkit.io.data import encode_responses
    from rlkit.io.rows import check_pair_lengths

    if cfg.ref is None or cfg.rm or cfg.reward_fn:
        raise RlkitError("a prefs table is scored by the reference only (for DPO): pass --ref REF and no --rm or "
                         "--reward-fn")
    from rlkit import devices

    manifest = manifests.make_manifest("prefs", "score-ref", cfg, inputs, **reference,
                                       **devices.manifest_entry(models.dev))
    rows = 0
    # multi-turn columns pass through, so that `update --algo dpo` can refuse the rows
    extra = [f for f in reader.schema if f.name in schemas.MULTI_TURN_NAMES]
    with streams.write_table("prefs", out, manifest, extra) as w, \
            console.progress("score-ref", None, unit="pairs") as bar:
        for batch in reader:
            model, limits = models.load().model, models.limits
            if rows == 0:
                devices.announce("score-ref", models.dev, cfg.dtype)
            cols = {name: batch.column(name) for name in batch.schema.names}
            prompts = batch.column("prompt").to_pylist()
            for side in ("chosen", "rejected"):
                p_ids, r_ids = encode_responses(tokenizer, prompts, batch.column(side).to_pylist())
                check_pair_lengths(batch, side, p_ids, r_ids, limits, reader.label, row0=rows,
                                   budget=cfg.batch_tokens)
                lps = score_tokens(model, p_ids, r_ids, tokenizer.pad_token_id, 1.0, cfg.batch_tokens, cfg.packing)
                cols[f"ref_{side}_logp"] = pa.array([sum(x) for x in lps], pa.float64())
            w.write(pa.record_batch([cols[f.name] if f.name in cols else pa.nulls(batch.num_rows, f.type)
                                     for f in w.schema], schema=w.schema))
            bar.advance(batch.num_rows)
            rows += batch.num_rows
        if rows == 0:
            raise RlkitError(f"{reader.label}: the prefs table has no rows")
    console.info(f"score-ref: {rows} preference pairs scored by {cfg.ref}")
    return out


def recorded_reference(upstream: Manifest) -> tuple[Path, Path]:
    """(the reference, the policy that records it, as the rollout named it) for rollouts sampled by a policy
    `update` trained: its manifest names the reference its input was scored against. The policy is read at the
    path resolved when the rollout ran (this stage may run elsewhere). Checked against the fingerprint recorded
    then; an SFT checkpoint records none: the error says how to make one and pass it."""
    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, fingerprints

    policy = upstream.path(upstream.sampling_section, "policy")
    given = upstream.sampling.get("policy")
    nothing = ("nothing to score with: pass --ref REF (reference log-probs), --rm NAME=DIR, "
               "--reward-fn NAME=FILE.py:FUNC and/or --teacher DIR")
    if not policy or not Path(policy).is_dir():
        raise RlkitError(nothing + " (the input does not name a policy whose reference could be used)")
    entry = (checkpoints.load_manifest(Path(policy)) or {}).get("reference")
    if not isinstance(entry, dict) or not entry.get("path"):
        raise RlkitError(f"{nothing}. The policy that sampled these rollouts, {policy}, records no reference (an SFT "
                         f"checkpoint has none): make one with `rlkit freeze-ref --policy {policy} --out ref/` and pass "
                         "`--ref ref/`")
    ref = Path(entry["path"])
    if not ref.is_dir():
        raise RlkitError(f"{policy} was trained against the reference {ref}, which is not there any more; pass --ref REF")
    if entry.get("fingerprint") and fingerprints.fingerprint(ref) != entry["fingerprint"]:
        raise RlkitError(f"the reference {ref} has changed since {policy} was trained against it; pass --ref REF")
    return ref, Path(given if isinstance(given, str) else policy)


def _judges(cfg: ScoreRefConfig, rms: dict, fns, dev) -> dict:
    """--judge's judges, checked before any model loads: each rubric (a yes-no or score one), the judge's weights
    (hash-checked, as a reference is) and its rubric's choices against its tokenizer."""
    from rlkit.tasks.judge import parse_judges

    specs = parse_judges(cfg.judge, cfg.rubric, [*rms, *(f.name for f in fns)])
    dtype = "fp32" if cfg.dtype in ("stored", "auto") else cfg.dtype  # a judge checkpoint is stored fp32
    return {s.name: s.load(("yes-no", "score"), dev, dtype, cfg.trust_remote_code) for s in specs}


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


class Models:
    """score-ref's reference and reward models, loaded by `load()` when the first input batch has come, not when the
    stage starts: in the card's pipe rollout's vLLM then has started and measured its memory before these models
    take theirs. Everything checked without the weights (the reference's hashes, the directories, the tokenizer)
    is checked at start-up."""

    def __init__(self, cfg: ScoreRefConfig, dev, rms: dict[str, Path]) -> None:
        self.cfg, self.dev, self.rms = cfg, dev, rms
        self.model = self.limits = None  # the reference and what its rows must fit (`Limits`)
        self.teacher = self.teacher_limits = None  # --teacher's model and what its rows must fit
        self.teacher_fingerprint = None  # --teacher's weights' fingerprint (set with the teacher's checks)
        self.scorers: dict = {}  # component name -> (reward model, its tokenizer)
        self.judges: dict = {}  # component name -> rlkit.tasks.judge.Judge (checked at start-up, loaded here)
        self.loaded = False

    def load(self) -> Models:
        """Load every model once (on `dev`, in the resolved --dtype); the models themselves."""
        if self.loaded:
            return self
        from rlkit.io import checkpoints
        from rlkit.io.rows import Limits
        from rlkit.tasks.reward_model import load_reward_model

        cfg = self.cfg
        if cfg.plan:  # on a GPU: the models and one forward batch must fit what the GPU has free (rlkit.planner)
            from rlkit import planner

            # a teacher and judges are planned as further LMs
            lms = [d for d in (cfg.ref, cfg.teacher, *(j.path for j in self.judges.values())) if d is not None]
            planner.preflight_scoring(lms[0] if lms else None, [*lms[1:], *self.rms.values()], cfg.dtype,
                                      cfg.batch_tokens, cfg.packing, self.dev)
        if cfg.ref is not None:
            self.model, _, _ = checkpoints.load_reference(cfg.ref, self.dev, cfg.trust_remote_code, cfg.dtype)
            self.limits = Limits.of(self.model, f"reference {cfg.ref}")
        if cfg.teacher is not None:
            self.teacher = checkpoints.load_teacher(cfg.teacher, self.dev, cfg.trust_remote_code,
                                                    "fp32" if cfg.dtype == "stored" else cfg.dtype)
            self.teacher_limits = Limits.of(self.teacher, f"teacher {cfg.teacher}")
        rm_dtype = "fp32" if cfg.dtype == "stored" else cfg.dtype  # a reward model is stored fp32 (train-rm)
        self.scorers = {name: load_reward_model(d, cfg.trust_remote_code, device=self.dev, dtype=rm_dtype)
                        for name, d in self.rms.items()}
        for j in self.judges.values():
            j.load()
        self.loaded = True
        return self

    def refuse_the_policy(self, policies: set) -> None:
        """A judge or the teacher that is a policy that sampled the rows (`policies`, fingerprints): one line. A
        policy as its own judge rewards its own mistakes; as its own teacher it has nothing to learn (teacher_kl 0)."""
        from rlkit.io.fingerprints import refuse_policy_itself
        from rlkit.tasks.judge import refuse_self_judging

        whose = "the policy that sampled these rollouts"
        for j in self.judges.values():
            refuse_self_judging(j, policies, whose)
        if self.teacher_fingerprint is not None:
            refuse_policy_itself(f"teacher {self.cfg.teacher}", self.teacher_fingerprint, policies, whose,
                                 "distilling a policy from itself trains nothing (teacher_kl 0); use a different "
                                 "teacher checkpoint")


def parse_rms(specs: tuple[str, ...]) -> dict[str, Path]:
    """`--rm NAME=DIR` (or `--rm DIR`, named after the folder) -> {component name: dir}."""
    from rlkit.errors import RlkitError

    out: dict[str, Path] = {}
    for spec in specs:
        name, eq, d = spec.partition("=")
        name, path = (name.strip(), Path(d)) if eq else (Path(spec).name, Path(spec))
        if not name or not str(path):
            raise RlkitError(f"--rm {spec!r}: expected NAME=DIR or DIR")
        key = f"rm:{name}"
        if key in out:
            raise RlkitError(f"--rm names {name!r} twice; give each reward model its own NAME=DIR")
        out[key] = path
    return out


def run(cfg: ScoreRefConfig) -> Path | None:
    """Claims --out (see `claims.claim_out`: never over an input, one writer) and runs the stage."""
    from rlkit import devices
    from rlkit.io import checkpoints, claims
    from rlkit.tasks.judge import parse_judges

    devices.parse(cfg.device)
    judges = parse_judges(cfg.judge, cfg.rubric)  # a malformed spec: one line before anything is claimed
    inputs = {"--ref": cfg.ref, "--rm": [r.partition("=")[2] or r for r in cfg.rm], "--in": cfg.inp,
              "--reward-fn": cfg.reward_fn, "--teacher": cfg.teacher,
              "--judge": [p for j in judges for p in (j.path, j.rubric)]}
    if cfg.spool is not None:
        from rlkit.errors import RlkitError
        from rlkit.io import spool

        if cfg.out is not None:
            raise RlkitError("--spool DIR and --out are two outputs for one stream: pass one of them")
        spool.check_root(cfg.spool, "--spool")
    with claims.claim_out(cfg.out, "table", inputs), checkpoints.verifying(cfg.verify):
        return _run(cfg)


def _run(cfg: ScoreRefConfig) -> Path | None:
    from rlkit.tasks import reward_fn_sandbox, reward_fns

    rms = parse_rms(cfg.rm)
    # checked before models load (and, with --sandbox bwrap, their sandboxed workers started)
    fns = reward_fns.load_all(cfg.reward_fn, taken=rms, timeout=cfg.reward_timeout,
                              sandbox=reward_fn_sandbox(cfg.sandbox, cfg.sandbox_workers))
    with reward_fns.closing(fns):
        reward_fns.check_environments(fns, "score-ref reads a finished table: pass the function to rollout --env "
                                           "instead")
        return _run_loaded(cfg, rms, fns)


def _run_loaded(cfg: ScoreRefConfig, rms: dict[str, Path], fns) -> Path | None:
    import pyarrow as pa

    from rlkit import console, devices
    from rlkit.errors import DownstreamClosed, RlkitError
    from rlkit.io import checkpoints, claims, fingerprints, manifests, schemas, shards, streams
    from rlkit.tasks import reward_fns

    if cfg.shard:
        shards.parse(cfg.shard)
        if cfg.inp is None or cfg.inp == "-":
            raise RlkitError("--shard cuts an input file between groups: pass --in FILE (a piped-in shard of "
                             "`rollout --shard` needs no --shard here)")
    recorded = None
    if cfg.ref is None and not rms and not fns and cfg.teacher is None and not cfg.judge:  # the policy's reference
        pending = streams.open_table(cfg.inp, ["rollouts", "scored", "prefs"])
        recorded = recorded_reference(pending.result().record)
        cfg = replace(cfg, ref=recorded[0])
    if cfg.dtype not in ("auto", "stored", "fp32", "bf16"):
        raise RlkitError(f"--dtype {cfg.dtype!r} is not one of auto, stored, fp32, bf16")
    out = streams.resolve_out(cfg.out)
    claims.check_out(out, "table")
    # reward functions run on the host
    dev = devices.resolve(cfg.device) if cfg.ref is not None or rms or cfg.teacher is not None or cfg.judge else None
    ref_m: dict = {}
    if cfg.ref is not None:
        ref_m = checkpoints.verify_reference(cfg.ref)  # reads the files (hashes), puts nothing on the device
    for d in rms.values():
        checkpoints.check_model_dir(d, "reward model")
    teacher_tok = None
    if cfg.teacher is not None:  # checked (weights' hashes, tokenizer) before anything loads
        checkpoints.check_model_dir(cfg.teacher, "teacher")
        teacher_tok = checkpoints.load_tokenizer(cfg.teacher, cfg.trust_remote_code)
    if dev is not None:
        cfg = replace(cfg, dtype=score_dtype(dev, cfg.dtype))  # what auto became, as the manifest records it
    judges = _judges(cfg, rms, fns, dev)  # rubrics read, judges hash-checked, choices tokenized: before any load
    from rlkit.tasks import multi_turn

    # what each reward model, judge and function reads of a multi-turn row (--reads), checked before any load
    reads = multi_turn.parse_reads(cfg.reads, {n: multi_turn.default_reads() for n in [*rms, *judges,
                                                                                        *(f.name for f in fns)]},
                                   "score-ref")
    if recorded is not None:
        console.info(f"score-ref: reference {recorded[0]} (recorded by {recorded[1]})")
    else:  # the input opens and streams into memory on a thread while torch imports and the models load
        pending = streams.open_table(cfg.inp, ["rollouts", "scored", "prefs"])
    tokenizer = None
    reference: dict = {}  # the manifest entries naming the reference: its path and its weights' digest
    if cfg.ref is not None:
        tokenizer = checkpoints.load_tokenizer(cfg.ref, cfg.trust_remote_code)
        reference = {"reference": Path(cfg.ref), "reference_digest": ref_m.get("weights_digest")}
    models = Models(cfg, dev, rms)  # loaded when the first batch comes
    models.judges = judges
    if cfg.teacher is not None:
        models.teacher_fingerprint = fingerprints.fingerprint(cfg.teacher)
    reader = pending.result()
    inputs = {"in": reader.fingerprint, **({"ref": fingerprints.fingerprint(cfg.ref)} if cfg.ref else {}),
              **({"teacher": models.teacher_fingerprint} if cfg.teacher else {}),
              **{f"judge:{n}": f"{j.fingerprint} {j.rubric.sha256}" for n, j in judges.items()},
              **{name: fingerprints.fingerprint(d) for name, d in rms.items()}, **reward_fns.fingerprints(fns)}
    if manifests.skip_if_current(out, "score-ref", cfg, inputs):
        return out
    if reader.kind == "prefs":
        if cfg.shard:
            raise RlkitError("--shard cuts rollouts tables; score a prefs table whole")
        if cfg.teacher is not None or judges:
            raise RlkitError("--teacher and --judge score the completions of a rollouts table, not a prefs table "
                             "(build-prefs --judge labels pairs)")
        return _score_prefs(cfg, reader, models, tokenizer, out, inputs, reference)
    upstream = reader.record
    want = upstream.tokenizer
    if tokenizer is not None and want and want != checkpoints.tokenizer_fingerprint(tokenizer):
        raise RlkitError(
            f"reference {cfg.ref} has a different tokenizer from the policy that sampled these rollouts "
            f"({checkpoints.tokenizer_fingerprint(tokenizer)} vs {want}); freeze the reference from the same SFT checkpoint"
        )
    if teacher_tok is not None and want and want != checkpoints.tokenizer_fingerprint(teacher_tok):
        raise RlkitError(
            f"teacher {cfg.teacher} has a different tokenizer from the policy that sampled these rollouts "
            f"({checkpoints.tokenizer_fingerprint(teacher_tok)} vs {want}); on-policy distillation compares log-probs "
            "of the same token ids, so the teacher's vocabulary and special tokens must be the policy's exactly")
    if judges or cfg.teacher is not None:  # the policy as its own judge or teacher, refused before any model loads
        sampler = upstream.sampling.get("policy")  # (and batch by batch, as rows come)
        models.refuse_the_policy({upstream.inputs.get("policy"),
                                  *([fingerprints.fingerprint(Path(sampler))]
                                    if isinstance(sampler, str) and Path(sampler).is_dir() else [])})
    if cfg.teacher is not None and "teacher_logprobs" in reader.schema.names:
        raise RlkitError(f"{reader.label} already has teacher log-probs; score it with one teacher")
    clash = [n for n in [*rms, *(f.name for f in fns), *judges] if f"reward/{n}" in reader.schema.names]
    if clash:
        what = "reward model" if clash[0] in rms else "--judge" if clash[0] in judges else "--reward-fn"
        raise RlkitError(f"the input already has reward component {clash[0]!r}; name this {what} differently")
    if reader.kind == "scored" and cfg.ref is not None:
        raise RlkitError("the input already has reference log-probs; pass only --rm to add reward-model scores")
    temperature = upstream.temperature
    batches, shard = reader, {"shard": upstream.shard} if upstream.shard else {}
    if cfg.shard:
        if shard:
            raise RlkitError(f"{reader.label} is already shard {shard['shard']['index']}/{shard['shard']['count']} "
                             "of a rollout; score it whole (leave out --shard)")
        table = reader.read_all()
        span = shards.group_span(shards.parse(cfg.shard), table.column("group_id").to_pylist())
        batches = table.slice(span.start, len(span)).to_batches(max_chunksize=4096)
        shard = shards.manifest_entry(cfg.shard, span, table.num_rows, manifests.jsonable(cfg), inputs)
    out_kind = "scored" if cfg.ref is not None or reader.kind == "scored" else "rollouts"
    # reward components, verdicts, a multi-turn trajectory's columns (loss_mask, turns, ...), per-token ones
    # (teacher_logprobs, token_rewards) and prompts_drawn pass through as they are
    extra = [f for f in reader.schema if f.name.startswith(("reward/", "verdict/"))
             or f.name in schemas.CARRIED_NAMES]
    if cfg.teacher is not None:
        extra.append(next(f for f in schemas.TOKEN_FIELDS if f.name == "teacher_logprobs"))
    extra += [pa.field(f"reward/{n}", pa.float64()) for n in [*rms, *(f.name for f in fns), *judges]]
    extra += [pa.field(f"verdict/{n}", pa.string()) for n in judges]
    manifest = manifests.make_manifest(out_kind, "score-ref", cfg, inputs, tokenizer=want,
                                       rollout=dict(upstream.sampling) or None, temperature=temperature,
                                       engine=upstream.engine, reward_models={n: str(d) for n, d in rms.items()},
                                       reward_fns={f.name: f.label for f in fns},
                                       **({"teacher": str(cfg.teacher)} if cfg.teacher is not None else {}),
                                       **({"judges": {n: j.manifest_entry() for n, j in judges.items()}}
                                          if judges else {}),
                                       **({"reads": reads} if reads and "messages" in reader.schema.names else {}),
                                       **(reference or {k: upstream.get(k) for k in ("reference", "reference_digest")}),
                                       carried_paths=manifests.carried_paths(upstream.raw), **shard,
                                       **(devices.manifest_entry(dev) if dev is not None else {}))
    lp_type = schemas.kind("scored").schema().field("ref_logprobs").type
    following = bool(upstream.sampling.get("follow"))
    writer = streams.write_table(out_kind, out, manifest, extra)
    if cfg.spool is not None:
        from rlkit.io import spool

        if not following or out_kind != "scored":
            raise RlkitError(f"--spool writes the batches of a `rollout --follow` stream; {reader.label} is not one")
        geometry = spool.Geometry.of(upstream.get("follow"), reader.label)
        writer = spool.writing(cfg.spool, out_kind, manifest, extra, geometry)
    if following and not cfg.shard:
        # an unbounded `rollout --follow` stream: batch by batch as it comes, and the end of the run is
        # the downstream stage ending (`update --follow --max-steps`; with --spool, the update consuming the spool
        # ending cleanly), noticed even while no input comes
        idle = streams.downstream_closed
        if cfg.spool is not None:
            from rlkit.follow.rollout import consumer_gone

            follow_dir = Path((upstream.get("follow") or {}).get("dir", ""))
            before = spool.marker_id(cfg.spool)  # an earlier run's end of the update does not count
            idle = lambda: consumer_gone(cfg.spool, follow_dir, before)  # noqa: E731
        batches = reader.batches(idle=idle)
    try:
        rows = _score_stream(cfg, batches, writer=writer, models=models,
                             tokenizer=tokenizer or teacher_tok, temperature=temperature, lp_type=lp_type, reader=reader,
                             empty_ok=bool(shard) or following, fns=fns, row0=span.start if cfg.shard else 0,
                             reads=reads,
                             started=(lambda: devices.announce("score-ref", dev, cfg.dtype)) if dev is not None else None)
    except BrokenPipeError:
        if not following:
            raise
        raise DownstreamClosed("score-ref") from None
    finally:
        for j in judges.values():  # a judge's generation engine (vllm), when one was started
            j.close()
    if cfg.spool is not None:  # the stream ended complete: its rollout reached --max-steps
        spool.mark_worker_end(cfg.spool, geometry.index, geometry.count)
    by = " and ".join([*([str(cfg.ref)] if cfg.ref else []), *([f"teacher {cfg.teacher}"] if cfg.teacher else []),
                       *(f"judge {n} ({j.path})" for n, j in judges.items()),
                       *(f"{n} ({d})" for n, d in rms.items()),
                       *(f"{f.name} ({f.label})" for f in fns)])
    console.info(f"score-ref: {rows} rows scored by {by}"
                 + (f" (shard {cfg.shard}: rows {span.start}-{span.stop} of {table.num_rows})" if cfg.shard else ""))
    return out


def _score_stream(cfg: ScoreRefConfig, batches, writer, models: Models, tokenizer, temperature, lp_type, reader,
                  empty_ok: bool, fns=(), started=None, row0: int = 0, reads=None) -> int:
    """Score `batches` one by one, writing each as soon as it is scored; -> rows written. An empty input
    is an error unless `empty_ok` (a shard may be empty; a follow run that was already finished is).
    When the first batch arrives the models load (`models.load()`) and `started()` is called (the stage's
    device line). Each batch's rows must fit the reference's vocabulary and context (`models.limits`), and no
    longer than --batch-tokens, before the reference runs (`check_rows`; `row0`, the first batch's row number
    in the input, names them). Reward models, judges and functions read each row's text as `reads` says
    (`rlkit.tasks.multi_turn`: a multi-turn row's final turn, model turns or whole conversation); the rows of a
    trajectory an environment error ended are not scored (0, verdict `env_error`)."""
    import pyarrow as pa

    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.io.rows import check_rows

    with writer as w, console.progress("score-ref", None, unit="rows") as bar:
        for batch in batches:
            if models.judges or models.teacher_fingerprint is not None:  # before a model loads for this batch
                models.refuse_the_policy(set(batch.column("policy_fingerprint").to_pylist()))
            model, limits = models.load().model, models.limits
            for lim in (limits, models.teacher_limits):
                if lim is not None:
                    check_rows(batch, lim, reader.label, row0=row0, budget=cfg.batch_tokens)
            row0 += batch.num_rows
            if started is not None:
                started()
                started = None
            cols = {name: batch.column(name) for name in batch.schema.names}
            if model is not None:
                ref_lp = score_batch(model, batch, tokenizer.pad_token_id, temperature, cfg.batch_tokens, cfg.packing)
                cols["ref_logprobs"] = pa.array(ref_lp, lp_type)
            if models.teacher is not None:  # at the rollout's temperature, like pi_old and pi_ref
                t_lp = score_batch(models.teacher, batch, tokenizer.pad_token_id, temperature, cfg.batch_tokens, cfg.packing)
                cols["teacher_logprobs"] = pa.array(t_lp, lp_type)
            cols.update(_rewards(cfg, batch, models, fns, reads or {}, w.rows))
            w.write(pa.record_batch([cols[f.name] if f.name in cols else pa.nulls(batch.num_rows, f.type)
                                     for f in w.schema], schema=w.schema))
            bar.advance(batch.num_rows)
        if reader.rows == 0 and not empty_ok:
            raise RlkitError(f"{reader.label}: the rollouts table has no rows")
    return w.rows


def _rewards(cfg: ScoreRefConfig, batch, models: Models, fns, reads: dict, row0: int) -> dict:
    """A record batch's reward columns (`reward/NAME`, a judge's `verdict/NAME`) from the reward models, judges and
    functions, each on its reading of the rows (`reads`); the rows of a trajectory an environment error ended get
    0 (verdict `env_error`) unscored. `row0`: the batch's first row in the output (the functions' messages)."""
    import pyarrow as pa

    from rlkit.tasks import multi_turn, reward_fns
    from rlkit.tasks.reward_model import score_texts

    out: dict = {}
    if not (models.scorers or models.judges or fns):
        return out
    prompts = batch.column("prompt").to_pylist()
    mt = multi_turn.columns(batch)
    skip = multi_turn.ended_by_error(mt)

    def read(name: str) -> list[str]:
        return multi_turn.texts(reads.get(name, "conversation"), mt)

    for name, (rm, rm_tok) in models.scorers.items():
        texts = read(name)

        def rm_score(rows, rm=rm, rm_tok=rm_tok, t=texts):
            return score_texts(rm, rm_tok, [prompts[i] for i in rows], [t[i] for i in rows], cfg.batch_tokens,
                               packed=cfg.packing)

        out[f"reward/{name}"] = pa.array(multi_turn.score_kept(skip, rm_score, 0.0), pa.float64())
    if models.judges:  # the policy itself was refused before the batch's models loaded (Models.refuse_the_policy)
        for name, j in models.judges.items():
            texts, got = read(name), {}

            def judge(rows, j=j, t=texts, got=got):
                rewards, got["verdicts"], _ = j.score([prompts[i] for i in rows], [t[i] for i in rows],
                                                      cfg.batch_tokens)
                return rewards

            out[f"reward/{name}"] = pa.array(multi_turn.score_kept(skip, judge, 0.0), pa.float64())
            it = iter(got.get("verdicts") or ())
            out[f"verdict/{name}"] = pa.array([multi_turn.ENV_ERROR if s else next(it) for s in skip], pa.string())
    if fns:
        rows = reward_fns.columns_of(batch, fns)
        for f in fns:
            texts = read(f.name)

            def run(keep, f=f, t=texts):
                sub = multi_turn.subset(rows, keep)
                sub["completion"] = [t[i] for i in keep]
                return f.score(sub, row0=row0)

            out[f"reward/{f.name}"] = pa.array(multi_turn.score_kept(skip, run, 0.0), pa.float64())
    return out


command = stage_options.command(
    ScoreRefConfig,
    "Add to a rollouts table (streams) the frozen reference's per-token log-probs, a teacher's (--teacher, for "
    "distillation), and reward models', LLM judges' (--judge) and reward functions' scores.")

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
(`--reward-fn NAME=FILE.py:FUNC`, repeatable, `rlkit.scorers.reward_fns`) add `reward/NAME` the same way,
batch by batch; their signatures are checked before the models load. `--teacher DIR` (on-policy distillation)
adds `teacher_logprobs`, a teacher's log-prob of every completion token, by the same forward-only scorer as the
reference (packed, micro-batched, at the rollout's temperature, bf16 on a GPU with --dtype auto); the teacher
must have the policy's tokenizer exactly (same vocabulary and special tokens: the log-probs of the same token ids
are compared), else one line; the policy that sampled the rows is refused as its own teacher as it is as its own
judge (the same weights' fingerprint, `Models.refuse_the_policy`). `--judge [NAME=]DIR[:rubric=FILE]` (or with
`--rubric FILE`) adds an LLM judge's verdict on each (prompt, response) under a yes-no or score rubric as
`reward/NAME` and `verdict/NAME` (`rlkit.scorers.judge`: hash-checked, never the policy itself). With none of --ref, --rm, --reward-fn, --teacher and --judge, the reference is the one the sampling policy was trained against: `update` records it in
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
    from rlkit.scorers import Scorer


@dataclass(frozen=True)
class ScoreRefConfig:
    ref: Path | None = option(None, "--ref", panel="Model", help="Frozen reference directory (made by `rlkit freeze-ref`). Without --ref, --rm and --reward-fn: the reference the sampling policy was trained against (recorded by `update` in its checkpoint).")
    # NAME=DIR reward models, each adds a `reward/rm:NAME` column
    rm: tuple[str, ...] = option((), "--rm", panel="Model", help="Reward model NAME=DIR (repeatable; or DIR, named after it): adds reward/rm:NAME.")
    # [NAME=]DIR[:rubric=FILE] LLM judges (rlkit.scorers.judge.parse_judges), each adds `reward/NAME` and `verdict/NAME`
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


def _load(cfg: ScoreRefConfig, scorers: list[Scorer], dev) -> list:
    """Load every scorer's model once (on `dev`, in the resolved --dtype), when the first input batch has come, not
    when the stage starts: in the card's pipe rollout's vLLM then has started and measured its memory before these
    models take theirs. -> what the rows must fit (`Limits`) for each model that reads the policy's token ids."""
    from rlkit.io.rows import Limits
    from rlkit.scorers import LogProbScorer

    if cfg.plan:  # on a GPU: the models and one forward batch must fit what the GPU has free (rlkit.planner)
        from rlkit import planner

        # a teacher and judges are planned as further LMs
        lms = [s.model_dir for s in scorers if s.lm]
        planner.preflight_scoring(lms[0] if lms else None,
                                  [*lms[1:], *(s.model_dir for s in scorers if not s.lm and s.model_dir)], cfg.dtype,
                                  cfg.batch_tokens, cfg.packing, dev)
    for s in scorers:
        s.load()
    return [Limits.of(s.model, s.what) for s in scorers if isinstance(s, LogProbScorer)]


def _score_prefs(cfg, reader, scorers: list[Scorer], out, inputs, dev) -> Path | None:
    """A prefs table in, the same table out with the reference's summed log-prob of each response (DPO)."""
    import pyarrow as pa

    from rlkit import console, devices
    from rlkit.errors import RlkitError
    from rlkit.io import manifests, schemas, streams
    from rlkit.io.data import encode_responses
    from rlkit.io.rows import check_pair_lengths
    from rlkit.scorers.logprobs import score_tokens

    if cfg.shard:
        raise RlkitError("--shard cuts rollouts tables; score a prefs table whole")
    if cfg.teacher is not None or cfg.judge:
        raise RlkitError("--teacher and --judge score the completions of a rollouts table, not a prefs table "
                         "(build-prefs --judge labels pairs)")
    if cfg.ref is None or cfg.rm or cfg.reward_fn:
        raise RlkitError("a prefs table is scored by the reference only (for DPO): pass --ref REF and no --rm or "
                         "--reward-fn")
    ref = scorers[0]
    manifest = manifests.make_manifest("prefs", "score-ref", cfg, inputs, **ref.manifest_entry(),
                                       **devices.manifest_entry(dev))
    rows, limits = 0, None
    # multi-turn columns pass through, so that `update --algo dpo` can refuse the rows
    extra = [f for f in reader.schema if f.name in schemas.MULTI_TURN_NAMES]
    with streams.write_table("prefs", out, manifest, extra) as w, \
            console.progress("score-ref", None, unit="pairs") as bar:
        for batch in reader:
            if limits is None:
                limits = _load(cfg, scorers, dev)
                devices.announce("score-ref", dev, cfg.dtype)
            cols = {name: batch.column(name) for name in batch.schema.names}
            prompts, tokenizer = batch.column("prompt").to_pylist(), ref.tokenizer
            for side in ("chosen", "rejected"):
                p_ids, r_ids = encode_responses(tokenizer, prompts, batch.column(side).to_pylist())
                check_pair_lengths(batch, side, p_ids, r_ids, limits[0], reader.label, row0=rows,
                                   budget=cfg.batch_tokens)
                lps = score_tokens(ref.model, p_ids, r_ids, tokenizer.pad_token_id, 1.0, cfg.batch_tokens,
                                   cfg.packing)
                cols[f"ref_{side}_logp"] = pa.array([sum(x) for x in lps], pa.float64())
            w.write(pa.record_batch([cols[f.name] if f.name in cols else pa.nulls(batch.num_rows, f.type)
                                     for f in w.schema], schema=w.schema))
            bar.advance(batch.num_rows)
            rows += batch.num_rows
        if rows == 0:
            raise RlkitError(f"{reader.label}: the prefs table has no rows")
    console.info(f"score-ref: {rows} preference pairs scored by {cfg.ref}")
    return out


def run(cfg: ScoreRefConfig) -> Path | None:
    """Claims --out (see `claims.claim_out`: never over an input, one writer) and runs the stage."""
    from rlkit import devices
    from rlkit.io import checkpoints, claims
    from rlkit.scorers import parse_judges, parse_rms, reward_fns
    from rlkit.tasks import reward_fn_sandbox

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
        rms = parse_rms(cfg.rm)
        # checked before models load (and, with --sandbox bwrap, their sandboxed workers started)
        fns = reward_fns.load_all(cfg.reward_fn, taken=rms, timeout=cfg.reward_timeout,
                                  sandbox=reward_fn_sandbox(cfg.sandbox, cfg.sandbox_workers))
        with reward_fns.closing(fns, "score-ref"):
            reward_fns.check_environments(fns, "score-ref reads a finished table: pass the function to rollout "
                                               "--env instead")
            return _run_loaded(cfg, rms, fns)


def _run_loaded(cfg: ScoreRefConfig, rms: dict[str, Path], fns) -> Path | None:
    from rlkit import console, devices
    from rlkit import scorers as sc
    from rlkit.errors import RlkitError
    from rlkit.io import claims, streams

    if cfg.shard:
        from rlkit.io import shards

        shards.parse(cfg.shard)
        if cfg.inp is None or cfg.inp == "-":
            raise RlkitError("--shard cuts an input file between groups: pass --in FILE (a piped-in shard of "
                             "`rollout --shard` needs no --shard here)")
    recorded = None
    if cfg.ref is None and not rms and not fns and cfg.teacher is None and not cfg.judge:  # the policy's reference
        pending = streams.open_table(cfg.inp, ["rollouts", "scored", "prefs"])
        recorded = sc.recorded_reference(pending.result().record)
        cfg = replace(cfg, ref=recorded[0])
    if cfg.dtype not in ("auto", "stored", "fp32", "bf16"):
        raise RlkitError(f"--dtype {cfg.dtype!r} is not one of auto, stored, fp32, bf16")
    out = streams.resolve_out(cfg.out)
    claims.check_out(out, "table")
    # reward functions run on the host
    dev = devices.resolve(cfg.device) if cfg.ref is not None or rms or cfg.teacher is not None or cfg.judge else None
    if dev is not None:
        cfg = replace(cfg, dtype=sc.score_dtype(dev, cfg.dtype))  # what auto became, as the manifest records it
    scorers = sc.from_options(cfg.ref, rms, cfg.teacher, cfg.judge, cfg.rubric, fns, device=dev, dtype=cfg.dtype,
                              trust_remote_code=cfg.trust_remote_code, batch_tokens=cfg.batch_tokens,
                              packed=cfg.packing)
    try:
        # what each reward model, judge and function reads of a multi-turn row (--reads), checked before any load
        reads = sc.set_reads(scorers, cfg.reads, "score-ref")
        if recorded is not None:
            console.info(f"score-ref: reference {recorded[0]} (recorded by {recorded[1]})")
        else:  # the input opens and streams into memory on a thread while torch imports and the models load
            pending = streams.open_table(cfg.inp, ["rollouts", "scored", "prefs"])
        return _score(cfg, scorers, pending.result(), out, dev, reads)
    finally:
        sc.close_all(scorers)  # a judge's generation engine (vllm), when one was started


def _score(cfg: ScoreRefConfig, scorers: list[Scorer], reader, out: Path, dev, reads: dict) -> Path | None:
    """Check the input against every scorer and score it, streaming (`_score_stream`), or a prefs table."""
    from rlkit import console, devices
    from rlkit import scorers as sc
    from rlkit.errors import DownstreamClosed, RlkitError
    from rlkit.io import manifests, schemas, shards, streams

    inputs = {"in": reader.fingerprint, **sc.inputs(scorers)}
    if manifests.skip_if_current(out, "score-ref", cfg, inputs):
        return out
    if reader.kind == "prefs":
        return _score_prefs(cfg, reader, scorers, out, inputs, dev)
    upstream = reader.record
    for s in scorers:
        s.check_upstream(upstream)  # the reference's and the teacher's tokenizer; the rollout's temperature
    sc.refuse_the_sampler(scorers, upstream)  # the policy as its own judge or teacher (and batch by batch, as rows come)
    sc.clash(scorers, reader)
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
             or f.name in schemas.CARRIED_NAMES] + sc.fields(scorers)
    entries = sc.manifest_entries(scorers)
    if cfg.ref is None:  # the reference the input was scored against, carried on
        entries.update({k: upstream.get(k) for k in ("reference", "reference_digest")})
    manifest = manifests.make_manifest(out_kind, "score-ref", cfg, inputs, tokenizer=upstream.tokenizer,
                                       rollout=dict(upstream.sampling) or None, temperature=upstream.temperature,
                                       engine=upstream.engine, **entries,
                                       **({"reads": reads} if reads and "messages" in reader.schema.names else {}),
                                       carried_paths=manifests.carried_paths(upstream.raw), **shard,
                                       **(devices.manifest_entry(dev) if dev is not None else {}))
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
        rows = _score_stream(cfg, batches, writer, scorers, reader, dev, empty_ok=bool(shard) or following,
                             row0=span.start if cfg.shard else 0,
                             started=(lambda: devices.announce("score-ref", dev, cfg.dtype)) if dev is not None else None)
    except BrokenPipeError:
        if not following:
            raise
        raise DownstreamClosed("score-ref") from None
    if cfg.spool is not None:  # the stream ended complete: its rollout reached --max-steps
        spool.mark_worker_end(cfg.spool, geometry.index, geometry.count)
    by = " and ".join(s.said for s in sorted(scorers, key=lambda s: not s.lm))  # the models first, judges among them
    console.info(f"score-ref: {rows} rows scored by {by}"
                 + (f" (shard {cfg.shard}: rows {span.start}-{span.stop} of {table.num_rows})" if cfg.shard else ""))
    return out


def _score_stream(cfg: ScoreRefConfig, batches, writer, scorers: list[Scorer], reader, dev, empty_ok: bool,
                  started=None, row0: int = 0) -> int:
    """Score `batches` one by one, writing each as soon as it is scored; -> rows written. An empty input
    is an error unless `empty_ok` (a shard may be empty; a follow run that was already finished is).
    When the first batch arrives the models load (`_load`) and `started()` is called (the stage's
    device line). Each batch's rows must fit the reference's and the teacher's vocabulary and context, and no
    longer than --batch-tokens, before they run (`check_rows`; `row0`, the first batch's row number
    in the input, names them). Then each scorer adds its columns (`rlkit.scorers.Scorer.score`)."""
    import pyarrow as pa

    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.io.rows import check_rows
    from rlkit.scorers import Rows, refuse_the_policy

    limits = None
    with writer as w, console.progress("score-ref", None, unit="rows") as bar:
        for batch in batches:
            if any(s.refusal for s in scorers):  # before a model loads for this batch
                refuse_the_policy(scorers, set(batch.column("policy_fingerprint").to_pylist()))
            limits = _load(cfg, scorers, dev) if limits is None else limits
            for lim in limits:
                check_rows(batch, lim, reader.label, row0=row0, budget=cfg.batch_tokens)
            row0 += batch.num_rows
            if started is not None:
                started()
                started = None
            cols = {name: batch.column(name) for name in batch.schema.names}
            rows = Rows(batch, w.rows)
            for s in scorers:
                cols.update(s.score(rows))
            w.write(pa.record_batch([cols[f.name] if f.name in cols else pa.nulls(batch.num_rows, f.type)
                                     for f in w.schema], schema=w.schema))
            bar.advance(batch.num_rows)
        if reader.rows == 0 and not empty_ok:
            raise RlkitError(f"{reader.label}: the rollouts table has no rows")
    return w.rows


command = stage_options.command(
    ScoreRefConfig,
    "Add to a rollouts table (streams) the frozen reference's per-token log-probs, a teacher's (--teacher, for "
    "distillation), and reward models', LLM judges' (--judge) and reward functions' scores.")

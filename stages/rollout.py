"""`rlkit rollout`: sample n completions per prompt from the policy and score them with the task's
verifier.

Reads a policy checkpoint and prompts (a task's train split, or --prompts FILE). Writes a 'rollouts'
table, streamed batch by batch: prompt and completion token ids, the sampling policy's log-prob of
each completion token (pi_old, at the sampling temperature), the finish reason, the checkpoint's
fingerprint and step, and each reward component as a `reward/<name>` column: `reward/verifier` (the
task's), and one per `--reward-fn NAME=FILE.py:FUNC` (the user's function, `rlkit.tasks.reward_fns`; its
signature is checked before the engine starts). Completions are up to --max-new-tokens, by default the task's
generation length; the code task's `verdict/verifier` says `truncated` for one cut there that did not pass. The
progress and closing lines show the mean total reward (the components summed, what update trains on without
--reward) and each component's mean, and a warning when most completions were cut. Same seed and inputs give
the same table. Sampling goes
through the `rlkit.engines` protocol: `--engine` names a registered engine (hf, vllm) or auto, and the
engine's name is recorded in the manifest, where `engines.capabilities(name)` tells what its log-probs are worth.
`--device` (auto: the GPU when there is one) is where the hf engine runs and what vLLM, which picks its own GPU, is
checked against; the device is said once on stderr and recorded in the manifest.

With `--env SPEC` each row is a multi-turn trajectory against an environment (`rlkit.envs`): the sampling driver
(`rlkit.sampling.run_episodes`) runs every trajectory of a chunk turn by turn, the rows carry `loss_mask` (0 on
the environment's tokens), `turns`, `turn_rewards`, `terminated`, `truncated`, `end_reason`, `tool_calls`,
`messages`, `reward/env` and `token_rewards` (each step's reward at its turn's last sampled token, a share of
reward/env); the prompts are the environment's own when it brings them, else the task's or --prompts FILE's. The
environment's rewards alone score its trajectories unless --task names a task, whose verifier then adds
`reward/verifier` (on the final turn); the reward's composition is said on stderr and recorded in the manifest
(`reward`), with what each scorer reads of a trajectory (`rlkit.tasks.multi_turn`, --reads). A trajectory an
environment error ended has every reward component 0. docs/environments.md. On a GPU shared with score-ref,
`--colocate DIR` sizes vLLM's memory share (`rlkit.engines.memory`), and `--follow --max-lag 0` puts vLLM to sleep
while update trains (docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

from rlkit import engines, stage_options
from rlkit.options import (
    AnswerColumn,
    Device,
    EnforceEager,
    EngineName,
    Env,
    EnvErrors,
    EnvSchedule,
    EnvTimeout,
    EnvWorkers,
    Force,
    GpuMemoryUtilization,
    MaxEnvTokens,
    MaxModelLen,
    MaxTotalTokens,
    MaxTurns,
    NoPlan,
    NoVerify,
    OutTable,
    PolicyDir,
    PromptColumn,
    Reads,
    RewardFn,
    RewardTimeout,
    SamplingDtype,
    SamplingEngine,
    SandboxKind,
    SandboxWorkers,
    Seed,
    Task,
    TensorParallel,
    TrustRemoteCode,
    VllmLora,
)
from rlkit.stage_options import option

if TYPE_CHECKING:
    from rlkit.engines import Engine



@dataclass(frozen=True)
class RolloutConfig:
    policy: Path = option(..., PolicyDir)
    # the task named (None: arithmetic's prompts, without --env its verifier too); recorded as resolved: its spec, or
    # under --env the verifier's task (None: no verifier), `env:SPEC` when the environment brings the prompts
    task: str | None = option(None, Task)
    prompts: str | None = option(None, panel="Data", help="Prompts file (.arrow/.parquet/.jsonl), '-' for stdin, or datasets spec; default: the task's train split.")
    prompt_column: str = option("prompt", PromptColumn)
    answer_column: str = option("answer", AnswerColumn)
    num_prompts: int | None = option(None, min=1, panel="Data", help="Prompts to sample for (task default 64; a file: all rows).")
    n: int = option(8, "--n", min=1, panel="Data", help="Completions per prompt (the group size).")
    # DAPO's dynamic sampling: keep sampling new prompts until this many groups have unequal rewards
    min_informative_groups: int | None = option(None, min=1, panel="Data", help="DAPO's dynamic sampling: write only groups whose rewards are not all equal (the others carry no signal for group-normalised algorithms), sampling new prompts after --num-prompts (--follow: --batch-prompts) until this many are written; at most --max-refill-rounds more rounds of that many prompts, then the batch is filled up with uninformative groups. Needs --n >= 2 and rewards at rollout (the task's verifier, --env, --reward-fn).")
    max_refill_rounds: int = option(4, min=0, panel="Data", help="--min-informative-groups: the prompts sampled after the first round are at most this many times its prompts (verl's max_num_gen_batches - 1); each chunk then samples only as many prompts as groups are still missing.")
    temperature: float = option(1.0, panel="Sampling", help="Sampling temperature (> 0).")
    top_p: float = option(1.0, panel="Sampling", help="Nucleus sampling threshold.")
    max_new_tokens: int | None = option(None, min=1, panel="Sampling", help="Longest completion, in tokens (TRL's max_completion_length, verl's response_length); under --env, the longest model turn (per turn; a whole trajectory is --max-total-tokens). Default: the environment's max_new_tokens under --env, else the task's own generation length (arithmetic 16; math 96, 256 with data=; code 40, 512 with data=; a user task's max_new_tokens, else 16); the manifest records the value in force. A completion cut there has finish_reason `length` (verdict `truncated` where the task gives verdicts), and a warning says so when more than half are.")
    env: str | None = option(None, Env)  # multi-turn trajectories against an environment (rlkit.envs)
    max_turns: int = option(8, MaxTurns)
    max_total_tokens: int | None = option(None, MaxTotalTokens)
    max_env_tokens: int = option(256, MaxEnvTokens)
    env_timeout: float = option(60.0, EnvTimeout)
    env_errors: Literal["fail", "end"] = option("fail", EnvErrors)
    env_workers: int = option(32, EnvWorkers)
    env_schedule: Literal["auto", "turns", "ready"] = option("auto", EnvSchedule)
    engine: EngineName = option("auto", SamplingEngine)
    batch_tokens: int = option(16384, min=16, panel="Optimization", help="Token budget per generation batch (hf engine).")
    tp: int = option(1, TensorParallel)
    gpu_memory_utilization: float | None = option(None, GpuMemoryUtilization)
    # models other stages run on the same GPU meanwhile (score-ref's --ref, --rm): vLLM's memory share leaves them room
    colocate: tuple[Path, ...] = option((), "--colocate", panel="Engine", help="A model another stage of the pipe runs on this GPU at the same time, e.g. score-ref's --ref and --rm (repeatable): rollout's vLLM leaves room for it (its weights x 1.25, plus 2 GiB for CUDA contexts) when it sizes --gpu-memory-utilization. See docs/gpu.md.")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = option("auto", SamplingDtype)
    max_model_len: int | None = option(None, MaxModelLen)
    enforce_eager: bool = option(False, EnforceEager)
    vllm_lora: Literal["adapter", "merge"] = option("adapter", VllmLora)
    # "i/N": this job's share of the prompts (whole chunks), see rlkit.io.shards
    shard: str | None = option(None, panel="Engine", help="I/N: sample only this job's share of the prompts (0 <= I < N); `rlkit cat` joins the N shards into the table one job gives.")
    # prompts a generation chunk: its seed follows its first prompt, so the same chunks give the same samples
    chunk_prompts: int = option(64, min=1, panel="Engine", help="Prompts per generation chunk; a chunk's sampling seed follows its first prompt, so the samples depend on it, and a --shard is whole chunks (under --follow: of each batch's prompts).")
    # --follow DIR: stream batches of `batch_prompts` prompts forever, switching to DIR's newest step
    # between batches (see rlkit.io.follow and `update --follow`)
    follow: Path | None = option(None, "--follow", panel="Follow", help="Persistent: stream batches of --batch-prompts prompts without end, each sampled by the newest complete step-NNNNNN/ in this directory (written by `update --follow`), loaded into the live engine between batches. See docs/follow.md.")
    batch_prompts: int | None = option(None, min=1, panel="Follow", help="--follow: prompts per batch (default 64); batch b samples the prompts of `--seed SEED+b+1` (a --prompts file: its rows in turn).")
    max_lag: int = option(1, min=0, panel="Follow", help="--follow: batch b waits until the newest step is at least (start step) + b - K, so rows are at most K steps older than the policy they train; 0 is synchronous (the per-round pipeline's result).")
    max_steps: int | None = option(None, min=1, panel="Follow", help="--follow: stop after the batch that trains step (--policy's step) + N.")
    # --follow: batch files in a spool directory an `update --follow --in SPOOL` consumes (rlkit.io.spool)
    spool: Path | None = option(None, "--spool", panel="Follow", help="--follow: write each batch as its own complete Arrow file into this spool directory (with --shard I/M: this worker's share of every batch), for `update --follow --in SPOOL` fed by many workers, instead of one stream to stdout or --out. See docs/scale-out.md.")
    reward_fn: tuple[str, ...] = option((), RewardFn)  # NAME=FILE.py:FUNC user reward functions, each adds reward/NAME
    reward_timeout: float = option(60.0, RewardTimeout)  # seconds one --reward-fn call may run (0: no limit)
    reads: tuple[str, ...] = option((), Reads)  # NAME=READING: the text of a multi-turn row a component reads
    sandbox: str | None = option(None, SandboxKind)  # code task: bwrap unless none; --reward-fn: only when given
    sandbox_workers: int | None = option(None, SandboxWorkers)
    seed: int = option(0, Seed)
    device: str = option("auto", Device)  # vllm runs on its own GPU, checked against this
    out: Path | None = option(None, OutTable)
    trust_remote_code: bool = option(False, TrustRemoteCode)
    plan: bool = option(True, NoPlan, invert=True)  # --no-plan: no memory check before vLLM starts on a GPU
    verify: bool = option(True, NoVerify, invert=True)  # --no-verify: no hash check of the policy (never for a reference)
    force: bool = option(False, Force)


def run(cfg: RolloutConfig) -> Path | None:
    """Claims --out (see `claims.claim_out`: never over an input, one writer) and runs the stage."""
    from rlkit.io import checkpoints, claims

    _check_device(cfg.device)  # a bad --device is one line before anything is claimed or written
    inputs = {"--policy": cfg.policy, "--prompts": cfg.prompts, "--task": cfg.task, "--reward-fn": cfg.reward_fn,
              "--follow": cfg.follow, "--colocate": cfg.colocate}
    if cfg.spool is not None:
        from rlkit.errors import RlkitError
        from rlkit.io import spool

        if cfg.follow is None:
            raise RlkitError("--spool writes the batches of a --follow run; pass --follow DIR too")
        if cfg.out is not None:
            raise RlkitError("--spool DIR and --out are two outputs for one stream: pass one of them")
        if cfg.spool.resolve() == cfg.follow.resolve():
            raise RlkitError(f"--spool {cfg.spool} is the --follow directory; the spool is a directory of its own")
        spool.check_root(cfg.spool, "--spool")
    with claims.claim_out(cfg.out, "table", inputs), checkpoints.verifying(cfg.verify):
        return _run(cfg)


def _check_device(spec: str) -> None:
    """--device's spelling, and `cuda` where torch sees no GPU: one line each (exit 2). Initialises no CUDA context
    (vLLM, started later in this process, could otherwise not fork its engine process)."""
    from rlkit import devices

    kind, _ = devices.parse(spec)
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            devices.resolve(spec)  # raises: CUDA is not available here


def _run(cfg: RolloutConfig) -> Path | None:
    from rlkit.engines import memory
    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, claims, streams
    from rlkit.scorers import reward_fns
    from rlkit.tasks import generation_length, get_task, reward_fn_sandbox, task_sandbox

    env = None
    if cfg.env is not None:
        from rlkit.envs import get_env

        env = get_env(cfg.env).sandboxed(cfg.sandbox)  # a bad spec, class or option: one line before anything starts
    named = cfg.task is not None
    task = get_task(cfg.task or "arithmetic")  # the prompts' task
    # the verifier: the task's, except that an environment's trajectories are scored by its own rewards alone unless
    # the user names a task
    scorer = task if env is None or named else None
    own = env is not None and callable(env.attribute("iter_examples")) and not cfg.prompts
    if own:
        from rlkit.envs import env_task

        task = env_task(env)  # the environment brings its own prompts
    sandbox = task_sandbox(scorer, cfg.sandbox, cfg.sandbox_workers)  # the code task's: checked before any sampling
    if cfg.colocate and cfg.gpu_memory_utilization:
        raise RlkitError("--colocate sizes vLLM's --gpu-memory-utilization from the models it names; pass one of them")
    for d in cfg.colocate:
        memory.model_bytes(d)  # a model directory with weights: checked now, whatever the engine and device
    engines.check(cfg.engine, _engine_options(cfg))  # a known name; a named engine takes these options
    if cfg.temperature <= 0:
        raise RlkitError(f"--temperature {cfg.temperature:g}: sampling needs a temperature > 0 (use `rlkit eval` for greedy)")
    if not 0 < cfg.top_p <= 1:
        raise RlkitError(f"--top-p {cfg.top_p:g}: expected a number in (0, 1]")
    if cfg.vllm_lora not in ("adapter", "merge"):
        raise RlkitError(f"--vllm-lora {cfg.vllm_lora!r} is not one of adapter, merge")
    checkpoints.check_model_dir(cfg.policy, "policy")
    out = streams.resolve_out(cfg.out)
    claims.check_out(out, "table")
    if env is not None and cfg.max_new_tokens is None and isinstance(env.attribute("max_new_tokens"), int):
        cfg = replace(cfg, max_new_tokens=env.attribute("max_new_tokens"))  # the environment's turn length
    if env is not None:
        cfg = replace(cfg, env=env.spec)
        from rlkit import console
        from rlkit.sampling.tally import turn_limit_warning

        if (low := turn_limit_warning("rollout", env, cfg.max_turns)) is not None:
            console.warn(low)
    recorded = task.spec if env is None or (own and not named) else getattr(scorer, "spec", None)
    cfg = replace(cfg, task=recorded, max_new_tokens=generation_length(task, cfg.max_new_tokens))  # in force, recorded
    # --reward-fn: checked (and, with --sandbox bwrap, their sandboxed workers started) before any sampling
    fns = reward_fns.load_all(cfg.reward_fn, taken=("verifier",), timeout=cfg.reward_timeout,
                              sandbox=reward_fn_sandbox(cfg.sandbox, cfg.sandbox_workers))
    with reward_fns.closing(fns):
        reward_fns.check_environments(fns, None if env is not None else
                                      "pass --env, or score the rows with another function")
        verifier = _Verifier(task, sandbox, cfg.max_new_tokens, env, scorer, max_turns=cfg.max_turns)
        verifier.reads = verifier.readings(cfg.reads, fns)
        if cfg.follow is not None:
            return _run_follow(cfg, verifier, out, fns)
        return _run_table(cfg, verifier, out, fns)


def _run_table(cfg: RolloutConfig, verifier: _Verifier, out: Path | None, fns) -> Path | None:
    """rollout's one finite table (without --follow)."""

    from rlkit import console, devices
    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, data, fingerprints, manifests, schemas, shards, streams
    from rlkit.scorers import reward_fns
    from rlkit.tasks import task_inputs

    task = verifier.task
    if cfg.batch_prompts is not None or cfg.max_steps is not None:
        raise RlkitError("--batch-prompts and --max-steps are --follow options (without it: --num-prompts)")
    refill = _refill(cfg, cfg.num_prompts or (None if cfg.prompts else 64))
    inputs = {"policy": fingerprints.fingerprint(cfg.policy), **task_inputs(task), **reward_fns.fingerprints(fns),
              **verifier.env_inputs()}
    # prompts stream: a chunk of --chunk-prompts is drawn (or sliced), rendered and tokenized only when it
    # is sampled, so memory stays flat and the first rows come out at once whatever --num-prompts
    if cfg.prompts:
        source = data.load_source(cfg.prompts, "prompts", {"prompt": cfg.prompt_column, "answer": cfg.answer_column})
        inputs["prompts"] = source.fingerprint
        source = source.head(None if refill else cfg.num_prompts)
        t = source.table
        total = t.num_rows
        scored = "answer" in t.column_names and t.column("answer").null_count == 0
        if refill is not None:  # rounds of --num-prompts rows, as far as the file goes
            first = min(total, cfg.num_prompts or total)
            total = min(total, first * (1 + cfg.max_refill_rounds))
            refill = refill._replace(limit=total, first=first)
    else:
        source = None
        cfg = replace(cfg, num_prompts=cfg.num_prompts or 64)
        total = _task_total(task, cfg) if cfg.shard else cfg.num_prompts
        if refill is not None:
            total = refill.limit
        scored = True  # a task's examples always carry a gold answer (UserTask checks the user's)
    span = range(total)
    if cfg.shard:
        span = shards.prompt_span(shards.parse(cfg.shard), total, cfg.chunk_prompts)
    if manifests.skip_if_current(out, "rollout", cfg, inputs):
        return out

    engine = _start_engine(cfg, cfg.policy)
    tokenizer = engine.tokenizer
    device = _engine_device(engine, cfg)
    tools = verifier.env.tool_schemas() if verifier.env is not None else None  # a TRL class's, for chat prompts
    chunks = _first_made(_file_chunks(source, tokenizer, span, cfg.chunk_prompts, tools) if source
                         else _task_chunks(task, tokenizer, cfg, span))
    if not scored and verifier.scores:
        console.warn("some prompts have no gold answer: no verifier reward column is written")
    verifier.announce(fns, cfg.prompts)
    extra = verifier.fields(scored, fns)
    if refill is not None:
        _check_refill(cfg, extra)
        extra = [*extra, *schemas.REFILL_FIELDS]
    fp, step = inputs["policy"], checkpoints.policy_step(cfg.policy)
    manifest = manifests.make_manifest("rollouts", "rollout", cfg, inputs,
                                       tokenizer=checkpoints.tokenizer_fingerprint(tokenizer), engine=engine.name,
                                       sampling_dtype=getattr(engine, "dtype", "fp32"),
                                       **devices.manifest_entry(device), **verifier.manifest_entry(fns),
                                       **shards.manifest_entry(cfg.shard, span, total, manifests.jsonable(cfg), inputs))
    with streams.write_table("rollouts", out, manifest, extra) as w, \
            console.progress("rollout", len(span) * cfg.n if refill is None else None) as bar:
        # chunks keep their global position and seed whatever the shard, so shards concatenate into the
        # table one job gives
        _sample(cfg, engine, tokenizer, verifier, w, bar, chunks, cfg.seed, 0, fp, step, scored, fns,
                None if refill is None else refill.start())
        engine.close()  # before the stream ends: downstream's end of input means the engine's GPU memory is free
    verifier.say()
    return out


def _run_follow(cfg: RolloutConfig, verifier: _Verifier, out: Path | None, fns=()) -> Path | None:
    """`rollout --follow DIR`: the follow service (`rlkit.follow.rollout`) streams batches of --batch-prompts
    prompts, each sampled here (`_sample`: completions, or trajectories with --env) by DIR's newest step."""
    from rlkit.errors import RlkitError
    from rlkit.follow import rollout as follow
    from rlkit.io import data, fingerprints
    from rlkit.scorers import reward_fns
    from rlkit.tasks import task_inputs

    if cfg.num_prompts is not None:
        raise RlkitError("--follow streams batches of --batch-prompts prompts without end; --num-prompts is for one "
                         "finite table")
    inputs = {"policy": fingerprints.fingerprint(cfg.policy), **task_inputs(verifier.task),
              **reward_fns.fingerprints(fns), **verifier.env_inputs()}
    source = None
    if cfg.prompts:
        source = data.load_source(cfg.prompts, "prompts", {"prompt": cfg.prompt_column, "answer": cfg.answer_column})
        inputs["prompts"] = source.fingerprint

    refill = _refill(cfg, cfg.batch_prompts or 64)

    def sample(engine, tokenizer, w, bar, chunks, seed, group0, fp, step, scored):
        _sample(cfg, engine, tokenizer, verifier, w, bar, chunks, seed, group0, fp, step, scored, fns,
                None if refill is None else refill.start())

    def fields(scored: bool) -> list:
        from rlkit.io import schemas

        extra = verifier.fields(scored, fns)
        if refill is not None:
            _check_refill(cfg, extra)
            extra = [*extra, *schemas.REFILL_FIELDS]
        return extra

    stage = follow.Stage(start_engine=lambda path: _start_engine(cfg, path),
                         engine_device=lambda engine: _engine_device(engine, cfg), sample=sample,
                         fields=fields, say=verifier.say,
                         tools=verifier.env.tool_schemas() if verifier.env is not None else None,
                         prompts_a_batch=None if refill is None else refill.limit,
                         groups_a_batch=None if refill is None else refill.want,
                         scores=verifier.scores, manifest=verifier.manifest_entry(fns))
    verifier.announce(fns, cfg.prompts)
    return follow.run(cfg, verifier.task, source, inputs, out, stage)


def _engine_options(cfg: RolloutConfig):
    """The engine's share of the config (`engines.EngineOptions`)."""

    return engines.EngineOptions(seed=cfg.seed, trust_remote_code=cfg.trust_remote_code, batch_tokens=cfg.batch_tokens,
                                 tp=cfg.tp, gpu_memory_utilization=cfg.gpu_memory_utilization, dtype=cfg.dtype,
                                 max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager, lora=cfg.vllm_lora,
                                 device=cfg.device, colocate=tuple(cfg.colocate),
                                 sleep=cfg.follow is not None and cfg.max_lag == 0, plan=cfg.plan)


def _start_engine(cfg: RolloutConfig, policy: Path) -> Engine:
    """The engine --engine names (auto: resolved, and why said on stderr), started on checkpoint `policy`, its
    device said on stderr; its `tokenizer` is the checkpoint's."""
    from rlkit import console, devices

    chosen, why = engines.choose(cfg.engine)
    console.info(f"rollout: engine {chosen} ({why})")
    engine = engines.create(chosen, policy, _engine_options(cfg))
    devices.announce("rollout", _engine_device(engine, cfg), getattr(engine, "dtype", None))
    return engine


def _engine_device(engine: Engine, cfg: RolloutConfig):
    """The torch.device the engine runs on (an engine that does not say: --device resolved)."""
    from rlkit import devices

    dev = getattr(engine, "device", None)
    return dev if dev is not None else devices.resolve(cfg.device)


def _prompts(c0, ids, answers, texts, prompt_ids):
    from rlkit.sampling import Prompts

    return Prompts(c0, ids, answers, texts, prompt_ids)


def _task_total(task, cfg: RolloutConfig) -> int:
    """The prompts a task gives for --num-prompts (what --shard cuts): all of them from a built-in task,
    whose train stream is endless; a user task's stream may end sooner, so it is walked once (nothing kept)."""
    import itertools

    from rlkit.tasks import UserTask

    if not isinstance(task, UserTask):
        return cfg.num_prompts
    return sum(1 for _ in itertools.islice(task.iter_examples("train", cfg.seed), cfg.num_prompts))


def _task_chunks(task, tokenizer, cfg: RolloutConfig, span: range):
    """Yield the task's train prompts `span` as Prompts of --chunk-prompts, each drawn and tokenized when
    it is asked for. `task.examples(split, n, seed)` is the first n of `iter_examples` (the Task protocol;
    every task from `get_task` has both), so the rows are those of the whole list; a shard draws and drops
    the prompts before its span (the stream is sequential in its seed)."""
    import itertools

    from rlkit.io import data

    it = itertools.islice(task.iter_examples("train", cfg.seed), span.start, span.stop)
    for c0 in range(span.start, span.stop, cfg.chunk_prompts):
        ex = list(itertools.islice(it, cfg.chunk_prompts))
        if not ex:
            return  # a user task's stream ended before --num-prompts
        texts = [e.prompt for e in ex]
        yield _prompts(c0, [e.prompt_id for e in ex], [e.answer for e in ex], texts,
                     data.encode_prompts(tokenizer, texts, False))


def _file_chunks(source, tokenizer, span: range, chunk: int, tools=None):
    """Yield rows `span` of a prompts file as Prompts of `chunk` rows, each rendered (chat template, with the
    environment's tool schemas when it has them) and tokenized when it is asked for."""
    from rlkit.io import data

    for c0 in range(span.start, span.stop, chunk):
        part = source.rows(c0, min(span.stop, c0 + chunk))
        t = part.table
        texts = data.render_prompts(tokenizer, part, for_sft=False, tools=tools)
        answers = t.column("answer").to_pylist() if "answer" in t.column_names else [None] * t.num_rows
        yield _prompts(c0, t.column("prompt_id").to_pylist(), answers, texts,
                     data.encode_prompts(tokenizer, texts, part.chat))


def _first_made(chunks):
    """`chunks` with its first chunk made now, before the output opens: a task that raises or a chat file
    without a chat template fails before anything is written, stdout included."""
    import itertools

    first = next(chunks, None)
    return iter(()) if first is None else itertools.chain([first], chunks)


@dataclass
class _Verifier:
    """The rewards rollout writes and how: the task's verifier (a chunk's rows at once, `rlkit.tasks.verify`; the
    code task's programs in `sandbox`, concurrently; a completion cut at --max-new-tokens gets the verdict
    `truncated`), under --env the environment's `reward/env`, each component's reading of a multi-turn row
    (`rlkit.tasks.multi_turn`), and the run's tally for the progress and summary lines: the verdict reasons, the
    completions cut, and the sum of each reward component and of their total."""

    task: object  # where the prompts come from
    sandbox: object = None
    max_new_tokens: int = 0
    env: object = None  # --env's EnvSpec: trajectories (reward/env)
    scorer: object = None  # the task whose verifier scores the rows (reward/verifier); None: no verifier
    reads: dict = field(default_factory=dict)  # component -> its reading of a multi-turn row
    counts: dict = field(default_factory=dict)
    rows: int = 0
    cut: int = 0
    sums: dict = field(default_factory=dict)  # reward/<name> -> sum over rows; "reward" -> the total's
    refills: list = field(default_factory=list)  # --min-informative-groups: each batch's `_Refill`
    max_turns: int = 0  # --env: --max-turns (the closing line's warning)
    trajectories: object = None  # --env: the run's `rlkit.sampling.tally.TrajectoryTally`

    def __post_init__(self) -> None:
        if self.env is not None:
            from rlkit.sampling.tally import TrajectoryTally

            self.trajectories = TrajectoryTally()

    @property
    def verdicts(self) -> bool:
        """Whether the task gives a reason with each reward (a `verdict/verifier` column)."""
        return self.scores and getattr(self.scorer, "score_batch", None) is not None

    @property
    def scores(self) -> bool:
        """Whether a task's verifier scores the rows: always without --env; with it only when --task names the task
        (the environment's rewards score its trajectories)."""
        return self.scorer is not None

    def readings(self, specs: tuple[str, ...], fns) -> dict[str, str]:
        """Each component's reading of a multi-turn row: the defaults, and --reads (checked: one line)."""
        from rlkit.tasks import multi_turn

        defaults = {**({"verifier": multi_turn.default_reads(self.scorer)} if self.scores else {}),
                    **{f.name: multi_turn.default_reads() for f in fns}}
        return multi_turn.parse_reads(specs, defaults, "rollout")

    def env_inputs(self) -> dict[str, str]:
        """What --env adds to the input fingerprints: its class's file (an edited environment reruns), and a named
        verifier's task when the environment brings the prompts."""
        from rlkit.tasks import task_inputs

        if self.env is None:
            return {}
        scorer = task_inputs(self.scorer) if self.scores and self.scorer is not self.task else {}
        return {"env": self.env.fingerprint, **({"verifier": scorer["task"]} if scorer else {})}

    def composition(self, fns) -> str:
        """What `reward` is: `env + verifier (task X)` and each --reward-fn, as said on stderr and in the manifest."""
        parts = (["env"] if self.env is not None else []) + ([f"verifier (task {self.scorer.name})"] if self.scores
                                                             else []) + [f"{f.name} (--reward-fn {f.label})" for f in fns]
        return " + ".join(parts) or "none"

    def manifest_entry(self, fns) -> dict:
        """The manifest's `reward`: the composition, each component's reading of a multi-turn row (under --env),
        and what `token_rewards` are a share of."""
        entry = {"composition": self.composition(fns)}
        if self.env is not None:
            entry.update(reads=dict(self.reads), token_rewards="env")
        return {"reward": entry}

    def announce(self, fns, prompts: str | None) -> None:
        """rollout's line under --env on what its reward is: `reward = env` (the environment's prompts, a task's or
        --prompts FILE's), `reward = env + verifier (task X)` when --task names X, and each --reward-fn; with what
        each scorer reads of a trajectory."""
        from rlkit import console
        from rlkit.tasks import multi_turn

        if self.env is None:
            return
        line = f"rollout: reward = {self.composition(fns)}"
        if self.reads:
            line += "; " + ", ".join(f"{k} reads {multi_turn.READINGS[v]}" for k, v in self.reads.items())
        if not self.scores:
            src = (f"--prompts {prompts}" if prompts else "the environment's own prompts"
                   if getattr(self.task, "from_env", False) else f"task {self.task.name}'s prompts")
            line += f" (on {src}; --task NAME adds that task's verifier)"
        console.info(line)

    def fields(self, scored: bool, fns) -> list:
        """The table's columns beyond the rollouts kind's: each reward component (and the verifier's verdicts),
        and with --env the trajectories' (`rlkit.io.schemas.MULTI_TURN_FIELDS`) and their per-turn `token_rewards`
        (a share of reward/env)."""
        import pyarrow as pa

        from rlkit.io import schemas

        names = [*(["env"] if self.env is not None else []), *(["verifier"] if scored and self.scores else []),
                 *(f.name for f in fns)]
        extra = [pa.field(f"reward/{n}", pa.float64()) for n in names]
        extra += [pa.field("verdict/verifier", pa.string())] if scored and self.verdicts else []
        if self.env is None:
            return extra
        return [*extra, *schemas.MULTI_TURN_FIELDS, schemas.token_rewards_field("env")]

    def __call__(self, completions: list[str], answers: list[str], finish_reasons: list[str]):
        from rlkit.tasks import verify

        scores = verify(self.scorer, completions, answers, self.sandbox, finish_reasons=finish_reasons)
        for r in scores.reasons or ():
            self.counts[r] = self.counts.get(r, 0) + 1
        return scores

    def score(self, cols: dict, answers: list, fins: list[str], scored: bool, fns, row0: int,
              environments=None) -> None:
        """Add the chunk's reward columns to `cols`: the verifier's (and its verdicts) and each --reward-fn's, each
        on its reading of the rows (`rlkit.tasks.multi_turn`); the rows of a trajectory an environment error ended
        are not scored (every component 0, verdict `env_error`). `environments`: each row's instance (rollout --env,
        for the functions that read them)."""
        from rlkit.tasks import multi_turn

        skip = multi_turn.ended_by_error(cols)
        if scored and self.scores:
            reads = multi_turn.texts(self.reads.get("verifier", "final"), cols)
            got = {}

            def verify(rows):
                s = self([reads[i] for i in rows], [answers[i] for i in rows], [fins[i] for i in rows])
                got["reasons"] = s.reasons
                return s.values

            cols["reward/verifier"] = multi_turn.score_kept(skip, verify, 0.0)
            if self.verdicts:
                it = iter(got.get("reasons") or ())
                cols["verdict/verifier"] = [multi_turn.ENV_ERROR if s else next(it) for s in skip]
                self.counts[multi_turn.ENV_ERROR] = self.counts.get(multi_turn.ENV_ERROR, 0) + sum(skip)
        for f in fns:
            reads = multi_turn.texts(self.reads.get(f.name, "conversation"), cols)
            envs = environments if f.reads_environments else None

            def run(rows, f=f, reads=reads, envs=envs):
                sub = multi_turn.subset(cols, rows)
                sub["completion"] = [reads[i] for i in rows]
                return f.score(sub, row0=row0, environments=None if envs is None else [envs[i] for i in rows])

            cols[f"reward/{f.name}"] = multi_turn.score_kept(skip, run, 0.0)

    def record(self, cols: dict, env_wait: float = 0.0) -> dict[str, float]:
        """Tally a chunk's written columns -> the running means for the progress line: `reward`, the total
        update trains on (`rlkit.algorithms.inputs.combine_rewards`: the components summed at weight 1, as update
        takes them without --reward), then each `reward/<name>`; under --env also `turns` (per trajectory), with
        `env_wait` the seconds the chunk's turn loop waited on its environment."""
        from rlkit.algorithms.inputs import combine_rewards

        self.rows += len(cols["finish_reason"])
        self.cut += sum(f == "length" for f in cols["finish_reason"])
        extra = {}
        if self.trajectories is not None and "end_reason" in cols:
            self.trajectories.add(cols, env_wait)
            extra = {"turns": self.trajectories.mean_turns}
        comps = {k.split("/", 1)[1]: v for k, v in cols.items() if k.startswith("reward/")}
        if not comps:
            return extra
        total, _ = combine_rewards(comps, None)
        for k, v in (("reward", float(total.double().sum())), *((f"reward/{n}", float(sum(c))) for n, c in comps.items())):
            self.sums[k] = self.sums.get(k, 0.0) + v
        return {**{k: v / self.rows for k, v in self.sums.items()}, **extra}

    def say(self) -> None:
        from rlkit import console
        from rlkit.tasks import truncation_warning

        if self.sums:
            means = {k: v / self.rows for k, v in self.sums.items()}
            parts = [f"{k} {v:.4g}" for k, v in means.items() if k != "reward"]
            console.info(f"rollout: mean reward {means['reward']:.4g} over {self.rows} completions ("
                         + (" + ".join(parts) if len(parts) > 1 else parts[0])
                         + "; update trains on this sum, or on the components weighed by its --reward)")
        if self.trajectories is not None:
            for line in self.trajectories.lines("rollout"):
                console.info(line)
            own = self.env.attribute("max_turns")
            for line in self.trajectories.warnings("rollout", self.max_turns, own if isinstance(own, int) else None):
                console.warn(line)
        if self.counts:
            total = sum(self.counts.values())
            console.info(f"rollout: {self.scorer.name} verdicts of {total} responses: "
                         + ", ".join(f"{k} {v} ({v / total:.1%})" for k, v in sorted(self.counts.items(),
                                                                                        key=lambda kv: -kv[1])))
        if self.refills:
            drawn, kept = sum(r.drawn for r in self.refills), sum(r.kept for r in self.refills)
            want, first = sum(r.want for r in self.refills), sum(r.first for r in self.refills)
            informative, tail = sum(r.informative for r in self.refills), sum(r.tail for r in self.refills)
            line = (f"rollout: dynamic sampling: informative {informative} of {drawn} sampled "
                    f"({informative / max(1, drawn):.0%}); kept {kept}")
            if drawn > first:
                line += f"; {drawn - first} sampled after the first round's {first}"
            if tail:
                line += f"; {tail} sampled after the last group kept, in its chunk, dropped (in no prompts_drawn)"
            if kept < want:
                console.warn(line + f"; --max-refill-rounds reached: {want - kept} uninformative groups fill the batch")
            else:
                console.info(line)
        cut = truncation_warning("rollout", self.cut, self.rows, self.max_new_tokens, self.task)
        if cut:
            console.warn(cut)


def _sample(cfg: RolloutConfig, engine: Engine, tokenizer, verifier: _Verifier, w, bar, chunks, seed: int, group0: int,
            fp: str, step: int, scored: bool, fns=(), refill: _Refill | None = None) -> None:
    """Sample each `rlkit.sampling.Prompts` of `chunks` through the sampling driver and write its rows to `w`. A
    chunk starting at prompt c0 is seeded `seed * 1_000_003 + c0`; prompt p becomes group `group0 + p`. Without
    --env each row is one completion; with it, one trajectory (`rlkit.sampling.run_episodes`). `verifier` scores
    each chunk's rows at once (`_Verifier.score`: a trajectory's final turn by default; with their verdicts where
    the task gives them); `fns` (--reward-fn) add their reward columns, computed on each chunk's rows (a function
    that reads the environment instances gets them: they stay open until it has scored). `refill`
    (--min-informative-groups): `chunks` re-cut as it asks (`_Refill.chunks`), only its informative groups are
    written, and sampling stops once it has enough."""
    from rlkit import sampling

    n = cfg.n
    s = _sampling(cfg)
    if verifier.trajectories is not None:
        verifier.trajectories.begin()
    if refill is not None:
        chunks = refill.chunks(chunks, cfg.chunk_prompts)
    keep_open = verifier.env is not None and any(f.reads_environments for f in fns)
    for ch in chunks:
        ep = None
        if verifier.env is None:
            gen = sampling.sample(engine, ch, s, seed * 1_000_003 + ch.c0)
            comps = tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
            fins = gen.finish_reasons
            rows = [(k // n, k % n) for k in range(len(comps))]  # (prompt within the chunk, sample)
            cols = {
                "prompt_id": [ch.ids[p] for p, _ in rows],
                "group_id": [group0 + ch.c0 + p for p, _ in rows],
                "sample_idx": [j for _, j in rows],
                "prompt": [ch.texts[p] for p, _ in rows],
                "completion": comps,
                "prompt_ids": [ch.prompt_ids[p] for p, _ in rows],
                "completion_ids": gen.completion_ids,
                "old_logprobs": gen.logprobs,
                "finish_reason": gen.finish_reasons,
            }
        else:
            ep = sampling.run_episodes(engine, tokenizer, verifier.env, ch, s, seed * 1_000_003 + ch.c0,
                                       keep_open=keep_open)
            c = ep.columns
            rows = [(k // n, k % n) for k in ep.trajectory]
            fins = ep.finish_reasons
            cols = {
                "prompt_id": c["prompt_id"],
                "group_id": [group0 + ch.c0 + p for p, _ in rows],
                "sample_idx": c["sample_idx"],
                "prompt": c["prompt"],
                "completion": tokenizer.batch_decode(c["completion_ids"], skip_special_tokens=True),
                "prompt_ids": c["prompt_ids"],
                "completion_ids": c["completion_ids"],
                "old_logprobs": c["old_logprobs"],
                "finish_reason": c["finish_reason"],
            }
        try:
            cols["policy_fingerprint"] = [fp] * len(rows)
            cols["policy_step"] = [step] * len(rows)
            cols["answer"] = [ch.answers[p] for p, _ in rows]
            if ep is not None:
                cols["reward/env"] = c["reward/env"]
                cols.update({k: c[k] for k in ("loss_mask", "turns", "turn_rewards", "terminated", "truncated",
                                               "end_reason", "tool_calls", "messages", "token_rewards",
                                               "observation_tokens")})
                if ep.unknown:
                    from rlkit import console

                    console.warn(f"rollout: {len(ep.unknown)} trajectories were shown text the tokenizer cannot encode "
                                 f"(the model saw its unknown token {tokenizer.unk_token!r} there), first {ep.unknown[0]}; "
                                 "check the environment's observations against the model's vocabulary")
            verifier.score(cols, cols["answer"], fins, scored, fns, w.rows,
                           [getattr(e, "wrapped", e) for e in ep.instances] if keep_open else None)
        except BaseException as e:
            if ep is not None:
                ep.close(e)
            raise
        if ep is not None:
            ep.close()
        if refill is not None:
            cols = refill.take(cols)
            if cols is None:
                bar.advance(0)
                continue
        w.write(cols)
        bar.advance(len(cols["group_id"]), **verifier.record(cols, ep.env_wait if ep is not None else 0.0))
        if refill is not None and refill.done:
            break
    if refill is not None:
        rest = refill.fill()
        if rest is not None:
            w.write(rest)
            bar.advance(len(rest["group_id"]), **verifier.record(rest))
        verifier.refills.append(refill)


class RefillPlan(NamedTuple):
    want: int  # informative groups a batch
    limit: int  # prompts a batch may sample at most
    first: int  # prompts of its first round

    def start(self) -> _Refill:
        return _Refill(self.want, self.limit, self.first)


def _refill(cfg: RolloutConfig, first: int | None) -> RefillPlan | None:
    """--min-informative-groups K, checked: K groups out of at most (1 + --max-refill-rounds) x `first` prompts
    (--num-prompts, or --batch-prompts under --follow); None without it."""
    from rlkit.errors import RlkitError

    k = cfg.min_informative_groups
    if k is None:
        return None
    if cfg.n < 2:
        raise RlkitError(f"--min-informative-groups needs groups of --n >= 2 samples to compare (got --n {cfg.n})")
    if cfg.shard:
        raise RlkitError("--min-informative-groups samples until enough groups have unequal rewards, so how many "
                         "prompts a job takes is not known in advance: it cannot be cut into --shard jobs")
    if first is not None and k > first:
        what = "--batch-prompts" if cfg.follow is not None else "--num-prompts"
        raise RlkitError(f"--min-informative-groups {k} is more than {what} {first}: the batch is at most that many "
                         "groups")
    return RefillPlan(k, (first or k) * (1 + cfg.max_refill_rounds), first or k)


def _check_refill(cfg: RolloutConfig, fields: list) -> None:
    """Refilling compares each group's rewards, so the rollout must give some (a verifier, --env, --reward-fn)."""
    from rlkit.errors import RlkitError

    if not any(f.name.startswith("reward/") for f in fields):
        raise RlkitError("--min-informative-groups compares each group's rewards, but this rollout gives none "
                         "(prompts without gold answers and no --env or --reward-fn); reward models come later, at "
                         "score-ref, where refilling cannot resample")


@dataclass
class _Refill:
    """DAPO's dynamic sampling over one batch (Yu et al. 2025, "DAPO"; verl's `filter_groups`): a group whose
    rewards (the components summed, as `update` takes them without --reward) are all equal gives every
    group-normalised advantage 0, so only groups with unequal rewards are written, `want` of them, while at most
    `limit` prompts are sampled: the first round's `first`, then only as many as groups are still missing
    (`chunks`). The uninformative groups are kept aside (up to `want`) to fill the batch up when the limit comes
    first, so it always holds `want` groups (`update --follow` takes whole batches). Every written row carries
    `prompts_drawn` (`rlkit.io.schemas.REFILL_FIELDS`): its group and the uninformative ones sampled since the group
    written before it, so that over a batch they sum to the prompts sampled up to its last group. The prompts that
    the chunk filling the batch sampled after its last group (a first-round chunk) are `tail`, in no group's."""

    want: int
    limit: int
    first: int  # prompts of the first round (--num-prompts, --batch-prompts)
    kept: int = 0  # informative groups written
    drawn: int = 0  # prompts sampled
    informative: int = 0  # groups sampled whose rewards are not all equal: the kept ones and any in the tail
    tail: int = 0  # prompts sampled after the batch was full (the rest of its chunk): dropped, in no prompts_drawn
    since: int = 0  # prompts sampled since the last group written
    spare: list = field(default_factory=list)  # uninformative groups: their columns

    @property
    def done(self) -> bool:
        return self.kept >= self.want or self.drawn >= self.limit

    def chunks(self, chunks, size: int):
        """The stream's prompts (`chunks`: `rlkit.sampling.Prompts` from prompt 0 on) re-cut into the chunks this
        batch samples, each made once the one before it is taken: the first round's `first` prompts in chunks of
        `size`, as a plain rollout of `first` prompts cuts them, then chunks of as many prompts as groups are still
        missing (at most `size`, up to `limit`), so that past the first round no informative group is sampled to be
        dropped. A chunk's seed follows its first prompt (`_sample`): the same seed gives the same chunks."""
        buf = None  # prompts drawn from `chunks`, not sampled yet
        at = 0  # the next prompt to sample
        while not self.done:
            k = min(size, self.first - at) if at < self.first else min(size, self.want - self.kept, self.limit - at)
            if k <= 0:
                return
            while buf is None or len(buf.ids) < k:
                more = next(chunks, None)
                if more is None:
                    break
                buf = more if buf is None else _prompts_joined(buf, more)
            if buf is None or not buf.ids:
                return  # the stream ended (a prompts file, a user task)
            piece, buf = _prompts_cut(buf, k)
            at = buf.c0
            yield piece

    def take(self, cols: dict) -> dict | None:
        """A chunk's columns -> those of its informative groups still wanted, each group's rows together (None: none)."""
        from rlkit.algorithms.inputs import combine_rewards

        comps = {k.split("/", 1)[1]: v for k, v in cols.items() if k.startswith("reward/")}
        total = combine_rewards(comps, None)[0].tolist()
        order: dict[int, list[int]] = {}
        for i, g in enumerate(cols["group_id"]):
            order.setdefault(g, []).append(i)
        out: list[dict] = []
        for rows in order.values():
            if self.drawn >= self.limit:
                break
            self.drawn += 1
            informative = len({total[i] for i in rows}) > 1
            self.informative += informative
            if self.kept >= self.want:  # in the chunk that filled the batch, after its last group: dropped
                self.tail += 1
                continue
            self.since += 1
            if informative:
                group = {k: [v[i] for i in rows] for k, v in cols.items()}
                group["prompts_drawn"] = [self.since] * len(rows)
                self.since = 0
                self.kept += 1
                out.append(group)
            elif len(self.spare) < self.want:
                self.spare.append({k: [v[i] for i in rows] for k, v in cols.items()})
        return _joined(out)

    def fill(self) -> dict | None:
        """At the limit with fewer than `want` informative groups: the batch filled up with uninformative ones (the
        first carries the prompts drawn since the last written group). None when nothing is missing."""
        missing = self.want - self.kept
        if missing <= 0 or not self.spare:
            return None
        groups = self.spare[:missing]
        for j, g in enumerate(groups):
            g["prompts_drawn"] = [self.since if j == 0 else 0] * len(g["group_id"])
        self.since = 0
        return _joined(groups)


def _prompts_joined(a, b):
    """Two `rlkit.sampling.Prompts` of consecutive prompts -> one."""
    from dataclasses import fields

    return replace(a, **{f.name: None if getattr(a, f.name) is None else getattr(a, f.name) + getattr(b, f.name)
                         for f in fields(a) if f.name != "c0"})


def _prompts_cut(p, k: int):
    """`rlkit.sampling.Prompts` -> (its first `k` prompts, the rest, from prompt c0 + k)."""
    from dataclasses import fields

    def part(sl: slice) -> dict:
        return {f.name: None if getattr(p, f.name) is None else getattr(p, f.name)[sl] for f in fields(p)
                if f.name != "c0"}

    return replace(p, **part(slice(None, k))), replace(p, c0=p.c0 + k, **part(slice(k, None)))


def _joined(groups: list[dict]) -> dict | None:
    if not groups:
        return None
    return {k: [x for g in groups for x in g[k]] for k in groups[0]}


def _sampling(cfg: RolloutConfig):
    """The driver's options from the stage's (`rlkit.sampling.Sampling`)."""
    from rlkit.sampling import Sampling

    return Sampling(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                    max_turns=cfg.max_turns, max_total_tokens=cfg.max_total_tokens, max_env_tokens=cfg.max_env_tokens,
                    env_timeout=cfg.env_timeout, env_errors=cfg.env_errors, env_workers=cfg.env_workers,
                    env_schedule=cfg.env_schedule)


command = stage_options.command(
    RolloutConfig, "Sample n completions per prompt, or n multi-turn trajectories against an environment (--env), with "
    "log-probs and rewards (the task's verifier, the environment's, --reward-fn); streams a rollouts table.")

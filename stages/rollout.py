"""`rlkit rollout`: sample n completions per prompt from the policy and score them with the task's
verifier.

Reads a policy checkpoint and prompts (a task's train split, or --prompts FILE). Writes a 'rollouts'
table, streamed batch by batch: prompt and completion token ids, the sampling policy's log-prob of
each completion token (pi_old, at the sampling temperature), the finish reason, the checkpoint's
fingerprint and step, and each reward component as a `reward/<name>` column: `reward/verifier` (the
task's), and one per `--reward-fn NAME=FILE.py:FUNC` (the user's function, `rlkit.scorers.reward_fns`; its
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

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rlkit import engines, stage_options
from rlkit.options import (
    AnswerColumn,
    EngineFlags,
    EnvFlags,
    PolicyDir,
    PromptColumn,
    Reads,
    RewardFn,
    RewardTimeout,
    SamplerFlags,
    Task,
    TrustVerifier,
    engine_options,
)
from rlkit.stage_options import option, splice

if TYPE_CHECKING:
    from rlkit.engines import Engine
    from rlkit.sampling.verify import Verifier


@dataclass(frozen=True)
@splice(EnvFlags, before="engine")
@splice(EngineFlags, before="shard")
@splice(SamplerFlags)
class RolloutConfig:
    policy: Path = option(..., PolicyDir)
    # the task named (None: arithmetic's prompts, without --env its verifier too); recorded as resolved: its spec, or
    # under --env the verifier's task (None: no verifier), `env:SPEC` when the environment brings the prompts
    task: str | None = option(None, Task)
    trust_verifier: bool = option(False, TrustVerifier)  # use a verifier that pays junk (rlkit.tasks.trust)
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
    # (spliced in here: EnvFlags' --env, --max-turns, ..., then EngineFlags' --engine, --batch-tokens, ..., --colocate)
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
    from rlkit.sampling.verify import Verifier
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
    checked = None
    if scorer is not None:  # the verifier that writes reward/verifier: checked before the engine starts
        from rlkit.tasks.trust import trusted

        checked = trusted(scorer, "rollout", sandbox=sandbox, trust=cfg.trust_verifier)
    recorded = task.spec if env is None or (own and not named) else getattr(scorer, "spec", None)
    cfg = replace(cfg, task=recorded, max_new_tokens=generation_length(task, cfg.max_new_tokens))  # in force, recorded
    # --reward-fn: checked (and, with --sandbox bwrap, their sandboxed workers started) before any sampling
    fns = reward_fns.load_all(cfg.reward_fn, taken=("verifier",), timeout=cfg.reward_timeout,
                              sandbox=reward_fn_sandbox(cfg.sandbox, cfg.sandbox_workers))
    with reward_fns.closing(fns):
        reward_fns.check_environments(fns, None if env is not None else
                                      "pass --env, or score the rows with another function")
        if env is not None:  # a TRL class's reward/env depends on the functions that read its instances
            env = env.read_by([f for f in fns if f.reads_environments])
        verifier = Verifier(task, sandbox, cfg.max_new_tokens, env, scorer, max_turns=cfg.max_turns, checked=checked)
        verifier.reads = verifier.readings(cfg.reads, fns)
        if cfg.follow is not None:
            return _run_follow(cfg, verifier, out, fns)
        return _run_table(cfg, verifier, out, fns)


def _run_table(cfg: RolloutConfig, verifier: Verifier, out: Path | None, fns) -> Path | None:
    """rollout's one finite table (without --follow)."""

    from rlkit import console, devices
    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, data, fingerprints, manifests, shards, streams
    from rlkit.sampling import Sampling, rows
    from rlkit.sampling import refill as dynamic
    from rlkit.scorers import reward_fns
    from rlkit.tasks import task_inputs

    task = verifier.task
    if cfg.batch_prompts is not None or cfg.max_steps is not None:
        raise RlkitError("--batch-prompts and --max-steps are --follow options (without it: --num-prompts)")
    refill = dynamic.plan(cfg, cfg.num_prompts or (None if cfg.prompts else 64))
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
        total = rows.task_total(task, cfg.num_prompts, cfg.seed) if cfg.shard else cfg.num_prompts
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
    chunks = rows.first_made(rows.file_chunks(source, tokenizer, span, cfg.chunk_prompts, tools) if source
                             else rows.task_chunks(task, tokenizer, cfg.seed, span, cfg.chunk_prompts))
    if not scored and verifier.scores:
        console.warn("some prompts have no gold answer: no verifier reward column is written")
    verifier.announce(fns, cfg.prompts)
    extra = dynamic.columns(verifier.fields(scored, fns), refill)
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
        rows.write(engine, tokenizer, verifier, w, bar, chunks, Sampling.of(cfg), cfg.chunk_prompts, cfg.seed, 0, fp, step,
                   scored, fns, None if refill is None else refill.start())
        engine.close()  # before the stream ends: downstream's end of input means the engine's GPU memory is free
    verifier.say()
    return out


def _run_follow(cfg: RolloutConfig, verifier: Verifier, out: Path | None, fns=()) -> Path | None:
    """`rollout --follow DIR`: the follow service (`rlkit.follow.rollout`) streams batches of --batch-prompts
    prompts, each sampled here (`rlkit.sampling.rows.write`: completions, or trajectories with --env) by DIR's
    newest step."""
    from rlkit.errors import RlkitError
    from rlkit.follow import rollout as follow
    from rlkit.io import data, fingerprints
    from rlkit.sampling import Sampling, rows
    from rlkit.sampling import refill as dynamic
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

    refill = dynamic.plan(cfg, cfg.batch_prompts or 64)

    def sample(engine, tokenizer, w, bar, chunks, seed, group0, fp, step, scored):
        rows.write(engine, tokenizer, verifier, w, bar, chunks, Sampling.of(cfg), cfg.chunk_prompts, seed, group0, fp,
                   step, scored, fns, None if refill is None else refill.start())

    stage = follow.Stage(start_engine=lambda path: _start_engine(cfg, path),
                         engine_device=lambda engine: _engine_device(engine, cfg), sample=sample,
                         fields=lambda scored: dynamic.columns(verifier.fields(scored, fns), refill),
                         say=verifier.say,
                         tools=verifier.env.tool_schemas() if verifier.env is not None else None,
                         prompts_a_batch=None if refill is None else refill.limit,
                         groups_a_batch=None if refill is None else refill.want,
                         scores=verifier.scores, manifest=verifier.manifest_entry(fns))
    verifier.announce(fns, cfg.prompts)
    return follow.run(cfg, verifier.task, source, inputs, out, stage)


def _engine_options(cfg: RolloutConfig):
    """The engine's share of the config (`engines.EngineOptions`): --max-lag 0 under --follow sleeps it."""
    return engine_options(cfg, sleep=cfg.follow is not None and cfg.max_lag == 0)


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


command = stage_options.command(
    RolloutConfig, "Sample n completions per prompt, or n multi-turn trajectories against an environment (--env), with "
    "log-probs and rewards (the task's verifier, the environment's, --reward-fn); streams a rollouts table.")

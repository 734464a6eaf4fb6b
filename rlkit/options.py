"""Option types shared by the stage commands (typer `Annotated` aliases), so flags read the same everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from rlkit import config_file
from rlkit.engines.base import EngineOptions
from rlkit.engines.base import names as engine_names
from rlkit.io import tracking
from rlkit.stage_options import Group, option
from rlkit.training import TrainOptions

ConfigFile = Annotated[
    Path | None,
    typer.Option("--config", is_eager=True, expose_value=False, callback=config_file.apply, help=config_file.CONFIG_HELP),
]
def _log_level(ctx, param, value: str) -> None:
    from rlkit import console

    if value not in console.LEVELS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(console.LEVELS)}", ctx=ctx, param=param)
    ctx.meta["rlkit_log_level"] = value
    _apply_level(ctx)


def _quiet(ctx, param, value: bool) -> None:
    if value:
        ctx.meta["rlkit_quiet"] = True
        _apply_level(ctx)


def _apply_level(ctx) -> None:
    """-q is --log-level warning, and wins over a lower --log-level, in whichever order they come."""
    from rlkit import console

    level = ctx.meta.get("rlkit_log_level", "info")
    if ctx.meta.get("rlkit_quiet") and console.LEVELS.index(level) < console.LEVELS.index("warning"):
        level = "warning"
    console.set_level(level)


LogLevel = Annotated[Literal["debug", "info", "warning", "error"], typer.Option("--log-level", is_eager=True, expose_value=False, callback=_log_level, help="debug, info, warning or error: rlkit's messages at this level and above on stderr; library logs (transformers, vLLM, datasets, torch) go through the same handler at warning, or at debug/error when asked. Errors always print; data on stdout is never touched.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", is_eager=True, expose_value=False, callback=_quiet, help="Only warnings and errors (no progress, no summaries): --log-level warning.")]
def output_path(value: str | Path) -> Path:
    """The parser of every option naming a path to write (--out, --metrics, --tensorboard): '' is refused
    (as a Path it would be '.', the working directory)."""
    if isinstance(value, Path):
        return value
    if not str(value).strip():
        raise ValueError("the path is empty; expected a path to write")
    return Path(value)


OutDir = Annotated[Path, typer.Option("--out", "-o", parser=output_path, rich_help_panel="Output & tracking", help="Output directory (written atomically).")]
OutTable = Annotated[
    Path | None,
    typer.Option("--out", "-o", allow_dash=True, parser=output_path,
                 rich_help_panel="Output & tracking", help="Output table (.arrow). Omitted or '-': stream to stdout (must be a pipe)."),
]
InTable = Annotated[
    Path | None,
    typer.Option("--in", "-i", allow_dash=True,
                 rich_help_panel="Data", help="Input table (.arrow), or '-' for stdin. Omitted: read stdin when it is a pipe."),
]
PolicyDir = Annotated[Path, typer.Option("--policy", rich_help_panel="Model", help="Policy checkpoint directory (Hugging Face layout).")]
Task = Annotated[
    str,
    typer.Option("--task", rich_help_panel="Data", help="Task spec NAME[:key=value,...] (built-in arithmetic, math or code, or an `rlkit.tasks` entry point), path/to/file.py:CLASS[:key=value,...] or package.module:CLASS[:...]; e.g. 'arithmetic:terms=2-5,max=20', 'math:data=gsm8k.jsonl', 'my_tasks.py:Countdown:max=50'. See docs/tasks-rewards.md."),
]
TrustVerifier = Annotated[bool, typer.Option("--trust-verifier", rich_help_panel="Data", help="Use the task's verifier even though it pays junk. Before a stage rewards, trains or evaluates with a task's verifier it checks it on a small fixed sample of the task's own examples: each gold answer must score full marks (a warning counts those it rejects) and junk (the empty answer, a nonsense word, another example's gold answer) must not; a verifier that pays junk is refused (exit 65) unless this is given. See docs/tasks-rewards.md#the-verifier-check.")]
RejectedTargets = Annotated[Literal["refuse", "drop", "keep"], typer.Option("--rejected-targets", rich_help_panel="Data", help="sft: what to do with a task's SFT targets that its own verifier rejects (sft scores every distinct target with it before training; a task whose verifier runs programs: the verifier check's sample only): refuse (one line, exit 65, nothing trained), drop (train on the others; the count is said and recorded) or keep (train on them anyway, with a warning). See docs/tasks-rewards.md#the-verifier-check.")]
RewardFn = Annotated[
    list[str] | None,
    typer.Option("--reward-fn", rich_help_panel="Data", help="User reward function NAME=path/to/file.py:FUNC or NAME=package.module:FUNC (repeatable): adds a reward/NAME column. Parameters prompt, completion, answer, row: one row per call, returns a number; prompts, completions, answers, rows: a batch per call, returns a list. See docs/tasks-rewards.md."),
]
Reads = Annotated[
    list[str] | None,
    typer.Option("--reads", rich_help_panel="Data", help="NAME=READING (repeatable): which text of a multi-turn row (--env) the reward component NAME reads: final (the trajectory's final model turn), model (the row's model turns, without the environment's text) or conversation (the whole row as the model saw it, tool results and feedback included). Defaults: a task's verifier final, reward models, judges and --reward-fn conversation. A single-turn row is its completion whatever the reading. See docs/tasks-rewards.md."),
]
RewardTimeout = Annotated[
    float,
    typer.Option("--reward-timeout", min=0, rich_help_panel="Data", help="Seconds one call of a --reward-fn may run; a call that takes longer stops the stage with one error line naming the function and the row (0: no limit)."),
]
# Multi-turn rollouts against an environment (rlkit.envs, rlkit.sampling; docs/environments.md)
Env = Annotated[str | None, typer.Option("--env", rich_help_panel="Environment", help="Run multi-turn trajectories against this environment: a built-in NAME[:key=value,...] (calc, guess, python: a sandboxed Python interpreter tool; textarena:game=ID for textarena's single-player games, openenv:url=ws://HOST:PORT/ws for an OpenEnv server, through their extras), path/to/file.py:CLASS[:key=value,...] (also a class written for TRL's environment_factory, unchanged), package.module:CLASS, or an `rlkit.envs` entry point. One instance per trajectory: reset(example) gives the prompt, step(action) the next observation and reward, until it terminates or a limit truncates it; the trajectory's reward (reward/env) is the sum of its steps'. Prompts come from the environment when it brings its own (iter_examples), else from --task or --prompts; rollout adds a task's verifier (reward/verifier, on the final turn) only when --task is given. See docs/environments.md.")]
MaxTurns = Annotated[int, typer.Option("--max-turns", min=1, rich_help_panel="Environment", help="--env: model turns per trajectory; one that reaches it is truncated (not a loss).")]
MaxTotalTokens = Annotated[int | None, typer.Option("--max-total-tokens", min=1, rich_help_panel="Environment", help="--env: completion tokens of a whole trajectory, the model's and the environment's (default: what the model's context leaves after the prompt); --max-new-tokens is per turn.")]
MaxEnvTokens = Annotated[int, typer.Option("--max-env-tokens", min=1, rich_help_panel="Environment", help="--env: tokens of one observation appended to the trajectory; a longer one keeps its first tokens (the end is cut).")]
EnvTimeout = Annotated[float, typer.Option("--env-timeout", min=0, rich_help_panel="Environment", help="--env: seconds one reset(), step() or close() call may run; one that takes longer is given up (its thread is told to stop, a sandboxed tool's worker is killed) and stops the stage with one error line naming the class, the method and the trajectory, or ends that trajectory with --env-errors end (0: no limit).")]
EnvWorkers = Annotated[int, typer.Option("--env-workers", min=1, rich_help_panel="Environment", help="--env: environment calls (reset, step, tools, close) of different trajectories that run at once, in threads; an async def method or tool is awaited on an event loop instead, any number at once. 1: one at a time, in trajectory order. An environment that holds a session per trajectory (OpenEnv) has at most this many open (or its own max_sessions). Raise it up to --num-prompts x --n for a slow environment.")]
EnvSchedule = Annotated[Literal["auto", "turns", "ready"], typer.Option("--env-schedule", rich_help_panel="Environment", help="--env: when a trajectory's next turn is sampled. turns: every running trajectory's turn in one engine call once the environment has answered them all (the table at a seed is the same whatever the environment's latencies and --env-workers); ready: as soon as its own environment has answered (vllm: continuous batching, each request seeded by seed, prompt, sample and turn; hf: the next batch is the trajectories ready when the engine is free), so no trajectory waits for another's environment (hf's rows then depend on the latencies: docs/environments.md). auto: ready on vllm, turns on hf.")]
EnvErrors = Annotated[Literal["fail", "end"], typer.Option("--env-errors", rich_help_panel="Environment", help="--env: what an environment that raises, returns a bad value (a reward that is not a finite number, an observation that is not text or chat messages) or overruns --env-timeout does: fail (one error line, exit 2, nothing written) or end (that trajectory ends, every reward component 0, and its end_reason says why).")]
# Where model-written programs run (the code task's verifier; --reward-fn with --sandbox): see rlkit.sandbox
SandboxKind = Annotated[
    str | None,
    typer.Option("--sandbox", metavar="<bwrap|none>", rich_help_panel="Data", help="Where untrusted code runs: bwrap (each program in its own bubblewrap sandbox: no network, a read-only system, a private tmpfs, its own PID namespace, resource limits and a wall-clock timeout) or none (a plain subprocess with the same limits: UNSAFE, the program runs as you). Default: bwrap for the code task; --reward-fn functions run in the stage as they always did unless --sandbox bwrap is given, and then in sandboxed workers. Without bubblewrap the stage refuses to run model code (docs/install.md). See docs/sandbox.md."),
]
SandboxWorkers = Annotated[
    int | None,
    typer.Option("--sandbox-workers", min=1, rich_help_panel="Data", help="Sandboxed programs (or reward-function workers) run at the same time; default: the CPU count. Results keep row order."),
]
JudgeRubric = Annotated[Path | None, typer.Option("--rubric", rich_help_panel="Model", help="The rubric of each --judge that names none with rubric=FILE (default DIR/rubric.toml): a TOML file with kind, template and choices or pattern. See docs/tasks-rewards.md#naming-a-judge.")]
Seed = Annotated[int, typer.Option("--seed", rich_help_panel="Optimization", help="Random seed; same seed and inputs give the same result.")]
Force = Annotated[bool, typer.Option("--force", rich_help_panel="Output & tracking", help="Rerun even when --out is up to date with these inputs and settings.")]
TrustRemoteCode = Annotated[
    bool, typer.Option("--trust-remote-code", rich_help_panel="Model", help="Allow model code from the checkpoint (off unless asked for).")
]
PromptColumn = Annotated[str, typer.Option("--prompt-column", rich_help_panel="Data", help="Column of the data that holds the prompt.")]
AnswerColumn = Annotated[str, typer.Option("--answer-column", rich_help_panel="Data", help="Column of the data that holds the gold answer.")]
NoVerify = Annotated[bool, typer.Option("--no-verify", rich_help_panel="Model", help="Load policy and reward-model checkpoints without checking their weights against the sha256 in rlkit.json (a frozen reference is always checked). Checks are cached per file version, so leaving them on costs one read per checkpoint.")]
# The memory plan a stage runs when it starts on a GPU (rlkit.planner): --no-plan skips it
NoPlan = Annotated[bool, typer.Option("--no-plan", rich_help_panel="Precision & memory", help="Skip the memory plan this stage runs when it starts on a GPU (which refuses, exit 71, a run whose planned peak exceeds the GPU's memory; `rlkit plan` shows it).")]
# Where the models run (every stage that runs one): see rlkit.devices
Device = Annotated[str, typer.Option("--device", metavar="<auto|cpu|cuda|cuda:N>", rich_help_panel="Precision & memory", help="Where the models run: auto (cuda:LOCAL_RANK under torchrun, else cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N.")]
# Training numerics (sft, train-rm, update): see rlkit.training
TrainDtype = Annotated[Literal["auto", "fp32", "bf16", "fp16"], typer.Option("--dtype", rich_help_panel="Precision & memory", help="Compute dtype: auto (bf16 on a GPU with bf16 kernels, fp32 on the CPU), fp32, bf16 or fp16. bf16/fp16 run the forward and backward under autocast over fp32 master weights and fp32 AdamW state (the saved checkpoint is fp32); fp16 adds a dynamic loss scale. See docs/precision-lora.md.")]
GradCheckpointing = Annotated[bool, typer.Option("--gradient-checkpointing", rich_help_panel="Precision & memory", help="Recompute activations in backward (transformers' non-reentrant gradient checkpointing): less memory, ~30% more compute.")]
# Micro-batches and packing (sft, train-rm, update; score-ref packs too): see rlkit.training.engine, rlkit.ops.packing
MicroBatchSize = Annotated[int | None, typer.Option("--micro-batch-size", rich_help_panel="Precision & memory", help="Sequences (rows) per forward/backward pass on each GPU or process: per rank under torchrun, like verl's ppo_micro_batch_size_per_gpu and TRL's per_device_train_batch_size. Each optimizer step (update: --minibatch-size sequences; train-rm: --batch-size pairs; sft: one --batch-tokens batch) runs as micro-batches of this many whose gradients accumulate into ONE step, with every loss term normalised over the whole step (the same update as one forward, in less memory). Default: the whole step in one pass on the CPU; on a GPU, micro-batches of 16384 tokens (as --micro-batch-tokens 16384).")]
MicroBatchTokens = Annotated[int | None, typer.Option("--micro-batch-tokens", rich_help_panel="Precision & memory", help="Like --micro-batch-size, but each forward/backward pass on each GPU or process takes rows while their real prompt + completion tokens (no padding counted) fit in this many, like verl's ppo_max_token_len_per_gpu; a row longer than it is refused, naming the row. sft's --batch-tokens, unlike this, counts padded tokens (rows x longest row).")]
Packing = Annotated[bool, typer.Option("--packing/--no-packing", rich_help_panel="Precision & memory", help="Pack the sequences of each forward pass into rows without padding, each with its own position ids and an attention that never crosses a sequence boundary (FlashAttention's varlen kernel when the model uses it). This is TRL's padding_free, not TRL's packing: sequences are never cut or merged into fixed-length blocks, and the log-probs and the loss are those of padded rows (memory and speed change, not the result). --no-packing: one right-padded row per sequence.")]
DistTimeout = Annotated[float, typer.Option("--dist-timeout", metavar="MINUTES", rich_help_panel="Precision & memory", help="Under torchrun: minutes a rank may wait in a collective for the others (the process group's timeout) before the run stops with an error. While rank 0 works alone (reading a piped input, writing and hashing the checkpoint) the other ranks wait for it outside any collective, with no time limit; under `update --follow` they wait for each batch rank 0 reads up to this long.")]
LoraRank = Annotated[int | None, typer.Option("--lora-rank", rich_help_panel="LoRA", help="Train a LoRA adapter of this rank (peft) instead of every weight; the checkpoint holds the adapter in PEFT's layout plus the base model's path and hashes.")]
LoraAlpha = Annotated[float | None, typer.Option("--lora-alpha", rich_help_panel="LoRA", help="LoRA scaling alpha (default 2 x --lora-rank).")]
LoraDropout = Annotated[float, typer.Option("--lora-dropout", rich_help_panel="LoRA", help="LoRA dropout on the adapter's input.")]
LoraTargets = Annotated[str | None, typer.Option("--lora-targets", rich_help_panel="LoRA", help="Comma-separated module names to adapt, e.g. q_proj,v_proj (default: every linear layer of the blocks, not the output head).")]
# Resume snapshots (sft, train-rm): see rlkit.training.resume
SaveSteps = Annotated[int, typer.Option("--save-steps", min=0, rich_help_panel="Output & tracking", help="Every N optimizer steps save a resume snapshot (weights, AdamW, LR schedule, RNG, data position) in .NAME.resume beside --out NAME: rerunning the same command after a kill resumes from it with the same result, and it is removed once --out is written (0: no snapshots, no resuming).")]
Resume = Annotated[Literal["auto", "must", "never"], typer.Option("--resume", rich_help_panel="Output & tracking", help="With --save-steps: what to do with the snapshot a stopped run left. auto: resume it when it is intact and was made with these settings and inputs, else say why in one warning line, discard it and start from step 0; must: resume it or stop with one error line, changing nothing; never: start from step 0 and replace it. Each snapshot file is checked against the sha256 its resume.json records before anything is loaded.")]

# Where metrics go besides the screen and the manifest (sft, train-rm, update, eval): rlkit.io.tracking
def _report_to(ctx, param, value: str | None) -> str | None:
    try:
        tracking.parse_report_to(value)
    except ValueError as e:
        raise typer.BadParameter(str(e), ctx=ctx, param=param) from None
    return value


Metrics = Annotated[Path | None, typer.Option("--metrics", parser=output_path, rich_help_panel="Output & tracking", help="Append the run's metrics as JSON lines to this file (the file `rlkit report` plots).")]
ReportTo = Annotated[str | None, typer.Option("--report-to", callback=_report_to, rich_help_panel="Output & tracking", help=tracking.REPORT_TO_HELP)]
RunName = Annotated[str | None, typer.Option("--run-name", rich_help_panel="Output & tracking", help=tracking.RUN_NAME_HELP)]
Project = Annotated[str, typer.Option("--project", rich_help_panel="Output & tracking", help=tracking.PROJECT_HELP)]
TensorBoardDir = Annotated[Path | None, typer.Option("--tensorboard", parser=output_path, rich_help_panel="Output & tracking", help="TensorBoard log directory (implies --report-to tensorboard; default runs/PROJECT/RUN_NAME).")]


def tracking_options(report_to: str | None, project: str, run_name: str | None, tensorboard: Path | None):
    """The shared tracking flags -> rlkit.io.tracking.TrackingConfig."""
    return tracking.TrackingConfig(report_to=tracking.parse_report_to(report_to), project=project,
                                   run_name=run_name, tensorboard=tensorboard)


# The tracking flags of a stage config's `tracking: TrackingConfig = nested(TRACKING)` (rlkit.stage_options)
TRACKING = Group(tracking.TrackingConfig, build=tracking_options, report_to=option(None, ReportTo),
                 run_name=option(None, RunName), project=option(tracking.DEFAULT_PROJECT, Project),
                 tensorboard=option(None, TensorBoardDir))


# The engine a stage samples with and its knobs (rollout, eval, build-prefs; rlkit.engines, rlkit.sampling)
EngineName = Literal[engine_names()]  # auto and every registered --engine, shown and checked by click
SamplingEngine = Annotated[EngineName, typer.Option("--engine", rich_help_panel="Engine", help="Sampling engine: hf (Hugging Face generate in this process), vllm, or auto (vLLM when it imports and a GPU is present, else hf).")]
TensorParallel = Annotated[int, typer.Option("--tp", min=1, rich_help_panel="Engine", help="vLLM tensor-parallel size (GPUs per engine).")]
GpuMemoryUtilization = Annotated[float | None, typer.Option("--gpu-memory-utilization", min=0.01, max=1.0, rich_help_panel="Engine", help="vLLM memory fraction (on a GPU default: what rollout's --colocate models leave, capped at 0.9, or 0.5 without --colocate; 0.3 on vLLM's CPU backend). See docs/gpu.md.")]
SamplingDtype = Annotated[Literal["auto", "fp32", "bf16", "fp16"], typer.Option("--dtype", rich_help_panel="Precision & memory", help="Sampling dtype: auto (vLLM on a GPU: bf16; vLLM's CPU backend: the checkpoint's; the hf engine: fp32), fp32, bf16 or fp16 (the hf engine samples in fp32; other dtypes need --engine vllm).")]
MaxModelLen = Annotated[int | None, typer.Option("--max-model-len", min=16, rich_help_panel="Engine", help="vLLM context length (default: the model's).")]
EnforceEager = Annotated[bool, typer.Option("--enforce-eager", rich_help_panel="Engine", help="vLLM: no CUDA graphs (faster start-up).")]
VllmLora = Annotated[Literal["adapter", "merge"], typer.Option("--vllm-lora", rich_help_panel="Engine", help="vLLM on a LoRA checkpoint: adapter (vLLM's LoRA: the base's weights plus the adapter per request; a --follow reload swaps adapters) or merge (the merged weights, written to a temporary directory: no LoRA kernels, a weights write per reload). The hf engine always merges.")]


@dataclass(frozen=True)
class EngineFlags:
    """The engine options of every stage that samples (rollout, eval, build-prefs), declared once: a stage's config
    takes them as its own fields with `@stage_options.splice(EngineFlags, before=...)` (--colocate only rollout's),
    and `engine_options(cfg)` is what they resolve to. Never made itself."""

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


def engine_options(cfg: Any, **more: Any) -> EngineOptions:
    """What a stage config's engine options resolve to: its `EngineFlags` fields (--colocate where it takes it) with
    its --seed, --trust-remote-code, --device and --no-plan, as the `EngineOptions` its engine starts with; `more`:
    the settings the stage adds (rollout's `sleep`)."""
    return EngineOptions(seed=cfg.seed, trust_remote_code=cfg.trust_remote_code, batch_tokens=cfg.batch_tokens,
                         tp=cfg.tp, gpu_memory_utilization=cfg.gpu_memory_utilization, dtype=cfg.dtype,
                         max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager, lora=cfg.vllm_lora,
                         device=cfg.device, colocate=tuple(getattr(cfg, "colocate", ())), plan=cfg.plan, **more)


@dataclass(frozen=True)
class EnvFlags:
    """The environment options of every stage that runs trajectories (rollout, eval), declared once: a stage's config
    takes them as its own fields with `@stage_options.splice(EnvFlags, before=...)`; all but --env are the sampling
    driver's settings of the same names (`rlkit.sampling.Sampling.of(cfg)`). Never made itself."""

    env: str | None = option(None, Env)  # multi-turn trajectories against an environment (rlkit.envs)
    max_turns: int = option(8, MaxTurns)
    max_total_tokens: int | None = option(None, MaxTotalTokens)
    max_env_tokens: int = option(256, MaxEnvTokens)
    env_timeout: float = option(60.0, EnvTimeout)
    env_errors: Literal["fail", "end"] = option("fail", EnvErrors)
    env_workers: int = option(32, EnvWorkers)
    env_schedule: Literal["auto", "turns", "ready"] = option("auto", EnvSchedule)


@dataclass(frozen=True)
class SamplerFlags:
    """The closing options of every stage that samples a policy (rollout, eval, build-prefs), declared once: a
    stage's config takes them as its last fields with `@stage_options.splice(SamplerFlags)` (eval's without --out
    and --force). Never made itself."""

    sandbox: str | None = option(None, SandboxKind)  # the code task's programs: bwrap unless none; --reward-fn: if given
    sandbox_workers: int | None = option(None, SandboxWorkers)
    seed: int = option(0, Seed)
    device: str = option("auto", Device)  # where the policy samples (rlkit.devices); vllm's GPU is checked against it
    out: Path | None = option(None, OutTable)
    trust_remote_code: bool = option(False, TrustRemoteCode)
    plan: bool = option(True, NoPlan, invert=True)  # --no-plan: no memory check before vLLM starts on a GPU
    verify: bool = option(True, NoVerify, invert=True)  # --no-verify: no hash check of the policy (never for a reference)
    force: bool = option(False, Force)


# One name per concept across the commands. Old spellings keep working, hidden from --help, with one
# deprecation line each (rlkit.cli rewrites them before parsing): command -> {old option: new option}.
RENAMED: dict[str, dict[str, str]] = {
    "prompts": {"--num": "--num-prompts", "-n": "--num-prompts"},
    "eval": {"--num": "--num-prompts", "-n": "--num-prompts"},
    "sft": {"--max-len": "--max-length", "--warmup": "--warmup-ratio"},
    "train-rm": {"--base": "--model"},
}
# ... and old values of an option: command -> {option: {old value: new value}}.
RENAMED_VALUES: dict[str, dict[str, dict[str, str]]] = {
    "rollout": {"--dtype": {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}},
}


# The panels `--help` groups every command's options into (typer's rich_help_panel): each option names its own
# where it is declared (stage_options.option(panel=...) on a config field, or the rich_help_panel of a shared alias
# above); the shared --config, --log-level and -q stay under "Options". tests/unit/test_vocabulary.py checks that
# no option is left out, tests/unit/test_stage_options.py that each panel is one of these.
PANELS = ("Model", "Data", "Algorithm", "KL", "Optimization", "Sampling", "Environment", "Engine", "Precision & memory", "LoRA",
          "Follow", "Output & tracking", "What to show")


def modernize(args: list[str], warn) -> list[str]:
    """`args` (a command line after `rlkit`) with the old spellings of RENAMED and RENAMED_VALUES replaced;
    `warn(line)` is called once per old spelling met. Stops at `--`."""
    out = list(args)
    cmd = next((a for a in out if not a.startswith("-")), None)
    names, values = RENAMED.get(cmd or "", {}), RENAMED_VALUES.get(cmd or "", {})
    if not (names or values):
        return out
    said: set[str] = set()
    i = out.index(cmd) + 1
    while i < len(out):
        a = out[i]
        if a == "--":
            break
        opt, eq, val = a.partition("=") if a.startswith("--") else (a, "", "")
        if opt in names:
            if opt not in said:
                warn(f"rlkit {cmd}: {opt} is deprecated; use {names[opt]}")
                said.add(opt)
            opt = names[opt]
            out[i] = f"{opt}{eq}{val}" if eq else opt
        if opt in values:
            j, v = (i, val) if eq else (i + 1, out[i + 1] if i + 1 < len(out) else None)
            new = values[opt].get(v) if v is not None else None
            if new is not None:
                if f"{opt}={v}" not in said:
                    warn(f"rlkit {cmd}: {opt} {v} is deprecated; use {opt} {new}")
                    said.add(f"{opt}={v}")
                out[j] = f"{opt}={new}" if eq else new
            i = j
        i += 1
    return out


def train_options(dtype: str, gradient_checkpointing: bool, lora_rank: int | None, lora_alpha: float | None,
                  lora_dropout: float, lora_targets: str | None, micro_batch_size: int | None = None,
                  micro_batch_tokens: int | None = None, packing: bool = True,
                  dist_timeout: float = TrainOptions.dist_timeout):
    """The shared training flags -> rlkit.training.TrainOptions (checked in the stage's run)."""
    from rlkit.training import TrainOptions, lora_options

    return TrainOptions(dtype=dtype, gradient_checkpointing=gradient_checkpointing,
                        lora=lora_options(lora_rank, lora_alpha, lora_dropout, lora_targets),
                        micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens, packing=packing,
                        dist_timeout=dist_timeout)


# The training flags of a stage config's `train: TrainOptions = nested(TRAIN)` (sft, train-rm, update)
TRAIN = Group(TrainOptions, build=train_options, dtype=option("auto", TrainDtype),
              gradient_checkpointing=option(False, GradCheckpointing), micro_batch_size=option(None, MicroBatchSize),
              micro_batch_tokens=option(None, MicroBatchTokens), packing=option(True, Packing),
              dist_timeout=option(TrainOptions.dist_timeout, DistTimeout),
              lora_rank=option(None, LoraRank), lora_alpha=option(None, LoraAlpha), lora_dropout=option(0.0, LoraDropout),
              lora_targets=option(None, LoraTargets))

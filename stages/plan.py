"""`rlkit plan STAGE [the stage's own options]`: what a stage would hold on each GPU, and whether it fits,
without a GPU and without reading a weight.

    rlkit plan update --policy ckpt/ --prompt-tokens 512 --completion-tokens 1024 --micro-batch-size 4
    rlkit plan update --policy qwen2.5-7b --gpus 8 --gradient-checkpointing --suggest
    rlkit plan score-ref --ref ref/ --in rollouts.arrow --json
    rlkit plan rollout --policy ckpt/ --engine vllm --n 8 --max-new-tokens 1024
    rlkit plan pipe --policy ckpt/ --ref ref/           # rollout | score-ref | update on one GPU

The stage's options are parsed by the stage's own command (so they mean exactly what they mean there; an
--out is not needed). The model is a checkpoint directory, any directory holding a `config.json`, or a
shipped shape by name (qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, qwen2.5-14b). The shape of the work comes
from --prompt-tokens/--completion-tokens, else from the stage's input table (--in: its longest prompt and
completion, its rows), else from the stage's own limits (sft --max-length, train-rm --max-length, rollout
--max-new-tokens), else a default of 256 + 256 tokens (half the model's context each where that is shorter);
the plan prints which, and where each came from. A sequence longer than the model's context
(max_position_embeddings) is refused, and so is an input the stage itself would refuse (the stage's own table
check). The training stages and score-ref are measured (`rlkit.planner.trace`: the stage's own step on fake
tensors at the real shapes, FSDP2 over --gpus ranks, at most one GPU a row of the step and MAX_GPUS); vLLM is
planned by its own accounting (`rollout --engine vllm`; the hf engine is not planned). Prints each part per
GPU (they sum to the peak) and last `fits: yes|no (...)`; --json prints one JSON object instead; --suggest
adds the flags that make it fit, or says that nothing the search reaches does. Exit 0 whether or not it fits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlkit import stage_options
from rlkit.stage_options import argument, option

STAGES = ("update", "sft", "train-rm", "score-ref", "rollout", "pipe")


@dataclass(frozen=True)
class PlanConfig:
    stage: str = argument(..., help="The stage to plan: update, sft, train-rm, score-ref, rollout (--engine vllm) or pipe (rollout | score-ref | update on one GPU).")
    args: tuple[str, ...] = argument((), help="The stage's own options, as that stage takes them (--policy, --minibatch-size, --micro-batch-size, --lora-rank, ...).", metavar="[STAGE OPTIONS]...")
    prompt_tokens: int | None = option(None, min=1, panel="Data", help="Prompt length in tokens (default: the input table's longest, else the stage's own limit, else 256 or half the model's context).")
    completion_tokens: int | None = option(None, min=1, panel="Data", help="Completion length in tokens (default: the input table's longest, else the stage's --max-new-tokens or limit, else 256 or half the model's context).")
    gpus: int = option(1, min=1, panel="Precision & memory", help="GPUs the stage runs on (torchrun's world: FSDP2 shards over them); at most 1024, and at most one a row of the step.")
    gpu_memory: float = option(80.0, min=1.0, panel="Precision & memory", help="Memory of one GPU, GiB.")
    json: bool = option(False, "--json", panel="What to show", help="Print one JSON object (fits, peak_gib, parts per GPU) instead of the table.")
    suggest: bool = option(False, "--suggest", panel="What to show", help="Add the micro-batch size / gradient checkpointing / LoRA / GPU count that makes it fit.")


def run(cfg: PlanConfig) -> None:
    from rlkit import planner
    from rlkit.errors import RlkitError

    if cfg.stage not in STAGES:
        raise RlkitError(f"plan {cfg.stage!r}: expected one of {', '.join(STAGES)}")
    if cfg.gpus > planner.MAX_GPUS:
        raise RlkitError(f"plan: --gpus {cfg.gpus}: expected at most {planner.MAX_GPUS} (the largest torchrun world "
                         "a plan traces)")
    hw = planner.Hardware(cfg.gpus, cfg.gpu_memory)
    stage_cfg = parse_stage(cfg.stage, cfg.args)
    if cfg.stage == "pipe":
        ests = plan_pipe(stage_cfg, cfg, hw)
        show(ests, cfg)
        return
    est = plan_stage(cfg.stage, stage_cfg, cfg, hw, suggest=cfg.suggest)
    show([est], cfg)


# -- the stage's own options


def _stage_module(stage: str):
    from rlkit.stages import rollout, score_ref, sft, train_rm, update

    return {"update": update, "pipe": update, "sft": sft, "train-rm": train_rm, "score-ref": score_ref,
            "rollout": rollout}[stage]


def parse_stage(stage: str, args: tuple[str, ...]):
    """The stage's config from its own command line (`rlkit.cli`'s click command of that stage)."""
    import click
    import typer

    from rlkit.errors import RlkitError

    mod = _stage_module(stage)
    one = typer.Typer()
    one.command()(mod.command)
    cmd = typer.main.get_command(one)  # the stage's own click command (typer's, as `rlkit STAGE` parses it)
    cls = mod.command.config  # the config the stage's command is made from (stage_options.command)
    args = list(args)
    if any(p.name == "out" and p.required for p in cmd.params) and "--out" not in args:
        args += ["--out", "-plan-no-output-"]  # the plan writes nothing: the stage's required --out is not asked for
    try:
        with cmd.make_context(f"rlkit plan {stage}", args) as ctx:
            s = stage_options.config_from(cls, ctx.params)
    except click.exceptions.Exit:
        raise
    except click.ClickException as e:
        raise RlkitError(f"plan {stage}: {e.format_message()}") from e
    return s


def _given(args: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _model(path, flag: str, tiny=None) -> dict:
    from rlkit import planner

    return planner.model_config(path, flag, tiny)


def plan_stage(stage: str, s, cfg: PlanConfig, hw, suggest: bool = False):
    """The estimate for one stage's config `s` (and, with `suggest`, what makes it fit)."""
    from rlkit import planner
    from rlkit.errors import RlkitError
    from rlkit.planner.work import DEFAULT_TOKENS, check_world, micro_batches, read_input, work_of

    table = read_input(stage, s)
    if stage in ("update", "pipe"):
        from rlkit.algorithms.config import resolve

        rl = resolve(s.rl)
        config = _model(s.policy, "--policy")
        given = _given(cfg.args, "--minibatch-size")
        work = work_of(stage, s, cfg, config, (rl.minibatch_size, "--minibatch-size" + ("" if given else "'s default")),
                     table=table)
        flag = "--minibatch-size"

        def plan(train, h):
            return planner.plan_training("update", config, work, h, train, algo=rl.algo, beta=rl.beta or 0.0)

        train = s.train
    elif stage == "sft":
        config = _model(s.model, "--model", s.tiny)
        half = s.max_len // 2
        work = work_of(stage, s, cfg, config, (1, ""), (half, s.max_len - half, "--max-length, halved"))
        rows = max(1, s.batch_tokens // (work.prompt + work.completion))
        work = replace(work, rows=rows, origin={**work.origin, "rows": "--batch-tokens / the sequence's tokens"})
        flag = "--batch-tokens"

        def plan(train, h):
            return planner.plan_training("sft", config, work, h, train)

        train = s.train
    elif stage == "train-rm":
        config = _model(s.base, "--model")
        half = s.max_length // 2
        work = work_of(stage, s, cfg, config, (s.batch_size, "--batch-size"),
                     (half, s.max_length - half, "--max-length, halved"))
        flag = "--batch-size"

        def plan(train, h):
            return planner.plan_training("train-rm", config, work, h, train)

        train = s.train
    elif stage == "score-ref":
        if s.ref is None:
            raise RlkitError("plan score-ref: give --ref DIR (the reference to plan for)")
        config = _model(s.ref, "--ref")
        rms = [_model(d, "--rm") for d in _rm_dirs(s.rm)]
        work = work_of(stage, s, cfg, config, (1, "--batch-tokens"), table=table)
        for rm in rms:
            work_of(stage, s, cfg, rm, (1, ""), table=table)  # each reward model's context too
        est = planner.plan_score_ref(config, work, hw, s.dtype, s.batch_tokens, s.packing, rms)
        est.settings["shape"] = _shape(work, {"rows_per_batch": est.settings["rows_per_batch"]})
        return est
    else:  # rollout
        if s.engine == "hf":
            raise RlkitError("plan rollout --engine hf: the hf engine's memory is not planned (only vLLM's, by its own "
                             "accounting); expected --engine vllm (or auto: vLLM on a GPU)")
        config = _model(s.policy, "--policy")
        ctx = int(config.get("max_position_embeddings") or 0)
        from rlkit.tasks import generation_length, get_task

        task = get_task(s.task or "arithmetic")  # rollout's default task
        max_new = generation_length(task, s.max_new_tokens)  # without the flag: the task's own length
        prompt = min(DEFAULT_TOKENS, max(1, ctx - max_new)) if ctx else DEFAULT_TOKENS
        limit = (prompt, max_new, "--max-new-tokens" if s.max_new_tokens else f"task {task.name}'s length")
        work = work_of(stage, s, cfg, config, (1, ""), limit)
        if limit is not None and not cfg.prompt_tokens:
            why = f"the default {DEFAULT_TOKENS}" if prompt == DEFAULT_TOKENS else "the model's context less --max-new-tokens"
            work = replace(work, origin={**work.origin, "prompt_tokens": why})
        util = s.gpu_memory_utilization or 0.9
        est = planner.plan_vllm(config, work, hw, dtype="fp32" if s.dtype == "fp32" else "bf16", utilization=util,
                                n=s.n, prompts=s.num_prompts or 64)
        if s.engine == "auto":
            est.notes.insert(0, "--engine auto: planned as vLLM, what auto picks on a GPU where vLLM imports")
        est.notes += _env_notes(s)
        est.settings["shape"] = _shape(work)
        return est
    train.check(distributed=hw.gpus > 1, step_rows=work.rows, step_flag=flag)
    check_world(stage, work, hw, flag)
    est = plan(train, hw)
    est.settings["shape"] = _shape(work, micro_batches(train, work, hw))
    if suggest and not est.fits:
        kw = {"algo": rl.algo, "beta": rl.beta or 0.0} if stage in ("update", "pipe") else {}
        est.suggestion = planner.suggest_training("update" if stage == "pipe" else stage, config, work, hw, train, **kw)
    return est


def _env_notes(s) -> list[str]:
    """What the rollout's environment holds beside the GPU: its class's `resources(options, trajectories,
    env_workers)` lines (the python tool's sandboxes), if it says."""
    if getattr(s, "env", None) is None:
        return []
    from rlkit.envs import get_env

    env = get_env(s.env).sandboxed(getattr(s, "sandbox", None))
    fn = getattr(env.factory, "resources", None)
    if not callable(fn):
        return []
    return [f"environment {env.name}: {line}" for line in fn(env.options, (s.num_prompts or 64) * s.n, s.env_workers)]


def _shape(work, more: dict | None = None) -> dict:
    d = {"rows": work.rows, "prompt_tokens": work.prompt, "completion_tokens": work.completion}
    if work.batch_rows is not None:
        d["batch_rows"] = work.batch_rows
    return {**d, **(more or {}), "from": dict(work.origin)}


def _rm_dirs(specs: tuple[str, ...]) -> list[str]:
    return [s.partition("=")[2] if "=" in s else s for s in specs]


def plan_pipe(s, cfg: PlanConfig, hw) -> list:
    """rollout (vLLM) | score-ref | update on one GPU: vLLM and score-ref's models are held at once (score-ref
    loads on its first batch, while rollout still samples); update loads once its input has ended (rollout and
    score-ref have exited)."""
    from rlkit import planner

    upd = plan_stage("pipe", s, cfg, hw, suggest=cfg.suggest)
    upd.stage = "update"
    work = planner.Work(upd.settings["shape"]["prompt_tokens"], upd.settings["shape"]["completion_tokens"], 1)
    config = _model(s.policy, "--policy")
    ref = _model(s.ref, "--ref") if s.ref is not None else config
    roll = planner.plan_vllm(config, work, hw, utilization=0.5)
    score = planner.plan_score_ref(ref, work, hw, "auto", 16384, True)
    both = {k: roll.parts.get(k, 0) + score.parts.get(k, 0) for k in {**roll.parts, **score.parts}}
    together = planner.Estimate("rollout + score-ref", both, sum(both.values()), roll.gpu_memory, 1,
                                "vLLM's accounting + traced", ["rollout's vLLM engine and score-ref's reference run at once"])
    return [roll, score, together, upd]


# -- output


def _out(line: str) -> None:
    print(line, flush=True)


ROWS = (("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
        ("activations", "activations"), ("kv_cache", "KV cache"), ("batch", "batch tensors"))


def _shape_line(shape: dict) -> str:
    src = shape["from"]
    parts = [f"{shape['prompt_tokens']:,} prompt tokens ({src['prompt_tokens']})",
             f"{shape['completion_tokens']:,} completion tokens ({src['completion_tokens']})"]
    if src.get("rows"):
        parts.insert(0, f"{shape['rows']:,} rows a step ({src['rows']})")
    if "batch_rows" in shape:
        parts.append(f"{shape['batch_rows']:,} rows held ({src['batch_rows']})")
    if "micro_batch_rows" in shape:
        parts.append(f"{shape['rows_per_gpu']:,} rows per GPU in {shape['micro_batches_per_gpu']:,} micro-batch"
                     f"{'es' if shape['micro_batches_per_gpu'] > 1 else ''} of {shape['micro_batch_rows']:,} "
                     f"({shape['micro_batch_from']})")
    if "rows_per_batch" in shape:
        parts.append(f"{shape['rows_per_batch']:,} rows a forward batch (--batch-tokens)")
    return "  planned for: " + "; ".join(parts)


def show(ests: list, cfg: PlanConfig) -> None:
    import json

    from rlkit import planner

    fits = all(e.fits for e in ests[-2:]) if cfg.stage == "pipe" else ests[0].fits
    last = ests[-1] if cfg.stage != "pipe" else max(ests[-2:], key=lambda e: e.peak)
    if cfg.json:
        body = {"stage": cfg.stage, "fits": fits, "peak_gib": round(last.peak / planner.GIB, 2),
                "gpu_memory_gib": cfg.gpu_memory, "gpus": cfg.gpus,
                "plans": [e.to_json() for e in ests]}
        _out(json.dumps(body))
        return
    for e in ests:
        unit, div = ("GiB", planner.GIB) if e.peak >= planner.GIB // 10 else ("MiB", 2**20)
        _out(f"{e.stage}: per GPU ({e.gpus} GPU{'s' if e.gpus > 1 else ''} of {e.gpu_memory / planner.GIB:.0f} GiB; "
             f"{e.method})")
        if "shape" in e.settings:
            _out(_shape_line(e.settings["shape"]))
        for key, label in ROWS:
            if key in e.parts and (e.parts[key] or key in ("weights", "activations")):
                _out(f"  {label:20} {e.parts[key] / div:8.2f} {unit}")
        _out(f"  {'peak':20} {e.peak / div:8.2f} {unit}  (the sum of the parts: what one GPU holds at its peak)")
        if e.logits:
            _out(f"  note: the logits (and their gradient) take {e.logits / div:.2f} {unit} at their own peak, "
                 "within activations")
        for n in e.notes:
            _out(f"  note: {n}")
        if e.suggestion:
            sug = e.suggestion
            flags = planner.flags_text(sug["flags"], sug["gpus"] if sug["gpus"] != e.gpus else None)
            if sug.get("nothing"):
                _out(f"  suggest: nothing fits, even with {flags} (peak {sug['peak_gib']:.1f} GiB)")
            else:
                _out(f"  suggest: {flags} (peak {sug['peak_gib']:.1f} GiB)")
    _out(last.fits_line().replace("fits: yes", "fits: yes" if fits else "fits: no")
         if cfg.stage != "pipe" else f"fits: {'yes' if fits else 'no'} (peak {last.peak / planner.GIB:.1f} GiB "
         f"of {cfg.gpu_memory:.0f} GiB per GPU)")


command = stage_options.command(PlanConfig, """What a stage would hold on each GPU, and whether it fits: measured on fake tensors, no GPU or weights needed.

Give the stage and its own options: rlkit plan update --policy ckpt/ --micro-batch-size 4 --gpus 8.""")

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
completion, its rows), else from the stage's own limits. The training stages and score-ref are measured
(`rlkit.planner.trace`: the stage's own step on fake tensors at the real shapes, FSDP2 over --gpus ranks);
vLLM is planned by its own accounting. Prints each part per GPU and last `fits: yes|no (...)`; --json prints
one JSON object instead; --suggest adds the flags that make it fit. Exit 0 whether or not it fits.
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
    prompt_tokens: int | None = option(None, min=1, panel="Data", help="Prompt length in tokens (default: the input table's longest, else the stage's own limit).")
    completion_tokens: int | None = option(None, min=1, panel="Data", help="Completion length in tokens (default: the input table's longest, else the stage's --max-new-tokens or limit).")
    gpus: int = option(1, min=1, panel="Precision & memory", help="GPUs the stage runs on (torchrun's world: FSDP2 shards over them).")
    gpu_memory: float = option(80.0, min=1.0, panel="Precision & memory", help="Memory of one GPU, GiB.")
    json: bool = option(False, "--json", panel="What to show", help="Print one JSON object (fits, peak_gib, parts per GPU) instead of the table.")
    suggest: bool = option(False, "--suggest", panel="What to show", help="Add the micro-batch size / gradient checkpointing / LoRA / GPU count that makes it fit.")


def run(cfg: PlanConfig) -> None:
    from rlkit import planner

    if cfg.stage not in STAGES:
        from rlkit.errors import RlkitError

        raise RlkitError(f"plan {cfg.stage!r}: expected one of {', '.join(STAGES)}")
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
            return stage_options.config_from(cls, ctx.params)
    except click.exceptions.Exit:
        raise
    except click.ClickException as e:
        raise RlkitError(f"plan {stage}: {e.format_message()}") from e


def _lengths(inp: str | None) -> tuple[int, int, int] | None:
    """(longest prompt, longest completion, rows) of an input table (rollouts, scored), or None."""
    if not inp or inp == "-":
        return None
    import pyarrow.compute as pc

    from rlkit.io import streams

    table, _ = streams.read_table(inp, ["rollouts", "scored"], require_rows=False)
    names = table.schema.names
    if "prompt_ids" not in names or "completion_ids" not in names:
        return None
    p = pc.max(pc.list_value_length(table.column("prompt_ids"))).as_py() or 1
    c = pc.max(pc.list_value_length(table.column("completion_ids"))).as_py() or 1
    return int(p), int(c), table.num_rows


def _work(cfg, prompt: int, completion: int, rows: int, batch_rows: int | None = None, inp: str | None = None):
    from rlkit import planner

    got = _lengths(inp)
    if got is not None:
        prompt, completion, batch_rows = got[0], got[1], got[2]
    return planner.Work(cfg.prompt_tokens or prompt, cfg.completion_tokens or completion, rows, batch_rows)


def _model(path, flag: str, tiny=None) -> dict:
    from rlkit import planner

    return planner.model_config(path, flag, tiny)


def plan_stage(stage: str, s, cfg: PlanConfig, hw, suggest: bool = False):
    """The estimate for one stage's config `s` (and, with `suggest`, what makes it fit)."""
    from rlkit import planner

    if stage == "update":
        from rlkit.algorithms.config import resolve

        rl = resolve(s.rl)
        config = _model(s.policy, "--policy")
        work = _work(cfg, 256, 256, rl.minibatch_size, None, s.inp)

        def plan(train, h):
            return planner.plan_training("update", config, work, h, train, algo=rl.algo, beta=rl.beta or 0.0)

        train = s.train
    elif stage == "sft":
        config = _model(s.model, "--model", s.tiny)
        work = _work(cfg, s.max_len // 2, s.max_len - s.max_len // 2, 1)
        work = replace(work, rows=max(1, s.batch_tokens // (work.prompt + work.completion)))

        def plan(train, h):
            return planner.plan_training("sft", config, work, h, train)

        train = s.train
    elif stage == "train-rm":
        config = _model(s.base, "--model")
        work = _work(cfg, s.max_length // 2, s.max_length - s.max_length // 2, s.batch_size)

        def plan(train, h):
            return planner.plan_training("train-rm", config, work, h, train)

        train = s.train
    elif stage == "score-ref":
        if s.ref is None:
            from rlkit.errors import RlkitError

            raise RlkitError("plan score-ref: give --ref DIR (the reference to plan for)")
        config = _model(s.ref, "--ref")
        rms = [_model(d, "--rm") for d in _rm_dirs(s.rm)]
        work = _work(cfg, 256, 256, 1, None, s.inp)
        return planner.plan_score_ref(config, work, hw, s.dtype, s.batch_tokens, s.packing, rms)
    else:  # rollout
        config = _model(s.policy, "--policy")
        work = _work(cfg, 256, s.max_new_tokens, 1)
        util = s.gpu_memory_utilization or 0.9
        return planner.plan_vllm(config, work, hw, dtype="fp32" if s.dtype == "fp32" else "bf16", utilization=util,
                                 n=s.n, prompts=s.num_prompts or 64)
    train.check(distributed=hw.gpus > 1)
    est = plan(train, hw)
    if suggest and not est.fits:
        kw = {"algo": rl.algo, "beta": rl.beta or 0.0} if stage == "update" else {}
        est.suggestion = planner.suggest_training(stage, config, work, hw, train, **kw)
    return est


def _rm_dirs(specs: tuple[str, ...]) -> list[str]:
    return [s.partition("=")[2] if "=" in s else s for s in specs]


def plan_pipe(s, cfg: PlanConfig, hw) -> list:
    """rollout (vLLM) | score-ref | update on one GPU: vLLM and score-ref's models are held at once (score-ref
    loads on its first batch, while rollout still samples); update loads once its input has ended (rollout and
    score-ref have exited)."""
    from rlkit import planner

    config = _model(s.policy, "--policy")
    ref = _model(s.ref, "--ref") if s.ref is not None else config
    work = _work(cfg, 256, 256, s.rl.minibatch_size, None, s.inp)
    roll = planner.plan_vllm(config, work, hw, utilization=0.5)
    score = planner.plan_score_ref(ref, work, hw, "auto", 16384, True)
    upd = plan_stage("update", s, cfg, hw, suggest=cfg.suggest)
    together = planner.Estimate("rollout + score-ref", {k: roll.parts.get(k, 0) + score.parts.get(k, 0)
                                                        for k in roll.parts}, roll.peak + score.peak,
                                roll.gpu_memory, 1, "vLLM's accounting + traced",
                                ["rollout's vLLM engine and score-ref's reference run at once"])
    return [roll, score, together, upd]


# -- output


def _out(line: str) -> None:
    print(line, flush=True)


ROWS = (("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
        ("activations", "activations"), ("logits", "logits (own peak)"), ("kv_cache", "KV cache"),
        ("batch", "batch tensors"))


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
        for key, label in ROWS:
            if key in e.parts and (e.parts[key] or key in ("weights", "activations")):
                _out(f"  {label:20} {e.parts[key] / div:8.2f} {unit}")
        _out(f"  {'peak':20} {e.peak / div:8.2f} {unit}")
        for n in e.notes:
            _out(f"  note: {n}")
        if e.suggestion:
            flags = " ".join(k if v is True else f"{k} {v}" for k, v in e.suggestion["flags"].items() if k != "gpus")
            on = f" on {e.suggestion['gpus']} GPUs" if e.suggestion["gpus"] != e.gpus else ""
            _out(f"  suggest: {flags}{on} (peak {e.suggestion['peak_gib']:.1f} GiB)")
        elif cfg.suggest and not e.fits and e.method == "traced":
            _out("  suggest: nothing tried fits (micro-batches, gradient checkpointing, LoRA, more GPUs)")
    _out(last.fits_line().replace("fits: yes", "fits: yes" if fits else "fits: no")
                if cfg.stage != "pipe" else f"fits: {'yes' if fits else 'no'} (peak {last.peak / planner.GIB:.1f} GiB "
                f"of {cfg.gpu_memory:.0f} GiB per GPU)")


command = stage_options.command(PlanConfig, """What a stage would hold on each GPU, and whether it fits: measured on fake tensors, no GPU or weights needed.

Give the stage and its own options: rlkit plan update --policy ckpt/ --micro-batch-size 4 --gpus 8.""")

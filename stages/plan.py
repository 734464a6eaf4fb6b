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


# -- the shape of the work, and where each figure came from


def _table(stage: str, s):
    """The stage's input table, read and checked as the stage reads and checks it -> (table, label), or None
    (no input named: the plan does not read stdin)."""
    from rlkit.io import data, streams

    if stage in ("update", "pipe"):
        if not s.inp or s.inp == "-":
            return None
        from rlkit import algorithms

        inp = algorithms.get(s.rl.algo).input()
        table, reader = streams.read_table(s.inp, list(inp.kinds), require_rows=False)
        inp.check(reader.kind, s.rl)
        return table, f"--in {s.inp}"
    if stage == "score-ref":
        if not s.inp or s.inp == "-":
            return None
        table, _ = streams.read_table(s.inp, ["rollouts", "scored", "prefs"], require_rows=False)
        return table, f"--in {s.inp}"
    if stage == "train-rm":
        if s.prefs == "-":
            return None
        src = data.load_source(s.prefs, "prefs", {})
        from rlkit.tasks import prefs

        t = src.table.to_pydict()
        prefs.check_pairs(src.label, t["prompt"], t["chosen"], t["rejected"])
        return None  # pairs of text: their lengths are the tokenizer's, --max-length bounds them
    if stage == "sft" and s.data:
        data.load_source(s.data, "sft", {"prompt": s.prompt_column, "completion": s.completion_column})
    return None


def _longest(got) -> tuple[int, int, int] | None:
    """(longest prompt, longest completion, rows) of a token table (rollouts, scored), or None."""
    if got is None:
        return None
    import pyarrow.compute as pc

    table = got[0]
    names = table.schema.names
    if "prompt_ids" not in names or "completion_ids" not in names or not table.num_rows:
        return None
    p = pc.max(pc.list_value_length(table.column("prompt_ids"))).as_py() or 1
    c = pc.max(pc.list_value_length(table.column("completion_ids"))).as_py() or 1
    return int(p), int(c), table.num_rows


DEFAULT_TOKENS = 256  # prompt and completion each, where nothing else gives them (at most half the model's context)


def _work(stage: str, s, cfg: PlanConfig, config: dict, rows: tuple[int, str], limit: tuple[int, int, str] | None = None,
          table=None):
    """The shape planned for: prompt and completion tokens from --prompt-tokens/--completion-tokens, else the input
    table's longest, else the stage's own limit `limit` (prompt, completion, its flag), else DEFAULT_TOKENS each
    (half the model's context where that is shorter); `rows` (value, where from). Refused past the model's
    context. -> planner.Work, with `origin` saying where each figure came from."""
    from rlkit import planner
    from rlkit.errors import RlkitError

    ctx = int(config.get("max_position_embeddings") or 0)
    got = _longest(table)
    batch_rows = None
    if got is not None:
        prompt, completion = (got[0], f"{table[1]}, its longest"), (got[1], f"{table[1]}, its longest")
        batch_rows = got[2]
    elif limit is not None:
        prompt, completion = (limit[0], limit[2]), (limit[1], limit[2])
    else:
        d = min(DEFAULT_TOKENS, ctx // 2) if ctx else DEFAULT_TOKENS
        why = (f"the default {DEFAULT_TOKENS}" if d == DEFAULT_TOKENS else
               f"half the model's {ctx}-token context: the default {DEFAULT_TOKENS} is longer")
        prompt, completion = (d, why), (d, why)
    if cfg.prompt_tokens:
        prompt = (cfg.prompt_tokens, "--prompt-tokens")
    if cfg.completion_tokens:
        completion = (cfg.completion_tokens, "--completion-tokens")
    if ctx and prompt[0] + completion[0] > ctx:
        raise RlkitError(f"plan {stage}: a sequence of {prompt[0]:,} prompt ({prompt[1]}) + {completion[0]:,} completion "
                         f"({completion[1]}) tokens is longer than the model's context of {ctx:,} tokens "
                         f"(max_position_embeddings); expected at most {ctx:,} together")
    origin = {"prompt_tokens": prompt[1], "completion_tokens": completion[1], "rows": rows[1]}
    if batch_rows is not None:
        origin["batch_rows"] = f"{table[1]}, its rows"
    return planner.Work(prompt[0], completion[0], rows[0], batch_rows, origin)


def _check_world(stage: str, work, hw, flag: str) -> None:
    from rlkit.errors import RlkitError

    if hw.gpus > work.rows:
        raise RlkitError(f"plan {stage}: --gpus {hw.gpus} is more GPUs than the {work.rows:,} rows of one optimizer step "
                         f"({flag}); expected at most {work.rows:,} (each GPU trains at least one row)")


def _micro(train, work, hw) -> dict:
    """The micro-batches a rank runs, as the trace cuts them, and where their size came from."""
    from rlkit.training import GPU_MICRO_BATCH_TOKENS

    per_rank = -(-work.rows // hw.gpus)
    length = work.prompt + work.completion
    if train.micro_batch_size is not None:
        size, why = train.micro_batch_size, "--micro-batch-size"
    else:
        tokens = train.micro_batch_tokens or GPU_MICRO_BATCH_TOKENS
        size = max(1, tokens // length)
        why = (f"--micro-batch-tokens {tokens:,}" if train.micro_batch_tokens else
               f"the GPU's default budget of {tokens:,} tokens")
    size = min(size, per_rank)
    return {"rows_per_gpu": per_rank, "micro_batch_rows": size, "micro_batches_per_gpu": -(-per_rank // size),
            "micro_batch_from": why}


def _model(path, flag: str, tiny=None) -> dict:
    from rlkit import planner

    return planner.model_config(path, flag, tiny)


def plan_stage(stage: str, s, cfg: PlanConfig, hw, suggest: bool = False):
    """The estimate for one stage's config `s` (and, with `suggest`, what makes it fit)."""
    from rlkit import planner
    from rlkit.errors import RlkitError

    table = _table(stage, s)
    if stage in ("update", "pipe"):
        from rlkit.algorithms.config import resolve

        rl = resolve(s.rl)
        config = _model(s.policy, "--policy")
        given = _given(cfg.args, "--minibatch-size")
        work = _work(stage, s, cfg, config, (rl.minibatch_size, "--minibatch-size" + ("" if given else "'s default")),
                     table=table)
        flag = "--minibatch-size"

        def plan(train, h):
            return planner.plan_training("update", config, work, h, train, algo=rl.algo, beta=rl.beta or 0.0)

        train = s.train
    elif stage == "sft":
        config = _model(s.model, "--model", s.tiny)
        half = s.max_len // 2
        work = _work(stage, s, cfg, config, (1, ""), (half, s.max_len - half, "--max-length, halved"))
        rows = max(1, s.batch_tokens // (work.prompt + work.completion))
        work = replace(work, rows=rows, origin={**work.origin, "rows": "--batch-tokens / the sequence's tokens"})
        flag = "--batch-tokens"

        def plan(train, h):
            return planner.plan_training("sft", config, work, h, train)

        train = s.train
    elif stage == "train-rm":
        config = _model(s.base, "--model")
        half = s.max_length // 2
        work = _work(stage, s, cfg, config, (s.batch_size, "--batch-size"),
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
        work = _work(stage, s, cfg, config, (1, "--batch-tokens"), table=table)
        for rm in rms:
            _work(stage, s, cfg, rm, (1, ""), table=table)  # each reward model's context too
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

        task = get_task(s.task)
        max_new = generation_length(task, s.max_new_tokens)  # without the flag: the task's own length
        prompt = min(DEFAULT_TOKENS, max(1, ctx - max_new)) if ctx else DEFAULT_TOKENS
        limit = (prompt, max_new, "--max-new-tokens" if s.max_new_tokens else f"task {task.name}'s length")
        work = _work(stage, s, cfg, config, (1, ""), limit)
        if limit is not None and not cfg.prompt_tokens:
            why = f"the default {DEFAULT_TOKENS}" if prompt == DEFAULT_TOKENS else "the model's context less --max-new-tokens"
            work = replace(work, origin={**work.origin, "prompt_tokens": why})
        util = s.gpu_memory_utilization or 0.9
        est = planner.plan_vllm(config, work, hw, dtype="fp32" if s.dtype == "fp32" else "bf16", utilization=util,
                                n=s.n, prompts=s.num_prompts or 64)
        if s.engine == "auto":
            est.notes.insert(0, "--engine auto: planned as vLLM, what auto picks on a GPU where vLLM imports")
        est.settings["shape"] = _shape(work)
        return est
    train.check(distributed=hw.gpus > 1, step_rows=work.rows, step_flag=flag)
    _check_world(stage, work, hw, flag)
    est = plan(train, hw)
    est.settings["shape"] = _shape(work, _micro(train, work, hw))
    if suggest and not est.fits:
        kw = {"algo": rl.algo, "beta": rl.beta or 0.0} if stage in ("update", "pipe") else {}
        est.suggestion = planner.suggest_training("update" if stage == "pipe" else stage, config, work, hw, train, **kw)
    return est


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

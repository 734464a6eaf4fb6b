"""`rlkit sft`: supervised fine-tuning, the first stage of both RLHF and RLVR.

Reads a base model (`tiny`, a local directory or a hub id) and either a task's generated train split
or a data file with prompt/completion (or chat `messages`) columns. Writes a Hugging Face checkpoint
with `rlkit.json` (config, input fingerprints, weights sha256, metrics).

Loss is on completion tokens only (prompt and padding masked), and on a task's trajectory targets
(`rlkit.tasks.Transcript`: `--task calc`'s tool-use transcripts, `--task guess`'s games) on the model's turns
only: the tool results and feedback in them are context, masked as a rollout's `loss_mask` masks them, each part
tokenised on its own as a rollout appends it; batches are packed by a token budget,
not a fixed row count; AdamW with linear warmup and cosine decay. Ends with a greedy held-out
evaluation when a task is known, through the sampling driver on the hf engine wrapping the trained model in memory
(its figures go into the checkpoint's manifest, written with the weights; `rlkit eval --engine vllm --policy OUT`
evaluates the written checkpoint on vLLM). Under torchrun it trains data-parallel (FSDP2, `rlkit.training.distributed`):
each rank takes rows rank::N of every batch; rank 0 writes the gathered checkpoint.

Rejection sampling (DeepSeek-R1's stage 3, RAFT): with `--data` a rollouts or scored table and `--min-reward R`
and/or `--best-of`, it trains on the completions whose total reward reaches R (`--best-of`: one a prompt group,
the best), on the token ids the policy sampled, not re-tokenised, and off a multi-turn row's environment tokens
(`rlkit.training.rejection`; a kept row longer than --max-length is refused, not truncated). The table's tokenizer
must be --model's; the held-out evaluation is the rollout's task unless --task is given (none for an
environment's own prompts); rollout samples a task's train split, so no held-out example is trained on. The
checkpoint records the table's fingerprint as its `data` input and the filter in its metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from rlkit import stage_options
from rlkit.io.tracking import TrackingConfig
from rlkit.options import (
    TRACKING,
    TRAIN,
    Device,
    Force,
    Metrics,
    NoPlan,
    NoVerify,
    OutDir,
    RejectedTargets,
    Resume,
    SandboxKind,
    SandboxWorkers,
    SaveSteps,
    Seed,
    TrustRemoteCode,
    TrustVerifier,
)
from rlkit.stage_options import Group, nested, option
from rlkit.tiny import TinyConfig
from rlkit.training import TrainOptions


def _tiny(layers: int, hidden: int) -> TinyConfig:
    """The embedded model --layers and --hidden size (heads of 32 dimensions, a 4x MLP)."""
    return TinyConfig(layers=layers, hidden=hidden, heads=max(1, hidden // 32), intermediate=4 * hidden)


TINY = Group(TinyConfig, build=_tiny,
             layers=option(TinyConfig.layers, panel="Model", help="tiny model: transformer layers."),
             hidden=option(TinyConfig.hidden, panel="Model", help="tiny model: hidden width."))


@dataclass(frozen=True)
class SftConfig:
    out: Path = option(..., OutDir)
    model: str = option("tiny", panel="Model", help="Base model: 'tiny' (embedded, built fresh), a local directory or a hub id.")
    # resolved to "arithmetic" when no --data is given
    task: str | None = option(None, panel="Data", help="Task spec to train on (its train split and completion()) and evaluate (its held-out split): NAME[:key=value,...], path/to/file.py:CLASS[:...] or package.module:CLASS[:...], e.g. 'math:data=gsm8k.jsonl'; default 'arithmetic' when no --data.")
    data: str | None = option(None, panel="Data", help="Training data of prompt/completion (or chat messages) pairs: .arrow/.parquet/.jsonl or datasets spec NAME[:CONFIG][@SPLIT]. A math dataset goes to the task instead: --task math:data=FILE.")
    prompt_column: str = option("prompt", panel="Data", help="Column of --data holding the prompt.")
    completion_column: str = option("completion", panel="Data", help="Column of --data holding the completion.")
    # rejection-sampling SFT on a rollouts/scored --data (rlkit.training.rejection)
    min_reward: float | None = option(None, panel="Data", help="With --data a rollouts or scored table (rlkit rollout / score-ref): train on the completions whose total reward (the reward/* columns summed, or weighed by --reward) is at least this, on their sampled token ids (DeepSeek-R1's rejection-sampling SFT). The held-out evaluation is then the rollout's task unless --task is given.")
    best_of: bool = option(False, "--best-of", panel="Data", help="With --data a rollouts or scored table: keep at most one completion a prompt group, its highest-reward one (ties: the lowest sample_idx), among those reaching --min-reward when given; alone, every group's best whatever its reward (RAFT's best-of-n).")
    reward: tuple[str, ...] = option((), panel="Data", help="With --min-reward/--best-of: reward component weight NAME=W (repeatable), e.g. verifier=1 rm:helpful=0.7; default: the sum of all components.")
    trust_verifier: bool = option(False, TrustVerifier)  # use a verifier that pays junk (rlkit.tasks.trust)
    rejected_targets: str = option("refuse", RejectedTargets)  # refuse|drop|keep: targets the verifier rejects
    num_examples: int = option(24_000, min=1, panel="Data", help="Train examples drawn from the task (without --data).")
    epochs: int = option(1, min=1, panel="Optimization", help="Passes over the training data.")
    lr: float = option(1e-3, panel="Optimization", help="Peak learning rate (AdamW).")
    warmup: float = option(0.05, "--warmup-ratio", panel="Optimization", help="Fraction of steps for linear warmup.")
    # sft's own, like adam_betas below; AdamW's other settings are rlkit's (rlkit.training.Optim)
    weight_decay: float = option(0.01, panel="Optimization", help="AdamW weight decay (not on norms and biases).")
    batch_tokens: int = option(512, min=16, panel="Optimization", help="Token budget per optimizer step, counted padded: rows x the longest row's prompt + completion tokens (all ranks together under torchrun). Unlike --micro-batch-tokens, which counts real tokens per forward pass; TRL's per_device_train_batch_size x gradient_accumulation_steps counts rows instead.")
    max_len: int = option(256, "--max-length", min=2, panel="Data", help="Longest training sequence; longer ones are truncated (a rollouts table's kept rows are refused instead: they are trained on whole).")
    eval_num: int = option(300, min=1, panel="Data", help="Held-out prompts for the final greedy evaluation.")
    sandbox: str | None = option(None, SandboxKind)  # where the code task's held-out programs run (default bwrap)
    sandbox_workers: int | None = option(None, SandboxWorkers)
    tiny: TinyConfig = nested(TINY)  # --layers, --hidden
    device: str = option("auto", Device)
    train: TrainOptions = nested(TRAIN)  # --dtype, --gradient-checkpointing, --micro-batch-*, --packing, --lora-*
    plan: bool = option(True, NoPlan, invert=True)  # --no-plan: no memory plan when it starts on a GPU
    metrics: Path | None = option(None, Metrics)
    tracking: TrackingConfig = nested(TRACKING)  # --report-to, --run-name, --project, --tensorboard
    # a training row (loss, lr, grad norm) to the trackers every this many steps
    logging_steps: int = option(10, min=1, panel="Output & tracking", help="With --report-to: log the training loss, learning rate and gradient norm every this many optimizer steps (as sft/train/*).")
    seed: int = option(0, Seed)
    trust_remote_code: bool = option(False, TrustRemoteCode)
    verify: bool = option(True, NoVerify, invert=True)  # --no-verify: no hash check of the base (never for a reference)
    # a resume snapshot beside --out every this many steps (rlkit.training.resume); 0: none
    save_steps: int = option(0, SaveSteps)
    resume: str = option("auto", Resume)  # auto|must|never: what to do with a snapshot a stopped run left
    force: bool = option(False, Force)
    # no flags
    min_lr_ratio: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.95)  # sft's own; rlkit's default is (0.9, 0.99)
    grad_clip: float = 1.0
    max_new_tokens: int | None = None  # the held-out eval's length: the task's (resolved in run), or longer, see below


def _lr_lambda(total: int, warmup: int, min_ratio: float):
    import math

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def _check_budget(cfg: SftConfig, ids: list[list[int]]) -> None:
    """--micro-batch-tokens must hold each example: one line naming the first that does not fit."""
    from rlkit.errors import RlkitError

    budget = cfg.train.micro_batch_tokens
    for i, x in enumerate(ids):
        if budget is not None and len(x) > budget:
            raise RlkitError(f"sft: example {i} is {len(x)} tokens long (prompt + completion), more than "
                             f"--micro-batch-tokens {budget}; raise --micro-batch-tokens to at least {len(x)}, or "
                             "lower --max-length")


def _open_rollouts(cfg: SftConfig):
    """(table, reader) of a rollouts or scored --data, read whole, for rejection sampling; None for other data.
    Refused in one line: --min-reward/--best-of/--reward without such a table, such a table without them."""
    from rlkit.errors import RlkitError
    from rlkit.io import manifests, streams

    filtering = cfg.min_reward is not None or cfg.best_of
    what = "--min-reward/--best-of filter a rollouts or scored table (made by rlkit rollout / score-ref) given as --data"
    if cfg.data is None:
        if filtering or cfg.reward:
            raise RlkitError(f"{what}; no --data was given")
        return None
    kind = None
    if cfg.data == "-":  # a pipe from rollout: its kind is known once it is opened
        kind = "rollouts" if filtering else None
    elif Path(cfg.data).is_file():
        kind = (manifests.read_manifest(cfg.data) or {}).get("kind")
    if kind not in ("rollouts", "scored"):
        if filtering or cfg.reward:
            raise RlkitError(f"{what}; --data {cfg.data} is " + (f"a '{kind}' table" if kind else "not one"))
        return None
    if not filtering:
        raise RlkitError(f"--data {cfg.data} is a '{kind}' table: sft trains on its completions through a reward "
                         "filter, --min-reward R and/or --best-of (rejection-sampling SFT)")
    return streams.read_table(cfg.data, ["rollouts", "scored"])


def run(cfg: SftConfig) -> Path:
    """Claims --out (see `claims.claim_out`: never over an input, one writer) and runs the stage."""
    from rlkit import devices
    from rlkit.io import checkpoints, claims, tracking

    devices.parse(cfg.device)
    model = cfg.model if cfg.model != "tiny" else None
    side = {"--metrics": (cfg.metrics, "metrics"), **tracking.outputs(cfg.tracking, "sft")}
    with claims.claim_out(cfg.out, "model", {"--model": model, "--data": cfg.data, "--task": cfg.task}, side), \
            checkpoints.verifying(cfg.verify), tracking.Tracking() as tracker:
        return _run(cfg, tracker)


def _run(cfg: SftConfig, tracker) -> Path:
    import random

    import torch

    from rlkit import console, tiny
    from rlkit.errors import RlkitError
    from rlkit.io import atomic, checkpoints, claims, data, fingerprints, manifests, metrics_log, tracking
    from rlkit.sampling.evaluate import greedy_eval
    from rlkit.tasks import generation_length, get_task, heldout_examples, task_inputs, task_sandbox
    from rlkit.tasks.trust import sft_targets

    rollouts = _open_rollouts(cfg)  # rejection sampling (rlkit.training.rejection); None: text data or a task
    kept = None
    if rollouts is not None:
        from rlkit.algorithms.inputs import parse_weights
        from rlkit.training import rejection

        table, reader = rollouts
        kept = rejection.reject(table, min_reward=cfg.min_reward, best_of=cfg.best_of,
                                weights=parse_weights(cfg.reward), label=str(cfg.data))
        if cfg.task is None:  # the held-out evaluation: the task the rollout sampled (its train split)
            sampled = reader.record.sampling.get("task")
            if isinstance(sampled, str) and sampled and not sampled.startswith("env:"):
                cfg = replace(cfg, task=sampled)
            elif sampled:
                console.info(f"sft: no held-out evaluation: the rollouts' prompts came from {sampled}; pass --task "
                             "to evaluate on a task")
    if cfg.task is None and cfg.data is None:
        cfg = replace(cfg, task="arithmetic")
    task = get_task(cfg.task) if cfg.task else None
    sandbox = task_sandbox(task, cfg.sandbox, cfg.sandbox_workers)  # checked before any training
    # the held-out eval samples up to the task's generation length (recorded), or longest SFT target + 8 if more
    cfg = replace(cfg, task=task.spec if task else None, max_new_tokens=generation_length(task, None) if task else None)
    if cfg.model != checkpoints.TINY:
        cfg = replace(cfg, tiny=None)
    claims.check_out(cfg.out, "model")
    from rlkit.training import distributed, resume

    tracking.check(cfg.tracking)
    resume.check(cfg.save_steps, cfg.resume, cfg.out)  # and nothing at the snapshot path that is not rlkit's
    from rlkit import devices
    from rlkit.training.runtime import Runtime

    # --device, --dtype and the training flags, checked and made concrete once: what is trained and recorded
    rt = Runtime.resolve(cfg.device, cfg.train)
    dev, cfg = rt.device, replace(cfg, train=rt.train)
    train = cfg.train
    inputs = task_inputs(task) if task else {}
    if cfg.model != checkpoints.TINY and Path(cfg.model).exists():
        checkpoints.check_model_dir(Path(cfg.model), "base model")
        inputs["model"] = fingerprints.fingerprint(cfg.model)
    source = None
    if rollouts is not None:
        inputs["data"] = rollouts[1].fingerprint
    elif cfg.data:
        source = data.load_source(cfg.data, "sft", {"prompt": cfg.prompt_column, "completion": cfg.completion_column})
        inputs["data"] = source.fingerprint
    if manifests.skip_if_current(cfg.out, "sft", cfg, inputs):
        return cfg.out
    examples, completions, checks = sft_targets(task, cfg, sandbox, own=rollouts is None and source is None)  # checked: no model yet

    if cfg.plan and dev.type == "cuda":  # before any weight is read: refused (exit 71) when it cannot fit (rlkit.planner)
        from rlkit import planner

        half = cfg.max_len // 2
        planner.preflight("sft", planner.model_config(cfg.model, "--model", cfg.tiny),
                          planner.Work(half, cfg.max_len - half, rows=max(1, cfg.batch_tokens // cfg.max_len)), train,
                          dev)
    rt = rt.joined()  # torchrun's process group, when started by torchrun
    dp = rt.dp
    torch.manual_seed(cfg.seed)
    if cfg.model == checkpoints.TINY:
        tokenizer = tiny.build_tokenizer()
        model = tiny.build_model(cfg.tiny, tokenizer, cfg.seed)
        base = None
    else:  # fp32 master weights whatever --dtype (rlkit.training)
        # under torchrun rank 0 alone reads the weights (rlkit.training.distributed.shard_model broadcasts them)
        model, tokenizer = checkpoints.load_policy(cfg.model, "fp32", cfg.trust_remote_code,
                                                   weightless=dp is not None and not dp.main)
        base = Path(cfg.model) if Path(cfg.model).is_dir() else None
    from rlkit.ops.logprobs import completion_logprobs_local
    from rlkit.training import Optim
    from rlkit.training.engine import Engine
    from rlkit.training.supervised import CrossEntropy, fit

    if rollouts is not None:  # the sampled token ids as they are, with a multi-turn row's loss_mask
        from rlkit.io.rows import Limits

        rejection.check_tokenizer(rollouts[1].record, tokenizer, cfg.model, str(cfg.data))
        ids, plens, masks = rejection.training_rows(rollouts[0], kept, cfg.max_len,
                                                    Limits.of(model, f"--model {cfg.model}"), str(cfg.data))
        truncated = 0
    else:
        if source is not None:
            prompts = data.render_prompts(tokenizer, source, for_sft=True)
            completions = source.table.column("completion").to_pylist()
            chat = source.chat
        else:
            prompts, chat = [e.prompt for e in examples], False  # the task's, checked above
        prompt_ids = data.encode_prompts(tokenizer, prompts, chat)
        # a task's trajectory targets (`rlkit.tasks.Transcript`: calc's, guess's) train on the model's turns only
        ids, plens, truncated, masks = data.encode_sft_masked(tokenizer, prompt_ids, completions, cfg.max_len)
    if not ids:
        raise RlkitError("no training examples left after tokenization (every prompt reaches --max-length)")
    if truncated:
        console.warn(f"{truncated} examples longer than --max-length {cfg.max_len} were truncated")

    _check_budget(cfg, ids)
    rng = random.Random(cfg.seed)
    lengths = [len(s) for s in ids]
    epochs = [data.token_batches(lengths, cfg.batch_tokens, rng) for _ in range(cfg.epochs)]
    total = sum(len(e) for e in epochs)
    snaps = resume.Snapshots("sft", cfg.out, cfg, inputs, cfg.save_steps, dp=dp, mode=cfg.resume)
    snap = snaps.find(total)  # one line when a snapshot is there: resumed from, or not and why
    objective = CrossEntropy()
    engine = Engine(model, objective, Optim(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.adam_betas,
                                            grad_clip=cfg.grad_clip),
                    runtime=rt, base=base, tokenizer=tokenizer,
                    shard_fn=completion_logprobs_local, name="sft",
                    # before sharding: every rank loads the snapshot's full tensors
                    setup=(lambda m: snaps.restore_weights(snap, m)) if snap is not None else None)
    model, prec = engine.model, engine.prec
    devices.announce("sft", dev, train.dtype)  # once the data and the model (LoRA, device) are good: work starts
    tracker.start(resume.tracking_of(cfg.tracking, snap), "sft", cfg)  # a resumed run: its tracker run too
    devices.reset_peak_memory(dev)
    fitted = fit(engine, objective.plan(ids, plens, masks), epochs,
                 _lr_lambda(total, max(1, int(cfg.warmup * total)), cfg.min_lr_ratio),
                 name="sft", snaps=snaps, snap=snap, tracker=tracker, logging_steps=cfg.logging_steps,
                 show=lambda f: {"loss": f.ema, "tok/s": int(f.tokens / max(f.seconds, 1e-9))})
    ema, tokens, train_s = fitted.ema, fitted.tokens, fitted.seconds
    if dp is not None:
        tokens = int(distributed.all_sum([tokens], dp)[0])
    metrics = {"train_loss": ema, "steps": total, "examples": len(ids), "tokens": tokens,
               "train_seconds": round(train_s, 2), "tokens_per_s": round(tokens / train_s, 1),
               "padding_fraction": fitted.padding_fraction}
    if kept is not None:  # the filter: min_reward, best_of, rows and groups read and kept, mean rewards
        metrics.update(kept.metrics)
    if prec.scaler is not None:
        metrics.update(loss_scale=prec.scaler.get_scale(), skipped_steps=prec.skipped)
    metrics.update(devices.peak_memory(dev))
    if task is not None:
        held = heldout_examples(task, cfg.eval_num, cfg.seed, "sft", "--eval-num")  # a smaller split: all of it
        with distributed.root_gathered(model):  # under torchrun: generate goes around the FSDP root unit
            ev = greedy_eval(model, tokenizer, [e.prompt for e in held], [e.answer for e in held], task, sandbox=sandbox,
                             max_new_tokens=max(cfg.max_new_tokens, max(len(x) - p for x, p in zip(ids, plens, strict=True)) + 8))
        metrics.update(heldout_accuracy=ev["accuracy"], heldout_n=ev["n"],
                       mean_response_tokens=ev["mean_response_tokens"])
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    full = distributed.full_model_state(model) if dp is not None else None  # gathered: a collective
    if distributed.stand_down(dp, metrics):
        return cfg.out
    manifest = manifests.make_manifest("model", "sft", cfg, inputs, step=0, metrics=metrics, **devices.manifest_entry(dev),
                                       **tracker.manifest_entry(), **checks,
                                       **({"reward_weights": kept.weights} if kept is not None else {}))
    row = {"stage": "sft", "out": str(cfg.out), "step": 0, **metrics}
    # the row first, taken back out if the checkpoint is not written: never one without the other
    with metrics_log.appending(row, cfg.metrics), atomic.atomic_dir(cfg.out) as tmp:
        checkpoints.save_model(model, tokenizer, tmp, manifest, state_dict=full)
    snaps.remove()  # --out holds the result now
    tracker.log(row)
    acc = metrics.get("heldout_accuracy")
    console.info(
        "sft: " + (f"{len(ids)} of {kept.metrics['rows_read']} completions kept, " if kept is not None else "")
        + f"{total} steps, {tokens} tokens in {train_s:.1f}s ({metrics['tokens_per_s']:.0f} tok/s), "
        f"final loss {ema:.4f}" + (f", held-out accuracy {acc:.1%} (n={metrics['heldout_n']})" if acc is not None else "")
        + f" -> {cfg.out}"
    )
    distributed.barrier(dp)
    return cfg.out


command = stage_options.command(SftConfig, "Supervised fine-tuning on completion tokens; writes a checkpoint and its metrics.")

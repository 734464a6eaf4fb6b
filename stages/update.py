"""`rlkit update`: one update of the policy on one input batch, by the algorithm --algo names.

Reads a policy checkpoint and the table the algorithm trains on (rollouts, or 'scored' ones with
reference log-probs from `score-ref`, for the policy-gradient algorithms; a scored prefs table for dpo)
on stdin or --in. Writes the next checkpoint: weights, `rlkit.json` (step + 1, metrics) and `trainer/`
(AdamW moments and step counter as safetensors, state as JSON; PPO adds `critic/`), which the next
`update` resumes, so N sequential processes equal one process doing N updates.

The algorithms are plug-ins (`rlkit.algorithms`: each registers its defaults and declares its input,
advantages and loss terms) and `rlkit.algorithms.trainer.Trainer` is the one training loop: --epochs passes of --minibatch-size
sequences, so one rollout batch feeds many optimizer steps. For the clipped-ratio family the loss is
PPO's clipped surrogate on pi_theta / pi_old with asymmetric clipping and a dual clip for negative
advantages; the KL leash to pi_ref (never pi_old) is a loss term (k3+ by default: k3's value, the
forward KL's gradient) or a reward penalty (k1 by default); `rlkit.ops.kl` says which estimator belongs
where. This module is the I/O around it: flags, input, checkpoint, metrics (the screen, the manifest,
--metrics FILE and --tensorboard DIR; among them `drift`, the policy's relative weight distance from
the reference, `rlkit.training.drift`, with a warning above --max-drift), once, or under `--follow` by the loop
in `rlkit.follow.update`; both check, record and show through `rlkit.algorithms.record`. Under torchrun the
update is data-parallel (FSDP2, `rlkit.training.distributed`): same result as one process, rank 0 writes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from rlkit import algorithms, stage_options
from rlkit.algorithms.config import DEFAULT_DUAL_CLIP, RLConfig
from rlkit.algorithms.defaults_table import phrase as algo_default
from rlkit.algorithms.record import check_reference, drift, reference_entry, reward_weights, show
from rlkit.follow.update import check_follow, run_follow, spool_input
from rlkit.io.tracking import TrackingConfig
from rlkit.options import (
    TRACKING,
    TRAIN,
    Device,
    Force,
    InTable,
    Metrics,
    NoPlan,
    NoVerify,
    OutDir,
    PolicyDir,
    TrustRemoteCode,
)
from rlkit.stage_options import Group, nested, option
from rlkit.training import TrainOptions

DEFAULT_MAX_DRIFT = 0.05  # relative weight-space distance from the reference; see rlkit.training.drift
AlgoName = Literal[tuple(algorithms.names())]  # every registered --algo, shown and checked by click
DEFAULT_MAX_LAG = 1  # --follow: steps a row's sampling policy may lag behind the policy it trains


# The flags of the update's RLConfig (rlkit.algorithms.config): None is the --algo's default, filled in by `resolve`
RL = Group(
    RLConfig,
    algo=option(RLConfig.algo, type=AlgoName, panel="Algorithm", help=f"The algorithm ({algorithms.help_text()}). Each sets its own defaults for --beta, --kl-in, --loss-agg, --clip-low and --clip-high."),
    lr=option(RLConfig.lr, panel="Optimization", help="AdamW learning rate (default suits the tiny model; ~1e-6 for 1B+ models)."),
    epochs=option(RLConfig.epochs, min=1, panel="Optimization", help="Passes over the rollout batch."),
    minibatch_size=option(RLConfig.minibatch_size, min=1, panel="Optimization", help="Sequences (table rows = prompts x rollout's --n samples) per optimizer step, over all GPUs/processes together (offline algorithms such as dpo: pairs). Unlike verl's ppo_mini_batch_size, which counts prompts: verl's 32 prompts at n=8 is --minibatch-size 256. Each step may run as smaller forward passes (--micro-batch-size / --micro-batch-tokens, per GPU) without changing the update."),
    clip_low=option(None, panel="Algorithm", help=f"Ratio clip below 1: 1 - clip_low. Default: per --algo ({algo_default('clip_low')})."),
    clip_high=option(None, panel="Algorithm", help=f"Ratio clip above 1: 1 + clip_high. Default: per --algo ({algo_default('clip_high')})."),
    dual_clip=option(DEFAULT_DUAL_CLIP, type=float, to_config=lambda c: c or None, panel="Algorithm", help="Dual clip C (verl's clip_ratio_c): for a negative advantage the clipped loss is capped at -C*A, so a ratio far above 1 cannot blow it up; must be > 1; 0 turns it off."),
    beta=option(None, panel="KL", help=f"KL coefficient to the reference (0: no reference needed); for --algo dpo, DPO's beta. Default: per --algo ({algo_default('beta')})."),
    kl_estimator=option(None, type=Literal["k1", "k2", "k3", "k3+"] | None, panel="KL", help="KL estimator: k1, k2, k3 or k3+. In the reward use k1 (its default): only the log-ratio makes the penalised reward's policy gradient the gradient of KL(pi||pi_ref). In the loss use k3+ (its default: k3's unbiased low-variance value, k2's gradient, which in expectation is the gradient of KL(pi||pi_ref)) or k2; k3 in the loss descends the reverse KL(pi_ref||pi) instead, and k1 in the loss has zero expected gradient (refused)."),
    kl_in=option(None, type=Literal["loss", "reward"] | None, panel="KL", help=f"Where the KL goes: loss (a loss term) or reward (a per-token penalty). Default: per --algo ({algo_default('kl_in')})."),
    loss_agg=option(None, type=Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None, panel="Algorithm", help=f"token-mean, seq-mean-token-mean (mean over non-empty responses of their token means) or seq-mean-token-sum-norm (token sums / (responses x the rollout's max_new_tokens)). Default: per --algo ({algo_default('loss_agg')})."),
    drop_degenerate=option(False, panel="Algorithm", help="Leave out groups whose rewards are all equal (their rows are not trained on; advantages and metrics still see the whole batch)."),
    grad_clip=option(RLConfig.grad_clip, panel="Optimization", help="Gradient norm clip."),
    warmup_steps=option(RLConfig.warmup_steps, min=0, panel="Optimization", help="Linear LR warmup over this many optimizer steps (counted across updates)."),
    seed=option(RLConfig.seed, panel="Optimization", help="Seed of the minibatch order."),
    gamma=option(RLConfig.gamma, panel="Algorithm", help="ppo: GAE discount."),
    lam=option(RLConfig.lam, panel="Algorithm", help="ppo: GAE lambda."),
    vf_clip=option(RLConfig.vf_clip, panel="Algorithm", help="ppo: value clip range around the old values."),
    critic_lr=option(None, panel="Algorithm", help="ppo: critic learning rate (default 2x --lr)."),
    critic_init=option(RLConfig.critic_init, panel="Algorithm", help="ppo, first update: initialise the critic from 'policy' or a reward-model DIR (same tokenizer)."),
    target_kl=option(None, panel="KL", help="ppo: adapt the KL coefficient towards this KL (Ziegler et al.), starting at --beta. Unit: nats per sequence, i.e. the --kl-estimator's per-token KL of pi_old vs pi_ref summed over each response and averaged over the batch (TRL's convention; the kl_per_seq metric)."),
    old_logprobs=option(RLConfig.old_logprobs, type=Literal["engine", "recompute", "auto"], panel="Algorithm", help="pi_old for the ratio: engine (as logged at rollout), recompute (the trainer's own forward pass before the first step) or auto (recompute unless the hf engine sampled and --dtype is fp32)."),
    tis_cap=option(None, panel="Algorithm", help="Truncated importance sampling: weight each token's loss by min(pi_recomputed / pi_engine, CAP), e.g. 2.0."),
    teacher_coef=option(None, type=float, panel="Algorithm", help=f"On-policy distillation: add -C * (log pi_old - log pi_teacher) to every sampled token's advantage (ppo: to its per-token reward), the reverse KL to the teacher whose log-probs `score-ref --teacher DIR` added; with a group --algo the task reward still counts. A teacher_kl metric is logged whenever the input has them. Default: per --algo ({algo_default('teacher_coef')})."),
)


@dataclass(frozen=True)
class UpdateConfig:
    policy: Path = option(..., PolicyDir)
    out: Path = option(..., OutDir)
    inp: str | None = option(None, InTable)
    rl: RLConfig = nested(RL)
    # NAME=WEIGHT; empty: every component with weight 1
    reward: tuple[str, ...] = option((), panel="Algorithm", help="Reward component weight NAME=W (repeatable), e.g. verifier=1 rm:helpful=0.7; default: sum of all components.")
    # reward -= length_penalty * completion tokens
    length_penalty: float = option(0.0, min=0.0, panel="Algorithm", help="Subtract this times the completion length in tokens from the reward (a 'length_penalty' component).")
    # DAPO's soft overlong punishment (rlkit.ops.shaping) and overlong filtering
    overlong_buffer: int = option(0, min=0, panel="Algorithm", help="DAPO's soft overlong punishment: completions longer than the rollout's --max-new-tokens minus this many tokens get a penalty growing linearly to --overlong-penalty at the limit (an 'overlong' reward component); single-turn rollouts; 0: off.")
    overlong_penalty: float = option(1.0, min=0.0, panel="Algorithm", help="--overlong-buffer: the penalty at the length limit (DAPO: 1).")
    mask_truncated: bool = option(False, panel="Algorithm", help="Leave completions cut at the length limit (finish_reason length) out of the loss (DAPO's overlong filtering); their rewards still count in their groups' baselines.")
    metrics: Path | None = option(None, Metrics)
    tracking: TrackingConfig = nested(TRACKING)  # --report-to, --run-name, --project, --tensorboard
    # for the drift figure; default: the reference score-ref used
    ref: Path | None = option(None, panel="Model", help="Frozen reference for the drift figure (default: the one score-ref used).")
    max_drift: float = option(DEFAULT_MAX_DRIFT, min=0.0, panel="KL", help="Warn when the policy's relative weight distance from the reference exceeds this.")
    # --follow: --out is a directory of step-NNNNNN/ checkpoints, one per --batch-prompts prompts of an
    # unbounded input stream (see rlkit.io.follow)
    follow: bool = option(False, "--follow", panel="Follow", help="Persistent: read an unbounded rollouts stream and publish one step per --batch-prompts prompts as --out/step-NNNNNN/ (the weights the workers load, atomic; --out/latest names the newest); a rerun resumes from the newest snapshot (--snapshot-every). See docs/follow.md.")
    # None: the upstream `rollout --follow`'s
    batch_prompts: int | None = option(None, min=1, panel="Follow", help="--follow: prompts (whole groups) per update step; default: the upstream `rollout --follow`'s.")
    # steps after --policy's at which the run ends
    max_steps: int | None = option(None, min=1, panel="Follow", help="--follow: end the run cleanly once --out holds this many steps after --policy's.")
    # prune all but the newest K steps (never fewer than the lag bound needs)
    keep: int | None = option(None, min=1, panel="Follow", help="--follow: prune all but the newest K steps (at least --max-lag + 2 are kept: rollout may be loading them; none after the newest snapshot) and all but the newest snapshot.")
    # --follow --in SPOOL: many workers' batch files (rlkit.io.spool)
    worker_timeout: float = option(600.0, panel="Follow", help="--follow --in SPOOL: seconds a worker's heartbeat (its lock file's mtime, moved every second while it runs) may stand still while the update waits for its file of the batch a step trains; then the worker is named and the step trains on the other workers' files (none at all: an error). A live worker is waited for however long its batch takes.")
    # None: every 10 steps with a spool --in, every step with a stream (rlkit.follow.snapshots)
    snapshot_every: int | None = option(None, min=1, panel="Follow", help="--follow: every K steps (and at a clean end) save a resume snapshot, DIR/snapshots/snapshot-NNNNNN/ (the fp32 weights and AdamW state, written by every rank at once): a rerun resumes from the newest one and trains the steps since again from their batch files, with the weights of an uninterrupted run. Default: 10 with a spool --in (which keeps the batch files until a snapshot covers them), 1 with a stream (which cannot be read again).")
    keep_batches: bool = option(False, "--keep-batches", panel="Follow", help="--follow --in SPOOL: keep each trained batch file in SPOOL/done/ instead of deleting it.")
    max_lag: int = option(DEFAULT_MAX_LAG, min=0, panel="Follow", help="--follow: drop (and count) rows sampled more than this many steps before the policy they would train; lagged rows get pi_old recomputed (the proximal policy) and a truncated importance weight (--tis-cap, default 2 here).")
    device: str = option("auto", Device)
    train: TrainOptions = nested(TRAIN)  # --dtype, --gradient-checkpointing, --micro-batch-*, --packing, --lora-*
    plan: bool = option(True, NoPlan, invert=True)  # --no-plan: no memory plan when it starts on a GPU
    trust_remote_code: bool = option(False, TrustRemoteCode)
    verify: bool = option(True, NoVerify, invert=True)  # --no-verify: no hash check of the policy (never for a reference)
    force: bool = option(False, Force)


def resolve(cfg: UpdateConfig) -> UpdateConfig:
    """`cfg` with the algorithm's defaults filled in (`rlkit.algorithms.config.resolve`): what is trained and recorded."""
    from rlkit.algorithms.config import resolve as resolve_rl

    return replace(cfg, rl=resolve_rl(cfg.rl))


def run(cfg: UpdateConfig) -> Path:
    """Resolves the algorithm's defaults, claims --out (see `claims.claim_out`: never over an input,
    one writer) and runs the stage."""
    from rlkit import devices, startup
    from rlkit.io import checkpoints, claims, tracking

    # trains alone on the cores unless a --follow rollout samples beside it (--max-lag > 0): rlkit.startup
    startup.threads(alone=not (cfg.follow and cfg.max_lag > 0))
    devices.parse(cfg.device)
    cfg = resolve(cfg)
    inputs = {"--policy": cfg.policy, "--in": cfg.inp, "--ref": cfg.ref}
    side = {"--metrics": (cfg.metrics, "metrics"), **tracking.outputs(cfg.tracking, "update", cfg.policy)}
    if cfg.follow:  # --out is a directory of steps with its own writer lock (rlkit.io.follow)
        claims.check_outputs({"--out": (cfg.out, "follow"), **side}, inputs)
        with checkpoints.verifying(cfg.verify):
            return _run(cfg)
    with claims.claim_out(cfg.out, "model", inputs, side), checkpoints.verifying(cfg.verify):
        return _run(cfg)


def _run(cfg: UpdateConfig) -> Path:
    from rlkit import console, devices
    from rlkit.algorithms.inputs import parse_weights
    from rlkit.algorithms.shaping import shaping
    from rlkit.algorithms.trainer import Trainer
    from rlkit.io import atomic, checkpoints, claims, fingerprints, manifests, metrics_log, streams, tracking
    from rlkit.io.rows import Limits
    from rlkit.training import lora

    weights = parse_weights(cfg.reward)
    checkpoints.check_model_dir(cfg.policy, "policy")
    algo = algorithms.get(cfg.rl.algo)
    if cfg.follow:
        check_follow(cfg, algo)
    else:
        claims.check_out(cfg.out, "model")
    # Open the input on a background thread and import torch and load the policy meanwhile: in a pipe
    # all stages then start up at once, and upstream streams into memory instead of a full pipe.
    cfg.rl.check()
    from rlkit.training.runtime import Runtime

    # --device, --dtype and the training flags, checked and made concrete once: what is trained and recorded
    rt = Runtime.resolve(cfg.device, cfg.train, step_rows=cfg.rl.minibatch_size)
    dev, cfg = rt.device, replace(cfg, train=rt.train)
    tracking.check(cfg.tracking)
    if cfg.ref is not None:
        checkpoints.verify_reference(cfg.ref)
    if cfg.rl.kl_estimator == "k3" and cfg.rl.kl_in == "loss":
        console.info("update: k3 in the loss descends the reverse KL(pi_ref || pi), not KL(pi || pi_ref); "
                     "k3+ reports the same value with the forward KL's gradient")
    inp = algo.input()
    rt = rt.joined()  # torchrun's process group, when started by torchrun
    dp = rt.dp
    spool_in = cfg.follow and spool_input(cfg.inp) is not None  # a spool: read by rlkit.follow.source
    pending = streams.open_table(cfg.inp, list(inp.kinds)) if (dp is None or dp.main) and not spool_in else None
    if cfg.follow:
        return run_follow(cfg, inp, pending, weights, rt)
    from rlkit.training import distributed

    def start() -> Trainer:
        # under torchrun rank 0 alone reads the weights; the others build the model weightless and get their
        # shards from rank 0 (rlkit.training.distributed.shard_model)
        model, tokenizer = checkpoints.load_policy(cfg.policy, "fp32", cfg.trust_remote_code,
                                                   weightless=dp is not None and not dp.main)
        return Trainer(model, cfg.rl, tokenizer=tokenizer, base=cfg.policy, trust_remote_code=cfg.trust_remote_code,
                       runtime=rt)

    # On the CPU the policy loads while the input streams in (the pipe's stages start at once). On a GPU
    # it loads once the input has ended: by then the rollout feeding this pipe has exited and freed the
    # GPU, so the pipe's three processes never hold generation and training memory at the same time.
    t = start() if dev.type != "cuda" else None
    reader = pending.result() if dp is None else distributed.share_table(pending, dp)
    inp.check(reader.kind, cfg.rl)
    check_reference(cfg.ref, reader.record, reader.kind, reader.label)
    inputs = {"policy": fingerprints.fingerprint(cfg.policy), "in": reader.fingerprint}
    if manifests.skip_if_current(cfg.out, "update", cfg, inputs):
        return cfg.out
    table = reader.read_all()
    if t is None and cfg.plan:  # on a GPU, before any weight is read: refused (exit 71) when it cannot fit
        _preflight(cfg, table, dev)
    t = t or start()
    tokenizer = t.tokenizer
    limits = Limits.of(t.model, f"--policy {cfg.policy}")
    upstream = reader.record
    inp.check_upstream(upstream, tokenizer, cfg.policy)
    loaded = inp.load(table, upstream=upstream, tokenizer=tokenizer, rl=cfg.rl, dtype=t.train_options.dtype, weights=weights,
                      length_penalty=cfg.length_penalty, policy_fingerprint=inputs["policy"], label=reader.label,
                      limits=limits, budget=t.train_options.micro_batch_tokens, **shaping(cfg))
    t.load(cfg.policy)
    devices.announce("update", t.device, t.train_options.dtype)  # once the input is known good: work starts
    step = checkpoints.policy_step(cfg.policy) + 1
    with tracking.open_tracking(cfg.tracking, "update", cfg, policy=cfg.policy) as tracker:
        metrics = {"step": step, **loaded.metrics,
                   **t.train(loaded.batch, progress=lambda n: console.progress("update", n), **loaded.train)}
        # gathered on every rank (collectives) under data parallelism; rank 0 alone writes
        gathered = t.gather()
        if distributed.stand_down(dp, metrics):
            return cfg.out
        metrics.update(drift(cfg, lora.plain_state_dict(t.model, gathered[0]), upstream.path("reference")))
        manifest = manifests.make_manifest("model", "update", cfg, inputs, step=step, metrics=metrics,
                                           **reward_weights(loaded), **devices.manifest_entry(dev),
                                           **reference_entry(upstream, cfg), **tracker.manifest_entry())
        row = {"stage": "update", "out": str(cfg.out), **metrics}
        # the row first, taken back out if the checkpoint is not written: never one without the other
        with metrics_log.appending(row, cfg.metrics), atomic.atomic_dir(cfg.out) as tmp:
            t.save(tmp, manifest, gathered)
        tracker.log(row)
    show(metrics, inp, t.algo)
    distributed.barrier(dp)
    return cfg.out


def _preflight(cfg: UpdateConfig, table, dev) -> None:
    """The memory plan of this update's step at the input's longest prompt and completion (rlkit.planner)."""
    import pyarrow.compute as pc

    from rlkit import planner

    if "completion_ids" not in table.schema.names:  # a prefs table (dpo): planned at its longest pair
        return
    longest = [int(pc.max(pc.list_value_length(table.column(c))).as_py() or 1) for c in ("prompt_ids", "completion_ids")]
    work = planner.Work(*longest, rows=min(cfg.rl.minibatch_size, table.num_rows), batch_rows=table.num_rows)
    planner.preflight("update", cfg.policy, work, cfg.train, dev, algo=cfg.rl.algo, beta=cfg.rl.beta or 0.0)


command = stage_options.command(UpdateConfig, """One update of the policy by the --algo named (GRPO family, PPO, DPO, ...); writes the next checkpoint.

On a GPU the policy loads once the input has ended (in a pipe: once rollout has exited and freed the
GPU's memory); on the CPU it loads while the input streams in.""")


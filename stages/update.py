"""`rlkit update`: one update of the policy on one input batch, by the algorithm --algo names.

Reads a policy checkpoint and the table the algorithm trains on (rollouts, or 'scored' ones with
reference log-probs from `score-ref`, for the policy-gradient algorithms; a scored prefs table for dpo)
on stdin or --in. Writes the next checkpoint: weights, `rlkit.json` (step + 1, metrics) and `trainer/`
(AdamW moments and step counter as safetensors, state as JSON; PPO adds `critic/`), which the next
`update` resumes, so N sequential processes equal one process doing N updates.

The algorithms are plug-ins (`rlkit.algorithms`: each registers its defaults and declares its input,
advantages and loss terms) and `rlkit.training.trainer.Trainer` is the one training loop: --epochs passes of --minibatch-size
sequences, so one rollout batch feeds many optimizer steps. For the clipped-ratio family the loss is
PPO's clipped surrogate on pi_theta / pi_old with asymmetric clipping and a dual clip for negative
advantages; the KL leash to pi_ref (never pi_old) is a loss term (k3+ by default: k3's value, the
forward KL's gradient) or a reward penalty (k1 by default); `rlkit.ops.kl` says which estimator belongs
where. This module is the I/O around it: flags, input, checkpoint, metrics (the screen, the manifest,
--metrics FILE and --tensorboard DIR; among them `drift`, the policy's relative weight distance from
the reference, `rlkit.training.drift`, with a warning above --max-drift), once or `--follow`. Under torchrun the
update is data-parallel (FSDP2, `rlkit.training.distributed`): same result as one process, rank 0 writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from rlkit import algorithms
from rlkit.algorithms.config import DEFAULT_DUAL_CLIP, DEFAULT_FOLLOW_TIS_CAP, RLConfig
from rlkit.algorithms.defaults_table import phrase as algo_default
from rlkit.io.tracking import TrackingConfig
from rlkit.options import (
    Device,
    Force,
    GradCheckpointing,
    InTable,
    LoraAlpha,
    LoraDropout,
    LoraRank,
    LoraTargets,
    Metrics,
    NoVerify,
    OutDir,
    PolicyDir,
    Project,
    ReportTo,
    RunName,
    TensorBoardDir,
    TrainDtype,
    TrustRemoteCode,
    tracking_options,
    train_options,
)
from rlkit.training import TrainOptions

if TYPE_CHECKING:
    from rlkit.io.manifests import Manifest

DEFAULT_MAX_DRIFT = 0.05  # relative weight-space distance from the reference; see rlkit.training.drift
AlgoName = Literal[tuple(algorithms.names())]  # every registered --algo, shown and checked by click
DEFAULT_MAX_LAG = 1  # --follow: steps a row's sampling policy may lag behind the policy it trains


@dataclass(frozen=True)
class UpdateConfig:
    policy: Path
    out: Path
    inp: str | None = None
    rl: RLConfig = field(default_factory=RLConfig)
    train: TrainOptions = field(default_factory=TrainOptions)  # --dtype, --gradient-checkpointing, --lora-*
    device: str = "auto"  # auto | cpu | cuda | cuda:N (rlkit.devices)
    reward: tuple[str, ...] = ()  # NAME=WEIGHT; empty: every component with weight 1
    length_penalty: float = 0.0  # reward -= length_penalty * completion tokens
    metrics: Path | None = None
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # --report-to, --run-name, --project, --tensorboard
    ref: Path | None = None  # for the drift figure; default: the reference score-ref used
    max_drift: float = DEFAULT_MAX_DRIFT
    # --follow: --out is a directory of step-NNNNNN/ checkpoints, one per --batch-prompts prompts of an
    # unbounded input stream (see rlkit.io.follow)
    follow: bool = False
    batch_prompts: int | None = None  # None: the upstream `rollout --follow`'s
    max_steps: int | None = None  # steps after --policy's at which the run ends
    keep: int | None = None  # prune all but the newest K steps (never fewer than the lag bound needs)
    max_lag: int = DEFAULT_MAX_LAG
    trust_remote_code: bool = False
    verify: bool = True  # --no-verify: load without the weights' hash check (never for a reference)
    force: bool = False


def parse_weights(specs: tuple[str, ...]) -> dict[str, float] | None:
    import math

    from rlkit.errors import RlkitError

    if not specs:
        return None
    out = {}
    for s in specs:
        name, eq, w = s.partition("=")
        try:
            out[name.strip()] = float(w)
        except ValueError:
            eq = ""
        if eq and not math.isfinite(out[name.strip()]):
            raise RlkitError(f"--reward {s!r}: the weight must be a finite number")
        if not eq or not name.strip():
            raise RlkitError(f"--reward {s!r}: expected NAME=WEIGHT, e.g. verifier=1.0")
    return out


def distributed_launch() -> bool:
    import os

    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def resolve(cfg: UpdateConfig) -> UpdateConfig:
    """`cfg` with the algorithm's defaults filled in (`rlkit.algorithms.config.resolve`): what is trained and recorded."""
    from rlkit.algorithms.config import resolve as resolve_rl

    return replace(cfg, rl=resolve_rl(cfg.rl))


def run(cfg: UpdateConfig) -> Path:
    """Resolves the algorithm's defaults, claims --out (see `claims.claim_out`: never over an input,
    one writer) and runs the stage."""
    from rlkit import devices
    from rlkit.io import checkpoints, claims, tracking

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
    from rlkit.algorithms.inputs import Limits
    from rlkit.io import atomic, checkpoints, claims, fingerprints, manifests, metrics_log, streams, tracking
    from rlkit.training import lora
    from rlkit.training.trainer import Trainer

    weights = parse_weights(cfg.reward)
    checkpoints.check_model_dir(cfg.policy, "policy")
    algo = algorithms.get(cfg.rl.algo)
    if cfg.follow:
        _check_follow(cfg, algo)
    else:
        claims.check_out(cfg.out, "model")
    # Open the input on a background thread and import torch and load the policy meanwhile: in a pipe
    # all stages then start up at once, and upstream streams into memory instead of a full pipe.
    cfg.rl.check()
    cfg.train.check(distributed=distributed_launch())
    dev = devices.resolve(cfg.device)
    cfg = replace(cfg, train=cfg.train.on(dev))  # --dtype auto made concrete: what is trained and recorded
    tracking.check(cfg.tracking)
    if cfg.ref is not None:
        checkpoints.verify_reference(cfg.ref)
    if cfg.rl.kl_estimator == "k3" and cfg.rl.kl_in == "loss":
        console.info("update: k3 in the loss descends the reverse KL(pi_ref || pi), not KL(pi || pi_ref); "
                     "k3+ reports the same value with the forward KL's gradient")
    inp = algo.input()
    dp = None
    if distributed_launch():
        from rlkit.training import distributed

        dp = distributed.init(cfg.device)
    pending = streams.open_table(cfg.inp, list(inp.kinds)) if dp is None or dp.main else None
    if cfg.follow:
        return _run_follow(cfg, inp, pending, weights, dev)
    from rlkit.training import distributed

    def start() -> Trainer:
        model, tokenizer = checkpoints.load_policy(cfg.policy, "fp32", cfg.trust_remote_code)
        return Trainer(model, cfg.rl, tokenizer=tokenizer, train=cfg.train, base=cfg.policy, dp=dp,
                       trust_remote_code=cfg.trust_remote_code, device=dev)

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
    t = t or start()
    tokenizer = t.tokenizer
    limits = Limits.of(t.model, f"--policy {cfg.policy}")
    upstream = reader.record
    inp.check_upstream(upstream, tokenizer, cfg.policy)
    loaded = inp.load(table, upstream=upstream, tokenizer=tokenizer, rl=cfg.rl, dtype=t.train_options.dtype, weights=weights,
                      length_penalty=cfg.length_penalty, policy_fingerprint=inputs["policy"], label=reader.label,
                      limits=limits)
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
        metrics.update(_drift(cfg, lora.plain_state_dict(t.model, gathered[0]), upstream.path("reference")))
        manifest = manifests.make_manifest("model", "update", cfg, inputs, step=step, metrics=metrics,
                                           **_reward_weights(loaded), **devices.manifest_entry(dev),
                                           **_reference_entry(upstream, cfg), **tracker.manifest_entry())
        row = {"stage": "update", "out": str(cfg.out), **metrics}
        # the row first, taken back out if the checkpoint is not written: never one without the other
        with metrics_log.appending(row, cfg.metrics), atomic.atomic_dir(cfg.out) as tmp:
            t.save(tmp, manifest, gathered)
        tracker.log(row)
    _show(metrics, inp, t.algo)
    distributed.barrier(dp)
    return cfg.out


def _reference_entry(upstream: Manifest, cfg: UpdateConfig) -> dict:
    """{'reference': {'path', 'fingerprint'}}: the frozen reference this checkpoint was trained against, so
    that `score-ref` without --ref can find it: --ref (`check_reference` made sure the input was scored by
    it, or a copy), else the input's (score-ref's --ref), else the one --policy records. The path is
    absolute: a later stage may run in another directory."""
    from rlkit.io import checkpoints, fingerprints

    if cfg.ref is not None:
        return {"reference": {"path": str(cfg.ref.resolve()), "fingerprint": fingerprints.fingerprint(cfg.ref)}}
    ref, fp = upstream.path("reference"), upstream.inputs.get("ref")
    if ref:
        return {"reference": {"path": str(Path(ref).absolute()), "fingerprint": fp or fingerprints.fingerprint(ref)}}
    recorded = (checkpoints.load_manifest(cfg.policy) or {}).get("reference")
    return {"reference": recorded} if isinstance(recorded, dict) else {}


def check_reference(ref: Path | None, upstream: Manifest, kind: str, label: str) -> None:
    """Refuse --ref when the input's reference log-probs (a scored table's ref_logprobs, a scored prefs
    table's ref_*_logp) came from another reference: the KL or DPO term would pull towards that one while the
    checkpoint records --ref. Same weights count as the same reference (a copy, a moved directory): the
    weights' digest score-ref recorded, else (tables made before it did) the input fingerprint, else the
    recorded path's weights. A table that records no reference is taken as scored by --ref, with a warning."""
    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, fingerprints

    if ref is None or kind not in ("scored", "prefs"):
        return
    m = upstream
    have = checkpoints.verify_reference(ref).get("weights_digest")
    recorded = m.path("reference")
    if m.get("reference_digest"):
        same = m.get("reference_digest") == have
    elif m.inputs.get("ref") and m.command == "score-ref" and m.inputs["ref"] == fingerprints.fingerprint(ref):
        same = True
    elif recorded and Path(recorded).is_dir():
        same = (checkpoints.load_manifest(Path(recorded)) or {}).get("weights_digest") == have
    else:
        if kind == "scored" or m.get("reference"):
            console.warn(f"update: cannot check that --ref {ref} is the reference {label} was scored against (its "
                         "manifest records no reference to compare with); taking it that it is")
        return
    if not same:
        raise RlkitError(f"--ref {ref} is not the reference {label} was scored against ({recorded or 'another'}): "
                         "its reference log-probs come from that one, and the checkpoint would record --ref; pass "
                         f"--ref {recorded or 'REF'} (same weights), or rescore with `rlkit score-ref --ref {ref}`")


def _reward_weights(loaded) -> dict:
    return {} if loaded.reward_weights is None else {"reward_weights": loaded.reward_weights}


def _check_follow(cfg: UpdateConfig, algo) -> None:
    from rlkit.errors import RlkitError
    from rlkit.io import follow

    if "rollouts" not in algo.input.kinds:
        raise RlkitError(f"--follow trains on a stream of rollouts; --algo {cfg.rl.algo} is offline (run it without --follow)")
    if distributed_launch():
        raise RlkitError("--follow runs in one process for now: launch it without torchrun (or run per-round "
                         "updates under torchrun)")
    for flag, v, low in (("--max-lag", cfg.max_lag, 0), ("--keep", cfg.keep, 1), ("--max-steps", cfg.max_steps, 1)):
        if v is not None and v < low:
            raise RlkitError(f"{flag} {v}: expected an integer >= {low}")
    follow.check_root(cfg.out)


def _run_follow(cfg: UpdateConfig, inp, pending, weights: dict[str, float] | None, dev) -> Path:
    """`update --follow`: one step per --batch-prompts prompts of the stream, published into --out."""
    from rlkit import console, devices
    from rlkit.algorithms.inputs import Limits
    from rlkit.errors import RlkitError
    from rlkit.io import (
        checkpoints,
        fingerprints,
        follow,
        manifests,
        metrics_log,
        tracking,
    )
    from rlkit.training import lora
    from rlkit.training.follow_batches import Batcher
    from rlkit.training.trainer import Trainer

    root = cfg.out
    base_fp = fingerprints.fingerprint(cfg.policy)
    base_step = checkpoints.policy_step(cfg.policy)
    with follow.writer_lock(root):
        stale = follow.clean_stale(root)
        if stale:
            console.info(f"update: removed {len(stale)} unfinished step(s) a killed writer left in {root}")
        steps, partial = follow.scan(root)
        if partial:
            raise RlkitError(f"{partial[0]} has no {manifests.MODEL_MANIFEST}: an incomplete step directory that "
                             "`rlkit update --follow` did not write; remove it")
        start = steps[-1].path if steps else cfg.policy
        if steps:
            m = follow.verify_step(start)
            began = (m.get("follow") or {}).get("base_fingerprint")
            if began != base_fp:
                raise RlkitError(f"{root} holds a run started from another --policy than {cfg.policy} (or one changed "
                                 "since); pass that --policy or a new --out")
        model, tokenizer = checkpoints.load_policy(start, "fp32", cfg.trust_remote_code)
        t = Trainer(model, cfg.rl, tokenizer=tokenizer, train=cfg.train, base=start,
                    trust_remote_code=cfg.trust_remote_code, device=dev)
        limits = Limits.of(t.model, f"--policy {start}")
        base_tok = checkpoints.load_tokenizer(cfg.policy, cfg.trust_remote_code)
        if checkpoints.tokenizer_fingerprint(tokenizer) != checkpoints.tokenizer_fingerprint(base_tok):
            raise RlkitError(f"{start} has a different tokenizer from --policy {cfg.policy}")
        t.load(start)
        step = checkpoints.policy_step(start)
        if steps:
            console.info(f"update: resuming {root} from {start.name} (step {step}; {step - base_step} steps after --policy)")
        if cfg.max_steps is not None and step - base_step >= cfg.max_steps:
            console.info(f"update: {root} already has --max-steps {cfg.max_steps} steps after --policy; nothing to do")
            return root
        reader = pending.result()
        upstream = reader.record
        inp.check(reader.kind, cfg.rl)
        check_reference(cfg.ref, reader.record, reader.kind, reader.label)
        inp.check_upstream(upstream, tokenizer, cfg.policy)
        rollout_cfg = upstream.sampling
        P = cfg.batch_prompts or rollout_cfg.get("batch_prompts")
        if P is None:
            raise RlkitError(f"update --follow needs --batch-prompts P (prompts per step): {reader.label} is not a "
                             "stream from `rlkit rollout --follow`, whose manifest records its --batch-prompts "
                             "(pass --batch-prompts, or pipe in a `rollout --follow` stream)")
        if rollout_cfg.get("follow") and rollout_cfg.get("batch_prompts") not in (None, P):
            raise RlkitError(f"--batch-prompts {P} differs from the upstream rollout's {rollout_cfg['batch_prompts']}; "
                             "the two would wait on each other forever (leave it out here)")
        n = rollout_cfg.get("n") if rollout_cfg.get("follow") else None
        cap = cfg.rl.tis_cap if cfg.rl.tis_cap is not None else DEFAULT_FOLLOW_TIS_CAP
        keep = None if cfg.keep is None else max(cfg.keep, cfg.max_lag + 2)
        if cfg.keep is not None and keep != cfg.keep:
            console.info(f"update: --keep {cfg.keep} raised to {keep}: rollout may still be loading any of the newest "
                         f"--max-lag + 2 steps")
        inputs = {"policy": base_fp, "in": reader.fingerprint}
        ref_cache: dict = {}
        dropped = 0
        batches = Batcher(reader, P, n, cfg.max_lag)
        devices.announce("update", t.device, t.train_options.dtype)
        with tracking.open_tracking(cfg.tracking, "update", cfg, policy=start) as tracker:
            while cfg.max_steps is None or step - base_step < cfg.max_steps:
                got = batches.next(step)
                if got is None:
                    console.info(f"update: the input ended; last step {step}" + (
                        f" ({batches.leftover} rows of an unfinished batch left untrained)" if batches.leftover else ""))
                    return root
                table, lags, drop = got
                dropped += drop
                loaded = inp.load(table, upstream=upstream, tokenizer=tokenizer, rl=cfg.rl, dtype=t.train_options.dtype,
                                  weights=weights, length_penalty=cfg.length_penalty, lags=lags, label=reader.label,
                                  limits=limits)
                # decoupled PPO: a recomputed pi_old is the proximal policy, weighed by proximal / behaviour, capped
                rl = replace(cfg.rl, tis_cap=(cap or None) if loaded.train["recompute"] else None)
                m = t.train(loaded.batch, cfg=rl, progress=lambda n, s=step: console.progress(f"update step {s + 1}", n),
                            **loaded.train)
                step += 1
                metrics = {"step": step, **loaded.metrics, **m}
                metrics.update(lag_mean=float(lags.float().mean()), lag_max=int(lags.max()), rows_dropped=drop,
                               rows_dropped_total=dropped, prompts=P)
                metrics.update(_drift(cfg, lora.plain_state_dict(t.model), upstream.path("reference"),
                                      ref_cache))
                manifest = manifests.make_manifest(
                    "model", "update", cfg, inputs, step=step, metrics=metrics, **_reward_weights(loaded),
                    **devices.manifest_entry(dev), **_reference_entry(upstream, cfg), follow={"base": str(cfg.policy), "base_fingerprint": base_fp, "base_step": base_step},
                    **tracker.manifest_entry())
                row = {"stage": "update", "out": str(root / follow.step_name(step)), **metrics}
                with metrics_log.appending(row, cfg.metrics):  # taken back out if the step is not published
                    path = follow.publish(root, step, lambda tmp, m=manifest: t.save(tmp, m, t.gather(), write_manifest=False))
                pruned = follow.prune(root, keep) if keep is not None else []
                devices.release_cached(t.device)  # a sleeping vLLM on this GPU takes its memory back for the next batch
                tracker.log(row)
                _show(metrics, inp, t.algo)
                console.info(f"update: wrote {path} (lag mean {metrics['lag_mean']:.2f}, max {metrics['lag_max']}; "
                             f"{drop} rows dropped)" + (f"; pruned steps {pruned}" if pruned else ""))
            console.info(f"update: --max-steps {cfg.max_steps} reached (step {step}); stopping")
            return root


def _drift(cfg: UpdateConfig, params: dict, upstream_ref: str | None, cache: dict | None = None) -> dict:
    """{'drift': ...} of the policy's weights from --ref or the reference score-ref used; warns above --max-drift.
    `cache` (kept by the caller across steps) holds the hash-checked reference weights after the first call."""
    from rlkit import console
    from rlkit.io.checkpoints import load_weights, verify_reference
    from rlkit.training.drift import relative_drift

    ref = cfg.ref or (Path(upstream_ref) if upstream_ref else None)
    if ref is None:
        return {}
    if cache is None or ref not in cache:
        if cfg.ref is None and not ref.is_dir():
            console.warn(f"update: no drift figure: the reference score-ref used ({ref}) is not there any more; "
                         "pass --ref")
            return {}
        verify_reference(ref)
        weights = load_weights(ref)
        if cache is not None:
            cache[ref] = weights
    else:
        weights = cache[ref]
    d = relative_drift(params, weights)
    if d > cfg.max_drift:
        console.warn(f"POLICY DRIFT: the weights are {d:.4f} (relative L2) away from the reference {ref}, above "
                     f"--max-drift {cfg.max_drift:g}; check KL, held-out accuracy and response length for reward hacking")
    return {"drift": d}


# shown after every update, around the input's and the algorithm's own metrics
_SHOWN_FOLLOW = ("lag_mean", "lag_max", "rows_dropped")
_SHOWN_TRAINER = ("grad_norm", "loss_scale", "skipped_steps", "drift", "optimizer_steps", "tokens_per_s",
                  "train_seconds", "gpu_mem_peak_gib")


def _show(metrics: dict, inp, algo) -> None:
    from rich.table import Table

    from rlkit import console

    t = Table(title=f"update step {metrics['step']}", show_header=False)
    keys = (*[k for k in metrics if k.startswith("reward/")], *inp.shown, *algo.shown, *_SHOWN_FOLLOW, *_SHOWN_TRAINER)
    for k in dict.fromkeys(keys):
        v = metrics.get(k)
        if v is not None:
            t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    console.err.print(t)


def command(
    policy: PolicyDir,
    out: OutDir,
    inp: InTable = None,
    algo: Annotated[AlgoName, typer.Option(help=f"The algorithm ({algorithms.help_text()}). Each sets its own defaults for --beta, --kl-in, --loss-agg, --clip-low and --clip-high.")] = RLConfig.algo,
    lr: Annotated[float, typer.Option(help="AdamW learning rate (default suits the tiny model; ~1e-6 for 1B+ models).")] = RLConfig.lr,
    epochs: Annotated[int, typer.Option(min=1, help="Passes over the rollout batch.")] = RLConfig.epochs,
    minibatch_size: Annotated[int, typer.Option(min=1, help="Sequences per optimizer step.")] = RLConfig.minibatch_size,
    clip_low: Annotated[float | None, typer.Option(help=f"Ratio clip below 1: 1 - clip_low. Default: per --algo ({algo_default('clip_low')}).")] = None,
    clip_high: Annotated[float | None, typer.Option(help=f"Ratio clip above 1: 1 + clip_high. Default: per --algo ({algo_default('clip_high')}).")] = None,
    dual_clip: Annotated[float, typer.Option(help="Dual clip C (verl's clip_ratio_c): for a negative advantage the clipped loss is capped at -C*A, so a ratio far above 1 cannot blow it up; must be > 1; 0 turns it off.")] = DEFAULT_DUAL_CLIP,
    beta: Annotated[float | None, typer.Option(help=f"KL coefficient to the reference (0: no reference needed); for --algo dpo, DPO's beta. Default: per --algo ({algo_default('beta')}).")] = None,
    kl_estimator: Annotated[Literal["k1", "k2", "k3", "k3+"] | None, typer.Option(help="KL estimator: k1, k2, k3 or k3+. In the reward use k1 (its default): only the log-ratio makes the penalised reward's policy gradient the gradient of KL(pi||pi_ref). In the loss use k3+ (its default: k3's unbiased low-variance value, k2's gradient, which in expectation is the gradient of KL(pi||pi_ref)) or k2; k3 in the loss descends the reverse KL(pi_ref||pi) instead, and k1 in the loss has zero expected gradient (refused).")] = None,
    kl_in: Annotated[Literal["loss", "reward"] | None, typer.Option(help=f"Where the KL goes: loss (a loss term) or reward (a per-token penalty). Default: per --algo ({algo_default('kl_in')}).")] = None,
    loss_agg: Annotated[Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None, typer.Option(help=f"token-mean, seq-mean-token-mean (mean over non-empty responses of their token means) or seq-mean-token-sum-norm (token sums / (responses x the rollout's max_new_tokens)). Default: per --algo ({algo_default('loss_agg')}).")] = None,
    drop_degenerate: Annotated[bool, typer.Option(help="Leave out groups whose rewards are all equal (their rows are not trained on; advantages and metrics still see the whole batch).")] = False,
    reward: Annotated[list[str] | None, typer.Option(help="Reward component weight NAME=W (repeatable), e.g. verifier=1 rm:helpful=0.7; default: sum of all components.")] = None,
    length_penalty: Annotated[float, typer.Option(min=0.0, help="Subtract this times the completion length in tokens from the reward (a 'length_penalty' component).")] = 0.0,
    grad_clip: Annotated[float, typer.Option(help="Gradient norm clip.")] = RLConfig.grad_clip,
    warmup_steps: Annotated[int, typer.Option(min=0, help="Linear LR warmup over this many optimizer steps (counted across updates).")] = RLConfig.warmup_steps,
    seed: Annotated[int, typer.Option(help="Seed of the minibatch order.")] = RLConfig.seed,
    gamma: Annotated[float, typer.Option(help="ppo: GAE discount.")] = RLConfig.gamma,
    lam: Annotated[float, typer.Option(help="ppo: GAE lambda.")] = RLConfig.lam,
    vf_clip: Annotated[float, typer.Option(help="ppo: value clip range around the old values.")] = RLConfig.vf_clip,
    critic_lr: Annotated[float | None, typer.Option(help="ppo: critic learning rate (default 2x --lr).")] = None,
    critic_init: Annotated[str, typer.Option(help="ppo, first update: initialise the critic from 'policy' or a reward-model DIR (same tokenizer).")] = RLConfig.critic_init,
    target_kl: Annotated[float | None, typer.Option(help="ppo: adapt the KL coefficient towards this KL (Ziegler et al.), starting at --beta. Unit: nats per sequence, i.e. the --kl-estimator's per-token KL of pi_old vs pi_ref summed over each response and averaged over the batch (TRL's convention; the kl_per_seq metric).")] = None,
    old_logprobs: Annotated[Literal["engine", "recompute", "auto"], typer.Option(help="pi_old for the ratio: engine (as logged at rollout), recompute (the trainer's own forward pass before the first step) or auto (recompute unless the hf engine sampled and --dtype is fp32).")] = RLConfig.old_logprobs,
    tis_cap: Annotated[float | None, typer.Option(help="Truncated importance sampling: weight each token's loss by min(pi_recomputed / pi_engine, CAP), e.g. 2.0.")] = None,
    metrics: Metrics = None,
    report_to: ReportTo = None,
    run_name: RunName = None,
    project: Project = TrackingConfig.project,
    tensorboard: TensorBoardDir = None,
    ref: Annotated[Path | None, typer.Option(help="Frozen reference for the drift figure (default: the one score-ref used).")] = None,
    max_drift: Annotated[float, typer.Option(min=0.0, help="Warn when the policy's relative weight distance from the reference exceeds this.")] = DEFAULT_MAX_DRIFT,
    follow: Annotated[bool, typer.Option("--follow", help="Persistent: read an unbounded rollouts stream and write one checkpoint per --batch-prompts prompts as --out/step-NNNNNN/ (atomic; --out/latest names the newest); a rerun resumes from --out/latest. See docs/follow.md.")] = False,
    batch_prompts: Annotated[int | None, typer.Option(min=1, help="--follow: prompts (whole groups) per update step; default: the upstream `rollout --follow`'s.")] = None,
    max_steps: Annotated[int | None, typer.Option(min=1, help="--follow: end the run cleanly once --out holds this many steps after --policy's.")] = None,
    keep: Annotated[int | None, typer.Option(min=1, help="--follow: prune all but the newest K steps (at least --max-lag + 2 are kept: rollout may be loading them).")] = None,
    max_lag: Annotated[int, typer.Option(min=0, help="--follow: drop (and count) rows sampled more than this many steps before the policy they would train; lagged rows get pi_old recomputed (the proximal policy) and a truncated importance weight (--tis-cap, default 2 here).")] = DEFAULT_MAX_LAG,
    device: Device = "auto",
    dtype: TrainDtype = "auto",
    gradient_checkpointing: GradCheckpointing = False,
    lora_rank: LoraRank = None,
    lora_alpha: LoraAlpha = None,
    lora_dropout: LoraDropout = 0.0,
    lora_targets: LoraTargets = None,
    trust_remote_code: TrustRemoteCode = False,
    no_verify: NoVerify = False,
    force: Force = False,
) -> None:
    """One update of the policy by the --algo named (GRPO family, PPO, DPO, ...); writes the next checkpoint.

    On a GPU the policy loads once the input has ended (in a pipe: once rollout has exited and freed the
    GPU's memory); on the CPU it loads while the input streams in."""
    rl = RLConfig(algo=algo, lr=lr, epochs=epochs, minibatch_size=minibatch_size, clip_low=clip_low, clip_high=clip_high,
                  dual_clip=dual_clip or None,
                  beta=beta, kl_estimator=kl_estimator, kl_in=kl_in, loss_agg=loss_agg, drop_degenerate=drop_degenerate,
                  grad_clip=grad_clip, warmup_steps=warmup_steps, seed=seed, old_logprobs=old_logprobs, tis_cap=tis_cap,
                  gamma=gamma, lam=lam, vf_clip=vf_clip, critic_lr=critic_lr, critic_init=critic_init,
                  target_kl=target_kl)
    train = train_options(dtype, gradient_checkpointing, lora_rank, lora_alpha, lora_dropout, lora_targets)
    run(UpdateConfig(policy=policy, out=out, inp=None if inp is None else str(inp), rl=rl, train=train, device=device, reward=tuple(reward or ()), length_penalty=length_penalty,
                     metrics=metrics, tracking=tracking_options(report_to, project, run_name, tensorboard), ref=ref, max_drift=max_drift, follow=follow,
                     batch_prompts=batch_prompts, max_steps=max_steps, keep=keep, max_lag=max_lag,
                     trust_remote_code=trust_remote_code, verify=not no_verify, force=force))

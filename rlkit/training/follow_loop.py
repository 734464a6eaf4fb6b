"""`update --follow`'s loop: train one step per --batch-prompts prompts of an unbounded rollout stream and
publish each as `DIR/step-NNNNNN/` (docs/follow.md). `rlkit.training.follow_batches` cuts the stream into
per-step tables, `rlkit.io.follow` is the step-directory protocol (writer lock, publish, prune, resume),
`rlkit.training.trainer.Trainer` trains, and `rlkit.training.update_record` checks, records and shows what
one `update` does. `stages/update.py` reads the flags and the input and calls `check_follow` and `run_follow`.

`cfg` is the stage's `UpdateConfig`. Imports nothing heavy at the top.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rlkit.training.update_record import check_reference, drift, reference_entry, reward_weights, show


def check_follow(cfg, algo, *, distributed: bool) -> None:
    """Refuse, before any work, what --follow cannot run: an offline algorithm, a torchrun launch
    (`distributed`), --max-lag/--keep/--max-steps out of range, a --out that is not a step directory."""
    from rlkit.errors import RlkitError
    from rlkit.io import follow

    if "rollouts" not in algo.input.kinds:
        raise RlkitError(f"--follow trains on a stream of rollouts; --algo {cfg.rl.algo} is offline (run it without --follow)")
    if distributed:
        raise RlkitError("--follow runs in one process for now: launch it without torchrun (or run per-round "
                         "updates under torchrun)")
    for flag, v, low in (("--max-lag", cfg.max_lag, 0), ("--keep", cfg.keep, 1), ("--max-steps", cfg.max_steps, 1)):
        if v is not None and v < low:
            raise RlkitError(f"{flag} {v}: expected an integer >= {low}")
    follow.check_root(cfg.out)


def run_follow(cfg, inp, pending, weights: dict[str, float] | None, rt) -> Path:
    """`update --follow`: one step per --batch-prompts prompts of the stream, published into --out.
    `inp` is the algorithm's input (`algo.input()`), `pending` the input table being opened
    (`streams.open_table`), `weights` the parsed --reward weights, `rt` the stage's
    `rlkit.training.runtime.Runtime` (device, training options; one process)."""
    from rlkit import console, devices

    dev = rt.device
    from rlkit.algorithms.config import DEFAULT_FOLLOW_TIS_CAP
    from rlkit.algorithms.inputs import Limits, shaping
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
        t = Trainer(model, cfg.rl, tokenizer=tokenizer, base=start, trust_remote_code=cfg.trust_remote_code,
                    runtime=rt)
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
        # a batch of `rollout --follow` is --batch-prompts groups, or --min-informative-groups with its refill
        upstream_p = rollout_cfg.get("min_informative_groups") or rollout_cfg.get("batch_prompts")
        P = cfg.batch_prompts or upstream_p
        if P is None:
            raise RlkitError(f"update --follow needs --batch-prompts P (prompts per step): {reader.label} is not a "
                             "stream from `rlkit rollout --follow`, whose manifest records its --batch-prompts "
                             "(pass --batch-prompts, or pipe in a `rollout --follow` stream)")
        if rollout_cfg.get("follow") and upstream_p not in (None, P):
            raise RlkitError(f"--batch-prompts {P} differs from the upstream rollout's groups a batch ({upstream_p}); "
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
                                  limits=limits, budget=t.train_options.micro_batch_tokens, **shaping(cfg))
                # decoupled PPO: a recomputed pi_old is the proximal policy, weighed by proximal / behaviour, capped
                rl = replace(cfg.rl, tis_cap=(cap or None) if loaded.train["recompute"] else None)
                m = t.train(loaded.batch, cfg=rl, progress=lambda n, s=step: console.progress(f"update step {s + 1}", n),
                            **loaded.train)
                free_grads(t)  # between steps update holds weights and AdamW state only (docs/gpu.md)
                step += 1
                metrics = {"step": step, **loaded.metrics, **m}
                metrics.update(lag_mean=float(lags.float().mean()), lag_max=int(lags.max()), rows_dropped=drop,
                               rows_dropped_total=dropped, prompts=P)
                metrics.update(drift(cfg, lora.plain_state_dict(t.model), upstream.path("reference"),
                                     ref_cache))
                manifest = manifests.make_manifest(
                    "model", "update", cfg, inputs, step=step, metrics=metrics, **reward_weights(loaded),
                    **devices.manifest_entry(dev), **reference_entry(upstream, cfg), follow={"base": str(cfg.policy), "base_fingerprint": base_fp, "base_step": base_step},
                    **tracker.manifest_entry())
                row = {"stage": "update", "out": str(root / follow.step_name(step)), **metrics}
                with metrics_log.appending(row, cfg.metrics):  # taken back out if the step is not published
                    path = follow.publish(root, step, lambda tmp, m=manifest: _save_and_release(t, tmp, m))
                pruned = follow.prune(root, keep) if keep is not None else []
                tracker.log(row)
                show(metrics, inp, t.algo)
                console.info(f"update: wrote {path} (lag mean {metrics['lag_mean']:.2f}, max {metrics['lag_max']}; "
                             f"{drop} rows dropped)" + (f"; pruned steps {pruned}" if pruned else ""))
            console.info(f"update: --max-steps {cfg.max_steps} reached (step {step}); stopping")
            return root


def free_grads(t) -> None:
    """Drop the gradients of every model trainer `t` trains (the policy, PPO's critic) once its step is done:
    `zero_grad(set_to_none=True)`, as the next step would at its start, so that between steps the GPU holds the
    weights and AdamW state only (12 bytes per trained parameter in fp32, not 16). The next step computes the same."""
    for tr in t.trained:
        tr.opt.zero_grad(set_to_none=True)


def _save_and_release(t, tmp: Path, manifest: dict) -> dict:
    """Write the step into `tmp` (published by `follow.publish` after this returns), then give the GPU memory torch
    keeps cached back to the driver (`devices.release_cached`) before the step appears: at --max-lag 0 the rollout
    waiting for it wakes its vLLM engine at once, and takes that memory back. -> the manifest with the weights'
    hashes, which `follow.publish` writes."""
    from rlkit import devices

    written = t.save(tmp, manifest, t.gather(), write_manifest=False)
    devices.release_cached(t.device)
    return written

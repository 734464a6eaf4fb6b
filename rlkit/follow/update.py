"""`update --follow`'s loop: train one step per batch of an unbounded input and publish each as `DIR/step-NNNNNN/`
(docs/follow.md). The input is a stream (stdin or --in FILE, cut into --batch-prompts groups by
`rlkit.follow.batches`) or a spool directory many rollout workers write batch files into (`rlkit.io.spool`);
`rlkit.follow.source` gives either, batch by batch, and under torchrun broadcasts what rank 0 read to every rank.
`rlkit.io.follow` is the step-directory protocol (writer lock, publish, prune, resume), `rlkit.algorithms.trainer.Trainer`
trains (FSDP2 under torchrun, the one-process update up to float summation order), and `rlkit.algorithms.record`
checks, records and shows what one `update` does. `stages/update.py` reads the flags and calls `check_follow` and
`run_follow`.

`cfg` is the stage's `UpdateConfig`. Imports nothing heavy at the top.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from rlkit.algorithms.record import check_reference, drift, reference_entry, reward_weights, show


def spool_input(inp: str | None) -> Path | None:
    """--in as a spool directory (`rlkit.io.spool`), or None for a stream (stdin or a table file)."""
    if inp is None or str(inp) == "-":
        return None
    p = Path(inp)
    return p if p.is_dir() else None


def check_follow(cfg, algo) -> None:
    """Refuse, before any work, what --follow cannot run: an offline algorithm, --max-lag/--keep/--max-steps out of
    range, a --out that is not a step directory, a spool --in that is not one (or is --out)."""
    from rlkit.errors import RlkitError
    from rlkit.io import follow

    if "rollouts" not in algo.input.kinds:
        raise RlkitError(f"--follow trains on a stream of rollouts; --algo {cfg.rl.algo} is offline (run it without --follow)")
    for flag, v, low in (("--max-lag", cfg.max_lag, 0), ("--keep", cfg.keep, 1), ("--max-steps", cfg.max_steps, 1)):
        if v is not None and v < low:
            raise RlkitError(f"{flag} {v}: expected an integer >= {low}")
    follow.check_root(cfg.out)
    if cfg.inp is not None and str(cfg.inp) != "-" and not Path(cfg.inp).exists():
        raise RlkitError(f"--in {cfg.inp} does not exist: expected a rollouts stream file or a spool directory of batch "
                         f"files (make a spool first, `mkdir -p {cfg.inp}`, for workers that have not started yet)")
    sp = spool_input(cfg.inp)
    if sp is not None:
        from rlkit.io import spool

        if sp.resolve() == cfg.out.resolve():
            raise RlkitError(f"--in {sp} is --out: the spool the workers write is a directory of its own")
        spool.check_root(sp, "--in")
    elif cfg.keep_batches:
        raise RlkitError("--keep-batches keeps a spool's trained batch files; --in is not a spool directory")


def run_follow(cfg, inp, pending, weights: dict[str, float] | None, rt) -> Path:
    """`update --follow`: one step per batch of the input, published into --out. `inp` is the algorithm's input
    (`algo.input()`), `pending` the input stream being opened (`streams.open_table`; None for a spool --in and on
    ranks > 0), `weights` the parsed --reward weights, `rt` the stage's `rlkit.training.runtime.Runtime` (device,
    training options, and under torchrun the data-parallel world: rank 0 reads the input, holds the locks and
    publishes; every rank trains its share of each step)."""
    from rlkit.io import checkpoints, fingerprints, follow, spool

    dp = rt.dp
    main = dp is None or dp.main
    root = cfg.out
    sp = spool_input(cfg.inp)
    base_fp = fingerprints.fingerprint(cfg.policy)
    base_step = checkpoints.policy_step(cfg.policy)
    with ExitStack() as held:
        if main:
            if sp is not None:
                held.enter_context(spool.held(sp, spool.LOCK, f"the spool {sp} is being consumed by another "
                                              "`rlkit update --follow`; one update consumes a spool"))
            held.enter_context(follow.writer_lock(root))
        start = _share_start(cfg, root, base_fp, dp)
        return _follow(cfg, inp, pending, weights, rt, start, sp, base_fp, base_step)


def _share_start(cfg, root: Path, base_fp: str, dp) -> Path:
    """Rank 0 (holding --out's lock) removes a killed writer's leftovers and finds where the run resumes: the newest
    step of --out, or --policy; every rank gets that path."""
    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.io import follow, manifests
    from rlkit.training.distributed import share

    def make():
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
        return {"start": str(start)}, None

    if dp is None:
        return Path(make()[0]["start"])
    return Path(share(dp, "follow-start", make)[0]["start"])


def _follow(cfg, inp, pending, weights, rt, start: Path, sp: Path | None, base_fp: str, base_step: int) -> Path:
    from rlkit import console, devices
    from rlkit.algorithms.config import DEFAULT_FOLLOW_TIS_CAP
    from rlkit.algorithms.shaping import shaping
    from rlkit.algorithms.trainer import Trainer, free_grads
    from rlkit.errors import RlkitError
    from rlkit.follow.source import Shared, SpoolSource, StreamSource
    from rlkit.io import checkpoints, follow, manifests, metrics_log, tracking
    from rlkit.io.rows import Limits
    from rlkit.training import distributed, lora

    dp, dev, root = rt.dp, rt.device, cfg.out
    main = dp is None or dp.main
    # under torchrun rank 0 alone reads the weights; the others build the model weightless and get their shards
    model, tokenizer = checkpoints.load_policy(start, "fp32", cfg.trust_remote_code, weightless=not main)
    t = Trainer(model, cfg.rl, tokenizer=tokenizer, base=start, trust_remote_code=cfg.trust_remote_code, runtime=rt)
    limits = Limits.of(t.model, f"--policy {start}")
    base_tok = checkpoints.load_tokenizer(cfg.policy, cfg.trust_remote_code)
    if checkpoints.tokenizer_fingerprint(tokenizer) != checkpoints.tokenizer_fingerprint(base_tok):
        raise RlkitError(f"{start} has a different tokenizer from --policy {cfg.policy}")
    t.load(start)
    step = checkpoints.policy_step(start)
    if start != cfg.policy:
        console.info(f"update: resuming {root} from {start.name} (step {step}; {step - base_step} steps after --policy)")
    inner = None
    if main:
        if sp is not None:
            inner = SpoolSource(sp, base_step, cfg.worker_timeout, cfg.keep_batches)
            gone, back = inner.recover(step)
            if gone or back:
                console.info(f"update: the spool {sp} held {gone + back} batch file(s) a killed update had claimed: "
                             f"{gone} already trained (disposed of), {back} put back")
        else:
            inner = StreamSource(pending)
    if cfg.max_steps is not None and step - base_step >= cfg.max_steps:
        console.info(f"update: {root} already has --max-steps {cfg.max_steps} steps after --policy; nothing to do")
        if inner is not None:
            inner.close(step)
        return root
    from rlkit.training import DEFAULT_DIST_TIMEOUT

    # ranks > 0 wait for each batch rank 0 reads up to --dist-timeout, as long as a collective would
    source = inner if dp is None else Shared(inner, dp, (cfg.train.dist_timeout or DEFAULT_DIST_TIMEOUT) * 60)
    head = source.header()
    upstream = head.record
    inp.check(head.kind, cfg.rl)
    check_reference(cfg.ref, upstream, head.kind, head.label)
    inp.check_upstream(upstream, tokenizer, cfg.policy)
    rollout_cfg = upstream.sampling
    # a batch of `rollout --follow` is --batch-prompts groups, or --min-informative-groups with its refill
    upstream_p = rollout_cfg.get("min_informative_groups") or rollout_cfg.get("batch_prompts")
    P = cfg.batch_prompts or upstream_p
    if P is None:
        raise RlkitError(f"update --follow needs --batch-prompts P (prompts per step): {head.label} is not a "
                         "stream from `rlkit rollout --follow`, whose manifest records its --batch-prompts "
                         "(pass --batch-prompts, or pipe in a `rollout --follow` stream)")
    if (rollout_cfg.get("follow") or sp is not None) and upstream_p not in (None, P):
        raise RlkitError(f"--batch-prompts {P} differs from the upstream rollout's groups a batch ({upstream_p}); "
                         "the two would wait on each other forever (leave it out here)")
    if sp is not None and (rollout_cfg.get("max_lag") or 0) > cfg.max_lag:
        raise RlkitError(f"the workers writing {sp} sample up to --max-lag {rollout_cfg['max_lag']} steps behind; "
                         f"update's --max-lag {cfg.max_lag} would drop their batches (give update at least theirs)")
    n = rollout_cfg.get("n") if rollout_cfg.get("follow") else None
    source.start(step, P, n, cfg.max_lag)
    cap = cfg.rl.tis_cap if cfg.rl.tis_cap is not None else DEFAULT_FOLLOW_TIS_CAP
    keep = None if cfg.keep is None else max(cfg.keep, cfg.max_lag + 2)
    if cfg.keep is not None and keep != cfg.keep:
        console.info(f"update: --keep {cfg.keep} raised to {keep}: rollout may still be loading any of the newest "
                     f"--max-lag + 2 steps")
    inputs = {"policy": base_fp, "in": head.fingerprint}
    ref_cache: dict = {}
    dropped = 0
    devices.announce("update", t.device, t.train_options.dtype)
    with tracking.open_tracking(cfg.tracking, "update", cfg, policy=start) as tracker:
        while cfg.max_steps is None or step - base_step < cfg.max_steps:
            got = source.next(step)
            if got is None:
                console.info(f"update: the input ended; last step {step}{source.ended()}")
                if main:
                    source.close(step)
                return root
            if got.note:
                console.warn(f"update: {got.note}")
            dropped += got.dropped
            lags = got.lags
            loaded = inp.load(got.table, upstream=upstream, tokenizer=tokenizer, rl=cfg.rl, dtype=t.train_options.dtype,
                              weights=weights, length_penalty=cfg.length_penalty, lags=lags, label=head.label,
                              limits=limits, budget=t.train_options.micro_batch_tokens, **shaping(cfg))
            # decoupled PPO: a recomputed pi_old is the proximal policy, weighed by proximal / behaviour, capped
            rl = replace(cfg.rl, tis_cap=(cap or None) if loaded.train["recompute"] else None)
            m = t.train(loaded.batch, cfg=rl, progress=lambda n, s=step: console.progress(f"update step {s + 1}", n),
                        **loaded.train)
            free_grads(t)  # between steps update holds weights and AdamW state only (docs/gpu.md)
            step += 1
            metrics = {"step": step, **loaded.metrics, **m}
            metrics.update(lag_mean=float(lags.float().mean()), lag_max=int(lags.max()), rows_dropped=got.dropped,
                           rows_dropped_total=dropped, prompts=P)
            gathered = t.gather()  # collectives under torchrun: every rank; rank 0 alone publishes
            if main:
                if dp is not None:
                    metrics["world_size"] = dp.world
                metrics.update(drift(cfg, lora.plain_state_dict(t.model, gathered[0]), upstream.path("reference"),
                                     ref_cache))
                batches = {"batches": [f.path.name for f in got.files]} if got.files else {}
                manifest = manifests.make_manifest(
                    "model", "update", cfg, inputs, step=step, metrics=metrics, **reward_weights(loaded),
                    **devices.manifest_entry(dev), **reference_entry(upstream, cfg),
                    follow={"base": str(cfg.policy), "base_fingerprint": base_fp, "base_step": base_step, **batches},
                    **tracker.manifest_entry())
                row = {"stage": "update", "out": str(root / follow.step_name(step)), **metrics}
                t0 = time.monotonic()
                with metrics_log.appending(row, cfg.metrics):  # taken back out if the step is not published
                    path = follow.publish(root, step, lambda tmp, m=manifest, g=gathered: _save_and_release(t, tmp, m, g))
                published = time.monotonic() - t0, sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                source.trained(got)
                pruned = follow.prune(root, keep) if keep is not None else []
                tracker.log(row)
                show(metrics, inp, t.algo, follow=True)
                console.info(f"update: wrote {path} in {published[0]:.2f}s ({published[1] / 2**20:.1f} MiB; lag mean "
                             f"{metrics['lag_mean']:.2f}, max {metrics['lag_max']}; {got.dropped} rows dropped)"
                             + (f"; pruned steps {pruned}" if pruned else ""))
            distributed.barrier(dp)  # the other ranks wait (in the store, unbounded) while rank 0 publishes
        console.info(f"update: --max-steps {cfg.max_steps} reached (step {step}); stopping")
        if main:
            source.close(step)
        return root


def _save_and_release(t, tmp: Path, manifest: dict, gathered: tuple) -> dict:
    """Write the step into `tmp` (published by `follow.publish` after this returns), then give the GPU memory torch
    keeps cached back to the driver (`devices.release_cached`) before the step appears: at --max-lag 0 the rollout
    waiting for it wakes its vLLM engine at once, and takes that memory back. -> the manifest with the weights'
    hashes, which `follow.publish` writes. `gathered` is what `t.gather()` gave every rank."""
    from rlkit import devices

    written = t.save(tmp, manifest, gathered, write_manifest=False)
    devices.release_cached(t.device)
    return written

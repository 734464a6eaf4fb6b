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
    if sp is None and (cfg.snapshot_every or 1) > 1:
        raise RlkitError(f"--snapshot-every {cfg.snapshot_every}: a stream cannot be read again, so a run on one "
                         "resumes exactly only from a snapshot of every step (leave --snapshot-every out, or pass 1); "
                         "a spool --in keeps its batch files until a snapshot covers them")


def snapshot_every(cfg) -> int:
    """--snapshot-every, or its default: every `snapshots.DEFAULT_EVERY` steps on a spool, every step on a stream."""
    from rlkit.follow import snapshots

    if cfg.snapshot_every is not None:
        return cfg.snapshot_every
    return snapshots.DEFAULT_EVERY if spool_input(cfg.inp) is not None else 1


def publish_dtype(device, train_dtype: str) -> str:
    """The dtype a step's weights are published in: the one the workers' engines serve. On a GPU bf16 (fp16 for a
    run that trains in fp16), as vLLM samples there; on a CPU the training dtype (--dtype), as the engines there
    compute in what they load."""
    if getattr(device, "type", str(device)) == "cuda":
        return "fp16" if train_dtype == "fp16" else "bf16"
    return train_dtype


def run_follow(cfg, inp, pending, weights: dict[str, float] | None, rt) -> Path:
    """`update --follow`: one step per batch of the input, published into --out. `inp` is the algorithm's input
    (`algo.input()`), `pending` the input stream being opened (`streams.open_table`; None for a spool --in and on
    ranks > 0), `weights` the parsed --reward weights, `rt` the stage's `rlkit.training.runtime.Runtime` (device,
    training options, and under torchrun the data-parallel world: rank 0 reads the input, holds the locks and
    publishes; every rank trains its share of each step and writes its shards of each snapshot)."""
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
        start = _share_start(cfg, root, base_fp, base_step, sp, dp)
        return _follow(cfg, inp, pending, weights, rt, start, sp, base_fp, base_step)


def _share_start(cfg, root: Path, base_fp: str, base_step: int, sp: Path | None, dp) -> dict:
    """Rank 0 (holding --out's lock) removes a killed writer's leftovers and finds where the run resumes: its newest
    snapshot (verified), or --policy, and the steps published after it, each with the batch files its manifest
    names (trained again on resume); every rank gets {"snapshot": path or None, "state": its resume.json,
    "replay": [[step, [file names]], ...], "published": the newest step}."""
    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.follow import snapshots
    from rlkit.io import checkpoints, follow, manifests
    from rlkit.training.distributed import share

    def make():
        stale = follow.clean_stale(root) + snapshots.clean_stale(root)
        if stale:
            console.info(f"update: removed {len(stale)} unfinished step(s) or snapshot(s) a killed writer left in {root}")
        steps, partial = follow.scan(root)
        if partial:
            raise RlkitError(f"{partial[0]} has no {manifests.MODEL_MANIFEST}: an incomplete step directory that "
                             "`rlkit update --follow` did not write; remove it")
        for s in steps[-1:]:
            m = follow.verify_step(s.path)
            if (m.get("follow") or {}).get("base_fingerprint") != base_fp:
                raise RlkitError(f"{root} holds a run started from another --policy than {cfg.policy} (or one changed "
                                 "since); pass that --policy or a new --out")
            tok = checkpoints.tokenizer_fingerprint(checkpoints.load_tokenizer(s.path, cfg.trust_remote_code))
            if tok != checkpoints.tokenizer_fingerprint(checkpoints.load_tokenizer(cfg.policy, cfg.trust_remote_code)):
                raise RlkitError(f"{s.path} has a different tokenizer from --policy {cfg.policy}")
        snaps = snapshots.scan(root)
        snap, state = (snaps[-1][1], snapshots.verify(snaps[-1][1])) if snaps else (None, None)
        if state is not None and (state["manifest"].get("follow") or {}).get("base_fingerprint") != base_fp:
            raise RlkitError(f"the snapshot {snap} is of a run started from another --policy than {cfg.policy}; pass "
                             "that --policy or a new --out")
        at = state["step"] if state is not None else base_step
        after = [s for s in steps if s.step > at]
        if after and snap is None and (after[0].path / "trainer").is_dir():
            raise RlkitError(f"{root} was written by an older rlkit (its steps hold the optimizer, and it has no "
                             f"{snapshots.ROOT}/): continue it with that version, or start a new --out from "
                             f"{steps[-1].path}")
        if after and sp is None:
            raise RlkitError(f"{root} holds steps {after[0].step}..{after[-1].step} after its newest snapshot "
                             f"({'step ' + str(at) if snap else 'none'}), and a stream cannot be read again to train "
                             "them: resume it with the spool it was trained from as --in, or start a new --out")
        replay = [[s.step, (manifests.read_manifest(s.path).get("follow") or {}).get("batches", [])] for s in after]
        return {"snapshot": str(snap) if snap else None, "state": state, "replay": replay,
                "published": steps[-1].step if steps else base_step}, None

    if dp is None:
        return make()[0]
    return share(dp, "follow-start", make)[0]


def _follow(cfg, inp, pending, weights, rt, start: dict, sp: Path | None, base_fp: str, base_step: int) -> Path:
    from rlkit import console, devices
    from rlkit.algorithms.config import DEFAULT_FOLLOW_TIS_CAP
    from rlkit.algorithms.shaping import shaping
    from rlkit.algorithms.trainer import Trainer, free_grads
    from rlkit.errors import RlkitError
    from rlkit.follow import snapshots
    from rlkit.follow.source import Shared, SpoolSource, StreamSource
    from rlkit.io import checkpoints, manifests, tracking
    from rlkit.io.rows import Limits
    from rlkit.training import distributed

    dp, dev, root = rt.dp, rt.device, cfg.out
    main = dp is None or dp.main
    every = snapshot_every(cfg)
    # under torchrun rank 0 alone reads the weights; the others build the model weightless and get their shards
    model, tokenizer = checkpoints.load_policy(cfg.policy, "fp32", cfg.trust_remote_code, weightless=not main)
    t = Trainer(model, cfg.rl, tokenizer=tokenizer, base=cfg.policy, trust_remote_code=cfg.trust_remote_code, runtime=rt)
    limits = Limits.of(t.model, f"--policy {cfg.policy}")
    t.load(cfg.policy)
    step = base_step
    snap = None
    if start["snapshot"] is not None:
        snap = snapshots.Snapshot(start["state"]["step"], Path(start["snapshot"]), start["state"])
        snapshots.load(t, snap)
        step = snap.step
        console.info(f"update: resuming {root} from its snapshot of step {step} ({step - base_step} steps after "
                     f"--policy)" + (f"; steps {start['replay'][0][0]}..{start['replay'][-1][0]} are trained again "
                                     "from their batch files" if start["replay"] else ""))
    elif start["replay"]:
        console.info(f"update: resuming {root} from --policy (no snapshot yet); steps {start['replay'][0][0]}.."
                     f"{start['replay'][-1][0]} are trained again from their batch files")
    published = start["published"]
    replay = {s: files for s, files in start["replay"]}
    pub_dtype = publish_dtype(dev, t.train_options.dtype)
    if snap is not None and published < snap.step:  # killed between the snapshot and the step's publish
        _publish(cfg, t, root, snap.step, snap.state["manifest"], snap.state["row"], pub_dtype, main)
        published = snap.step
    inner = None
    if main:
        if sp is not None:
            inner = SpoolSource(sp, base_step, cfg.worker_timeout, cfg.keep_batches)
            gone, kept, back = inner.recover(step, replay)
            if gone or kept or back:
                console.info(f"update: the spool {sp} held {gone + kept + back} batch file(s) a killed update had "
                             f"claimed: {gone} covered by its snapshot (disposed of), {kept} to train the steps since "
                             f"again, {back} put back")
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
    last_snap = snap.step if snap is not None else base_step
    devices.announce("update", t.device, t.train_options.dtype)
    # a resumed run goes on logging into its tracker run, which its newest step's manifest names
    newest = root / _step_name(published) if published > base_step else cfg.policy
    with tracking.open_tracking(cfg.tracking, "update", cfg, policy=newest) as tracker:
        while cfg.max_steps is None or step - base_step < cfg.max_steps:
            got = source.next(step)
            if got is None:
                console.info(f"update: the input ended; last step {step}{source.ended()}")
                break
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
            due = (step - base_step) % every == 0
            if step <= published:  # trained again after a restart: published (and logged) before it
                if due:
                    snapshots.save(t, root, step, {"manifest": manifests.read_manifest(root / _step_name(step)),
                                                   "row": {}})
                    last_snap = step
                    if main:
                        _covered(source, root, step, keep)
                console.info(f"update: step {step} trained again from the batch files it was trained from")
                distributed.barrier(dp)
                continue
            metrics = {"step": step, **loaded.metrics, **m}
            metrics.update(lag_mean=float(lags.float().mean()), lag_max=int(lags.max()), rows_dropped=got.dropped,
                           rows_dropped_total=dropped, prompts=P, publish_dtype=pub_dtype)
            full = distributed.full_model_state(t.model) if dp is not None else None  # collective: every rank
            manifest = row = None
            if main:
                if dp is not None:
                    metrics["world_size"] = dp.world
                metrics.update(drift(cfg, _plain(t, full), upstream.path("reference"), ref_cache))
                batches = {"batches": [f.path.name for f in got.files]} if got.files else {}
                manifest = manifests.make_manifest(
                    "model", "update", cfg, inputs, step=step, metrics=metrics, **reward_weights(loaded),
                    **devices.manifest_entry(dev), **reference_entry(upstream, cfg),
                    follow={"base": str(cfg.policy), "base_fingerprint": base_fp, "base_step": base_step,
                            "snapshot_every": every, **batches},
                    **tracker.manifest_entry())
                row = {"stage": "update", "out": str(root / _step_name(step)), **metrics}
            snapped = None
            if due:  # before the step is published: a step is never newer than what resumes it, on a stream
                snapped = snapshots.save(t, root, step, {"manifest": manifest, "row": row})
                last_snap = step
            if main:
                pub = _publish(cfg, t, root, step, manifest, row, pub_dtype, main, full=full, snapped=snapped)
                pruned = _covered(source, root, step, keep, last_snap) if due else \
                    _prune(root, keep, last_snap)
                tracker.log(pub["row"])
                show(metrics, inp, t.algo, follow=True)
                console.info(f"update: wrote {pub['path']} in {pub['seconds']:.2f}s ({pub['bytes'] / 2**20:.1f} MiB "
                             f"{pub_dtype} weights"
                             + (f"; snapshot in {snapped[1]:.2f}s, {snapped[2] / 2**20:.1f} MiB" if snapped else "")
                             + f"; lag mean {metrics['lag_mean']:.2f}, max {metrics['lag_max']}; {got.dropped} rows "
                             "dropped)" + (f"; pruned steps {pruned}" if pruned else ""))
            distributed.barrier(dp)  # the other ranks wait (in the store, unbounded) while rank 0 publishes
        else:
            console.info(f"update: --max-steps {cfg.max_steps} reached (step {step}); stopping")
        if step > last_snap:  # a clean end: a snapshot of the last step, whatever K
            snapshots.save(t, root, step, {"manifest": manifests.read_manifest(root / _step_name(step)) if main else None,
                                           "row": {}})
            if main:
                _covered(source, root, step, keep, step)
        if main:
            source.close(step)
        return root


def _step_name(step: int) -> str:
    from rlkit.io import follow

    return follow.step_name(step)


def _plain(t, full):
    from rlkit.training import lora

    return lora.plain_state_dict(t.model, full)


def _covered(source, root: Path, step: int, keep: int | None, snap: int | None = None) -> list[int]:
    """A snapshot of `step` is written: the batch files of the steps it covers go (`source.covered`); with --keep, the
    older snapshots and the weight steps beyond it are pruned. -> the weight steps pruned."""
    source.covered(step)
    return _prune(root, keep, step if snap is None else snap)


def _prune(root: Path, keep: int | None, snap: int) -> list[int]:
    """--keep K: all but the newest K weight steps (never one newer than the newest snapshot `snap`, whose manifest
    names the batch files a restart trains it from again) and all but the newest snapshot."""
    from rlkit.follow import snapshots
    from rlkit.io import follow

    if keep is None:
        return []
    snapshots.prune(root, 1)
    return follow.prune(root, keep, newest=snap)


def _publish(cfg, t, root: Path, step: int, manifest: dict, row: dict, dtype: str, main: bool, *, full=None,
             snapped=None) -> dict:
    """Publish step `step` as DIR/step-NNNNNN/: what a worker loads, the weights in `dtype` (`publish_dtype`), config
    and tokenizer, hash-checked, atomic (`follow.publish`); then its metrics row, with the publish's figures. Under
    torchrun every rank calls it when `full` is None (the full weights are gathered: a collective); rank 0 writes.
    -> {"path", "seconds", "bytes", "row"} on rank 0."""
    from rlkit.io import follow, metrics_log

    if full is None and t.dp is not None:
        from rlkit.training import distributed

        full = distributed.full_model_state(t.model)
    if not main:
        return {}
    t0 = time.monotonic()
    path = follow.publish(root, step, lambda tmp: _write_step(t, tmp, manifest, full, dtype))
    secs = time.monotonic() - t0
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    figures = {"publish_bytes": size, "publish_seconds": round(secs, 3)}
    if snapped is not None:
        figures.update(snapshot_seconds=round(snapped[1], 3), snapshot_bytes=snapped[2])
    row = {**row, **figures}
    with metrics_log.appending(row, cfg.metrics):  # once the step is there: never a row without its step
        pass
    return {"path": path, "seconds": secs, "bytes": size, "row": row}


def _write_step(t, tmp: Path, manifest: dict, full: dict | None, dtype: str) -> dict:
    """Write what a worker loads into `tmp` (published by `follow.publish` after this returns): the policy's weights
    in `dtype` (a LoRA adapter as trained), its config (recording that dtype) and tokenizer; no optimizer state.
    Then give the GPU memory torch keeps cached back to the driver (`devices.release_cached`) before the step
    appears: at --max-lag 0 the rollout waiting for it wakes its vLLM engine at once, and takes that memory back.
    -> the manifest with the weights' hashes, which `follow.publish` writes last."""
    import json

    from rlkit import devices
    from rlkit.io import adapters, checkpoints

    if adapters.state(t.model) is None:
        full = served_weights(t.model, full, dtype)
    written = checkpoints.save_model(t.model, t.tokenizer, tmp, manifest, state_dict=full, write_manifest=False)
    if adapters.state(t.model) is None and (tmp / "config.json").is_file():
        from rlkit.devices import TORCH_DTYPES

        c = json.loads((tmp / "config.json").read_text())
        c["dtype"] = TORCH_DTYPES[dtype]  # what the weights are: the engines start in it
        c.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    devices.release_cached(t.device)
    return written


def served_weights(model, full: dict | None, dtype: str) -> dict | None:
    """The policy's weights as a worker loads them: `full` (the gathered weights under torchrun) or the model's own,
    floating-point tensors in `dtype`, a tied weight once. None when nothing changes (one process, `dtype` the
    weights' own), so that `save_pretrained` writes the model as it always has."""
    import torch

    from rlkit.devices import TORCH_DTYPES

    want = getattr(torch, TORCH_DTYPES[dtype])
    sd = full if full is not None else model.state_dict()
    if full is None and all(v.dtype == want for v in sd.values() if v.is_floating_point()):
        return None
    if full is None and getattr(model.config, "tie_word_embeddings", False):
        for k in getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}:
            sd.pop(k, None)
    return {k: (v.detach().to("cpu", want) if v.is_floating_point() else v.detach().cpu()) for k, v in sd.items()}

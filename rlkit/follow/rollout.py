"""`rollout --follow DIR`'s service: batch after batch of prompts without end, each sampled by DIR's newest complete
step (written by `update --follow`), loaded into the live engine between batches.

The stage (`rlkit.stages.rollout`) brings what is its own as a `Stage`: how to start its engine, how one batch is
sampled and written (the sampling driver, with or without `--env`: a row per completion or per trajectory), its
table's columns and its closing lines. The service resolves the start step (`--policy`, or `DIR/latest` of a run
resumed), makes batch b's prompts (those of `rollout --seed SEED+b+1 --num-prompts P`; a `--prompts` file: its rows
in turn), waits until the newest step is at least (start step) + b - `--max-lag`, verifies a new step (hash and
tokenizer) and reloads it, puts a sleeping engine (vLLM, `--max-lag 0` on a GPU) to sleep while update trains, and
ends the stream after `--max-steps` or when the downstream stage ends. See docs/follow.md and `rlkit.io.follow`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Stage:
    """What the follow service asks of the stage it serves."""

    start_engine: Callable[[Path], Any]  # checkpoint -> a started engine (its `tokenizer` the checkpoint's)
    engine_device: Callable[[Any], Any]  # engine -> the torch.device it runs on
    # (engine, tokenizer, writer, progress bar, chunks of Prompts, seed, group0, policy fingerprint, step, scored):
    # sample the chunks and write their rows
    sample: Callable[..., None]
    fields: Callable[[bool], list]  # scored -> the table's columns beyond the rollouts kind's
    say: Callable[[], None]  # the stage's closing lines (rewards, verdicts)
    tools: list | None = None  # the environment's tool schemas for chat-template prompts (a TRL class's), or None
    # prompts a batch may sample (`rollout --min-informative-groups`: --batch-prompts x (1 + --max-refill-rounds),
    # the first --batch-prompts of them those of a batch without it); None: --batch-prompts
    prompts_a_batch: int | None = None
    # groups every batch writes (`--min-informative-groups`); None: its prompts (this worker's --shard of them)
    groups_a_batch: int | None = None
    scores: bool = True  # whether a task's verifier scores the rows (prompts without gold answers are then said)
    manifest: dict | None = None  # the stage's own manifest entries (rollout's `reward`)


def run(cfg, task, source, inputs: dict, out: Path | None, stage: Stage) -> Path | None:
    """Serve `cfg.follow` (a `RolloutConfig`) until --max-steps or the downstream stage ends; rows go to `out`.
    `task` gives the prompts (unless `source`, a --prompts file's `rlkit.io.data` source, does), `inputs` are the
    run's input fingerprints (with "policy")."""
    with contextlib.ExitStack() as held:  # a --spool worker's shard, held from before its engine starts to the end
        return _serve(cfg, task, source, inputs, out, stage, held)


def _serve(cfg, task, source, inputs: dict, out: Path | None, stage: Stage, held: contextlib.ExitStack) -> Path | None:
    import time

    from rlkit import console, devices, engines
    from rlkit.errors import DownstreamClosed, RlkitError
    from rlkit.io import checkpoints, data, fingerprints, follow, manifests, shards, spool, streams

    if cfg.max_lag < 0:
        raise RlkitError(f"--max-lag {cfg.max_lag} must be >= 0 (0: synchronous)")
    P = cfg.batch_prompts or 64
    cfg = replace(cfg, batch_prompts=P)
    Q = stage.prompts_a_batch or P  # the prompts batch b may draw; its groups are b * Q + i
    # --shard I/M: this worker samples its share of every batch's prompts (whole chunks, each with its own seed, so
    # the M workers' rows together are one worker's)
    shard = shards.parse(cfg.shard) if cfg.shard else shards.Shard(0, 1)
    span = shards.prompt_span(shard, Q, cfg.chunk_prompts)
    if not len(span):
        raise RlkitError(f"--shard {cfg.shard}: cut into chunks of --chunk-prompts {cfg.chunk_prompts}, the "
                         f"--batch-prompts {P} prompts of a batch leave this worker none (use fewer workers, more "
                         "--batch-prompts or fewer --chunk-prompts)")
    groups = stage.groups_a_batch or len(span)
    root = cfg.follow
    follow.check_root(root)
    ended_before = spool.marker_id(cfg.spool) if cfg.spool is not None else None  # an earlier run's end
    base_step = checkpoints.policy_step(cfg.policy)
    base_tok = checkpoints.tokenizer_fingerprint(checkpoints.load_tokenizer(cfg.policy, cfg.trust_remote_code))
    newest = follow.newest(root)
    start = newest.path if newest else cfg.policy
    if newest:
        m = follow.verify_step(start)
        if (m.get("follow") or {}).get("base_fingerprint") != inputs["policy"]:
            raise RlkitError(f"--follow {root} holds a run started from another --policy than {cfg.policy} (or one "
                             "changed since); pass that --policy or follow a new directory")
        same_tokenizer(checkpoints.tokenizer_fingerprint(checkpoints.load_tokenizer(start, cfg.trust_remote_code)),
                       base_tok, start, cfg.policy)
    step = checkpoints.policy_step(start)
    b = step - base_step  # batches already trained: batch b trains step base_step + b + 1
    done = cfg.max_steps is not None and b >= cfg.max_steps
    if done:
        console.info(f"rollout: {root} already has --max-steps {cfg.max_steps} steps; nothing to sample")
    t0 = time.monotonic()
    if cfg.spool is not None:  # the shard's lock and heartbeat first: a worker loading its engine is alive to update
        held.enter_context(spool.worker(cfg.spool, shard.index, shard.count))
    if done:  # an empty, complete stream: downstream sees the run is over without an engine start
        tokenizer = checkpoints.load_tokenizer(start, cfg.trust_remote_code)
        engine = None
        device = devices.resolve(cfg.device)
    else:
        engine = stage.start_engine(start)
        tokenizer = engine.tokenizer
        device = stage.engine_device(engine)
    start_secs = time.monotonic() - t0
    # --max-lag 0 on one GPU: the engine gives its GPU memory back while update trains on the batch it wrote
    sleeps = engine is not None and cfg.max_lag == 0 and engines.capabilities(engine.name).supports_sleep
    if sleeps and device.type != "cuda":
        console.info(f"rollout: {engine.name}'s sleep mode needs a GPU; the engine stays awake between batches")
        sleeps = False
    console.info(f"rollout: following {root} from {start} (step {step}); engine up in {start_secs:.1f}s")
    if source is not None:
        t = source.table
        f_ids = t.column("prompt_id").to_pylist()
        f_answers = t.column("answer").to_pylist() if "answer" in t.column_names else [None] * t.num_rows
        f_texts = data.render_prompts(tokenizer, source, for_sft=False, tools=stage.tools)
        f_prompt_ids = data.encode_prompts(tokenizer, f_texts, source.chat)
        scored = all(a is not None for a in f_answers)
    else:
        scored = True
    if not scored and stage.scores:
        console.warn("some prompts have no gold answer: no verifier reward column is written")
    extra = stage.fields(scored)
    # no rows without an engine: the name recorded then is the fallback's, as it has always been
    manifest = manifests.make_manifest("rollouts", "rollout", cfg, inputs, tokenizer=base_tok,
                                       engine=engine.name if engine is not None else engines.FALLBACK,
                                       sampling_dtype=getattr(engine, "dtype", "fp32"),
                                       **devices.manifest_entry(device), **(stage.manifest or {}),
                                       follow={"dir": str(root), "start_step": step, "base_step": base_step,
                                               "prompts_a_batch": Q, "rows_a_batch": groups * cfg.n,
                                               "shard": {"index": shard.index, "count": shard.count}})
    fp = fingerprints.fingerprint(start)
    reloads: list[float] = []
    wakes: list[float] = []
    asleep = False
    try:
        if cfg.spool is not None:
            writer = spool.writer(cfg.spool, "rollouts", manifest, extra, spool.Geometry.of(manifest["follow"], "rollout"))
        else:
            writer = streams.write_table("rollouts", out, manifest, extra)
        with writer as w:
            while cfg.max_steps is None or b < cfg.max_steps:
                if cfg.spool is not None and spool.exists(cfg.spool, b, shard.index, shard.count):
                    console.info(f"rollout: batch {b} of shard {shard.index}/{shard.count} is in the spool already")
                    b += 1  # a restarted worker: what it wrote before it was killed is kept, not sampled again
                    continue
                need = base_step + b - cfg.max_lag
                s = follow.newest(root)
                if step < need and (s is None or s.step < need):
                    s = follow.wait_for(root, need, stop=lambda: consumer_gone(cfg.spool, root, ended_before))
                    if s is None:
                        raise DownstreamClosed("rollout")
                reload = s is not None and s.step > step
                if asleep:  # a new step's load needs the weights' memory only: the KV cache comes back after it
                    t1 = time.monotonic()
                    engine.wake_up(("weights",) if reload else None)
                    wakes.append(time.monotonic() - t1)
                if reload:
                    s, secs = switch(engine, s, root, base_tok, cfg.policy)
                    step, fp = s.step, fingerprints.fingerprint(s.path)
                    reloads.append(secs)
                    console.info(f"rollout: batch {b}: sampling with {s.path.name} (weights reloaded in {secs:.3f}s)")
                if asleep:
                    t1 = time.monotonic()
                    engine.wake_up()
                    asleep = False
                    wakes[-1] += time.monotonic() - t1
                seed = cfg.seed + b + 1  # batch b samples as `rollout --seed SEED+b+1 --num-prompts P` would
                if source is None:
                    ex = task.examples("train", Q, seed)
                    ids, answers = [e.prompt_id for e in ex], [e.answer for e in ex]
                    texts = [e.prompt for e in ex]
                    prompt_ids = data.encode_prompts(tokenizer, texts, False)
                else:
                    rows = [(b * P + i) % len(f_ids) for i in range(Q)]
                    ids, answers = [f_ids[r] for r in rows], [f_answers[r] for r in rows]
                    texts, prompt_ids = [f_texts[r] for r in rows], [f_prompt_ids[r] for r in rows]
                with console.progress(f"rollout batch {b}", len(span) * cfg.n if Q == P else None) as bar:
                    chunks = _list_chunks(span, cfg.chunk_prompts, ids, answers, texts, prompt_ids)
                    stage.sample(engine, tokenizer, w, bar, chunks, seed, b * Q, fp, step, scored)
                b += 1
                if sleeps and (cfg.max_steps is None or b < cfg.max_steps):
                    asleep = engine.sleep()  # the batch is written: its GPU memory is update's until the next step
                    if asleep and not wakes:
                        console.info("rollout: --max-lag 0: the engine sleeps between batches (its GPU memory is free "
                                     "while update trains)")
            console.info(f"rollout: --max-steps {cfg.max_steps} reached; the stream ends")
        if cfg.spool is not None:
            spool.mark_worker_end(cfg.spool, shard.index, shard.count)
    except (BrokenPipeError, DownstreamClosed):
        if cfg.spool is None:
            streams.drop_stdout_sink()
        console.info(f"rollout: the {'update' if cfg.spool is not None else 'downstream stage'} ended; stopping after "
                     f"{b} batches")
    finally:
        if reloads:
            reloads.sort()
            console.info(f"rollout: {len(reloads)} weight reloads, median {reloads[len(reloads) // 2]:.3f}s, max "
                         f"{reloads[-1]:.3f}s; one engine start ({start_secs:.1f}s)")
        stage.say()
        if wakes:
            wakes.sort()
            console.info(f"rollout: {len(wakes)} wake-ups from sleep mode, median {wakes[len(wakes) // 2]:.3f}s, max "
                         f"{wakes[-1]:.3f}s")
        if engine is not None:
            engine.close()
    return out


def consumer_gone(spool_dir: Path | None, root: Path, before: tuple | None = None) -> bool:
    """While a batch waits for its step: the stage reading this stream ended (stdout's reader is gone), or, writing
    a spool, the update consuming it ended cleanly with the newest step published (`rlkit.io.spool.update_ended`;
    `before`: the end marker there was when this worker started, an earlier run's, which does not count)."""
    from rlkit.io import follow, spool, streams

    if spool_dir is None:
        return streams.downstream_closed()
    last = spool.update_ended(spool_dir, before)
    if last is None:
        return False
    s = follow.newest(root)
    return s is not None and s.step <= last


def same_tokenizer(got: str, want: str, where: Path, policy: Path) -> None:
    """Refuse a step whose tokenizer fingerprint `got` is not --policy's `want`."""
    from rlkit.errors import RlkitError

    if got != want:
        raise RlkitError(f"{where} has a different tokenizer from --policy {policy} ({got} vs {want}); a follow "
                         "directory's steps must all come from that policy")


def switch(engine, s, root: Path, base_tok: str, policy: Path, tries: int = 5):
    """Verify step `s` (hash, tokenizer) and load it into the live engine; a step pruned meanwhile
    is replaced by the then newest. -> (the step loaded, seconds the reload took)."""
    import time

    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, follow

    for attempt in range(tries):
        try:
            follow.verify_step(s.path)
            tok = checkpoints.load_tokenizer(s.path)
            same_tokenizer(checkpoints.tokenizer_fingerprint(tok), base_tok, s.path, policy)
            t0 = time.monotonic()
            engine.reload(s.path)
            return s, time.monotonic() - t0
        except (OSError, RlkitError):
            if s.path.exists() or attempt == tries - 1:
                raise
            s = follow.newest(root) or s  # pruned between the scan and the load: take the newest now
    raise AssertionError("unreachable")


def _list_chunks(span: range, chunk: int, ids, answers, texts, prompt_ids):
    """Yield prompts `span` of lists already in memory (a batch) as `rlkit.sampling.Prompts` of `chunk`."""
    from rlkit.sampling import Prompts

    for c0 in range(span.start, span.stop, chunk):
        c1 = min(span.stop, c0 + chunk)
        yield Prompts(c0, ids[c0:c1], answers[c0:c1], texts[c0:c1], prompt_ids[c0:c1])

"""How `rlkit rollout` makes its rows: the prompts as chunks (`task_chunks`, `file_chunks`), each chunk sampled through
the sampling driver (completions, or trajectories against an environment) and made into the table's columns, scored
(`rlkit.sampling.verify.Verifier`), filtered by DAPO's dynamic sampling (`rlkit.sampling.refill`) and written
(`write`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlkit.sampling.driver import Prompts, Sampling, run_episodes, sample

if TYPE_CHECKING:
    from rlkit.engines import Engine
    from rlkit.sampling.refill import Refill
    from rlkit.sampling.verify import Verifier


def write(engine: Engine, tokenizer, verifier: Verifier, w, bar, chunks, s: Sampling, chunk_prompts: int, seed: int,
          group0: int, fp: str, step: int, scored: bool, fns=(), refill: Refill | None = None) -> None:
    """Sample each `rlkit.sampling.Prompts` of `chunks` through the sampling driver and write its rows to `w`. A
    chunk starting at prompt c0 is seeded `seed * 1_000_003 + c0`; prompt p becomes group `group0 + p`. Without
    --env each row is one completion; with it, one trajectory (`rlkit.sampling.run_episodes`). `verifier` scores
    each chunk's rows at once (`Verifier.score`: a trajectory's final turn by default; with their verdicts where
    the task gives them); `fns` (--reward-fn) add their reward columns, computed on each chunk's rows (a function
    that reads the environment instances gets them: they stay open until it has scored). `refill`
    (--min-informative-groups): `chunks` re-cut as it asks (`Refill.chunks`), only its informative groups are
    written, and sampling stops once it has enough. `s`: the driver's options (`Sampling`; its `n` samples a
    prompt); `chunk_prompts`: --chunk-prompts."""
    n = s.n
    if verifier.trajectories is not None:
        verifier.trajectories.begin()
    if refill is not None:
        chunks = refill.chunks(chunks, chunk_prompts)
    keep_open = verifier.env is not None and any(f.reads_environments for f in fns)
    for ch in chunks:
        ep = None
        if verifier.env is None:
            gen = sample(engine, ch, s, seed * 1_000_003 + ch.c0)
            comps = tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
            fins = gen.finish_reasons
            rows = [(k // n, k % n) for k in range(len(comps))]  # (prompt within the chunk, sample)
            cols = {
                "prompt_id": [ch.ids[p] for p, _ in rows],
                "group_id": [group0 + ch.c0 + p for p, _ in rows],
                "sample_idx": [j for _, j in rows],
                "prompt": [ch.texts[p] for p, _ in rows],
                "completion": comps,
                "prompt_ids": [ch.prompt_ids[p] for p, _ in rows],
                "completion_ids": gen.completion_ids,
                "old_logprobs": gen.logprobs,
                "finish_reason": gen.finish_reasons,
            }
        else:
            ep = run_episodes(engine, tokenizer, verifier.env, ch, s, seed * 1_000_003 + ch.c0, keep_open=keep_open)
            c = ep.columns
            rows = [(k // n, k % n) for k in ep.trajectory]
            fins = ep.finish_reasons
            cols = {
                "prompt_id": c["prompt_id"],
                "group_id": [group0 + ch.c0 + p for p, _ in rows],
                "sample_idx": c["sample_idx"],
                "prompt": c["prompt"],
                "completion": tokenizer.batch_decode(c["completion_ids"], skip_special_tokens=True),
                "prompt_ids": c["prompt_ids"],
                "completion_ids": c["completion_ids"],
                "old_logprobs": c["old_logprobs"],
                "finish_reason": c["finish_reason"],
            }
        try:
            cols["policy_fingerprint"] = [fp] * len(rows)
            cols["policy_step"] = [step] * len(rows)
            cols["answer"] = [ch.answers[p] for p, _ in rows]
            if ep is not None:
                cols["reward/env"] = c["reward/env"]
                cols.update({k: c[k] for k in ("loss_mask", "turns", "turn_rewards", "terminated", "truncated",
                                               "end_reason", "tool_calls", "messages", "token_rewards",
                                               "observation_tokens")})
                if ep.unknown:
                    from rlkit import console

                    console.warn(f"rollout: {len(ep.unknown)} trajectories were shown text the tokenizer cannot encode "
                                 f"(the model saw its unknown token {tokenizer.unk_token!r} there), first {ep.unknown[0]}; "
                                 "check the environment's observations against the model's vocabulary")
            verifier.score(cols, cols["answer"], fins, scored, fns, w.rows,
                           [getattr(e, "wrapped", e) for e in ep.instances] if keep_open else None)
        except BaseException as e:
            if ep is not None:
                ep.close(e)
            raise
        if ep is not None:
            ep.close()
        if refill is not None:
            cols = refill.take(cols)
            if cols is None:
                bar.advance(0)
                continue
        w.write(cols)
        bar.advance(_done(cols), **verifier.record(cols, ep.env_wait if ep is not None else 0.0))
        if refill is not None and refill.done:
            break
    if refill is not None:
        rest = refill.fill()
        if rest is not None:
            w.write(rest)
            bar.advance(_done(rest), **verifier.record(rest))
        verifier.refills.append(refill)


def _done(cols: dict) -> int:
    """The completions (trajectories, under --env) a chunk's rows finish, as the progress bar counts them: a
    trajectory of several rows (a chat template's cut, `credit="turn"`) once, at its last row."""
    ends = cols.get("end_reason")
    return len(cols["group_id"]) if ends is None else sum(e != "continued" for e in ends)


def task_total(task, num_prompts: int, seed: int) -> int:
    """The prompts a task gives for --num-prompts (what --shard cuts): all of them from a built-in task,
    whose train stream is endless; a user task's stream may end sooner, so it is walked once (nothing kept)."""
    import itertools

    from rlkit.tasks import UserTask

    if not isinstance(task, UserTask):
        return num_prompts
    return sum(1 for _ in itertools.islice(task.iter_examples("train", seed), num_prompts))


def task_chunks(task, tokenizer, seed: int, span: range, chunk: int):
    """Yield the task's train prompts `span` as Prompts of `chunk` (--chunk-prompts), each drawn and tokenized when
    it is asked for. `task.examples(split, n, seed)` is the first n of `iter_examples` (the Task protocol;
    every task from `get_task` has both), so the rows are those of the whole list; a shard draws and drops
    the prompts before its span (the stream is sequential in its seed)."""
    import itertools

    from rlkit.io import data

    it = itertools.islice(task.iter_examples("train", seed), span.start, span.stop)
    for c0 in range(span.start, span.stop, chunk):
        ex = list(itertools.islice(it, chunk))
        if not ex:
            return  # a user task's stream ended before --num-prompts
        texts = [e.prompt for e in ex]
        yield Prompts(c0, [e.prompt_id for e in ex], [e.answer for e in ex], texts,
                      data.encode_prompts(tokenizer, texts, False))


def file_chunks(source, tokenizer, span: range, chunk: int, tools=None):
    """Yield rows `span` of a prompts file as Prompts of `chunk` rows, each rendered (chat template, with the
    environment's tool schemas when it has them) and tokenized when it is asked for."""
    from rlkit.io import data

    for c0 in range(span.start, span.stop, chunk):
        part = source.rows(c0, min(span.stop, c0 + chunk))
        t = part.table
        texts = data.render_prompts(tokenizer, part, for_sft=False, tools=tools)
        answers = t.column("answer").to_pylist() if "answer" in t.column_names else [None] * t.num_rows
        yield Prompts(c0, t.column("prompt_id").to_pylist(), answers, texts,
                      data.encode_prompts(tokenizer, texts, part.chat))


def first_made(chunks):
    """`chunks` with its first chunk made now, before the output opens: a task that raises or a chat file
    without a chat template fails before anything is written, stdout included."""
    import itertools

    first = next(chunks, None)
    return iter(()) if first is None else itertools.chain([first], chunks)

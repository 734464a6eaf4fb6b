"""Greedy held-out evaluation through the sampling driver (`rlkit.sampling.driver`), on any engine: accuracy under a
task's verifier, response length, sample outputs (`engine_eval`); or, against an environment, multi-turn
trajectories scored by the environment's own rewards, their mean reward (`env_eval`). `greedy_eval` is `engine_eval` on the hf engine
wrapping a model already in memory (sft's held-out evaluation)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlkit.console import progress
from rlkit.io.data import encode_prompts
from rlkit.sampling.driver import Prompts, Sampling, run_episodes, sample
from rlkit.tasks.base import verify


def greedy_eval(model, tokenizer, prompts: Sequence[str], answers: Sequence[str | None],
                task, *, sandbox=None, chat: bool = False, max_new_tokens: int = 16,
                batch_tokens: int = 16384, samples: int = 5) -> dict[str, Any]:
    """`engine_eval` on `model` (in memory, as it is: its device and dtype) through the hf engine."""
    from rlkit.engines.hf import HFEngine

    return engine_eval(HFEngine(model, tokenizer, batch_tokens), prompts, answers, task, sandbox=sandbox, chat=chat,
                       max_new_tokens=max_new_tokens, samples=samples)


def engine_eval(engine, prompts: Sequence[str], answers: Sequence[str | None], task, *, sandbox=None,
                chat: bool = False, max_new_tokens: int = 16, samples: int = 5, seed: int = 0) -> dict[str, Any]:
    """accuracy = mean verifier reward (`task`'s, through `verify`: the code task runs its programs in `sandbox`)
    over prompts with a gold answer, of one greedy response each from `engine` (temperature 0: each engine's own
    greedy decoding); lengths in tokens (no eos); `verdicts` counts the verifier's reasons when it gives them
    (`truncated` for a response cut at `max_new_tokens` that did not pass)."""
    tokenizer = engine.tokenizer
    ids = encode_prompts(tokenizer, prompts, chat)
    batch = Prompts(0, [str(i) for i in range(len(ids))], list(answers), list(prompts), ids)
    with progress("eval", len(ids)) as t:
        greedy = Sampling(n=1, temperature=0.0, max_new_tokens=max_new_tokens, logprobs=False)  # no logits kept
        gen = sample(engine, batch, greedy, seed, ticker=t)
    texts = tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
    lengths = [len(c) - (f == "eos") for c, f in zip(gen.completion_ids, gen.finish_reasons, strict=True)]
    pairs = [(t, a, f) for t, a, f in zip(texts, answers, gen.finish_reasons, strict=True) if a is not None]
    verdict = verify(task, [t for t, _, _ in pairs], [a for _, a, _ in pairs], sandbox,
                     finish_reasons=[f for _, _, f in pairs])  # a cut response: verdict `truncated`
    scored = verdict.values
    counts: dict[str, int] = {}
    for r in verdict.reasons or ():
        counts[r] = counts.get(r, 0) + 1
    return {
        "accuracy": sum(scored) / len(scored) if scored else None,
        "n": len(prompts),
        "n_scored": len(scored),
        "mean_response_tokens": sum(lengths) / max(1, len(lengths)),
        "truncated_fraction": sum(f == "length" for f in gen.finish_reasons) / max(1, len(lengths)),
        **({"verdicts": dict(sorted(counts.items()))} if verdict.reasons is not None else {}),
        "samples": [  # with the prompt's token ids as the model saw them (chat template, special tokens)
            {"prompt": p, "prompt_ids": i, "response": t, "answer": a}
            for p, i, t, a in list(zip(prompts, ids, texts, answers, strict=True))[:samples]
        ],
        "responses": texts,
        "finish_reasons": gen.finish_reasons,  # "eos" | "length" (| "stop"), one per prompt
    }


def env_eval(engine, env, prompts: Sequence[str], answers: Sequence[str | None], s, *, ids: Sequence[str] | None = None,
             seed: int = 0, samples: int = 5) -> dict[str, Any]:
    """One greedy trajectory (`s`: temperature 0, n 1, the turn and token limits) of each prompt against fresh
    instances of `env` (an `rlkit.envs.EnvSpec`), through `run_episodes`: `mean_reward`, the mean
    trajectory reward (`reward/env`, the sum of its steps' rewards: not an accuracy unless the environment's reward
    is a 0/1 verdict), the mean model turns, tool calls and sampled
    tokens per trajectory, how the trajectories ended (`end_reasons`), and the first `samples` conversations."""
    tokenizer = engine.tokenizer
    ids = [str(i) for i in range(len(prompts))] if ids is None else list(ids)
    batch = Prompts(0, ids, list(answers), list(prompts), [[] for _ in prompts],
                             splits=["heldout"] * len(prompts))
    with progress("eval", len(prompts)) as t:
        ep = run_episodes(engine, tokenizer, env, batch, s, seed, ticker=t)
    c, n = ep.columns, len(prompts)
    # a trajectory is one row, or several where a chat template rewrote its history: its last row carries how it
    # ended, its tool calls and the whole conversation; turns and sampled tokens add up over its rows
    last: dict[int, int] = {}
    turns, sampled = [0] * n, [0] * n
    for row, k in enumerate(ep.trajectory):
        last[k] = row
        turns[k] += c["turns"][row]
        sampled[k] += sum(c["loss_mask"][row])
    rows = [last[k] for k in range(n)]
    rewards = ep.rewards  # each trajectory's (a row's reward/env is its own turn's under credit="turn")
    ends: dict[str, int] = {}
    for r in rows:
        ends[c["end_reason"][r]] = ends.get(c["end_reason"][r], 0) + 1
    return {
        "mean_reward": sum(rewards) / n if n else None,  # the mean trajectory reward (reward/env)
        "n": n,
        "n_scored": n,
        "mean_turns": sum(turns) / max(1, n),
        "mean_tool_calls": sum(c["tool_calls"][r] for r in rows) / max(1, n),
        "mean_response_tokens": sum(sampled) / max(1, n),  # the model's tokens over all turns (no eos dropped)
        "truncated_fraction": sum(bool(c["truncated"][r]) for r in rows) / max(1, n),
        "end_reasons": dict(sorted(ends.items(), key=lambda kv: (-kv[1], kv[0]))),
        "samples": [
            {"prompt": prompts[k], "messages": c["messages"][r], "reward": rewards[k],
             "turns": turns[k], "end_reason": c["end_reason"][r], "answer": answers[k]}
            for k, r in enumerate(rows[:samples])
        ],
        "rewards": rewards,
        "finish_reasons": [c["finish_reason"][r] for r in rows],
    }

"""Greedy held-out evaluation: accuracy under a task's verifier, response length, sample outputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlkit.console import progress
from rlkit.engines.generation import generate
from rlkit.io.data import encode_prompts
from rlkit.tasks.base import verify


def greedy_eval(model, tokenizer, prompts: Sequence[str], answers: Sequence[str | None],
                task, *, sandbox=None, chat: bool = False, max_new_tokens: int = 16,
                batch_tokens: int = 16384, samples: int = 5) -> dict[str, Any]:
    """accuracy = mean verifier reward (`task`'s, through `verify`: the code task runs its programs in `sandbox`)
    over prompts with a gold answer; lengths in tokens (no eos); `verdicts` counts the verifier's reasons
    when it gives them (`truncated` for a response cut at `max_new_tokens` that did not pass)."""
    ids = encode_prompts(tokenizer, prompts, chat)
    with progress("eval", len(ids)) as t:
        gen = generate(model, tokenizer, ids, max_new_tokens=max_new_tokens, greedy=True,
                       batch_tokens=batch_tokens, ticker=t)
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
        "finish_reasons": gen.finish_reasons,  # "eos" | "length", one per prompt
    }

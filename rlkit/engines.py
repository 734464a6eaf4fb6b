"""Rollout engines behind one small interface: token ids in, n sampled completions per prompt out,
with the sampling policy's log-prob of every sampled token (pi_old). `rollout` picks one by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rlkit.generation import Generated, generate


class Engine(Protocol):
    name: str

    def sample(self, prompt_ids: Sequence[list[int]], *, n: int, temperature: float, top_p: float,
               max_new_tokens: int, seed: int) -> Generated:
        """Row i*n + j of the result is sample j of prompt i; logprobs are always filled."""
        ...


class HFEngine:
    """Hugging Face `generate`: batched by a token budget, KV cache, left padding, stop at EOS."""

    name = "hf"

    def __init__(self, model, tokenizer, batch_tokens: int = 16384) -> None:
        self.model, self.tokenizer, self.batch_tokens = model, tokenizer, batch_tokens

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed) -> Generated:
        return generate(self.model, self.tokenizer, prompt_ids, max_new_tokens=max_new_tokens, n=n, greedy=False,
                        temperature=temperature, top_p=top_p, seed=seed, batch_tokens=self.batch_tokens,
                        logprobs=True)


ENGINES = ("hf",)

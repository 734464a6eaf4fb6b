"""Batched Hugging Face `generate`, what the `hf` engine samples with and `rlkit eval` decodes greedily with:
left padding, KV cache, per-sequence stop at EOS, batches sized by a token budget, and optionally the
log-prob of every sampled token. Returns the engines' `Generated`.

A batch generates at most what the model's context (`max_position_embeddings`) leaves after its longest prompt:
a response is cut there as at `max_new_tokens` (finish reason "length"), never run into positions the model
has no embedding or training for.

`stop` strings end a completion once its text contains one (finish reason "stop"), keeping the tokens that wrote
it (a tool call keeps its closing tag); what `generate` produced after them in the batch is dropped.

On any device: the batch is built on the host and moved to the model's device once (pinned, non-blocking on a
GPU), and the results come back to the host once per batch (one `.cpu()` each for the tokens and log-probs).
"""

from __future__ import annotations

from collections.abc import Sequence

from rlkit import devices
from rlkit.engines.base import Generated
from rlkit.io.data import token_batches


def generate(model, tokenizer, prompt_ids: Sequence[list[int]], *, max_new_tokens: int, n: int = 1,
             greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
             batch_tokens: int = 16384, logprobs: bool = False, ticker=None, stop: Sequence[str] = ()) -> Generated:
    import torch
    from transformers import GenerationConfig

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    gen_kw = dict(do_sample=not greedy, pad_token_id=pad, eos_token_id=eos, return_dict_in_generate=True,
                  output_logits=logprobs, **({} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}))
    device = devices.model_device(model)
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    total = len(prompt_ids) * n
    out_ids: list[list[int] | None] = [None] * total
    out_fin: list[str | None] = [None] * total
    out_lp: list[list[float] | None] = [None] * total
    cost = [n * (len(p) + _room(len(p), max_new_tokens, context)) for p in prompt_ids]
    was_training = model.training
    model.eval()
    try:
        for b, batch in enumerate(token_batches(cost, batch_tokens)):
            width = max(len(prompt_ids[i]) for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):
                p = prompt_ids[i]
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            ids, mask = devices.to_device((ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)), device)
            torch.manual_seed(seed * 1_000_003 + b)
            with torch.no_grad():
                gen_cfg = GenerationConfig(max_new_tokens=_room(width, max_new_tokens, context), **gen_kw,
                                           **({"stop_strings": list(stop)} if stop else {}))
                res = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                     **({"tokenizer": tokenizer} if stop else {}))
            new = res.sequences[:, width:]
            if logprobs:
                logits = torch.stack(res.logits, dim=1).float()
                if not greedy:
                    logits = logits / temperature
                lp_rows = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1).cpu().tolist()
            for r, row in enumerate(new.cpu().tolist()):
                end = row.index(eos) + 1 if eos in row else len(row)
                fin = "eos" if end <= len(row) and row[end - 1] == eos else "length"
                if stop:
                    cut = _stop_end(tokenizer, row[:end], stop)
                    if cut is not None:
                        end, fin = cut, "stop"
                k = batch[r // n] * n + r % n
                out_ids[k] = row[:end]
                out_fin[k] = fin
                if logprobs:
                    out_lp[k] = lp_rows[r][:end]
            if ticker is not None:
                ticker.advance(len(batch))
    finally:
        model.train(was_training)
    return Generated(out_ids, out_fin, out_lp if logprobs else None)  # type: ignore[arg-type]


def _stop_end(tokenizer, row: list[int], stop: Sequence[str]) -> int | None:
    """The length of the shortest prefix of `row` whose text contains one of the `stop` strings (the tokens
    after it are generate's padding or past the stop), or None when no stop string occurs."""
    def hit(k: int) -> bool:
        text = tokenizer.decode(row[:k], skip_special_tokens=True)
        return any(s in text for s in stop)

    if not row or not hit(len(row)):
        return None
    lo, hi = 1, len(row)  # hit(hi) holds; find the smallest such k
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _room(prompt: int, max_new_tokens: int, context: int | None) -> int:
    """New tokens a batch whose longest prompt is `prompt` tokens may generate: `max_new_tokens`, at most what the
    model's `context` leaves (at least 1: a prompt that fills the context is the stages' to refuse)."""
    if not isinstance(context, int) or context <= 0:
        return max_new_tokens
    return max(1, min(max_new_tokens, context - prompt))
